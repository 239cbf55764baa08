"""Live: Slurm's own preemption of an elastic job (PreemptMode=REQUEUE or CANCEL, a GraceTime): it commits within
the grace time, requeues itself and resumes where it stopped, losing no step.

A private cluster of its own comes up with preemption configured (`LocalCluster.up(preempt_mode=...)`:
partition `urgent` preempts `gpu`, `PreemptParameters=send_user_signal`). No controller runs until the
job has committed and left: the rigid job preempts through Slurm alone. The daemon is started then, as
at a site that runs it, and starts the requeued job, which Slurm would hold back ~120 s (BeginTime),
at once. Waits are on states, with generous timeouts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from slurm_elastic.cluster.model import JobState
from slurm_elastic.devcluster.layout import PREEMPT_PARTITION
from slurm_elastic.errors import ElasticError
from tests.control.conftest import ElasticCluster, _free_port_base, _remove_scratch
from tests.control.live_files import json_lines, read_ack

pytestmark = pytest.mark.slurm

TEMPLATE = Path(__file__).resolve().parents[2] / "job_templates" / "ddp.sbatch"
GRACE_S = 60


@pytest.fixture(scope="module", params=["REQUEUE", "CANCEL"])
def preempting_cluster(request: pytest.FixtureRequest) -> Iterator[ElasticCluster]:
    from slurm_elastic.devcluster import LocalCluster
    from slurm_elastic.devcluster.version import find_program

    if find_program("slurmctld") is None or find_program("slurmd") is None:
        pytest.skip("Slurm is not installed (slurmctld/slurmd not found)")
    if os.geteuid() != 0:
        pytest.skip("the private local Slurm cluster needs root")
    root = Path(tempfile.mkdtemp(prefix="se-preempt-", dir="/tmp"))
    os.chmod(root, 0o755)
    for sub in ("ckpt", "out", "state"):
        (root / sub).mkdir()
        os.chmod(root / sub, 0o1777)
    local = LocalCluster(root / "cluster")
    try:
        local.up(nodes=2, spares=0, port_base=_free_port_base(2), timeout=60, slurmd_timeout=300,
                 preempt_mode=request.param, grace_time_s=GRACE_S)
    except ElasticError as exc:
        if local.exists():
            local.down()
        _remove_scratch(root)
        pytest.fail(f"cannot start the private Slurm cluster: {exc}")
    cluster = ElasticCluster(local=local, root=root, env={**os.environ, **local.env(),
                                                          "SLURM_ELASTIC_DAEMON_DIR": str(root / "state" / "daemon"),
                                                          "SLURM_ELASTIC_STATE_DIR": str(root / "state" / "user-root")})
    try:
        yield cluster
    finally:
        try:
            local.down()
        finally:
            if not os.environ.get("SLURM_ELASTIC_KEEP_TEST_CLUSTER"):
                _remove_scratch(root)


def test_a_preempted_job_commits_in_its_grace_time_and_resumes_losing_no_step(preempting_cluster, tmp_path):
    cluster = preempting_cluster
    ckpt = cluster.root / "ckpt"
    loss_log = cluster.root / "out" / "preempted-loss.jsonl"
    out = cluster.cli("sbatch", "--parsable", "--gpus=1", "--signal-before=30", f"--ckpt-dir={ckpt}",
                      "--job-name=preempted", f"--output={cluster.root / 'out'}/%j.out", "--open-mode=append",
                      str(TEMPLATE), sys.executable, "-m", "slurm_elastic.train.examples.digits",
                      "--steps", "1000000", "--step-sleep", "0.05", "--loss-log", str(loss_log))
    job_id = int(out.stdout.strip())
    job_dir = ckpt / str(job_id)
    rigid = daemon = None

    def job():
        return next((j for j in cluster.snapshot().jobs if j.job_id == job_id), None)

    try:
        cluster.wait_for(lambda: len(json_lines(loss_log)) >= 5, 300, 0.5,
                         what=lambda: f"training to start; {cluster.job_outputs()}")
        node = job().nodes[0]
        # A rigid job of the higher tier wants every GPU of the elastic job's node.
        proc = subprocess.run(["sbatch", "--parsable", f"--partition={PREEMPT_PARTITION}", f"--nodelist={node}",
                               "--gres=gpu:4", "--mem=1000", "--job-name=rigid", "--output=/dev/null",
                               "--wrap", "sleep 20"], env=cluster.env, capture_output=True, text=True, check=True)
        rigid = int(proc.stdout.strip().split(";")[0])
        ack = cluster.wait_for(lambda: read_ack(job_dir, job_id, 0), GRACE_S + 60, 0.5,
                               what=lambda: f"the preempted job's ACK; {cluster.job_outputs()}")
        # The rigid job ran: the elastic one left its node.
        cluster.wait_for(lambda: next((j for j in cluster.snapshot().jobs if j.job_id == rigid), None) is not None
                         and next(j for j in cluster.snapshot().jobs if j.job_id == rigid).state
                         in (JobState.RUNNING, JobState.COMPLETED), 300, 1, what="the rigid job started")
        daemon = cluster.spawn("-v", "admin", "daemon", "--interval", "2", log=tmp_path / "daemon.log")
        cluster.wait_for(lambda: any(r["step"] >= (ack.step or 0) + 3 for r in json_lines(loss_log)), 600, 1,
                         what=lambda: f"the elastic job resumed; job {job()}\n{cluster.job_outputs()}")
        again = job()
        assert again is not None and again.restarts >= 1 and not again.state.finished, again
        status = json.loads(cluster.cli("admin", "status", "--json").stdout)
        end = next(r for r in status["jobs"] if r["job_id"] == job_id)["slurm_end"]
        assert end is not None and end["cause"] == "preemption" and end["committed_step"] == ack.step, end
    finally:
        if daemon is not None:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(60)
        subprocess.run(["scancel", "--quiet", str(job_id), *([str(rigid)] if rigid else [])], env=cluster.env,
                       check=False)

    text = (cluster.root / "out" / f"{job_id}.out").read_text()
    assert ack.committed and ack.step is not None, ack
    assert "before the job's end (time limit or preemption)" in text, text[-3000:]
    assert f"restored step {ack.step} " in text, text[-3000:]
    assert "after a preemption (checkpoint acknowledged at Slurm's signal)" in text, text[-3000:]
    assert "Killed" not in text and "SIGKILL" not in text, text[-3000:]
    steps = [r["step"] for r in json_lines(loss_log)]
    # Every completed step logged once: a step run again after the resume would be a lost one.
    assert steps == list(range(steps[0], steps[0] + len(steps))), steps
