"""Shared click plumbing: turning ElasticError into one clear line and an exit code."""

from __future__ import annotations

import functools
import json
from typing import Any, Callable, TypeVar

import click

from slurm_elastic.errors import ElasticError, PermissionRefused, SettingError, SpecError

F = TypeVar("F", bound=Callable[..., Any])

# Bad input (a command line, a script, a variable) and refusals exit 2, as click's own usage errors do.
BAD_INPUT = (SpecError, SettingError, PermissionRefused)


class BadInput(click.ClickException):
    """Bad input of ours: one `Error:` line and exit 2 (click's UsageError would print the usage first)."""

    exit_code = 2


def not_implemented(what: str) -> None:
    """For commands a later issue fills: say so and exit 2, never pretend to work."""
    raise click.UsageError(f"{what} is not implemented yet")


def elastic_errors(func: F) -> F:
    """Map the ElasticError family to click errors: bad input exits 2, failures exit 1."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except BAD_INPUT as exc:
            raise BadInput(str(exc)) from None
        except ElasticError as exc:
            raise click.ClickException(str(exc)) from None

    return wrapper  # type: ignore[return-value]


_CONTROLS = {c: "?" for c in [*range(0x20), *range(0x7f, 0xa0)]}


def printable(text: object) -> str:
    """`text` with control characters shown as '?': a job's name is its user's, and escape sequences in it
    would reach the terminal of whoever lists it (clear the screen, retitle the window, hide text)."""
    return str(text).translate(_CONTROLS)


def echo_json(payload: object) -> None:
    click.echo(json.dumps(payload, indent=2, sort_keys=True, default=str))
