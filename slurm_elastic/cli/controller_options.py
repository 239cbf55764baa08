"""The controller commands' click options, generated from slurm_elastic/settings.py, and the config they build."""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import click

import re

from slurm_elastic import settings
from slurm_elastic.allocate.from_state import RigidPolicy
from slurm_elastic.allocate.problem import Policy
from slurm_elastic.control.protocol import ProtocolSettings
from slurm_elastic.control.reconcile import ControllerConfig
from slurm_elastic.errors import SpecError

F = TypeVar("F", bound=Callable[..., Any])


def controller_options(command: str) -> Callable[[F], F]:
    """Add the options `command` (settings.DAEMON, REBALANCE or WATCH) carries, in the table's order."""
    def decorate(func: F) -> F:
        for setting in reversed(settings.for_command(command)):
            func = option_of(setting)(func)
        return func
    return decorate


def option_of(setting: settings.Setting[Any]) -> Callable[[F], F]:
    """One setting as a click option: its name, default, bounds, help and (where it has one) variable."""
    assert setting.option is not None, setting.name
    kwargs: dict[str, Any] = {"default": setting.default, "help": setting.help}
    if setting.kind == "flag":
        kwargs["is_flag"] = True
    else:
        kwargs["show_default"] = setting.default is not None
        kwargs["type"] = _click_type(setting)
    if setting.env:
        kwargs.update(envvar=setting.env, show_envvar=True)
    return click.option(setting.option, setting.name, **kwargs)


def _click_type(setting: settings.Setting[Any]) -> click.ParamType | None:
    if setting.kind == "float":
        return click.FloatRange(min=setting.minimum, max=setting.maximum)
    if setting.kind == "int":
        return click.IntRange(min=None if setting.minimum is None else int(setting.minimum),
                              max=None if setting.maximum is None else int(setting.maximum))
    if setting.kind == "choice":
        return click.Choice(list(setting.choices))
    return None


def controller_config(ack_timeout: float, hysteresis: float, restart_budget: int, signal_name: str,
                      user: str | None = None) -> ControllerConfig:
    """The ControllerConfig of the options every controller command carries (the signal normalised)."""
    from slurm_elastic.jobfiles import signal_name as normalise

    try:
        sig = normalise(signal_name)
    except ValueError as exc:
        raise SpecError(str(exc)) from None
    # the objective has no option: a site picks it once, by its variable (settings.OBJECTIVE)
    return ControllerConfig(policy=Policy(objective=settings.OBJECTIVE.read()),
                            protocol=ProtocolSettings(signal=sig, ack_timeout_s=ack_timeout),
                            min_resize_interval_s=hysteresis, restart_budget_per_hour=restart_budget, user=user)


_PARTITION = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def rigid_policy(partitions: str, yield_after_s: float, minimum: str, guarantee: str) -> RigidPolicy:
    """The site's rules for pending rigid jobs from the daemon's options (a bad partition name: one line)."""
    names = tuple(name.strip() for name in partitions.split(",") if name.strip())
    for name in names:
        if not _PARTITION.fullmatch(name):
            raise SpecError(f"{settings.RIGID_PARTITIONS.option}: {name!r} is not a partition name")
    return RigidPolicy(partitions=names, yield_after_s=yield_after_s, protect_minimum=minimum == "protected",
                       guarantee=guarantee)
