"""Jobs limited to their partition's nodes: each pool of jobs is solved on its own nodes."""

from __future__ import annotations

import pytest

from slurm_elastic.allocate import AllocationProblem, JobRequest, NodeCapacity, solve
from slurm_elastic.errors import AllocationError

NODES = tuple(NodeCapacity(f"n{i}", 4, 32, 64_000) for i in range(1, 5))
SMALL = frozenset({"n1", "n2"})     # a partition of two of the four nodes


def _on(allocation, key: str) -> set[str]:
    return set(allocation.placement[key])


def test_a_job_gets_no_more_than_its_partitions_nodes_hold_and_only_there():
    answer = solve(AllocationProblem((JobRequest("a", 1, 16, allowed_nodes=SMALL),), NODES))
    assert answer.gpus["a"] == 8 and _on(answer, "a") <= SMALL


def test_disjoint_partitions_are_solved_as_separate_clusters():
    jobs = (JobRequest("a", 1, 16, allowed_nodes=SMALL), JobRequest("b", 1, 16, allowed_nodes=frozenset({"n3", "n4"})))
    answer = solve(AllocationProblem(jobs, NODES))
    assert (answer.gpus["a"], answer.gpus["b"]) == (8, 8)
    assert _on(answer, "a") <= SMALL and _on(answer, "b") <= {"n3", "n4"}


def test_the_confined_job_is_placed_before_the_one_that_may_go_anywhere():
    # b could take every GPU; a has nowhere but n1-n2, so it is solved first and b takes the rest
    jobs = (JobRequest("b", 1, 16), JobRequest("a", 1, 8, allowed_nodes=SMALL))
    answer = solve(AllocationProblem(jobs, NODES))
    assert answer.gpus["a"] == 8 and _on(answer, "a") <= SMALL
    assert answer.gpus["b"] == 8 and not _on(answer, "b") & _on(answer, "a")
    assert answer.notes and any("(2 nodes)" in n for n in answer.notes)


def test_a_job_whose_partition_has_every_node_is_not_a_pool_of_its_own():
    every = frozenset(n.name for n in NODES)
    plain = solve(AllocationProblem((JobRequest("a", 1, 16),), NODES))
    same = solve(AllocationProblem((JobRequest("a", 1, 16, allowed_nodes=every),), NODES))
    assert same.placement == plain.placement and same.notes == plain.notes


def test_allowed_nodes_must_be_a_set_of_names():
    with pytest.raises(AllocationError, match="allowed nodes"):
        solve(AllocationProblem((JobRequest("a", 1, 4, allowed_nodes=["n1"]),), NODES))  # type: ignore[arg-type]
