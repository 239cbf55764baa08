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

    with d_j = alpha sum_r rho[j,r] / Cap_r (allocated against demanded resources). Under the progress
    objective (Policy.objective "progress") the same fields carry

        (1 - pi_j) V_j(g)  +  pi_j V_j(g0) [x_j == x0_j]  -  M_j max(phi_j - g, 0)  -  gamma nodes_j

    (weight = 1 - pi_j, norm = 1, the speed curve is V_j; d_j = beta kappa_j = 0): staying exactly as it is
    keeps V_j(g0), any change loses pi_j of the new value (the restart's seconds of lost progress over
    the horizon), and each GPU below the fairness floor phi_j costs M_j.
    """

    weight: float             # w_j
    norm: float               # s_j(gmax): the speed term is 1 at the job's largest count, weight 1
    gmax: int
    per_gpu: float            # d_j, per GPU below gmax
    per_moved_gpu: float      # beta kappa_j, per GPU added or removed on a node (0 when no restart is charged)
    per_node: float           # gamma, per node the job spans
    stay: float = 0.0         # pi_j V_j(g0): added when the placement is exactly the current one
    in_place: float = 0.0     # added instead when it is a shrink that keeps its processes (Instance.in_place)
    floor: int = 0            # phi_j
    per_short_gpu: float = 0.0  # M_j, per GPU below the floor

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

    def value(self, g: int, speed: float, moved: int, nodes: int, stays: bool = False,
              in_place: bool = False) -> float:
        """The job's objective at g GPUs running at `speed`, `moved` GPUs changed per node, on `nodes` nodes;
        `stays`: the placement is exactly the current one; `in_place`: a shrink that keeps its processes."""
        out = self.speed_value(speed) if g > 0 else 0.0
        out -= self.per_gpu * (self.gmax - g)
        if moved:
            out -= self.per_moved_gpu * moved
        out -= self.per_node * nodes
        if stays:
            out += self.stay
        elif in_place:
            out += self.in_place
        if g < self.floor:
            out -= self.per_short_gpu * (self.floor - g)
        return out
