"""install.sh and the modulefiles it writes, checked in a real Lmod login shell."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import slurm_elastic

REPO = Path(__file__).resolve().parents[1]
INSTALL = REPO / "install.sh"
PREFIX = Path(sys.prefix)
LMOD_INIT = Path("/usr/share/lmod/lmod/init/bash")


def _installed_by_install_sh() -> bool:
    return (PREFIX / ".slurm-elastic-install").is_file()


def test_unknown_option_is_one_clear_line() -> None:
    proc = subprocess.run(["bash", str(INSTALL), "--frobnicate"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "install.sh: unknown option '--frobnicate' (see ./install.sh --help)"


def test_prefix_needs_a_value() -> None:
    proc = subprocess.run(["bash", str(INSTALL), "--prefix"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "--prefix needs a directory" in proc.stderr


@pytest.mark.skipif(not _installed_by_install_sh(), reason="tests not run from a venv that install.sh made")
def test_second_run_changes_nothing() -> None:
    dev = ["--dev"] if (PREFIX / "lib").glob("*/site-packages/__editable__*slurm_elastic*") else []
    stamp = (PREFIX / ".slurm-elastic-install").read_text()
    proc = subprocess.run(["bash", str(INSTALL), "--prefix", str(PREFIX), *dev],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "nothing changed" in proc.stdout, proc.stdout
    assert (PREFIX / ".slurm-elastic-install").read_text() == stamp


@pytest.mark.skipif(not LMOD_INIT.exists(), reason="Lmod is not installed (Debian package 'lmod')")
@pytest.mark.skipif(not _installed_by_install_sh(), reason="tests not run from a venv that install.sh made")
def test_module_load_in_a_real_lmod_login_shell(tmp_path: Path) -> None:
    modulefiles = PREFIX / "modulefiles"
    assert (modulefiles / "slurm-elastic" / f"{slurm_elastic.__version__}.lua").is_file()
    script = f"""
        # Lmod drops duplicate PATH entries on unload; start from a PATH without them.
        export PATH=$(printf %s "$PATH" | awk -v RS=: '!seen[$0]++' | paste -sd:)
        before=$PATH
        module use {modulefiles}
        module load slurm-elastic
        echo "WHICH=$(command -v slurm-elastic)"
        slurm-elastic --version
        python -c 'import slurm_elastic, sys; print("IMPORTED", slurm_elastic.__file__, sys.prefix)'
        echo "HOME=$SLURM_ELASTIC_HOME"
        module unload slurm-elastic
        [ "$PATH" = "$before" ] && echo PATH-RESTORED || echo "PATH-CHANGED $before -> $PATH"
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    env["PATH"] = "/usr/local/bin:/usr/bin:/bin"
    proc = subprocess.run(["bash", "-lc", script], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=120)
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr
    assert f"WHICH={PREFIX}/bin/slurm-elastic" in out
    assert f"slurm-elastic, version {slurm_elastic.__version__}" in out
    assert f"IMPORTED" in out and str(PREFIX) in out.split("IMPORTED", 1)[1].splitlines()[0]
    assert f"HOME={PREFIX}" in out
    assert "PATH-RESTORED" in out, out


def test_tcl_modulefile_has_the_magic_cookie() -> None:
    if not _installed_by_install_sh():
        pytest.skip("tests not run from a venv that install.sh made")
    tcl = PREFIX / "modulefiles" / "slurm-elastic" / slurm_elastic.__version__
    text = tcl.read_text()
    assert text.startswith("#%Module")
    assert f"prepend-path PATH {PREFIX}/bin" in text
    if shutil.which("tclsh"):
        # The file must at least be valid Tcl syntax (Environment Modules evaluates it).
        proc = subprocess.run(["tclsh"], input=f"puts [info complete [read [open {tcl}]]]\n",
                              capture_output=True, text=True)
        assert proc.stdout.strip() == "1"


# -- a site install (--prefix) that every user runs -------------------------------------------------------------
SITE_USER = "se-site-user"


def _private_default_python() -> str | None:
    """The realpath of PATH's python3 when another user cannot run it (a pyenv build under /root)."""
    found = shutil.which("python3")
    if found is None:
        return None
    probe = subprocess.run(["runuser", "-u", "nobody", "--", os.path.realpath(found), "-c", "pass"],
                           capture_output=True, cwd="/")
    return os.path.realpath(found) if probe.returncode != 0 else None


