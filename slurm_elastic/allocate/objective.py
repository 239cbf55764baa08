"""The allocation objective: each job's coefficients, computed once, and the one expression that scores a job.

Both MILPs (allocate/formulation.py) take their column costs and constants
from a job's `JobObjective`, and every scorer (Instance.job_objective, the
packing and greedy passes, the explanation) evaluates `JobObjective.value`,
so "better" means the same thing on every solver path. The terms and their
weights: docs/allocator.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from slurm_elastic.allocate.problem import Policy


@dataclass(frozen=True, slots=True)
class JobObjective:
    """Job j's share of the objective (maximised):

        w_j s_j(g) / s_j(gmax)  -  d_j (gmax - g)  -  beta kappa_j |x_j - x0_j|_1  -  gamma nodes_j

    with d_j = alpha sum_r rho[j,r] / Cap_r (allocated against demanded resources).
    """

    weight: float             # w_j
    norm: float               # s_j(gmax): the speed term is 1 at the job's largest count, weight 1
    gmax: int
    per_gpu: float            # d_j, per GPU below gmax
    per_moved_gpu: float      # beta kappa_j, per GPU added or removed on a node (0 when no restart is charged)
    per_node: float           # gamma, per node the job spans

    @classmethod
    def of(cls, policy: Policy, *, weight: float, norm: float, gmax: int, per_gpu_resources: Sequence[float],
           total: Sequence[float], kappa: float) -> JobObjective:
        """The coefficients from the policy's weights, the job's resources per GPU and the cluster's totals."""
        demand = 0.0
        for rho, cap in zip(per_gpu_resources, total):
            if cap > 0:
                demand += rho / cap
        return cls(weight, norm, gmax, demand * policy.alpha, policy.beta * kappa, policy.gamma)

    @property
    def per_speed(self) -> float:
        """The speed term's coefficient (the MILPs' epigraph column cost)."""
        return self.weight / self.norm

    @property
    def constant(self) -> float:
        """The part that does not depend on the placement: -d_j gmax (the MILPs' offset)."""
        return -self.per_gpu * self.gmax

    def speed_value(self, speed: float) -> float:
        return self.weight * speed / self.norm

    def value(self, g: int, speed: float, moved: int, nodes: int) -> float:
        """The job's objective at g GPUs running at `speed`, `moved` GPUs changed per node, on `nodes` nodes."""
        out = self.speed_value(speed) if g > 0 else 0.0
        out -= self.per_gpu * (self.gmax - g)
        if moved:
            out -= self.per_moved_gpu * moved
        out -= self.per_node * nodes
        return out
