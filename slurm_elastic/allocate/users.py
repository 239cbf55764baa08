"""A user's `--weight` moves GPUs among that user's own jobs, never from another user's.

The weight a user writes is their word, so it must not decide what other users get. When some job's
weight differs from its user's other jobs' (`JobRequest.own_weight` != 1), the allocation is solved
twice: first with every job at its user-neutral weight (own weight 1), which fixes what each user's jobs
hold on each node; then, for each user whose jobs carry different weights, those GPUs (and the CPUs and
memory no other user's job was given there) are divided again among that user's own jobs at their
weights. Every other user's allocation is the neutral one, exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Collection, Mapping

from slurm_elastic.allocate.problem import Allocation, AllocationProblem, NodeCapacity

Solve = Callable[[AllocationProblem], Allocation]


def weighted_users(problem: AllocationProblem) -> list[str]:
    """The users whose jobs carry different weights (whose GPUs a second solve divides)."""
    return sorted({j.user for j in problem.jobs if j.own_weight != 1.0})


def solve_by_user(problem: AllocationProblem, solve: Solve) -> Allocation:
    """`solve` at user-neutral weights, then each weighted user's slice divided at their own weights."""
    neutral = solve(dataclasses.replace(problem, jobs=tuple(j.neutral() for j in problem.jobs)))
    answer = neutral
    for user in weighted_users(problem):
        mine = tuple(dataclasses.replace(j, own_weight=1.0) for j in problem.jobs if j.user == user)
        keys = {j.key for j in mine}
        nodes = _slice(problem, neutral.placement, keys)
        divided = solve(AllocationProblem(mine, nodes, problem.policy))
        answer = _merge(answer, divided, keys, user)
    return answer


def _slice(problem: AllocationProblem, placement: Mapping[str, Mapping[str, int]],
           keys: Collection[str]) -> tuple[NodeCapacity, ...]:
    """Per node: the GPUs the neutral answer gave `keys`' jobs there, and the CPUs and memory left once
    every other job has what the neutral answer gave it."""
    others = [j for j in problem.jobs if j.key not in keys]
    out = []
    for node in problem.nodes:
        gpus = sum(placement.get(k, {}).get(node.name, 0) for k in keys)
        used = [(placement.get(j.key, {}).get(node.name, 0), j) for j in others]
        cpus = node.cpus - sum(g * j.cpus_per_gpu for g, j in used)
        mem = node.mem_mb - sum(g * j.mem_per_gpu_mb for g, j in used)
        out.append(NodeCapacity(node.name, gpus, max(int(cpus), 0), max(int(mem), 0)))
    return tuple(out)


def _merge(answer: Allocation, divided: Allocation, keys: Collection[str], user: str) -> Allocation:
    """`answer` with `keys`' jobs as `divided` placed them."""
    return dataclasses.replace(
        answer,
        gpus={**answer.gpus, **{k: divided.gpus[k] for k in keys}},
        placement={**answer.placement, **{k: divided.placement[k] for k in keys}},
        decisions=tuple(d for d in answer.decisions if d.key not in keys)
        + tuple(d for d in divided.decisions if d.key in keys),
        solve_s=answer.solve_s + divided.solve_s,
        notes=answer.notes + (f"user {user}'s jobs: the GPUs they hold at equal weights divided by their "
                              f"--weight ({divided.method}, {divided.status})",)
        + tuple(f"user {user}: {n}" for n in divided.notes),
    )