@pytest.fixture
def site_prefix() -> Iterator[Path]:
    import tempfile

    # Not under pytest's tmp_path (/tmp/pytest-of-root is 0700): the users must reach it.
    root = Path(tempfile.mkdtemp(prefix="slurm-elastic-site-", dir="/var/tmp"))
    os.chmod(root, 0o755)
    try:
        yield root / "opt"
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="a site install and acting as another user need root")
@pytest.mark.skipif(not LMOD_INIT.exists(), reason="Lmod is not installed (install.sh --dev installs it as root)")
def test_site_install_runs_for_an_unprivileged_user_through_module_load(site_prefix: Path) -> None:
    from users import ensure_user

    ensure_user(SITE_USER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHON" and not k.startswith("VIRTUAL_ENV")}
    # The controller-only extras: no torch, so this runs on every Python a system may have.
    proc = subprocess.run(["bash", str(INSTALL), "--prefix", str(site_prefix), "--extras", "daemon"],
                          capture_output=True, text=True, timeout=900, env=env, cwd="/")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    interpreter = os.path.realpath(site_prefix / "bin" / "python")
    if _private_default_python():
        assert "is private to its owner: using" in proc.stdout, proc.stdout
        assert not interpreter.startswith("/root/"), interpreter
    own_venv = site_prefix.parent / "own-venv"
    own_venv.mkdir()
    shutil.chown(own_venv, SITE_USER)
    script = f"""
        module use {site_prefix}/modulefiles
        module load slurm-elastic
        echo "WHICH=$(command -v slurm-elastic)"
        slurm-elastic --version
        slurm-elastic admin --help >/dev/null && echo ADMIN-HELP
        echo "HOME=$SLURM_ELASTIC_HOME"
        echo "WHOAMI=$(id -un)"
        # The researcher's own environment gets the shim from the site's wheel (docs/researcher.md;
        # --no-deps here only because this machine's site Python has no torch to satisfy [train]).
        {interpreter} -m venv {own_venv}
        {own_venv}/bin/python -m pip install -q --no-deps "$SLURM_ELASTIC_PACKAGE"
        {own_venv}/bin/python -c 'import slurm_elastic; print("OWN", slurm_elastic.__version__, slurm_elastic.__file__)'
    """
    runuser = shutil.which("runuser") or "/usr/sbin/runuser"
    run = subprocess.run([runuser, "-u", SITE_USER, "--", "bash", "-lc", script], capture_output=True,
                         text=True, timeout=180, cwd="/", env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/"})
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert f"WHICH={site_prefix}/bin/slurm-elastic" in out, out
    assert f"slurm-elastic, version {slurm_elastic.__version__}" in out and "ADMIN-HELP" in out, out
    assert f"HOME={site_prefix}" in out and f"WHOAMI={SITE_USER}" in out, out
    assert f"OWN {slurm_elastic.__version__} {own_venv}/lib/" in out, out
    unit = (site_prefix / "share" / "slurm-elastic" / "slurm-elastic.service").read_text()
    assert f"ExecStart={site_prefix}/bin/slurm-elastic " in unit, unit


@pytest.mark.skipif(os.geteuid() != 0, reason="telling a private interpreter needs root (runuser)")
def test_site_install_refuses_an_interpreter_other_users_cannot_run(site_prefix: Path) -> None:
    private = _private_default_python()
    if private is None:
        # PATH's python3 is public (CI on Debian 12 finds /usr/bin/python3 first): make a private one. A copy,
        # not a symlink: install.sh rightly judges an interpreter by its real path, which a link leaves public.
        private_dir = site_prefix.parent / "private"
        private_dir.mkdir(mode=0o700)
        shutil.copy2(os.path.realpath(sys.executable), private_dir / "python3")
        private = str(private_dir / "python3")
    proc = subprocess.run(["bash", str(INSTALL), "--prefix", str(site_prefix)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHON": private}, cwd="/")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "set PYTHON=" in proc.stderr, proc.stderr
    assert not site_prefix.exists(), "nothing may be written when the interpreter is refused"
