"""The project's L1 allocator as a simulator policy, fed JobRequests the way the controller builds them."""

from __future__ import annotations

import functools
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
WEIGHT_RANGE = (0.05, 50.0)
SIM_POLICY = Policy(time_limit_s=2.0, mip_rel_gap=0.02, threads=1)


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

    def __init__(self, policy: Policy = SIM_POLICY, weights: str = "remaining",
                 restart_cost_s: float | None = None, horizon_s: float = WEIGHT_HORIZON_S) -> None:
        if weights not in ("remaining", "equal"):
            raise ValueError(f"unknown l1 weights {weights!r}")
        self.policy = policy
        self.weights = weights
        self.restart_cost_s = restart_cost_s
        self.horizon_s = horizon_s
        self._speed_cache: dict[str, Callable[..., float]] = {}

    def decide(self, view: ClusterView) -> Decision:
        from slurm_elastic.allocate import AllocationProblem, JobRequest, NodeCapacity, solve

        gpn = view.gpus_per_node
        requests = []
        for jv in view.jobs:
            requests.append(JobRequest(
                key=jv.key, min_gpus=jv.job.min_gpus, max_gpus=jv.job.max_gpus,
                cpus_per_gpu=jv.job.cpus_per_gpu, mem_per_gpu_mb=jv.job.mem_per_gpu_mb,
                weight=self._weight(jv, gpn), current=dict(jv.placement),
                restart_cost_s=self._kappa(jv.job), throughput=self._throughput(jv.job, gpn)))
        nodes = tuple(NodeCapacity(n.name, n.gpus, n.cpus, n.mem_mb) for n in view.nodes)
        t0 = time.perf_counter()
        allocation = solve(AllocationProblem(tuple(requests), nodes, self.policy))
        solve_s = time.perf_counter() - t0
        placements = {k: {n: int(g) for n, g in p.items() if g > 0} for k, p in allocation.placement.items()}
        notes = [f"{d.key}: {d.gpus_before} -> {d.gpus_after} ({d.reason})"
                 for d in allocation.decisions if d.gpus_before != d.gpus_after]
        notes += [f"unplaceable {u.key}: {u.reason}" for u in allocation.unplaceable]
        if allocation.method != "milp":
            notes.append(f"solver method {allocation.method} (gap {allocation.mip_gap:.3g})")
        return Decision(placements, tuple(notes), solve_s,
                        {"method": allocation.method, "objective": allocation.objective,
                         "mip_gap": allocation.mip_gap})

    def _kappa(self, job: SimJob) -> float:
        if self.restart_cost_s is not None:
            return self.restart_cost_s
        return 30.0 if job.restart_overhead_s is None else job.restart_overhead_s

    def _weight(self, jv: JobView, gpn: int) -> float:
        if self.weights == "equal":
            return jv.job.weight
        remaining = jv.remaining_s(packed_placement(jv.job.max_gpus, gpn))
        lo, hi = WEIGHT_RANGE
        return jv.job.weight * min(hi, max(lo, self.horizon_s / max(remaining, 1e-9)))

    def _throughput(self, job: SimJob, gpn: int) -> Callable[..., float]:
        model = self._speed_cache.get(job.key)
        if model is None:
            @functools.lru_cache(maxsize=None)
            def model(gpus: int, nodes: int = 1, _speed=job.speed, _gpn=gpn) -> float:
                return _speed(packed_placement(int(gpus), _gpn, int(nodes)))
            self._speed_cache[job.key] = model
        return model
