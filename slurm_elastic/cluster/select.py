"""Choosing the Slurm backend: `--backend cli|pyslurm|auto` or SLURM_ELASTIC_BACKEND, logged once with why."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Mapping

from slurm_elastic import settings
from slurm_elastic.cluster.backend import Backend
from slurm_elastic.cluster.cli_backend import CliBackend
from slurm_elastic.cluster.pyslurm_backend import (PyslurmBackend, PyslurmUnusable, import_pyslurm, pyslurm_version,
                                                   usable_problem)
from slurm_elastic.cluster.slurm_values import SlurmVersion
from slurm_elastic.errors import SlurmError, SlurmUnavailable

log = logging.getLogger(__name__)

BACKEND_ENV = settings.BACKEND.env
# The backends a site may name, each made from the pyslurm module (None where it was not imported) and the CLI
# backend every other backend leans on for what its API lacks; `auto` chooses among them (choose_backend).
BACKENDS: dict[str, Callable[[ModuleType | None, CliBackend], Backend]] = {
    "cli": lambda module, cli: cli,
    "pyslurm": lambda module, cli: PyslurmBackend(module, cli=cli),
}
CHOICES = ("auto", *BACKENDS)


class BackendChoiceError(SlurmError):
    """The requested backend name is not one of CHOICES."""


@dataclass(frozen=True, slots=True)
class Selection:
    backend: Backend
    reason: str


def choose_backend(choice: str | None = None, *, env: Mapping[str, str] | None = None,
                   importer: Callable[[], ModuleType] | None = None,
                   slurm_version: Callable[[], SlurmVersion] | None = None) -> Selection:
    """Pick a backend. `auto` takes pyslurm only if all of these hold, else the CLI backend, saying why:

    - `import pyslurm` works in a probe process (it can end the process that tries it);
    - it is not a release known to be broken, and a resize description builds (self-check);
    - its major.minor equals the running Slurm's.

    An explicit `pyslurm` that fails any of the first two is an error (one line naming the
    reason), not a quiet fallback. `importer` and `slurm_version` exist so the decision can be
    tested where pyslurm cannot be installed; by default they probe and import pyslurm with
    `env`, and ask `scontrol --version`.
    """
    env = os.environ if env is None else env
    named = settings.BACKEND.read(env)
    source = "--backend" if choice else (BACKEND_ENV if named else "default")
    name = (choice or named or "auto").strip().lower()
    if name not in CHOICES:
        raise BackendChoiceError(f"unknown Slurm backend {name!r} (from {source}); choose one of {', '.join(CHOICES)}")
    cli = CliBackend(env=env)
    if name == "cli":
        return Selection(BACKENDS["cli"](None, cli), f"requested by {source}")
    module: ModuleType | None = None
    try:
        module = (importer or (lambda: import_pyslurm(env)))()
    except PyslurmUnusable as exc:  # the probe process's answer
        problem: str | None = str(exc)
    except Exception as exc:  # ImportError from an importer that does not probe
        problem = f"pyslurm is not importable ({type(exc).__name__}: {exc})"
    else:
        problem = usable_problem(module)
    if problem:
        if name == "pyslurm":
            raise SlurmUnavailable(f"pyslurm backend requested by {source} but unusable: {problem}; "
                                   f"use --backend cli") from None
        return Selection(BACKENDS["cli"](None, cli), f"auto: {problem}")
    assert module is not None
    ps_version = pyslurm_version(module)
    if name == "pyslurm":
        return Selection(BACKENDS["pyslurm"](module, cli), f"requested by {source} (pyslurm {ps_version})")
    running = (slurm_version or (lambda: cli.version))()
    if (ps_version.major, ps_version.minor) != (running.major, running.minor):
        return Selection(BACKENDS["cli"](None, cli), f"auto: pyslurm {ps_version.release} is built for another "
                                                     f"Slurm than the running {running.release}")
    return Selection(BACKENDS["pyslurm"](module, cli), f"auto: pyslurm {ps_version} matches Slurm {running}")


def select_backend(choice: str | None = None, *, env: Mapping[str, str] | None = None) -> Backend:
    """The backend to use, with one log line saying which and why."""
    sel = choose_backend(choice, env=env)
    log.info("Slurm backend: %s (%s)", sel.backend.name, sel.reason)
    return sel.backend
