"""Slurm's value spellings: hostlists, GRES/TRES, states, numbers, versions."""

from __future__ import annotations

import pytest

from slurm_elastic.cluster.model import JobState, NodeFlag, NodeState
from slurm_elastic.cluster.slurm_values import (SlurmParseError, SlurmVersion, expand_hostlist, gres_gpus,
                                                job_cpus_per_node, job_held, job_mem_per_node, job_state,
                                                node_state, number, per_gpu_value, reason_code, size_mb, tres_gpus)


@pytest.mark.parametrize("text,names", [
    ("n1", ("n1",)), ("n[1-3]", ("n1", "n2", "n3")), ("n[1,3],m2", ("n1", "n3", "m2")),
    ("gpu[08-10]", ("gpu08", "gpu09", "gpu10")), ("r[1-2]c[1-2]", ("r1c1", "r1c2", "r2c1", "r2c2")),
    ("", ()), ("(null)", ()),
])
def test_hostlists(text: str, names: tuple[str, ...]) -> None:
    assert expand_hostlist(text) == names


@pytest.mark.parametrize("text,gpus", [
    ("gpu:4", 4), ("gpu:a100:4(S:0-1)", 4), ("gres:gpu:3", 3), ("gres/gpu:3", 3), ("gpu:3(IDX:0-2)", 3),
    ("gpu:a100:2,gpu:v100:1", 3), ("shard:8,gpu:2", 2), ("gpu", 1), ("gpu:0", 0), ("shard:8", None),
    ("", None), ("(null)", None), (None, None),
])
def test_gres_gpus(text: str | None, gpus: int | None) -> None:
    assert gres_gpus(text) == gpus


def test_tres_and_per_gpu_values() -> None:
    assert tres_gpus("cpu=2,mem=1G,node=1,billing=2") is None
    assert tres_gpus("cpu=2,gres/gpu=6,gres/gpu:a100=6") == 6
    assert per_gpu_value("gres:gpu:4") == per_gpu_value("gres/gpu:4") == "4"
    assert per_gpu_value("") is None


@pytest.mark.parametrize("raw,flags,state,expected_flags", [
    ("down", ["NOT_RESPONDING"], NodeState.DOWN, {NodeFlag.NOT_RESPONDING}),
    (["DOWN", "NOT_RESPONDING"], [], NodeState.DOWN, {NodeFlag.NOT_RESPONDING}),
    ("IDLE+DRAIN", [], NodeState.IDLE, {NodeFlag.DRAIN}),
    ("MIXED+DRAIN", [], NodeState.MIXED, {NodeFlag.DRAIN}),
    ("drained", [], NodeState.IDLE, {NodeFlag.DRAIN}),
    ("down*", [], NodeState.DOWN, {NodeFlag.NOT_RESPONDING}),
    ("idle~", [], NodeState.IDLE, {NodeFlag.POWERED_DOWN}),
    (["IDLE", "POWERED_DOWN", "PLANNED"], [], NodeState.IDLE, {NodeFlag.POWERED_DOWN}),
    (["FUTURE"], [], NodeState.FUTURE, set()),
    ("MIXED+FAIL", [], NodeState.MIXED, {NodeFlag.FAIL}),
])
def test_node_states(raw, flags, state, expected_flags) -> None:
    assert node_state(raw, flags) == (state, frozenset(expected_flags))


def test_unknown_node_state() -> None:
    with pytest.raises(SlurmParseError):
        node_state(["NOT_RESPONDING"])


@pytest.mark.parametrize("raw,state", [
    ("RUNNING", JobState.RUNNING), (["PENDING"], JobState.PENDING), (["PENDING", "REQUEUED"], JobState.PENDING),
    (["RUNNING", "COMPLETING"], JobState.COMPLETING), ("COMPLETED", JobState.COMPLETED),
    (["PENDING", "REQUEUE_HOLD"], JobState.REQUEUE_HOLD), ("NODE_FAIL", JobState.NODE_FAIL),
])
def test_job_states(raw, state) -> None:
    assert job_state(raw) is state


