"""Real unprivileged users for tests, and an interpreter they can run with slurm-elastic importable.

The interpreter that runs the tests is often private: a pyenv build under
/root (mode 0700), which another user cannot execute. Then the same
interpreter is reached through READ-ONLY bind mounts in a root-owned
directory under /run (nothing can be written or deleted through them), and a
two-line launcher sets the library path its shared libpython needs. A
checkout in a private home (an editable install reads the package from it)
is bind-mounted the same way and put first on the launcher's PYTHONPATH. Every
test that acts as another user goes through `UserPython`, so a fresh machine
runs those tests for real instead of skipping them.
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

PROBE = "import site, sys; site.addsitedir(sys.argv[1]); import slurm_elastic.cli, highspy, torch"


def ensure_user(name: str) -> pwd.struct_passwd:
    """The Linux user `name`, created (no home, /bin/sh) when missing."""
    try:
        return pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", name], check=True,
                       capture_output=True)
        return pwd.getpwnam(name)


def _probe(user: str, python: str, site: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["runuser", "-u", user, "--", python, "-c", PROBE, site], capture_output=True, text=True,
                          cwd="/", timeout=180)


def _bind_ro(source: str, target: Path) -> str | None:
    """Bind-mount source at target read-only; None, or why it failed (a writable mount is refused)."""
    target.mkdir(parents=True, exist_ok=True)
    bind = subprocess.run(["mount", "--bind", source, str(target)], capture_output=True, text=True)
    if bind.returncode != 0:
        return f"mount --bind {source}: {bind.stderr.strip()}"
    ro = subprocess.run(["mount", "-o", "remount,bind,ro", str(target)], capture_output=True, text=True)
    if ro.returncode != 0:
        subprocess.run(["umount", str(target)], check=False, capture_output=True)
        return f"cannot make the bind mount of {source} read-only: {ro.stderr.strip()}"
    return None


@dataclass
class UserPython:
    """How user `user` runs this interpreter: `python` (a path it can execute) with `site` added.

    `python -c "import site; site.addsitedir(SITE); ..."` works as that user,
    in a shell, and inside a Slurm job the user submits.
    """

    user: str
    python: str
    site: str
    mounts: list[Path] = field(default_factory=list)
    scratch: Path | None = None
    checkout: Path | None = None   # a checkout the user reads through a bind mount (see `seen`)

    def argv(self, code: str, *args: str) -> list[str]:
        """runuser argv running `code` (after the site is added) as the user."""
        return ["runuser", "-u", self.user, "--", self.python, "-c",
                f"import site; site.addsitedir({self.site!r}); {code}", *args]

    def seen(self, path: Path | str) -> str:
        """path as this user reaches it: a file of a bind-mounted checkout is read through the mount."""
        real = Path(path).resolve()
        if self.checkout is not None and self.scratch is not None and real.is_relative_to(self.checkout):
            return str(self.scratch / "checkout" / real.relative_to(self.checkout))
        return str(real)

    def cli_argv(self, *args: str) -> list[str]:
        return self.argv("from slurm_elastic.cli import main; main()", *args)

    def close(self) -> None:
        for mount in reversed(self.mounts):
            if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "--lazy", str(mount)], check=False, capture_output=True)
        self.mounts.clear()
        if self.scratch is not None:
            # Only empty mount points and the launcher are left; never rmtree across a mount.
            for path in sorted(self.scratch.rglob("*"), reverse=True):
                if path.is_dir() and not os.path.ismount(path):
                    path.rmdir()
                elif not path.is_dir():
                    path.unlink()
            self.scratch.rmdir()
            self.scratch = None


def user_python(user: str, package: Path | None = None) -> UserPython:
    """A UserPython for `user`; raises RuntimeError saying why when none can be made.

    package: the slurm_elastic package directory the user is to import (default: the one imported here).
    """
    ensure_user(user)
    python = os.path.realpath(sys.executable)
    site = sysconfig.get_paths()["purelib"]
    imported = Path(importlib.util.find_spec("slurm_elastic").origin).parent.resolve()
    package = package.resolve() if package else imported
    if package == imported and _probe(user, python, site).returncode == 0:
        return UserPython(user, python, site)
    if os.geteuid() != 0:
        raise RuntimeError(f"{user} cannot run {python} and only root can bind-mount it somewhere public")
    scratch = Path(tempfile.mkdtemp(prefix="slurm-elastic-user-python-", dir="/run"))
    os.chmod(scratch, 0o755)     # root-owned: nobody else can replace the launcher or the mount points
    made = UserPython(user, python, site, scratch=scratch)
    try:
        base = Path(sys.base_prefix).resolve()
        why = _bind_ro(str(base), scratch / "base")
        if why:
            raise RuntimeError(why)
        made.mounts.append(scratch / "base")
        real = Path(python)
        inner = scratch / "base" / real.relative_to(base) if real.is_relative_to(base) else real
        site_dir = Path(site).resolve()
        if site_dir.is_relative_to(base):
            made.site = str(scratch / "base" / site_dir.relative_to(base))
        else:
            why = _bind_ro(str(site_dir), scratch / "site")
            if why:
                raise RuntimeError(why)
            made.mounts.append(scratch / "site")
            made.site = str(scratch / "site")
        pythonpath = ""
        if not (package.is_relative_to(site_dir) or package.is_relative_to(base)):
            # An editable install reads the package from its checkout, which may be in a private home
            # (CI cloned to /root/...: PermissionError on slurm_elastic/__init__.py). On PYTHONPATH it
            # comes before the editable finder, which setuptools appends to sys.meta_path.
            why = _bind_ro(str(package.parent), scratch / "checkout")
            if why:
                raise RuntimeError(why)
            made.mounts.append(scratch / "checkout")
            made.checkout = package.parent
            pythonpath = f"PYTHONPATH={scratch / 'checkout'}${{PYTHONPATH:+:$PYTHONPATH}} "
        launcher = scratch / "python"
        libdir = scratch / "base" / "lib"
        # A shared-libpython build finds libpython through an absolute RUNPATH into the private prefix.
        launcher.write_text(f"#!/bin/sh\n{pythonpath}LD_LIBRARY_PATH={libdir}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}} "
                            f"exec {inner} \"$@\"\n")
        launcher.chmod(0o755)
        made.python = str(launcher)
        probe = _probe(user, made.python, made.site)
        if probe.returncode != 0:
            raise RuntimeError(f"{user} cannot run slurm-elastic's Python even through read-only bind mounts: "
                               f"{probe.stderr.strip()[-300:]}")
        return made
    except BaseException:
        made.close()
        raise


def runnable_as_user() -> str | None:
    """Why tests cannot act as another user here (None when they can)."""
    if os.geteuid() != 0:
        return "acting as another user needs root (runuser)"
    if shutil.which("runuser") is None or shutil.which("useradd") is None:
        return "runuser/useradd not installed"
    return None
