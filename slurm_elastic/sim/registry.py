"""Policy names on the command line and the objects behind them."""

from __future__ import annotations

import dataclasses
from typing import Callable

from slurm_elastic.errors import TraceError
from slurm_elastic.sim.controller import SIM_CONFIG, ControllerPolicy
from slurm_elastic.sim.optimus import OptimusPolicy
from slurm_elastic.sim.policy import SchedulingPolicy
from slurm_elastic.sim.static import StaticPolicy
from slurm_elastic.sim.tiresias import TiresiasPolicy

# "controller" is the shipped Reconciler (default request source, L1 allocator, protocol, hysteresis, budget),
# deciding with the named objective (settings.OBJECTIVE: legacy or progress).
_FACTORIES: dict[str, Callable[[float | None, str], SchedulingPolicy]] = {
    "static": lambda max_scale, objective: StaticPolicy(),
    "tiresias": lambda max_scale, objective: TiresiasPolicy(),
    "optimus": lambda max_scale, objective: OptimusPolicy(),
    "controller": lambda max_scale, objective: ControllerPolicy(
        dataclasses.replace(SIM_CONFIG, policy=dataclasses.replace(SIM_CONFIG.policy, objective=objective)),
        max_scale=max_scale),
}
POLICIES = tuple(_FACTORIES)


def make_policy(name: str, *, max_scale: float | None = 2.0, objective: str = SIM_CONFIG.policy.objective
                ) -> SchedulingPolicy:
    """A fresh policy (policies keep per-run state such as Tiresias' promotions or the controller's journal)."""
    factory = _FACTORIES.get(name)
    if factory is None:
        raise TraceError(f"unknown policy {name!r} (choose {', '.join(POLICIES)} or all)")
    return factory(max_scale or None, objective)
