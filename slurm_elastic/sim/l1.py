"""The project's L1 allocator as a simulator policy, fed JobRequests the way the controller builds them."""

from __future__ import annotations

import functools
import math
import logging
import time
from typing import Callable

from slurm_elastic.allocate.problem import Policy
from slurm_elastic.sim.jobs import SimJob, packed_placement
from slurm_elastic.sim.policy import ClusterView, Decision, JobView

log = logging.getLogger(__name__)

# Weights by remaining time: a job's throughput term becomes "share of its remaining work done per
# WEIGHT_HORIZON_S seconds", which favours jobs close to the end (shortest remaining time first),
# the order that minimises average completion time. Clamped so no job is ignored or dominates.
WEIGHT_HORIZON_S = 3600.0
WEIGHT_RANGE = (0.01, 100.0)
# A resize costs the job `overhead` seconds of no progress at its new size; the allocator charges
# beta * kappa per GPU changed against throughput terms in weight units. Passing
# kappa = overhead * weight / (beta * HOLD_S * max_gpus) makes that charge equal the share of the job's
# throughput term lost over an allocation held HOLD_S seconds (linear-speed approximation), so the
# restart term and the throughput term are in the same units whatever the weight.
HOLD_S = 60.0
# The allocator's defaults except a 2 s limit and one thread: the simulator solves ~500 times per
# trace on a shared machine. (A 0.5 % gap was tried: no better, and slower; see
# benchmarks/simulate_l1_ablation.py.)
SIM_POLICY = Policy(time_limit_s=2.0, threads=1)


