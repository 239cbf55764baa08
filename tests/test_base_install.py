"""`pip install .` with no extras: the CLI, the allocator and a dry-run rebalance work (only train/ needs torch)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The packages whose own modules may import an extra's dependencies (train: torch, safetensors, xxhash).
EXTRA_PACKAGES = ("slurm_elastic.train",)

IMPORT_ALL = """
import importlib, pkgutil, sys, slurm_elastic
extra = tuple(sys.argv[1:])
bad = []
for m in pkgutil.walk_packages(slurm_elastic.__path__, "slurm_elastic."):
    if m.name.startswith(extra):
        continue
    try:
        importlib.import_module(m.name)
    except Exception as exc:
        bad.append(f"{m.name}: {exc!r}")
print("\\n".join(bad) or "ALL-IMPORTED")
"""


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("no-extras") / "venv"
    made = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, f"{sys.executable} -m venv failed: {made.stdout[-1500:]}{made.stderr[-1500:]}"
    proc = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(REPO)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return venv


def _run(venv: Path, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(venv / "bin" / argv[0]), *argv[1:]], capture_output=True, text=True, timeout=300,
                          cwd="/", env=env)


def test_no_extras_install_has_no_torch_and_runs_the_cli(base_venv: Path) -> None:
    assert _run(base_venv, "python", "-c", "import torch").returncode != 0, "torch came in without an extra"
    help_ = _run(base_venv, "slurm-elastic", "--help")
    assert help_.returncode == 0 and "Elastic deep-learning training on Slurm" in help_.stdout, help_.stderr
    assert _run(base_venv, "slurm-elastic", "admin", "--help").returncode == 0


def test_every_module_outside_the_extras_imports(base_venv: Path) -> None:
    proc = _run(base_venv, "python", "-c", IMPORT_ALL, *EXTRA_PACKAGES)
    assert proc.stdout.strip() == "ALL-IMPORTED", proc.stdout + proc.stderr


@pytest.mark.slurm
def test_no_extras_install_does_a_dry_run_rebalance(base_venv: Path, slurm_cluster) -> None:
    env = {**os.environ, "SLURM_CONF": str(slurm_cluster.slurm_conf)}
    proc = _run(base_venv, "slurm-elastic", "admin", "rebalance", "--dry-run", "--explain", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout.strip(), "a dry run prints what it would do (or that nothing changes)"