def test_numbers_of_every_version() -> None:
    assert number(5) == 5
    assert number({"set": True, "infinite": False, "number": 7}) == 7
    assert number({"set": False, "infinite": False, "number": 0}) is None
    assert number({"set": False, "infinite": True, "number": 0}, default=-1) == -1
    assert number(None) is None and number(True) is None


def test_sizes_and_versions() -> None:
    assert size_mb("1G") == 1024 and size_mb("16000M") == 16000 and size_mb("1024") == 1024
    with pytest.raises(SlurmParseError):
        size_mb("lots")
    assert SlurmVersion.parse("slurm-wlm 22.05.8") == SlurmVersion(22, 5, 8)
    assert SlurmVersion.from_meta({"slurm": {"version": {"major": "26", "minor": "05", "micro": "5"}}}) == \
        SlurmVersion(26, 5, 5)
    assert SlurmVersion(22, 5) < SlurmVersion(23, 2) <= SlurmVersion(24, 11)
    assert SlurmVersion(26, 5, 5).release == "26.05"


@pytest.mark.parametrize("state,hold_flag,priority,held", [
    (JobState.PENDING, False, 0, True),          # 22.05: no hold key, priority 0
    (JobState.PENDING, True, 0, True),           # 23.02+
    (JobState.PENDING, False, 4294901757, False),
    (JobState.COMPLETING, True, 0, True),        # still completing its requeuehold: it lands held
    (JobState.REQUEUED, False, 0, True),         # 22.05's spelling of that moment
    (JobState.REQUEUE_HOLD, False, None, True),
    (JobState.CANCELLED, True, 0, False),        # 24.11/26.05 keep hold: true after scancel
    (JobState.CANCELLED, False, 0, False),       # 22.05 keeps priority 0
    (JobState.COMPLETED, True, 0, False),
    (JobState.RUNNING, False, 0, False),
])
def test_job_held(state: JobState, hold_flag: bool, priority: int | None, held: bool) -> None:
    assert job_held(state, hold_flag=hold_flag, priority=priority) is held


@pytest.mark.parametrize("text,code", [
    ("JobHeldUser", "JobHeldUser"), ("None", ""), ("", ""), ("(null)", ""),
    ("job requeued in held state", "JobHeldUser"),       # squeue %r, pyslurm's state_reason
    ("job_requeued_in_held_state", "JobHeldUser"),       # scontrol show job's Reason=
    ("ReqNodeNotAvail, UnavailableNodes:n1", "ReqNodeNotAvail"),
    ("ReqNodeNotAvail,_UnavailableNodes:n1", "ReqNodeNotAvail"),
    ("some new description", "some new description"),   # unknown: kept as Slurm wrote it
])
def test_reason_code(text: str, code: str) -> None:
    assert reason_code(text) == code


def test_memory_per_node_precedence() -> None:
    # the allocation wins; then per GPU (23.02+ also report the per-GPU value as per node); per node; per CPU; TRES
    assert job_mem_per_node(allocated=1000, per_gpu=500, gpus_per_node=2, per_node=500) == 1000
    assert job_mem_per_node(per_gpu=500, gpus_per_node=2, per_node=500) == 1000
    assert job_mem_per_node(per_gpu=500, gpus_per_node=0, per_node=1024) == 1024
    assert job_mem_per_node(per_cpu=100, cpus_per_node=4) == 400
    assert job_mem_per_node(tres_total=3000, num_nodes=2) == 1500
    assert job_mem_per_node() == 0
    assert job_cpus_per_node(2, 2, gpus_per_node=2, cpus_per_gpu=1, running=False) == 2
    assert job_cpus_per_node(4, 2, gpus_per_node=2, cpus_per_gpu=1, running=True) == 2
    assert job_cpus_per_node(2, 2, gpus_per_node=2, cpus_per_gpu=3, running=False) == 6
