"""What a user's jobs claim moves GPUs among that user's own jobs, never from another user's.

A job's weight comes from its user's word: the `--weight` they gave it, and the remaining-work priority
(or the progress objective's values) taken from what the job writes. None of it may decide what other
users get. So when some job carries such a claim, the allocation is solved twice. First every job is
neutral: with more than one user, weight 1 and no values (what each user's jobs get then depends on
Slurm's view and the jobs' measured speeds only); with one user, its `--weight` taken out. That fixes what
each user's jobs hold on each node. Then, for each user whose jobs carry claims, those GPUs (and the CPUs
and memory no other user's job was given there) are divided again among that user's own jobs at their
claims. Every other user's allocation is the neutral one, exactly.

The neutral solve of one cycle starts from where the neutral solve of the last one left each job
(`JobRequest.neutral_current`, `with_neutral_places`), not from where the claims put it: from the real
placement, a job its user's claims had left queued asked the next neutral solve for GPUs again, which
took them from another user, and the claims handed them on (seen: a `--weight 1000000` job grew from 8
to 12 of 16 GPUs over a few cycles while the other user's job went from 8 to 2). The neutral world then
moves as if no claim was ever made.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Collection, Mapping, Sequence

from slurm_elastic.allocate.problem import Allocation, AllocationProblem, JobRequest, NodeCapacity

Solve = Callable[[AllocationProblem], Allocation]


def _several_users(problem: AllocationProblem) -> bool:
    return len({j.user for j in problem.jobs}) > 1


def claiming_users(problem: AllocationProblem) -> list[str]:
    """The users whose jobs carry claims (a `--weight`; with other users present, any weight or values
    taken from what the jobs write): the users whose GPUs a second solve divides."""
    several = _several_users(problem)

    def claims(job: JobRequest) -> bool:
        return job.own_weight != 1.0 or (several and (job.weight != 1.0 or job.values is not None))

    return sorted({j.user for j in problem.jobs if claims(j)})


def solve_by_user(problem: AllocationProblem, solve: Solve) -> Allocation:
    """`solve` with every job neutral, then each claiming user's slice divided at their jobs' claims."""
    several = _several_users(problem)
    neutral = solve(dataclasses.replace(problem, jobs=tuple(
        _in_neutral_place(_equal_weight(j) if several else j.neutral()) for j in problem.jobs)))
    answer = dataclasses.replace(neutral, neutral=neutral.placement)
    for user in claiming_users(problem):
        mine = tuple(dataclasses.replace(j, own_weight=1.0) for j in problem.jobs if j.user == user)
        if len(mine) == 1 and several:
            continue                      # one job: it holds its slice whatever it claims
        keys = {j.key for j in mine}
        nodes = _slice(problem, neutral.placement, keys)
        divided = solve(AllocationProblem(mine, nodes, problem.policy))
        answer = _merge(answer, divided, keys, user)
    return answer


def _equal_weight(job: JobRequest) -> JobRequest:
    """The job as the equal-weight solve sees it: weight 1, no values, its restart charges at weight 1."""
    w = job.charge_weight
    return dataclasses.replace(job, weight=1.0, values=None, own_weight=1.0, charge_weight=1.0,
                               restart_cost_s=job.restart_cost_s / w,
                               in_place_cost_s=None if job.in_place_cost_s is None else job.in_place_cost_s / w)


def _in_neutral_place(job: JobRequest) -> JobRequest:
    if job.neutral_current is None:
        return job
    # where it stands only in the neutral world: no processes there to keep by a shrink in place
    return dataclasses.replace(job, current=job.neutral_current, neutral_current=None, batch_node=None,
                               in_place_cost_s=None)


def with_neutral_places(jobs: Sequence[JobRequest],
                        remembered: Mapping[str, Mapping[str, int]]) -> tuple[JobRequest, ...]:
    """`jobs`, each of a user whose GPUs the last cycle's claims divided starting the neutral solve where the
    last neutral solve placed it (`remembered`: Allocation.neutral). Only where that user's jobs hold, node by
    node, what they held there in the neutral solve (its plans carried out); else from where they are."""
    def per_node(places: Sequence[Mapping[str, int]]) -> dict[str, int]:
        out: dict[str, int] = {}
        for place in places:
            for node, g in place.items():
                out[node] = out.get(node, 0) + g
        return {n: g for n, g in out.items() if g}

    by_user: dict[str, list[JobRequest]] = {}
    for j in jobs:
        by_user.setdefault(j.user, []).append(j)
    placed: dict[str, JobRequest] = {}
    for mine in by_user.values():
        moved = any(dict(remembered.get(j.key, {})) != dict(j.current) for j in mine)
        if (moved and all(j.key in remembered or not j.current for j in mine)
                and per_node([remembered.get(j.key, {}) for j in mine]) == per_node([j.current for j in mine])):
            placed.update((j.key, dataclasses.replace(j, neutral_current=dict(remembered.get(j.key, {}))))
                          for j in mine)
    return tuple(placed.get(j.key, j) for j in jobs)


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
        notes=answer.notes + (f"user {user}'s jobs: the GPUs they hold as neutral jobs divided by their own "
                              f"claims ({divided.method}, {divided.status})",)
        + tuple(f"user {user}: {n}" for n in divided.notes),
    )