class L1Policy:
    """Calls `slurm_elastic.allocate.solve` with one JobRequest per active job, every scheduling point.

    JobRequest, as the controller builds it: GPU range and per-GPU CPUs and
    memory from the job, `current` = its GPUs per node now, `restart_cost_s`
    = the restart overhead (the forward-layer checkpoint loses no work on a
    signalled restart), `throughput(gpus, nodes)` = the job's speed model at
    a packed placement. `weights` chooses the job weights: "remaining"
    (default, see WEIGHT_HORIZON_S) or "equal" (every job 1, the
    controller's default when users give none), both times the job's own
    weight from the trace.
    """

    name = "l1"

    def __init__(self, policy: Policy = SIM_POLICY, weights: str = "remaining", kappa: str = "scaled",
                 restart_cost_s: float | None = None, horizon_s: float = WEIGHT_HORIZON_S,
                 hold_s: float = HOLD_S, exponent: float = 1.0, max_scale: float | None = 2.0,
                 quiet_every: int = 5, min_requested: bool = False, frontier: bool = True) -> None:
        if weights not in ("remaining", "equal"):
            raise ValueError(f"unknown l1 weights {weights!r}")
        if kappa not in ("scaled", "raw"):
            raise ValueError(f"unknown l1 kappa mode {kappa!r}")
        self.policy = policy
        self.weights = weights
        self.kappa = kappa
        self.restart_cost_s = restart_cost_s
        self.horizon_s = horizon_s
        self.hold_s = hold_s
        self.exponent = exponent
        self.max_scale = max_scale
        self.quiet_every = max(1, quiet_every)
        self.min_requested = min_requested
        self.frontier = frontier
        self._quiet = 0
        self._last: object = None
        self._speed_cache: dict[str, Callable[..., float]] = {}
        self._best_speed: dict[str, float] = {}
        self._allowed: dict[str, tuple[int, ...]] = {}

    def decide(self, view: ClusterView) -> Decision:
        from slurm_elastic.allocate import AllocationProblem, JobRequest, NodeCapacity, solve

        state = (tuple((j.key, tuple(sorted(j.placement.items()))) for j in view.jobs),
                 tuple(n.name for n in view.nodes))
        if view.reasons == ("tick",) and state == self._last:
            # Nothing happened since the last solve: only the weights drifted. Re-solve every
            # `quiet_every` such ticks (the controller's level-triggered loop would re-solve each time).
            self._quiet += 1
            if self._quiet % self.quiet_every:
                return Decision({j.key: dict(j.placement) for j in view.jobs if j.placement})
        gpn = view.gpus_per_node
        requests = []
        for jv in view.jobs:
            weight = self._weight(jv, gpn)
            requests.append(JobRequest(
                key=jv.key, min_gpus=self._min_gpus(jv.job), max_gpus=self._max_gpus(jv.job),
                cpus_per_gpu=jv.job.cpus_per_gpu, mem_per_gpu_mb=jv.job.mem_per_gpu_mb,
                weight=weight, current=dict(jv.placement),
                restart_cost_s=self._kappa(jv.job, weight), throughput=self._throughput(jv.job, gpn),
                allowed_gpus=self._frontier(jv.job, gpn) if self.frontier else None))
        nodes = tuple(NodeCapacity(n.name, n.gpus, n.cpus, n.mem_mb) for n in view.nodes)
        t0 = time.perf_counter()
        allocation = solve(AllocationProblem(tuple(requests), nodes, self.policy))
        solve_s = time.perf_counter() - t0
        log.debug("t=%.0f: %d jobs, %s in %.3f s (gap %.3g)", view.now, len(requests), allocation.method, solve_s,
                  allocation.mip_gap)
        placements = {k: {n: int(g) for n, g in p.items() if g > 0} for k, p in allocation.placement.items()}
        self._last = (tuple((j.key, tuple(sorted(placements.get(j.key, {}).items()))) for j in view.jobs),
                      state[1])
        notes = [f"{d.key}: {d.gpus_before} -> {d.gpus_after} ({d.reason})"
                 for d in allocation.decisions if d.gpus_before != d.gpus_after]
        notes += [f"unplaceable {u.key}: {u.reason}" for u in allocation.unplaceable]
        if allocation.method != "milp":
            notes.append(f"solver method {allocation.method} (gap {allocation.mip_gap:.3g})")
        return Decision(placements, tuple(notes), solve_s,
                        {"method": allocation.method, "objective": allocation.objective,
                         "mip_gap": allocation.mip_gap})

    def _frontier(self, job: SimJob, gpn: int) -> tuple[int, ...]:
        """GPU counts faster than every smaller count: the allocator treats more GPUs as never slower,
        so counts where the measured speed drops (yolov3 at 8 GPUs is slower than at 4) are left out."""
        counts = self._allowed.get(job.key)
        if counts is None:
            best = 0.0
            keep = []
            for g in range(self._min_gpus(job), self._max_gpus(job) + 1):
                s = job.speed(packed_placement(g, gpn))
                if s > best * (1 + 1e-6) or not keep:
                    keep.append(g)
                    best = max(best, s)
            counts = self._allowed[job.key] = tuple(keep)
        return counts

    def _min_gpus(self, job: SimJob) -> int:
        return job.requested_gpus if self.min_requested else job.min_gpus

    def _max_gpus(self, job: SimJob) -> int:
        if self.max_scale is None:
            return job.max_gpus
        return max(job.min_gpus, min(job.max_gpus, math.ceil(self.max_scale * job.requested_gpus)))

    def _kappa(self, job: SimJob, weight: float) -> float:
        seconds = self.restart_cost_s if self.restart_cost_s is not None else (
            30.0 if job.restart_overhead_s is None else job.restart_overhead_s)
        if self.kappa == "raw" or self.policy.beta <= 0:
            return seconds
        return seconds * weight / (self.policy.beta * self.hold_s * self._max_gpus(job))

    def _weight(self, jv: JobView, gpn: int) -> float:
        if self.weights == "equal":
            return jv.job.weight
        # At its fastest allowed count: measured speeds are not always monotone (yolov3 is slower
        # at 8 GPUs than at 4), and the job is worth what it could do at its best.
        best = self._best_speed.get(jv.key)
        if best is None:
            best = max(jv.job.speed(packed_placement(g, gpn))
                       for g in range(self._min_gpus(jv.job), self._max_gpus(jv.job) + 1))
            self._best_speed[jv.key] = best
        remaining = jv.remaining / best
        lo, hi = WEIGHT_RANGE
        return jv.job.weight * min(hi, max(lo, (self.horizon_s / max(remaining, 1e-9)) ** self.exponent))

    def _throughput(self, job: SimJob, gpn: int) -> Callable[..., float]:
        model = self._speed_cache.get(job.key)
        if model is None:
            @functools.lru_cache(maxsize=None)
            def model(gpus: int, nodes: int = 1, _speed=job.speed, _gpn=gpn) -> float:
                return _speed(packed_placement(int(gpus), _gpn, int(nodes)))
            self._speed_cache[job.key] = model
        return model
