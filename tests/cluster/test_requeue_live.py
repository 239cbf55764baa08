"""Live: what a node failure does to a job the CLI backend submitted, on this Slurm.

From 25.11 Slurm has `sbatch --requeue=expedite`: a batch job requeued because its node failed is
eligible at once, at top priority, instead of waiting Slurm's ~120 s BeginTime. The CLI backend asks
for it only where slurmctld enables it (SlurmctldParameters=enable_expedited_requeue; without that
26.05 refuses the submission). This test brings up its own two-node cluster, with expedited requeue
enabled where the version has it, submits through the backend and kills the job's node (slurmd
SIGKILLed; Slurm notices after SlurmdTimeout): from 25.11 the job must run again on the other node
without the BeginTime wait; before 25.11 it must be the plain requeue, pending on BeginTime.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from slurm_elastic.cluster.backend import SubmitDescription
from slurm_elastic.cluster.cli_backend import REQUEUE_EXPEDITE_SINCE, CliBackend
from slurm_elastic.cluster.model import JobState
from slurm_elastic.cluster.shape import RequestShape
from slurm_elastic.devcluster.version import detect_version, find_program
from slurm_elastic.devcluster.processes import free_port_base
from slurm_elastic.spec import ElasticSpec
from tests.conftest import SlurmTestCluster

pytestmark = pytest.mark.slurm
wait_for = SlurmTestCluster.wait_for   # the suite's one poll-until helper

JOB = "#!/bin/bash\necho \"start restart=${SLURM_RESTART_COUNT:-0} on $SLURMD_NODENAME\"\nsleep 3000\n"


@pytest.fixture
def two_nodes():
    """A private two-node cluster (its own state dir and ports), down again after the test."""
    from slurm_elastic.devcluster import LocalCluster

    if find_program("slurmctld") is None or find_program("slurmd") is None:
        pytest.skip("Slurm is not installed (slurmctld/slurmd not found)")
    if os.geteuid() != 0:
        pytest.skip("the private local Slurm cluster needs root")
    version = detect_version()
    root = Path(tempfile.mkdtemp(prefix="se-requeue-", dir="/tmp"))
    os.chmod(root, 0o755)
    local = LocalCluster(root / "cluster")
    expedite = (version.major, version.minor) >= (REQUEUE_EXPEDITE_SINCE.major, REQUEUE_EXPEDITE_SINCE.minor)
    local.up(nodes=2, spares=0, gpus_per_node=1, port_base=free_port_base(4 + 2), slurmd_timeout=10,
             expedited_requeue=expedite, timeout=90)
    try:
        yield local, root, version, expedite
    finally:
        local.down()
        shutil.rmtree(root, ignore_errors=True)


def test_a_job_whose_node_fails_is_requeued_as_this_slurm_allows(two_nodes):
    local, root, version, expedite = two_nodes
    env = {**os.environ, **local.env()}
    backend = CliBackend(env=env)
    script = root / "job.sh"
    script.write_text(JOB)
    script.chmod(0o755)
    spec = ElasticSpec(1, 1, cpus_per_gpu=1, mem_per_gpu_mb=500)
    job_id = backend.submit(SubmitDescription(
        script=str(script), shape=RequestShape(1, 1, 1, 500),
        comment=spec.to_comment(), job_name="requeue-live", workdir=str(root),
        extra_args=(f"--output={root}/out-%j.txt",)))

    def job():
        return backend.snapshot().job(job_id)

    first = wait_for(lambda: (j := job()).state is JobState.RUNNING and j, 90, 0.5, "the job running")
    victim = first.nodes[0]
    shown = subprocess.run(["scontrol", "-o", "show", "job", str(job_id)], env=env, capture_output=True, text=True)
    print(f"Slurm {version}: {shown.stdout.strip()}")
    local.node_down(victim)         # slurmd SIGKILLed; Slurm calls the node DOWN after SlurmdTimeout (10 s)
    requeued = wait_for(lambda: (j := job()).restarts >= 1 and j, 120, 0.5, f"Slurm requeuing the job off {victim}")
    if expedite:
        # Eligible at once: running again on the other node well inside the BeginTime it would otherwise wait.
        again = wait_for(lambda: (j := job()).state is JobState.RUNNING and j.restarts >= 1 and j, 90, 0.5,
                           f"the job running again (Slurm {version}, --requeue=expedite)")
        assert victim not in again.nodes, again.nodes
        # RUNNING is Slurm's word; the script's first line reaches its output a moment later (seen empty
        # under CI's load on 26.05): wait for it.
        out = root / f"out-{job_id}.txt"
        assert wait_for(lambda: out.is_file() and "restart=1" in out.read_text(), 60, 0.5,
                        f"the restarted script's first line in {out}")
    else:
        # The plain requeue: pending on BeginTime (~120 s), which is what expedite removes.
        assert requeued.state is JobState.PENDING, requeued.state
        assert wait_for(lambda: job().reason == "BeginTime", 30, 0.5, "the BeginTime hold")
    backend.cancel(job_id)

