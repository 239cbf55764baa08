"""Policy names on the command line and the objects behind them."""

from __future__ import annotations

from slurm_elastic.errors import TraceError
from slurm_elastic.sim.l1 import L1Policy
from slurm_elastic.sim.optimus import OptimusPolicy
from slurm_elastic.sim.policy import SchedulingPolicy
from slurm_elastic.sim.static import StaticPolicy
from slurm_elastic.sim.tiresias import TiresiasPolicy

POLICIES = ("static", "tiresias", "optimus", "l1")


def make_policy(name: str, *, l1_max_scale: float | None = 2.0) -> SchedulingPolicy:
    """A fresh policy (policies keep per-run state such as Tiresias' promotions)."""
    if name == "static":
        return StaticPolicy()
    if name == "tiresias":
        return TiresiasPolicy()
    if name == "optimus":
        return OptimusPolicy()
    if name == "l1":
        return L1Policy(max_scale=l1_max_scale or None)
    raise TraceError(f"unknown policy {name!r} (choose {', '.join(POLICIES)} or all)")
