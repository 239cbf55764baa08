"""repair(problem) -> Allocation: after a node event, solve only the jobs the event touched.

Between two cycles most of an allocation stays right (COpter, SOSP'25, re-solves from the previous
round): a node lost or gained changes the jobs on it and the capacity around it, not the rest. `repair`
keeps every running job whose placement still holds (its nodes up with room for it, its count still one
it may take) exactly where it is, and solves the others (jobs that lost a node, jobs on a node whose
capacity shrank, pending and new jobs) with `solve` over the capacity the kept jobs leave. Its cost
follows the jobs and nodes touched, not the cluster's size.

The price: no kept job moves or grows, so a gained node goes to the jobs that wait, and the answer can
be worse than a full solve's. `RepairingSolver` is the controller's use of it: the full solve on a
large cluster's first cycle and then on a period, `repair` in between; small clusters always get the
full solve, which costs them less than a second.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Callable

from slurm_elastic.allocate.problem import (REPAIRED, Allocation, AllocationProblem, JobDecision, JobRequest,
                                            NodeCapacity)
from slurm_elastic.allocate.shapes import placement_is_valid_shape
from slurm_elastic.allocate.solver import solve

# Below this many (job, up node) pairs the full solve takes well under a second here (docs/allocator.md,
# "Benchmark"): the warm path would save nothing worth an answer it cannot certify.
REPAIR_MIN_PAIRS = 1_000_000
# How often a large cluster still gets the full solve, which may move and grow kept jobs.
FULL_SOLVE_PERIOD_S = 600.0


def repair(problem: AllocationProblem, *, solve_rest: Callable[[AllocationProblem], Allocation] = solve
           ) -> Allocation:
    """Keep every running job whose placement still holds; solve the rest in the room left."""
    t0 = time.perf_counter()
    problem.validate()
    room = {n.name: [n.gpus, n.cpus, n.mem_mb] for n in problem.nodes}
    kept, rest = _split(problem.jobs, room)
    for job in kept:
        _take(room, job, dict(job.current))
    gpus = {job.key: job.current_gpus for job in kept}
    placement = {job.key: dict(job.current) for job in kept}
    decisions = [JobDecision(job.key, job.current_gpus, job.current_gpus, "kept where it runs: the node event "
                             "did not touch it", cause="kept") for job in kept]
    notes = [f"repair: {len(kept)} running job(s) kept where they are; {len(rest)} solved in the room left "
             f"on {sum(1 for r in room.values() if r[0] > 0)} node(s)"]
    status, method, unplaceable = REPAIRED, "repair", problem.unplaceable
    if rest:
        sub, unplaceable = _solve_touched(problem, rest, room, solve_rest)
        gpus.update(sub.gpus)
        placement.update({k: dict(v) for k, v in sub.placement.items()})
        decisions.extend(sub.decisions)
        notes.append(f"the {len(rest)} touched job(s): {sub.status} ({sub.method})")
        notes.extend(sub.notes)
        method = f"repair+{sub.method}"
    order = {job.key: i for i, job in enumerate(problem.jobs)}
    decisions.sort(key=lambda d: order[d.key])
    # No bound: proving one would need the full model this path exists to avoid.
    return Allocation(gpus=gpus, placement=placement, status=status, method=method, objective=math.nan,
                      mip_gap=math.nan, bound=math.nan, solve_s=time.perf_counter() - t0,
                      decisions=tuple(decisions), unplaceable=tuple(unplaceable), notes=tuple(notes))


def _solve_touched(problem: AllocationProblem, rest: list[JobRequest], room: dict[str, list[int]],
                   solve_rest: Callable[[AllocationProblem], Allocation]) -> tuple[Allocation, tuple]:
    """Solve the touched jobs in the room the kept ones leave.

    The room of a node a kept job shares looks, to that solve, like a smaller node, and a job spanning
    nodes must take every elastic GPU of each (Policy.whole_nodes_when_spanning): a spanning placement
    on such a node is re-solved once over the nodes still wholly free, where every shape is Slurm's.
    """
    full = {n.name: n.gpus for n in problem.nodes}
    touched = {job.key for job in rest}
    carried = tuple(u for u in problem.unplaceable if u.key in touched)

    def over(names: set[str], jobs: list[JobRequest]) -> Allocation:
        nodes = tuple(NodeCapacity(n.name, *room[n.name]) for n in problem.nodes
                      if n.name in names and room[n.name][0] > 0)
        return solve_rest(AllocationProblem(tuple(jobs), nodes, problem.policy, carried))

    sub = over(set(room), rest)
    whole = problem.policy.whole_nodes_when_spanning
    bad = [job for job in rest
           if not placement_is_valid_shape(sub.placement.get(job.key, {}), full, whole)]
    if bad:
        redone = {job.key for job in bad}
        gpus, placement = dict(sub.gpus), {k: dict(v) for k, v in sub.placement.items()}
        for job in rest:
            if job.key not in redone:
                _take(room, job, placement.get(job.key, {}))
        free = {name for name, r in room.items() if r[0] == full[name]}
        again = over(free, bad)
        gpus.update(again.gpus)
        placement.update({k: dict(v) for k, v in again.placement.items()})
        sub = replace(sub, gpus=gpus, placement=placement,
                      decisions=tuple(d for d in sub.decisions if d.key not in redone) + again.decisions,
                      notes=(*sub.notes, f"{len(bad)} spanning placement(s) on shared nodes re-solved over "
                             f"{len(free)} wholly free node(s)", *again.notes),
                      unplaceable=(*sub.unplaceable, *again.unplaceable))
    outside = tuple(u for u in problem.unplaceable if u.key not in touched)
    return sub, (*outside, *{u.key: u for u in sub.unplaceable}.values())


def _take(room: dict[str, list[int]], job: JobRequest, placement: dict[str, int]) -> None:
    for name, g in placement.items():
        room[name][0] -= g
        room[name][1] -= g * job.cpus_per_gpu
        room[name][2] -= g * job.mem_per_gpu_mb


def _split(jobs: tuple[JobRequest, ...], room: dict[str, list[int]]) -> tuple[list[JobRequest], list[JobRequest]]:
    """The running jobs whose placement still holds, and the rest.

    A placement holds when each of its nodes is up in the problem (and in the job's partition) and its
    count is one the job may take now; a node whose capacity no longer covers all the jobs that hold
    still on it sends every one of them to the rest (the solve re-places them together).
    """
    holding = [job for job in jobs if job.current and _holds(job, room)]
    left = {name: list(r) for name, r in room.items()}
    for job in holding:
        _take(left, job, dict(job.current))
    over = {name for name, r in left.items() if min(r) < 0}
    kept = {job.key for job in holding if not over.intersection(job.current)}
    return [job for job in jobs if job.key in kept], [job for job in jobs if job.key not in kept]


def _holds(job: JobRequest, room: dict[str, list[int]]) -> bool:
    if any(g <= 0 or name not in room or room[name][0] <= 0 for name, g in job.current.items()):
        return False
    if job.allowed_nodes is not None and not job.allowed_nodes.issuperset(job.current):
        return False
    return job.current_gpus in job.candidate_gpus()


@dataclass
class RepairingSolver:
    """The controller's solve: the full solve on a small cluster, on a large one's first cycle and every
    `period_s`; `repair` in between (a lost or gained node answered without rebuilding the whole model)."""

    min_pairs: int = REPAIR_MIN_PAIRS
    period_s: float = FULL_SOLVE_PERIOD_S
    clock: Callable[[], float] = time.monotonic
    full: Callable[[AllocationProblem], Allocation] = solve
    _last_full: float | None = None

    def __call__(self, problem: AllocationProblem) -> Allocation:
        now = self.clock()
        pairs = len(problem.jobs) * sum(1 for n in problem.nodes if n.gpus > 0)
        due = self._last_full is None or now - self._last_full >= self.period_s
        if pairs < self.min_pairs or due:
            self._last_full = now
            return self.full(problem)
        return repair(problem, solve_rest=self.full)


def with_current(problem: AllocationProblem, allocation: Allocation) -> AllocationProblem:
    """The problem of the next cycle as if `allocation` had been carried out (for benchmarks and tests)."""
    return replace(problem, jobs=tuple(replace(j, current=dict(allocation.placement.get(j.key, {})))
                                       for j in problem.jobs))
