"""The job templates run slurm-elastic's Python, not whatever `python3` the job's PATH finds (live)."""

from __future__ import annotations

import json
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


# A rank that takes its time to start (imports, data loading) before it opens the session: it says so,
# then waits for the test's go file, then trains the digits example.
SLOW_START = """
import pathlib, runpy, sys, time
go = pathlib.Path(sys.argv[1])
print("RANK-STARTING", flush=True)
while not go.exists():
    time.sleep(0.05)
sys.argv = ["digits", *sys.argv[2:]]
runpy.run_module("slurm_elastic.train.examples.digits", run_name="__main__")
"""


@pytest.mark.parametrize("template", ["ddp", "torchrun"])
def test_a_signal_sent_while_the_ranks_start_is_honoured_not_lost(slurm_cluster, tmp_path, template) -> None:
    """The controller's signal may arrive before the session has its handler: it must still checkpoint."""
    ck, go, out = tmp_path / "ck", tmp_path / "go", tmp_path / f"{template}.out"
    path = tmp_path / f"{template}.sbatch"
    path.write_text((TEMPLATES / f"{template}.sbatch").read_text())
    env = _env(slurm_cluster, tmp_path, SLURM_ELASTIC_PYTHON=sys.executable, SLURM_ELASTIC_CKPT_DIR=str(ck),
               SLURM_ELASTIC_REQUEUE_WAIT_S="1")
    script = tmp_path / "slow_start.py"
    script.write_text(SLOW_START)
    # torchrun takes a script as its training command, the others a command line.
    command = [str(script)] if template == "torchrun" else ["python3", str(script)]
    proc = subprocess.run(["sbatch", "--parsable", "-N1", "--gres=gpu:1", "--mem=1G", "-o", str(out), str(path),
                           *command, str(go), "--ckpt-dir", str(ck), "--steps", "400",
                           "--every-steps", "1000", "--step-sleep", "0.05"],
                          env=env, capture_output=True, text=True, timeout=60, check=True)
    job = int(proc.stdout.strip().split(";")[0])
    try:
        try:
            slurm_cluster.wait_for(lambda: out.exists() and "RANK-STARTING" in out.read_text(), 120,
                                   what="the rank to start")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; job output: {out.read_text()[-3000:] if out.exists() else '-'}") from None
        slurm_cluster.run("scancel", "--signal=USR2", "--full", str(job))
        go.touch()
        slurm_cluster.wait_for(lambda: slurm_cluster.job(job).get("JobState") in ("COMPLETED", "FAILED"), 240,
                               what=f"job {job} ended")
        text = out.read_text()
        ack_path = ck / str(job) / f"ACK-{job}-0"
        # Lost, the signal would let the job train its 400 steps and complete without an ACK.
        assert ack_path.exists(), text[-3000:]
        ack = json.loads(ack_path.read_text())
        assert ack["committed"] is True and ack["step"] < 400, ack
        assert "exiting with 85" in text, text[-3000:]
    finally:
        slurm_cluster.run("scancel", str(job), check=False)


OMP_PROBE = "import os; print('OMP-THREADS', os.environ.get('OMP_NUM_THREADS'), flush=True)"


@pytest.mark.parametrize(("chosen", "expected"), [({}, "2"), ({"OMP_NUM_THREADS": "3"}, "3")])
def test_each_rank_gets_its_share_of_the_cpus_as_math_threads_unless_the_user_chose(
        slurm_cluster, tmp_path, chosen, expected) -> None:
    """Unset under srun, every rank of a node starts one math thread per core (a CPU script ran 25x slower)."""
    out, path = tmp_path / "ddp.out", tmp_path / "ddp.sbatch"
    path.write_text((TEMPLATES / "ddp.sbatch").read_text())
    env = _env(slurm_cluster, tmp_path, SLURM_ELASTIC_PYTHON=sys.executable)
    env.pop("OMP_NUM_THREADS", None)
    env.update(chosen)
    # two ranks on one node with 4 CPUs between them: 2 threads each
    proc = subprocess.run(["sbatch", "--parsable", "-N1", "--gres=gpu:2", "--ntasks-per-node=2", "-c", "2",
                           "--mem=1G", "-o", str(out), str(path), "python3", "-c", OMP_PROBE],
                          env=env, capture_output=True, text=True, timeout=60, check=True)
    job = int(proc.stdout.strip().split(";")[0])
    slurm_cluster.wait_for(lambda: slurm_cluster.job(job).get("JobState") in ("COMPLETED", "FAILED"), 180,
                           what=f"job {job} ended")
    text = out.read_text() if out.exists() else ""
    assert [line.split()[1] for line in text.splitlines() if line.startswith("OMP-THREADS")] == [expected] * 2, text
