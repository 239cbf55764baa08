"""Live: a maintenance reservation announced ahead keeps elastic jobs off its nodes.

A reservation on n3-n4 opens in 20 minutes. Slurm starts no job whose time limit ends after that on
those nodes while the reservation is to come: a plain 4-node job with no limit (the local cluster's
partition has none) stays pending. The elastic job's script asks for 30 minutes: the wrapper says so
at submit and sizes it (4-16 GPUs, step 4) on n1-n2 only, and the daemon, with n3-n4 idle, never
grows it onto them: a requeue at 16 GPUs would leave it pending until the maintenance is over.
"""

from __future__ import annotations

import subprocess
import time

import pytest

from slurm_elastic.cluster.model import JobState

pytestmark = pytest.mark.slurm

NAME = "se-maint"


def test_a_maintenance_to_come_keeps_elastic_jobs_off_its_nodes(elastic_cluster, tmp_path):
    cluster = elastic_cluster
    with cluster.reservation(NAME, "StartTime=now+20minutes", "Duration=60", "Nodes=n3,n4",
                             "Users=root", "Flags=MAINT", daemon_log=tmp_path / "daemon.log") as daemons:
        # Slurm's rule, on this version: a job with no time limit does not start on nodes reserved later
        plain = subprocess.run(["sbatch", "--parsable", "-N4", "--gres=gpu:1", "--mem=500", "--job-name=plain",
                                "--output=/dev/null", "--wrap", "sleep 30"], env=cluster.env, capture_output=True,
                               text=True, check=True)
        plain_id = int(plain.stdout.strip().split(";")[0])
        time.sleep(3)
        assert next(j for j in cluster.snapshot().jobs if j.job_id == plain_id).state is JobState.PENDING
        subprocess.run(["scancel", str(plain_id)], env=cluster.env, check=True)

        out = cluster.cli("sbatch", "--parsable", "--gpus=4-16", "--gpu-step=4", f"--ckpt-dir={cluster.root / 'ckpt'}",
                          "--job-name=before-maint", f"--output={cluster.root / 'out'}/%j.out", "--open-mode=append",
                          str(cluster.root / "fake_trainer.sbatch"))
        assert f"reservation {NAME} holds 2 node(s) from " in out.stderr, out.stderr
        assert "its time limit (30 min) would end after that" in out.stderr, out.stderr
        job_id = int(out.stdout.strip())

        def job():
            return next(j for j in cluster.snapshot().jobs if j.job_id == job_id)

        first = cluster.wait_for(lambda: (j := job()).state is JobState.RUNNING and j, 60,
                                 what=lambda: f"the job running; {cluster.slurm_view()}")
        assert first.gpus == 8 and set(first.nodes) == {"n1", "n2"}, first
        daemons.append(cluster.spawn("-v", "admin", "daemon", "--interval", "2", "--hysteresis", "0",
                                     "--speed", "linear", "--ack-timeout", "10", log=tmp_path / "daemon.log"))
        time.sleep(12)              # six daemon cycles with n3-n4 idle: it stays where Slurm can start it
        now = job()
        assert now.state is JobState.RUNNING and now.gpus == 8 and now.restarts == first.restarts, now
