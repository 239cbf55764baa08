"""Jobs that may run only on some nodes (their partition's): each pool of jobs solved on its own nodes.

Slurm starts a resized job only inside its partition, so a count the solver found by adding GPUs of
nodes outside it would leave the job pending. Jobs are grouped by the nodes they may use; each group
is solved on those nodes, with what the groups solved before it took subtracted. The most constrained
group goes first (it has nowhere else to go), jobs that may use any node last. Disjoint partitions are
solved exactly as separate clusters; where partitions share nodes, the earlier group has the shared
nodes first, and each group's status certifies its own solve, not the whole.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping

from slurm_elastic.allocate.problem import Allocation, AllocationProblem, JobRequest, NodeCapacity, weakest_status

Solve = Callable[[AllocationProblem], Allocation]


def _usable(problem: AllocationProblem) -> set[str]:
    """The nodes with GPUs to give: keeping a job off one without any (a DOWN node) restricts nothing."""
    return {n.name for n in problem.nodes if n.gpus > 0}


def restricted(problem: AllocationProblem) -> bool:
    """Some job may not use every node of the problem that has GPUs."""
    names = _usable(problem)
    return any(j.allowed_nodes is not None and not names <= j.allowed_nodes for j in problem.jobs)


def solve_by_pool(problem: AllocationProblem, solve: Solve) -> Allocation:
    """`solve` once per group of jobs with the same nodes, the smallest group of nodes first.

    A group's nodes are not its to take: every job of a later group that runs only on those nodes now is
    solved beside it there (its request, restart cost and claims weighed as in one solve), and one that
    runs there and elsewhere keeps what it holds there. Only the group's own answer is kept; the others
    are solved again with their group. Without that, a job kept off one node (by a partition, or by its
    own `--exclude` or lost-node report) was solved first on the rest alone and took other users' running
    GPUs (an adversarial probe: `--exclude` of a DOWN spare took bob's job from 8 GPUs to 4).
    """
    names = _usable(problem)
    groups: dict[frozenset[str] | None, list[JobRequest]] = {}
    for job in problem.jobs:
        nodes = None if job.allowed_nodes is None or names <= job.allowed_nodes else job.allowed_nodes & names
        groups.setdefault(nodes, []).append(job)
    order = sorted(groups, key=lambda g: (g is None, len(g or ()), sorted(g or ())))
    left = {n.name: n for n in problem.nodes}
    parts: list[tuple[frozenset[str] | None, Allocation]] = []
    for at, nodes in enumerate(order):
        jobs = tuple(dataclasses.replace(j, allowed_nodes=None) for j in groups[nodes])
        room = dict(left)
        rivals: list[JobRequest] = []
        if nodes is not None:
            for later in order[at + 1:]:
                for other in groups[later]:
                    held = {n: g for n, g in other.current.items() if g > 0}
                    if held and set(held) <= nodes:
                        rivals.append(dataclasses.replace(other, allowed_nodes=None))
                    elif held:
                        room = _less(room, other, {n: g for n, g in held.items() if n in nodes})
        pool = tuple(room[n.name] for n in problem.nodes if nodes is None or n.name in nodes)
        answer = solve(dataclasses.replace(problem, jobs=jobs + tuple(rivals), nodes=pool))
        parts.append((nodes, _only(answer, {j.key for j in jobs}) if rivals else answer))
        for job in jobs:
            left = _less(left, job, answer.placement.get(job.key, {}))
    return _merged(parts)


def _only(answer: Allocation, keys: set[str]) -> Allocation:
    """`answer` for the jobs `keys` alone (the rivals solved beside them are solved again with their group)."""
    return dataclasses.replace(
        answer, gpus={k: g for k, g in answer.gpus.items() if k in keys},
        placement={k: p for k, p in answer.placement.items() if k in keys},
        decisions=tuple(d for d in answer.decisions if d.key in keys),
        unplaceable=tuple(u for u in answer.unplaceable if u.key in keys),
        basis={k: v for k, v in answer.basis.items() if k in keys})


def _less(left: Mapping[str, NodeCapacity], job: JobRequest, placed: Mapping[str, int]) -> dict[str, NodeCapacity]:
    out = dict(left)
    for name, g in placed.items():
        n = out[name]
        out[name] = NodeCapacity(name, max(n.gpus - g, 0), max(int(n.cpus - g * job.cpus_per_gpu), 0),
                                 max(int(n.mem_mb - g * job.mem_per_gpu_mb), 0))
    return out


def _merged(parts: list[tuple[frozenset[str] | None, Allocation]]) -> Allocation:
    answers = [a for _, a in parts]
    methods = sorted({a.method for a in answers})
    return Allocation(
        gpus={k: g for a in answers for k, g in a.gpus.items()},
        placement={k: p for a in answers for k, p in a.placement.items()},
        status=weakest_status([a.status for a in answers]),
        method=methods[0] if len(methods) == 1 else "+".join(methods),
        objective=sum(a.objective for a in answers),
        # each pool's gap is to its own bound: the whole is no further from the sum than the worst of them
        mip_gap=math.nan if any(math.isnan(a.mip_gap) for a in answers) else max(a.mip_gap for a in answers),
        bound=sum(a.bound for a in answers),
        solve_s=sum(a.solve_s for a in answers),
        decisions=tuple(d for a in answers for d in a.decisions),
        unplaceable=tuple(u for a in answers for u in a.unplaceable),
        notes=tuple(f"{_pool_name(nodes)}: {n}" for nodes, a in parts for n in a.notes)
        + tuple(f"{_pool_name(nodes)}: {len(a.gpus)} job{'' if len(a.gpus) == 1 else 's'} solved "
                f"{'on these nodes alone' if nodes is not None else 'on what the groups before left'} "
                f"({a.method}, {a.status})" for nodes, a in parts),
        basis={k: v for a in answers for k, v in a.basis.items()},
    )


def _pool_name(nodes: frozenset[str] | None) -> str:
    if nodes is None:
        return "jobs that may use any node"
    shown = sorted(nodes)
    return f"jobs on {','.join(shown[:4])}{'...' if len(shown) > 4 else ''} ({len(shown)} nodes)"
