"""Who may act cluster-wide: root, the SlurmUser, or a Slurm operator/administrator."""

from __future__ import annotations

import logging
import os
import pwd
import re
import subprocess
from dataclasses import dataclass
from typing import Callable, Sequence

from slurm_elastic.errors import PermissionRefused

log = logging.getLogger(__name__)

Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=20, check=False)


@dataclass(frozen=True, slots=True)
class Caller:
    uid: int
    name: str


def current_caller() -> Caller:
    uid = os.geteuid()
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        name = str(uid)
    return Caller(uid, name)


def slurm_user(run: Runner | None = None) -> str | None:
    """SlurmUser from `scontrol show config` ('SlurmUser = slurm(64030)' -> 'slurm')."""
    run = run or _run
    try:
        proc = run(["scontrol", "show", "config"])
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("cannot read SlurmUser: %s", exc)
        return None
    m = re.search(r"^SlurmUser\s*=\s*([^\s(]+)", proc.stdout, re.MULTILINE)
    return m[1] if m and proc.returncode == 0 else None


def admin_level(user: str, run: Runner | None = None) -> tuple[str | None, str]:
    """(level, problem): 'Administrator'/'Operator'/'None' from sacctmgr, or None and why it is unknown."""
    run = run or _run
    try:
        proc = run(["sacctmgr", "--noheader", "--parsable2", "show", "user", user, "format=adminlevel"])
    except FileNotFoundError:
        return None, "sacctmgr is not installed"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"sacctmgr failed: {exc}"
    if proc.returncode != 0:
        first = (proc.stderr or proc.stdout).strip().splitlines()
        return None, f"sacctmgr failed ({first[0] if first else 'rc ' + str(proc.returncode)}; no accounting?)"
    level = proc.stdout.strip().splitlines()
    return (level[0].strip() if level else "None"), ""


def check_may_act(what: str, *, caller: Caller | None = None, run: Runner | None = None) -> str:
    """Raise PermissionRefused unless the caller may change other users' jobs; returns why it may."""
    who = caller or current_caller()
    if who.uid == 0:
        return "root"
    su = slurm_user(run)
    if su is not None and who.name == su:
        return "SlurmUser"
    level, problem = admin_level(who.name, run)
    if level in ("Administrator", "Operator"):
        return f"Slurm {level.lower()}"
    why = (f"Slurm admin level is {level!r}" if level is not None
           else f"Slurm operator/admin level could not be checked: {problem}")
    raise PermissionRefused(
        f"{what} changes other users' jobs: only root, the SlurmUser ({su or 'unknown'}) or a Slurm "
        f"operator/administrator may run it; you are {who.name} ({why}). "
        "For your own jobs use `slurm-elastic watch`.")
