"""tests/users.py itself: a real user imports slurm_elastic from a checkout in a home only root can read."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

import slurm_elastic
from users import runnable_as_user, user_python

USER = "se-private-checkout"


@pytest.fixture
def private_checkout() -> Path:
    """A copy of the package in a root-owned 0700 directory, as a clone under /root would be."""
    home = Path(tempfile.mkdtemp(prefix="slurm-elastic-private-home-", dir="/var/tmp"))
    os.chmod(home, 0o700)
    package = home / "checkout" / "slurm_elastic"
    shutil.copytree(Path(slurm_elastic.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "_which_copy.py").write_text("WHICH = 'the private checkout'\n")
    try:
        yield package
    finally:
        shutil.rmtree(home)


def test_a_checkout_in_a_private_home_is_imported_through_a_read_only_mount(private_checkout: Path) -> None:
    why = runnable_as_user()
    if why:
        pytest.fail(f"tests act as real users on CI machines: {why}")
    as_user = ["runuser", "-u", USER, "--"]
    made = user_python(USER, package=private_checkout)
    try:
        denied = subprocess.run([*as_user, "cat", str(private_checkout / "__init__.py")], capture_output=True)
        assert denied.returncode != 0, "the checkout must be private for this test to mean anything"
        out = subprocess.run(made.argv("import slurm_elastic.cli, slurm_elastic._which_copy as c; "
                                       "print(c.WHICH); print(slurm_elastic.__file__)"),
                             capture_output=True, text=True, timeout=120, cwd="/")
        assert out.returncode == 0, out.stderr[-2000:]
        which, where = out.stdout.split("\n")[:2]
        assert which == "the private checkout"
        assert made.scratch is not None and Path(where).is_relative_to(made.scratch / "checkout"), where
        # Files of the checkout that a test hands to the user (helpers under tests/) are named as it sees them.
        shown = subprocess.run([*as_user, "cat", made.seen(private_checkout / "_which_copy.py")],
                               capture_output=True, text=True)
        assert shown.stdout == "WHICH = 'the private checkout'\n", shown.stderr
        # Read-only: the user (or root, through the mount) cannot change the checkout.
        written = subprocess.run([*as_user, "touch", str(Path(where).parent / "planted.py")], capture_output=True)
        assert written.returncode != 0
        assert not (private_checkout / "planted.py").exists()
    finally:
        made.close()
    assert made.scratch is None and made.mounts == []
