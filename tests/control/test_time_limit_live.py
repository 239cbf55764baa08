"""Live: an elastic job trains through its time limits - Slurm's warning, a commit, its own requeue - losing no step.

The job is job_templates/ddp.sbatch running the digits example on one rank, submitted with a
2-minute limit and `--signal-before 30`; no controller runs, so every requeue is the job's own.
Waits are on states, with generous timeouts (the machine is loaded); Slurm sends the warning up
to 60 s early and holds a requeued job back before starting it again, so the timings vary.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from slurm_elastic.cluster.model import JobState
from tests.control.live_files import json_lines, read_ack

pytestmark = pytest.mark.slurm

TEMPLATE = Path(__file__).resolve().parents[2] / "job_templates" / "ddp.sbatch"
LIMITS = 2      # time limits the job must train through


def test_a_job_trains_through_two_time_limits_losing_no_step(elastic_cluster):
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
    try:
        def job():
            return next((j for j in cluster.snapshot().jobs if j.job_id == job_id), None)

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
