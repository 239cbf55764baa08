"""The one interface every scheduling policy implements, the views it sees, and shared placement."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol

from slurm_elastic.sim.cluster import SimNode
from slurm_elastic.sim.jobs import Segment, SimJob


@dataclass(frozen=True, slots=True)
class JobView:
    """One active job (arrived, not finished) as a policy sees it."""

    job: SimJob
    placement: Mapping[str, int]      # node -> GPUs held now (empty: pending or preempted)
    remaining: float                  # work left, in the job's speed units
    attained_gpu_s: float             # GPU-seconds held so far (2D-LAS "attained service")
    executed_s: float                 # wall seconds it has held GPUs
    restarts: int
    started: bool                     # ran at least once
    segment: Segment | None = None    # how it runs now, for jobs whose speed follows their progress
    in_place: int = 0                 # of its restarts, shrinks that kept its processes

    @property
    def key(self) -> str:
        return self.job.key

    @property
    def gpus(self) -> int:
        return sum(self.placement.values())

    def remaining_s(self, placement: tuple[int, ...]) -> float:
        """Seconds of running still needed at `placement`."""
        return self.remaining / self.job.speed(placement)


@dataclass(frozen=True, slots=True)
class ClusterView:
    now: float
    nodes: tuple[SimNode, ...]          # up nodes only
    jobs: tuple[JobView, ...]           # active jobs in submission order
    reasons: tuple[str, ...]            # why this decision point: tick, arrival, completion, node-down, node-up

    @property
    def gpus_per_node(self) -> int:
        return max((n.gpus for n in self.nodes), default=1)


@dataclass(frozen=True, slots=True)
class Decision:
    """Target placement of every active job (absent = 0 GPUs) and the policy's own account of why."""

    placements: Mapping[str, Mapping[str, int]]
    notes: tuple[str, ...] = ()
    solve_s: float = 0.0
    details: Mapping[str, object] = field(default_factory=dict)
    # Jobs shrunk to some of their nodes with their ranks kept (no requeue: the survivors commit and go on)
    in_place: frozenset[str] = frozenset()


class SchedulingPolicy(Protocol):
    """A scheduler under test: given the cluster now, where should every job run."""

    name: str

    def decide(self, view: ClusterView) -> Decision: ...


@dataclass(slots=True)
class FreeResources:
    """Free GPUs/CPUs/memory per up node while a policy builds its answer (mutable scratch, never stored)."""

    gpus: dict[str, int]
    cpus: dict[str, int]
    mem_mb: dict[str, int]

    @classmethod
    def of(cls, nodes: tuple[SimNode, ...], held: Mapping[str, Mapping[str, int]],
           jobs: Mapping[str, SimJob]) -> FreeResources:
        free = cls({n.name: n.gpus for n in nodes}, {n.name: n.cpus for n in nodes},
                   {n.name: n.mem_mb for n in nodes})
        for key, placement in held.items():
            free.take(jobs[key], placement)
        return free

    def take(self, job: SimJob, placement: Mapping[str, int]) -> None:
        for node, g in placement.items():
            self.gpus[node] -= g
            self.cpus[node] -= g * job.cpus_per_gpu
            self.mem_mb[node] -= g * job.mem_per_gpu_mb

    def give(self, job: SimJob, placement: Mapping[str, int]) -> None:
        for node, g in placement.items():
            if node in self.gpus:
                self.gpus[node] += g
                self.cpus[node] += g * job.cpus_per_gpu
                self.mem_mb[node] += g * job.mem_per_gpu_mb

    def usable(self, job: SimJob, node: str) -> int:
        """GPUs of `node` the job could take, with its CPUs and memory per GPU."""
        g = self.gpus[node]
        if job.cpus_per_gpu:
            g = min(g, self.cpus[node] // job.cpus_per_gpu)
        if job.mem_per_gpu_mb:
            g = min(g, self.mem_mb[node] // job.mem_per_gpu_mb)
        return max(0, g)

    def total_usable(self, job: SimJob) -> int:
        return sum(self.usable(job, n) for n in self.gpus)

    def place(self, job: SimJob, gpus: int, *, best_fit: bool = False) -> dict[str, int] | None:
        """Consolidated placement of `gpus` GPUs, or None if they do not fit; takes them when it fits.

        Nodes with the most usable GPUs first (as the Pollux simulator's
        baselines do); with `best_fit`, a job that fits on one node goes to
        the fullest node that still holds it (as Slurm's cons_tres does).
        """
        usable = {n: self.usable(job, n) for n in self.gpus}
        if sum(usable.values()) < gpus:
            return None
        if best_fit:
            fits = [n for n, u in usable.items() if u >= gpus]
            if fits:
                node = min(fits, key=lambda n: (usable[n], n))
                placement = {node: gpus}
                self.take(job, placement)
                return placement
        placement: dict[str, int] = {}
        left = gpus
        for node in sorted(usable, key=lambda n: (-usable[n], n)):
            if left == 0:
                break
            g = min(left, usable[node])
            if g > 0:
                placement[node] = g
                left -= g
        self.take(job, placement)
        return placement
