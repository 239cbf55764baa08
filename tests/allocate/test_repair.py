"""The warm path (allocate/repair.py): after a node event only the jobs it touched change."""

from __future__ import annotations

import math
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from slurm_elastic.allocate import AllocationProblem, JobRequest, NodeCapacity, Policy, RepairingSolver, repair, solve
from slurm_elastic.allocate.instance import Instance
from slurm_elastic.allocate.problem import REPAIRED
from slurm_elastic.allocate.repair import with_current
from slurm_elastic.errors import AllocationError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from solver import make_problem  # noqa: E402  (the benchmark's generator: one home for synthetic clusters)


def _rows(problem: AllocationProblem, placement) -> list[dict[int, int]]:
    inst = Instance(problem)
    return [{inst.node_index[n]: g for n, g in placement[j.key].items()} for j in problem.jobs]


def _after_one_cycle(jobs: int, nodes: int, seed: int) -> AllocationProblem:
    problem = make_problem(jobs, nodes, 8, False, seed=seed, policy=Policy())
    return with_current(problem, solve(problem))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_lost_node_changes_only_the_jobs_that_ran_on_it(seed: int) -> None:
    previous = _after_one_cycle(200, 96, seed)
    busiest = Counter(n for j in previous.jobs for n in j.current).most_common(1)[0][0]
    on_it = {j.key for j in previous.jobs if busiest in j.current}
    assert on_it, "the lost node held no job: this would prove nothing"
    lost = replace(previous, nodes=tuple(n for n in previous.nodes if n.name != busiest))
    answer = repair(lost)
    assert answer.status == REPAIRED and math.isnan(answer.bound)
    changed = {j.key for j in lost.jobs if answer.placement[j.key] != dict(j.current)}
    assert changed <= on_it | {j.key for j in lost.jobs if not j.current}
    assert on_it <= changed                       # none of them may keep GPUs on the node that is gone
    assert not Instance(lost).violations(_rows(lost, answer.placement))
    # what it gives up against the full solve, on these clusters: little (benchmarks/solver.py measures it)
    inst = Instance(lost)
    assert inst.objective(_rows(lost, answer.placement)) >= 0.97 * solve(lost).objective


def test_a_gained_node_goes_to_jobs_that_wait_and_moves_no_running_job() -> None:
    nodes = (NodeCapacity("a", 8, 64, 512_000),)
    jobs = (JobRequest("run", 4, 8, current={"a": 8}), JobRequest("wait", 4, 8))
    problem = with_current(AllocationProblem(jobs, nodes), solve(AllocationProblem(jobs, nodes)))
    assert problem.jobs[1].current == {}, "the waiting job had no room before the node arrived"
    gained = replace(problem, nodes=(*problem.nodes, NodeCapacity("b", 8, 64, 512_000)))
    answer = repair(gained)
    assert answer.placement["run"] == dict(problem.jobs[0].current)
    assert answer.placement["wait"] == {"b": 8}


def test_a_spanning_job_never_takes_part_of_a_node_a_kept_job_shares() -> None:
    # Kept jobs leave one GPU free on each of a and b: to a solve of the room alone these look like two
    # whole 1-GPU nodes, and a 2-GPU job would span them; Slurm's shape needs every GPU of each (8).
    nodes = tuple(NodeCapacity(n, 8, 64, 512_000) for n in "ab")
    jobs = (JobRequest("ka", 7, 7, current={"a": 7}), JobRequest("kb", 7, 7, current={"b": 7}),
            JobRequest("new", 2, 2))
    room_alone = solve(AllocationProblem(jobs[2:], (NodeCapacity("a", 1, 57, 505_000),
                                                    NodeCapacity("b", 1, 57, 505_000))))
    assert room_alone.placement["new"] == {"a": 1, "b": 1}, "the trap this test is about is not set"
    answer = repair(AllocationProblem(jobs, nodes))
    assert answer.placement["ka"] == {"a": 7} and answer.placement["kb"] == {"b": 7}
    assert answer.gpus["new"] == 0
    assert not Instance(AllocationProblem(jobs, nodes)).violations(_rows(AllocationProblem(jobs, nodes),
                                                                         answer.placement))
    # with a wholly free node it goes there
    more = AllocationProblem(jobs, (*nodes, NodeCapacity("c", 8, 64, 512_000)))
    assert repair(more).placement["new"] == {"c": 2}


def test_a_node_that_shrank_re_places_every_job_on_it() -> None:
    nodes = (NodeCapacity("a", 4, 64, 512_000), NodeCapacity("b", 8, 64, 512_000))
    jobs = (JobRequest("x", 2, 4, current={"a": 4}), JobRequest("y", 2, 4, current={"a": 4}))  # a had 8
    answer = repair(AllocationProblem(jobs, nodes))
    assert sum(answer.gpus.values()) == 8 and not Instance(AllocationProblem(jobs, nodes)).violations(
        _rows(AllocationProblem(jobs, nodes), answer.placement))


def test_bad_input_is_refused_as_solve_refuses_it() -> None:
    with pytest.raises(AllocationError):
        repair(AllocationProblem((JobRequest("x", 4, 2),), (NodeCapacity("a", 8, 64, 512_000),)))


def test_the_controllers_solver_repairs_between_full_solves_on_large_clusters_only() -> None:
    calls: list[str] = []
    now = [0.0]

    def full(problem: AllocationProblem):
        calls.append("full")
        return solve(problem)

    previous = _after_one_cycle(60, 32, 1)
    small = RepairingSolver(min_pairs=10**9, clock=lambda: now[0], full=full)
    small(previous), small(previous)
    assert calls == ["full", "full"]
    calls.clear()
    large = RepairingSolver(min_pairs=1, period_s=600, clock=lambda: now[0], full=full)
    assert large(previous).status != REPAIRED               # the first cycle: the full solve
    now[0] = 599.0
    answer = large(previous)
    assert answer.status == REPAIRED
    now[0] = 600.0
    assert large(previous).status != REPAIRED
    # the repair's touched jobs went through the same full solve (the pending ones, here)
    assert calls.count("full") >= 2
