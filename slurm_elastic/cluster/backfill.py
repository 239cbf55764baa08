"""Slurm's backfill reservation: the nodes and earliest time the highest-priority waiting job will start on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from slurm_elastic.cluster.model import Job, Node

# node -> (free GPUs, free CPUs, free MB, partitions)
Free = dict[str, tuple[int, int, int, tuple[str, ...]]]


@dataclass(frozen=True, slots=True)
class Reservation:
    """Where and from when the highest-priority waiting job will run (inf: no running job's end frees it)."""

    job_id: int
    start: float
    nodes: frozenset[str]

    def holds_back(self, job: Job, now: float) -> frozenset[str]:
        """The nodes `job` may not start on: all of the reservation's unless its time limit ends it first."""
        if job.time_limit_s is not None and now + job.time_limit_s <= self.start:
            return frozenset()
        return self.nodes


def free_now(nodes: Iterable[Node]) -> Free:
    """Free resources and partitions of every available node."""
    return {n.name: (n.gpus - n.gpus_alloc, n.cpus - n.cpus_alloc, n.mem_mb - n.mem_alloc_mb, n.partitions)
            for n in nodes if n.available}


def first_fit(job: Job, free: Free, held_back: frozenset[str] = frozenset()) -> list[str] | None:
    """The job's required nodes (ReqNodeList), then the first nodes (by name) of its partition with room
    for its shape, outside `held_back` and its excluded nodes (ExcNodeList); None if they do not all fit."""
    g = job.gpus_per_node
    c, m = g * (job.cpus_per_gpu or 0), g * (job.mem_per_gpu_mb or 0)
    off = held_back | frozenset(job.excluded_nodes)
    fits = [name for name, (fg, fc, fm, parts) in sorted(free.items()) if name not in off
            and (not job.partition or job.partition in parts) and fg >= g and fc >= c and fm >= m]
    required = set(job.required_nodes)
    if not required <= set(fits):
        return None
    chosen = [n for n in fits if n in required] + [n for n in fits if n not in required]
    return chosen[:job.num_nodes] if len(chosen) >= job.num_nodes else None


def reserve(job: Job, free: Free, ending: Iterable[tuple[float, Job]]) -> Reservation:
    """The earliest time and nodes `job` fits on as the active jobs reach their ends (time limits; inf: none)."""
    free = dict(free)
    for end, held in sorted(ending, key=lambda e: (e[0], e[1].job_id)):
        for name in held.nodes:
            if name in free:
                g, c, m, parts = free[name]
                free[name] = (g + held.gpus_per_node, c + held.cpus_per_node, m + held.mem_per_node_mb, parts)
        chosen = first_fit(job, free)
        if chosen is not None:
            return Reservation(job.job_id, end, frozenset(chosen))
    # Not even the empty cluster holds it (nodes are down): it reserves nothing.
    return Reservation(job.job_id, float("inf"), frozenset())
