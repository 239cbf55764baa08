"""The job templates run slurm-elastic's Python, not whatever `python3` the job's PATH finds (live)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

TEMPLATES = Path(__file__).resolve().parents[1] / "job_templates"
SYSTEM_PY = next((p for p in ("/usr/bin/python3", "/usr/bin/python3.11", "/usr/bin/python3.13") if Path(p).exists()),
                 None)
PROBE = "import sys, torch, slurm_elastic.train; print('RAN-WITH', sys.prefix, flush=True)"


def _no_torch_path(tmp_path: Path) -> str:
    """A PATH whose python3 cannot import torch (a bare interpreter, like a login shell without the module)."""
    bindir = tmp_path / "bare-bin"
    bindir.mkdir()
    if SYSTEM_PY is None:
        (bindir / "python3").write_text("#!/bin/sh\necho 'No module named torch' >&2\nexit 1\n")
        (bindir / "python3").chmod(0o755)
    else:
        (bindir / "python3").symlink_to(SYSTEM_PY)
    return f"{bindir}:/usr/local/bin:/usr/bin:/bin"


def _env(slurm_cluster, tmp_path: Path, **chosen: str) -> dict[str, str]:
    drop = ("SLURM_ELASTIC_PYTHON", "SLURM_ELASTIC_HOME", "VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")
    env = {k: v for k, v in slurm_cluster.env.items() if k not in drop}
    return {**env, "PATH": _no_torch_path(tmp_path), **chosen}


def _run(slurm_cluster, tmp_path: Path, template: str, env: dict[str, str], *command: str) -> tuple[str, str]:
    """Submit the template with `command` from a shell with `env`; (final state, job output)."""
    out = tmp_path / f"{template}.out"
    path = tmp_path / f"{template}.sbatch"
    path.write_text((TEMPLATES / f"{template}.sbatch").read_text())
    proc = subprocess.run(["sbatch", "--parsable", "-N1", "--gres=gpu:1", "--mem=1G", "-o", str(out), str(path),
                           *command], env=env, capture_output=True, text=True, timeout=60, check=True)
    job = int(proc.stdout.strip().split(";")[0])
    slurm_cluster.wait_for(lambda: slurm_cluster.job(job).get("JobState") in ("COMPLETED", "FAILED"), 180,
                           what=f"job {job} ended")
    return slurm_cluster.job(job).get("JobState", ""), out.read_text() if out.exists() else ""


@pytest.mark.parametrize("template", ["ddp", "torchrun"])
def test_a_python_without_torch_fails_at_once_with_one_line_naming_it(slurm_cluster, tmp_path, template) -> None:
    state, out = _run(slurm_cluster, tmp_path, template, _env(slurm_cluster, tmp_path), "python3", "-c", PROBE)
    lines = [line for line in out.splitlines() if "cannot import slurm_elastic.train" in line]
    assert state == "FAILED" and len(lines) == 1 and "python3" in lines[0], out
    assert "RAN-WITH" not in out and "Traceback" not in out, out


@pytest.mark.parametrize("variable", ["SLURM_ELASTIC_PYTHON", "SLURM_ELASTIC_HOME"])
def test_the_recorded_or_module_interpreter_is_used_over_path(slurm_cluster, tmp_path, variable) -> None:
    chosen = {variable: sys.executable if variable == "SLURM_ELASTIC_PYTHON" else sys.prefix}
    state, out = _run(slurm_cluster, tmp_path, "ddp", _env(slurm_cluster, tmp_path, **chosen), "python3", "-c", PROBE)
    assert state == "COMPLETED", out
    assert f"RAN-WITH {sys.prefix}" in out, out
