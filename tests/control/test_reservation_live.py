"""Live: an elastic job in an advance reservation is sized and grown on the reservation's nodes only.

A reservation holds n1-n2 of the private 4-node x 4-GPU cluster. A plain job blocks n2, so the
wrapper submits the elastic job (4-16 GPUs, step 4) at the 4 GPUs free inside the reservation. The
blocker ends and the daemon grows the job to the reservation's 8 GPUs on n1-n2 (a requeue, which
Slurm starts only there), never to the cluster's 16: a 16-GPU requeue would stay pending for good.
"""

from __future__ import annotations

import subprocess
import time

import pytest

from slurm_elastic.cluster.model import JobState

pytestmark = pytest.mark.slurm

NAME = "se-course"


def test_a_job_in_a_reservation_grows_to_what_the_reservation_holds(elastic_cluster, tmp_path):
    cluster = elastic_cluster
    with cluster.reservation(NAME, "StartTime=now", "Duration=60", "Nodes=n1,n2", "Users=root",
                             "Flags=IGNORE_JOBS", daemon_log=tmp_path / "daemon.log") as daemons:
        blocker = subprocess.run(["sbatch", "--parsable", f"--reservation={NAME}", "--nodelist=n2", "--gres=gpu:4",
                                  "--mem=1000", "--job-name=blocker", "--output=/dev/null", "--wrap", "sleep 3000"],
                                 env=cluster.env, capture_output=True, text=True, check=True)
        blocker_id = int(blocker.stdout.strip().split(";")[0])
        cluster.wait_for(lambda: any(j.job_id == blocker_id and j.state is JobState.RUNNING
                                     for j in cluster.snapshot().jobs), 60, what="the blocker running")
        job_id = cluster.submit("--gpus=4-16", "--gpu-step=4", name="in-course",
                                sbatch_flags=(f"--reservation={NAME}",))

        def job():
            return next(j for j in cluster.snapshot().jobs if j.job_id == job_id)

        first = cluster.wait_for(lambda: (j := job()).state is JobState.RUNNING and j, 60,
                                 what=lambda: f"the job running; {cluster.slurm_view()}")
        assert first.gpus == 4 and first.nodes == ("n1",) and first.reservation == NAME
        daemons.append(cluster.spawn("-v", "admin", "daemon", "--interval", "2", "--hysteresis", "0",
                                     "--speed", "linear", "--ack-timeout", "10", log=tmp_path / "daemon.log"))
        subprocess.run(["scancel", str(blocker_id)], env=cluster.env, check=True)
        grown = cluster.wait_for(lambda: (j := job()).state is JobState.RUNNING and j.gpus > 4 and j, 180, 0.5,
                                 what=lambda: f"the job grown; {cluster.slurm_view()}")
        assert grown.gpus == 8 and set(grown.nodes) == {"n1", "n2"}, grown
        time.sleep(8)              # four daemon cycles: it stays at what the reservation holds
        now = job()
        assert now.state is JobState.RUNNING and now.gpus == 8 and now.restarts == grown.restarts, now
