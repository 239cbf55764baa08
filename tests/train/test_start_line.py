"""The start line's cause: read from what the job's earlier start left in its own directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_elastic import jobfiles as protocol
from slurm_elastic.train.environment import JobEnvironment
from slurm_elastic.train.start_line import restart_cause, start_line


def _env(restart: int, step_id: int = 0) -> JobEnvironment:
    return JobEnvironment.from_env({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": str(restart),
                                    "SLURM_STEP_ID": str(step_id)})


@pytest.mark.parametrize("files, restart, step_id, cause", [
    ([protocol.ack_file_name(7, 0)], 1, 0, "a signalled stop: a resize by the controller, a time limit or a preemption (checkpoint acknowledged)"),
    ([protocol.peer_lost_file_name(7, 1, 0)], 1, 1, "a lost peer (the survivors committed and were relaunched"),
    ([protocol.peer_lost_file_name(7, 0, 0)], 1, 0, "a lost peer (the survivors committed before the requeue)"),
    ([protocol.ack_file_name(7, 0)], 2, 0, "a requeue (restart 2) with no acknowledged checkpoint"),
    ([protocol.peer_lost_file_name(8, 0, 0), protocol.ack_file_name(8, 0)], 1, 0, "a requeue (restart 1)"),
    ([], 0, 0, "an earlier run under job key 7"),
])
def test_the_cause_is_what_the_previous_start_of_this_job_left(tmp_path: Path, files: list[str], restart: int,
                                                                step_id: int, cause: str) -> None:
    job_dir = tmp_path / "7"
    job_dir.mkdir()
    for name in files:
        (job_dir / name).write_text("{}")
    assert restart_cause(str(job_dir), _env(restart, step_id)).startswith(cause)


@pytest.mark.parametrize("commit", ["done", "none"])
@pytest.mark.parametrize("kept", [True, False])
def test_the_cause_says_whether_the_survivors_committed(tmp_path: Path, commit: str, kept: bool) -> None:
    """What their report says (a BatchNorm model's survivors once never agreed: the line still said committed)."""
    job_dir = tmp_path / "7"
    job_dir.mkdir()
    report = protocol.PeerLostReport(
        job_id="7", restart_count=0, step_id=0, world_size=2, detected_by="heartbeat", detected_at=1.0,
        lost=(protocol.LostRank(1, "n2"),), lost_nodes=("n2",), surviving_nodes=("n1",), agreed_step=39,
        commit=commit, committed_step=39 if commit == "done" else None, reason="test")
    (job_dir / protocol.peer_lost_file_name(7, 0, 0)).write_bytes(report.to_bytes())
    env = JobEnvironment.from_env({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "0", "SLURM_PROCID": "0",
                                   "SLURM_NTASKS": "1", "SLURM_LOCALID": "0",
                                   "SLURM_STEP_ID": "0" if kept else "1", "SLURM_ELASTIC_GENERATION": "1" if kept else "0"})
    then = "went on in their processes" if kept else "were relaunched in place"
    expected = (f"a lost peer (the survivors committed and {then})" if commit == "done" else
                f"a lost peer (the survivors {then} without a commit: from the last checkpoint)")
    assert restart_cause(str(job_dir), env) == expected


def test_the_line_names_the_step_epoch_and_checkpoint(tmp_path: Path) -> None:
    line = start_line(str(tmp_path / "7"), _env(1), step=12, restored_step=12, epoch=3)
    assert line.startswith(f"slurm-elastic: resumed at step 12 (epoch 3) from {tmp_path / '7' / 'step-0000000012'}"
                           " after a requeue (restart 1)")
    assert start_line(str(tmp_path / "7"), _env(0), step=0, restored_step=None) == \
        f"slurm-elastic: started at step 0: no checkpoint in {tmp_path / '7'}"


def test_after_a_stop_that_committed_nothing_the_line_says_how_many_steps_are_done_again(tmp_path: Path) -> None:
    job_dir = tmp_path / "7"
    job_dir.mkdir()
    rows = [protocol.MetricsRow(step=s, time=1.0 + s, gpus=2, steps_per_s=1.0) for s in (10, 20, 33)]
    (job_dir / protocol.METRICS_FILE).write_bytes(b"".join(r.to_line() for r in rows))
    line = start_line(str(job_dir), _env(2), step=20, restored_step=20)
    assert "after a requeue (restart 2) with no acknowledged checkpoint" in line
    assert line.endswith("; an earlier start had reached step 33: at least 13 steps are lost"), line
    # a start that continues where the rows end (a committed stop) says nothing of a loss
    assert "lost" not in start_line(str(job_dir), _env(2), step=33, restored_step=33)
    # nothing committed at all: the fresh start says what it does again
    assert start_line(str(job_dir), _env(1), step=0, restored_step=None).endswith("at least 33 steps are lost")
    # a hostile metrics file (not the rows the shim writes) gives the plain line
    (job_dir / protocol.METRICS_FILE).write_text('{"step": "many"}\n' + "x" * 100)
    assert "lost" not in start_line(str(job_dir), _env(2), step=20, restored_step=20)


@pytest.mark.parametrize("content, cause", [
    ("time limit\n", "a time limit (checkpoint acknowledged at Slurm's signal)"),
    ("preemption\n", "a preemption (checkpoint acknowledged at Slurm's signal)"),
    ("a resize that gave me 64 GPUs\n", "a signalled stop: a resize by the controller"),
    ("x" * 5000, "a signalled stop: a resize by the controller"),
])
def test_the_templates_word_for_the_jobs_end_names_a_time_limit_or_a_preemption_and_nothing_else(
        tmp_path: Path, content: str, cause: str) -> None:
    job_dir = tmp_path / "7"
    job_dir.mkdir()
    (job_dir / protocol.ack_file_name(7, 0)).write_text("{}")
    (job_dir / protocol.end_cause_file_name(7, 0)).write_text(content)
    assert restart_cause(str(job_dir), _env(1)).startswith(cause)


def test_an_end_cause_that_is_a_fifo_or_a_link_is_not_read(tmp_path: Path) -> None:
    import os

    job_dir = tmp_path / "7"
    job_dir.mkdir()
    (job_dir / protocol.ack_file_name(7, 0)).write_text("{}")
    os.mkfifo(job_dir / protocol.end_cause_file_name(7, 0))     # opening it for reading must not block
    assert restart_cause(str(job_dir), _env(1)).startswith("a signalled stop")
    os.unlink(job_dir / protocol.end_cause_file_name(7, 0))
    (tmp_path / "elsewhere").write_text("time limit\n")
    os.symlink(tmp_path / "elsewhere", job_dir / protocol.end_cause_file_name(7, 0))
    assert restart_cause(str(job_dir), _env(1)).startswith("a signalled stop")
