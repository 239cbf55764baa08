"""The installed Slurm: where its daemons are and which version they are."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from slurm_elastic.errors import ClusterSetupError

# Debian installs the daemons in /usr/sbin, which is not on a normal user's PATH.
_EXTRA_DIRS = ("/usr/sbin", "/usr/local/sbin", "/sbin")
_VERSION_RE = re.compile(r"(\d+)\.(\d+)\.(\d+)")
INSTALL_HINT = "install it with `./install.sh --with-slurm` (Debian's slurmctld, slurmd, slurm-client and munge)"


@dataclass(frozen=True, slots=True, order=True)
class SlurmVersion:
    major: int
    minor: int
    patch: int = 0

    @classmethod
    def parse(cls, text: str) -> SlurmVersion:
        """Parse `slurmctld -V` output such as 'slurm-wlm 22.05.8' or 'slurm 24.11.5'."""
        match = _VERSION_RE.search(text)
        if not match:
            raise ClusterSetupError(f"cannot read a Slurm version from {text.strip()!r}")
        return cls(*(int(part) for part in match.groups()))

    def __str__(self) -> str:
        return f"{self.major}.{self.minor:02d}.{self.patch}"

    @property
    def reconfigure_replaces_daemons(self) -> bool:
        """From 23.11 `scontrol reconfigure` starts new slurmctld/slurmd processes (new pids, pid files rewritten)."""
        return (self.major, self.minor) >= (23, 11)

    @property
    def needs_cgroup_conf(self) -> bool:
        """From 23.11 slurmd autodetects cgroups unless cgroup.conf says `CgroupPlugin=disabled`."""
        return (self.major, self.minor) >= (23, 11)


def find_program(name: str) -> str | None:
    """The absolute path of a Slurm or munge program, also looking in the sbin directories."""
    found = shutil.which(name)
    if found:
        return found
    for directory in _EXTRA_DIRS:
        candidate = Path(directory) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def require_program(name: str) -> str:
    found = find_program(name)
    if found is None:
        raise ClusterSetupError(f"Slurm is not installed here: `{name}` not found; {INSTALL_HINT}")
    return found


def detect_version() -> SlurmVersion:
    """Ask the installed slurmctld for its version."""
    slurmctld = require_program("slurmctld")
    result = subprocess.run([slurmctld, "-V"], capture_output=True, text=True, timeout=30, check=False)
    if result.returncode != 0:
        raise ClusterSetupError(f"`{slurmctld} -V` failed: {(result.stderr or result.stdout).strip()}")
    return SlurmVersion.parse(result.stdout or result.stderr)
