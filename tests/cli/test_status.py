"""`status` reads each job's LATEST from a directory its user controls: never a link, a FIFO or a long read."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slurm_elastic.cli.status import newest_checkpoint_step
from slurm_elastic.cluster.model import Job, JobState
from slurm_elastic.spec import ElasticSpec


def _job(root: Path) -> Job:
    return Job(job_id=77, user="alice", name="train", state=JobState.RUNNING,
               spec=ElasticSpec(1, 4, ckpt_dir=str(root)))


def _latest(root: Path) -> Path:
    (root / "77").mkdir(parents=True)
    return root / "77" / "LATEST"


def test_a_plain_latest_gives_its_step(tmp_path: Path) -> None:
    _latest(tmp_path).write_text("step-0000001200\n")
    assert newest_checkpoint_step(_job(tmp_path)) == 1200


@pytest.mark.parametrize("kind", ["fifo", "link-to-dev-zero", "link-to-a-good-file", "binary", "huge"])
def test_a_hostile_latest_is_unknown_and_never_hangs(tmp_path: Path, kind: str) -> None:
    latest = _latest(tmp_path)
    if kind == "fifo":
        os.mkfifo(latest)                       # an open() without O_NONBLOCK would wait for a writer
    elif kind == "link-to-dev-zero":
        latest.symlink_to("/dev/zero")          # an unbounded read would never end
    elif kind == "link-to-a-good-file":
        (tmp_path / "elsewhere").write_text("step-0000000005\n")
        latest.symlink_to(tmp_path / "elsewhere")
    elif kind == "binary":
        latest.write_bytes(b"\xff\xfe\x00step")
    else:
        latest.write_text("step-" + "9" * 10_000_000)
    assert newest_checkpoint_step(_job(tmp_path)) is None
