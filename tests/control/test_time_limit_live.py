"""Live: an elastic job trains through its time limits - Slurm's warning, a commit, its own requeue - losing no step.

The job is job_templates/ddp.sbatch running the digits example on one rank, submitted with a
2-minute limit and `--signal-before 30`; every requeue is the job's own. No controller runs until
the job has requeued itself once (a site without the daemon); the daemon is started then, and it
starts the requeued jobs Slurm holds back ~120 s (BeginTime) at once, as at a site that runs it.
Waits are on states, with generous timeouts (the machine is loaded); Slurm sends the warning up to
60 s early, so the timings vary.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest

from slurm_elastic.cluster.model import JobState
from tests.control.live_files import json_lines, read_ack

pytestmark = pytest.mark.slurm

TEMPLATE = Path(__file__).resolve().parents[2] / "job_templates" / "ddp.sbatch"
LIMITS = 2      # time limits the job must train through


def test_a_job_trains_through_two_time_limits_losing_no_step(elastic_cluster, tmp_path):
    cluster = elastic_cluster
    cluster.cancel_all()
    ckpt = cluster.root / "ckpt"
    loss_log = cluster.root / "out" / "timelimit-loss.jsonl"
    out = cluster.cli("sbatch", "--parsable", "--gpus=1", "--signal-before=30", "--time=2", f"--ckpt-dir={ckpt}",
                      "--job-name=timelimit", f"--output={cluster.root / 'out'}/%j.out", "--open-mode=append",
                      str(TEMPLATE), sys.executable, "-m", "slurm_elastic.train.examples.digits",
                      "--steps", "1000000", "--step-sleep", "0.05", "--loss-log", str(loss_log))
    job_id = int(out.stdout.strip())
    job_dir = ckpt / str(job_id)
    daemon = None
    try:
        def job():
            return next((j for j in cluster.snapshot().jobs if j.job_id == job_id), None)

        def requeued_by_itself() -> bool:
            """The first limit's commit acknowledged and the job back in the queue, held by Slurm's BeginTime."""
            first = read_ack(job_dir, job_id, 0)
            now = job()
            return first is not None and now is not None and now.restarts >= 1

        cluster.wait_for(requeued_by_itself, 600, 1,
                         what=lambda: f"the first time limit's requeue; job {job()}\n{cluster.job_outputs()}")
        daemon = cluster.spawn("-v", "admin", "daemon", "--interval", "2", log=tmp_path / "daemon.log")

        def trained_past_the_limits() -> bool:
            """The last limit's commit acknowledged and the next incarnation trained 3 steps past it."""
            last = read_ack(job_dir, job_id, LIMITS - 1)
            return last is not None and last.step is not None and any(
                r["step"] >= last.step + 3 for r in json_lines(loss_log))

        cluster.wait_for(trained_past_the_limits, 1200, 1,
                         what=lambda: f"{LIMITS} time limits trained through; job {job()}\n{cluster.job_outputs()}")
        now = job()
        assert now is not None and now.restarts >= LIMITS and not now.state.finished, now
        status = json.loads(cluster.cli("admin", "status", "--json").stdout)
        end = next(r for r in status["jobs"] if r["job_id"] == job_id)["slurm_end"]
        assert end is not None and end["cause"] == "time limit" and end["restart"] == now.restarts, end
    finally:
        if daemon is not None:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(60)
        cluster.cancel_all()

    text = (cluster.root / "out" / f"{job_id}.out").read_text()
    assert text.count("requeues itself before its end") >= LIMITS, text[-3000:]
    assert text.count("before the job's end (time limit or preemption)") >= LIMITS, text[-3000:]
    assert text.count("after a time limit (checkpoint acknowledged at Slurm's signal)") >= LIMITS, text[-3000:]
    steps = [r["step"] for r in json_lines(loss_log)]
    # Every completed step logged once, none twice: a step run again after a resume would be a lost one.
    assert steps == list(range(steps[0], steps[0] + len(steps))), steps
    for restart in range(LIMITS):
        ack = read_ack(job_dir, job_id, restart)
        assert ack is not None and ack.committed and ack.step is not None, (restart, ack)
        # The next incarnation resumed at the step after the one committed at the warning.
        assert f"restored step {ack.step} " in text, (restart, ack.step, text[-3000:])
        assert steps[steps.index(ack.step) + 1] == ack.step + 1
    assert JobState.TIMEOUT not in {j.state for j in cluster.snapshot().jobs if j.job_id == job_id}


def test_this_slurms_partition_lines_give_the_local_clusters_limits(elastic_cluster):
    """The wrapper checks --time against `scontrol -o show partition` as this Slurm prints it: the local
    cluster's one partition is the default, with no DefaultTime and MaxTime=INFINITE."""
    from slurm_elastic.cluster.partitions import PartitionTimes

    assert PartitionTimes("gpu", None, None, is_default=True) in elastic_cluster.backend.partition_times()


def test_a_reservation_that_ends_before_the_run_is_said_at_submit(elastic_cluster, tmp_path):
    """`scontrol -o show reservation` as this Slurm prints it gives the window, and the wrapper says in one
    line that the run's requeues end with the reservation (a dry run: the line is the wrapper's, not Slurm's)."""
    import subprocess
    import time

    cluster = elastic_cluster
    name = "se-window"
    subprocess.run(["scontrol", "create", "reservation", f"ReservationName={name}", "StartTime=now", "Duration=30",
                    "Nodes=n4", "Users=root", "Flags=IGNORE_JOBS"], env=cluster.env, check=True,
                   capture_output=True, text=True)
    try:
        window = next(r for r in cluster.backend.reservations() if r.name == name)
        assert window.end_at is not None and window.start_at is not None
        assert abs(window.end_at - window.start_at - 1800) <= 1 and abs(window.end_at - time.time() - 1800) < 120
        args = ("sbatch", "--dry-run", "--gpus=1-2", f"--ckpt-dir={cluster.root / 'ckpt'}", f"--reservation={name}")
        unbounded = cluster.cli(*args, str(TEMPLATE))
        assert f"note: reservation {name} ends at " in unbounded.stderr, unbounded.stderr
        assert "though its run has no --total-time" in unbounded.stderr, unbounded.stderr
        assert f"--reservation={name}" in unbounded.stdout     # submitted as asked: a note, not a refusal
        bounded = cluster.cli(*args, "--total-time=20", str(TEMPLATE))
        assert "reservation" not in bounded.stderr, bounded.stderr
    finally:
        subprocess.run(["scontrol", "delete", f"ReservationName={name}"], env=cluster.env, check=False,
                       capture_output=True)
