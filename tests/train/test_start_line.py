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


def test_the_line_names_the_step_epoch_and_checkpoint(tmp_path: Path) -> None:
    line = start_line(str(tmp_path / "7"), _env(1), step=12, restored_step=12, epoch=3)
    assert line.startswith(f"slurm-elastic: resumed at step 12 (epoch 3) from {tmp_path / '7' / 'step-0000000012'}"
                           " after a requeue (restart 1)")
    assert start_line(str(tmp_path / "7"), _env(0), step=0, restored_step=None) == \
        f"slurm-elastic: started at step 0: no checkpoint in {tmp_path / '7'}"
