"""`admin status` on a job whose previous incarnation Slurm ended (a time limit, a preemption): the job
template's word for the end and the acknowledged step, read as every job file is (owner, size, content)."""

from __future__ import annotations

import os
from pathlib import Path

from slurm_elastic import jobfiles as shim
from slurm_elastic.cluster.model import Job, JobState
from slurm_elastic.control.phases import slurm_end
from slurm_elastic.spec import ElasticSpec


def _job(ckpt: Path, restarts: int = 2) -> Job:
    return Job(job_id=9, user="alice", name="j", state=JobState.RUNNING, nodes=("n1",), num_nodes=1,
               gpus_per_node=1, restarts=restarts, spec=ElasticSpec(1, 1, ckpt_dir=str(ckpt)))


def _files(ckpt: Path, cause: str, ack: shim.Ack | None, restart: int = 1) -> None:
    jd = ckpt / "9"
    jd.mkdir(parents=True, exist_ok=True)
    (jd / shim.end_cause_file_name(9, restart)).write_text(cause)
    if ack is not None:
        (jd / shim.ack_file_name(9, restart)).write_bytes(ack.to_bytes())


def test_a_time_limit_with_its_acknowledged_step(tmp_path: Path) -> None:
    _files(tmp_path, "time limit\n", shim.Ack(step=120, time=1.0, committed=True, world_size=2))
    end = slurm_end(_job(tmp_path), owner_uid=os.getuid())
    assert end == {"restart": 2, "cause": "time limit", "committed_step": 120,
                   "line": "restart 2 after a time limit: checkpoint of step 120 acknowledged"}


def test_a_preemption_whose_commit_was_not_acknowledged_says_so(tmp_path: Path) -> None:
    _files(tmp_path, "preemption\n", shim.Ack(step=100, time=1.0, committed=False, world_size=2))
    end = slurm_end(_job(tmp_path), owner_uid=os.getuid())
    assert end is not None and end["line"] == "restart 2 after a preemption: no acknowledged checkpoint"


def test_only_the_previous_incarnations_end_and_only_the_two_words_count(tmp_path: Path) -> None:
    _files(tmp_path, "time limit\n", None, restart=0)          # an older incarnation's end
    assert slurm_end(_job(tmp_path), owner_uid=os.getuid()) is None
    _files(tmp_path, "a resize to 64 GPUs\n", None)
    assert slurm_end(_job(tmp_path), owner_uid=os.getuid()) is None
    _files(tmp_path, "time limit\n", None)
    assert slurm_end(_job(tmp_path), owner_uid=os.getuid() + 1) is None    # another user's file
    assert slurm_end(_job(tmp_path, restarts=0), owner_uid=os.getuid()) is None
