"""On a live Slurm: an owner's `scancel --full --signal=TERM` just after a restart is final (control/revive.py),
and each version's record of such a job gives the signal.

The signal leaves the record the stale node-failure kill leaves on 26.05.5 (FAILED, ExitCode 0:15,
no cancel); what the owner's signal lacks is the node failure, so the daemon leaves the job as it
ended. (`--batch` alone, tried first, killed the shell and left the trainer running as an orphan that
the local cluster's process tracking lost.) The real stale kill, after a node that failed, is met in
tests/reliability/test_controller_faults.py's node flapping.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from slurm_elastic.cluster.model import JobState

pytestmark = pytest.mark.slurm


def _slurm(cluster: Any, *argv: str) -> None:
    subprocess.run(list(argv), env=cluster.env, check=True, capture_output=True, text=True, timeout=30)


def _job(cluster: Any, job_id: int) -> Any:
    return next((j for j in cluster.snapshot().jobs if j.job_id == job_id), None)


def test_an_owners_signal_just_after_a_restart_is_final(elastic_cluster: Any, tmp_path: Path) -> None:
    cluster = elastic_cluster
    cluster.cancel_all()
    log = tmp_path / "daemon.log"
    daemon = cluster.spawn("-v", "admin", "daemon", "--interval", "1", "--hysteresis", "0", log=log)
    try:
        job = cluster.submit("--gpus=2-2", name="stale-kill")
        plain = int(subprocess.run(
            ["sbatch", "--parsable", "-N1", "--gres=gpu:1", "--mem=1G", "--requeue", "--job-name=plain",
             f"--output={cluster.root / 'out'}/%j.out", str(cluster.root / "fake_trainer.sbatch")],
            env={**cluster.env, "SLURM_ELASTIC_CKPT_DIR": str(cluster.root / "ckpt")}, check=True, capture_output=True, text=True, timeout=30).stdout.strip().split(";")[0])

        def running(j: int, restarts: int) -> bool:
            got = _job(cluster, j)
            return got is not None and got.state is JobState.RUNNING and got.restarts == restarts

        cluster.wait_for(lambda: running(job, 0) and running(plain, 0), 120, 0.5, "both jobs running")
        plain_sizes = cluster.root / "ckpt" / str(plain) / "sizes.log"
        cluster.wait_for(plain_sizes.exists, 60, 0.5, "the plain job's trainer started")
        _slurm(cluster, "scontrol", "requeue", str(job))     # a restart before the kill, as after a node failure
        cluster.wait_for(lambda: running(job, 1), 180, 0.5, "the elastic job running again after its requeue")
        # RUNNING comes before the batch shell exists on the node: a signal sent then reaches nothing.
        sizes = cluster.root / "ckpt" / str(job) / "sizes.log"
        cluster.wait_for(lambda: sizes.exists() and '"restart": 1' in sizes.read_text(), 60, 0.5,
                         "the trainer started again")

        for j in (job, plain):
            _slurm(cluster, "scancel", "--full", "--signal=TERM", str(j))
        # The plain job is not ours: it stays as Slurm ended it, and shows how this version records it.
        ended = cluster.wait_for(lambda: (p := _job(cluster, plain)) is not None and p.state.finished and p, 60, 0.5,
                                 "the plain job ended")
        assert ended.state is JobState.FAILED and ended.exit_signal == signal.SIGTERM, ended
        assert ended.end_time is not None and ended.start_time is not None and ended.end_time >= ended.start_time

        # The daemon sees the FAILED job and says once why it leaves it: no node of it failed.
        cluster.wait_for(lambda: "its owner's (or an admin's) signal, final" in log.read_text(), 60, 0.5,
                         lambda: f"the daemon's word on the signalled job; Slurm: {_job(cluster, job)}")
        time.sleep(3)                                          # three more cycles at --interval 1
        got = _job(cluster, job)
        assert got.state is JobState.FAILED and got.restarts == 1, got
        assert f"job {job}: ended FAILED by SIGTERM" not in log.read_text()
        assert _job(cluster, plain).state is JobState.FAILED   # never requeued by the daemon
    finally:
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(60)
        print(log.read_text()[-3000:])
        cluster.cancel_all()
