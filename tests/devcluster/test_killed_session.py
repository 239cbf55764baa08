"""A test session killed while it held the shared local cluster (SIGKILL: no teardown ran); the next one
starts that cluster afresh instead of inheriting its jobs, its down nodes and its SlurmdTimeout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_elastic.devcluster import LocalCluster
from slurm_elastic.devcluster.version import find_program

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(find_program("slurmctld") is None, reason="Slurm is not installed"),
    pytest.mark.skipif(os.geteuid() != 0, reason="the local cluster needs root"),
]

TESTS = Path(__file__).resolve().parents[1]

# The sessions below use the suite's own slurm_cluster fixture, loaded from tests/conftest.py.
CONFTEST = f"""
import importlib.util, sys
sys.path.insert(0, {str(TESTS)!r})
spec = importlib.util.spec_from_file_location("suite_conftest", {str(TESTS / "conftest.py")!r})
suite = sys.modules["suite_conftest"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite)
slurm_cluster = suite.slurm_cluster
"""

KILLED = """
import os, signal

def test_killed_while_its_job_runs(slurm_cluster, tmp_path):
    slurm_cluster.sbatch("#!/bin/bash\\nsleep 600\\n", "-N1", "-o", "/dev/null", "--job-name=left-behind",
                         cwd=tmp_path)
    slurm_cluster.wait_for(lambda: "R" in slurm_cluster.run("squeue", "-h", "-o", "%t").stdout.split(), 60,
                           what="the job running")
    os.kill(os.getpid(), signal.SIGKILL)
"""

NEXT = """
def test_next_session(slurm_cluster):
    print("JOBS=" + repr(slurm_cluster.run("squeue", "-h", "-o", "%j %T").stdout))
"""


def _session(directory: Path, test: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    directory.mkdir()
    (directory / "conftest.py").write_text(CONFTEST)
    (directory / "test_session.py").write_text(test)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-c", os.devnull,
                           "--rootdir", str(directory), "-W", "always", str(directory)],
                          capture_output=True, text=True, env=env, cwd=directory, timeout=300)


def test_a_cluster_left_up_by_a_killed_session_is_started_afresh(tmp_path: Path, short_cluster_dir: Path) -> None:
    state = short_cluster_dir
    env = {**os.environ, "SLURM_ELASTIC_CLUSTER_DIR": str(state)}
    env.pop("SLURM_CONF", None)
    try:
        killed = _session(tmp_path / "killed", KILLED, env)
        assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-2000:]
        assert LocalCluster(state).is_up(), "the killed session must leave its cluster up, or this proves nothing"
        after = _session(tmp_path / "next", NEXT, env)
        assert after.returncode == 0, after.stdout[-3000:]
        jobs = next(line for line in after.stdout.splitlines() if "JOBS=" in line)
        assert "left-behind" not in jobs, jobs
        assert "left up by a test session that ended without its teardown" in after.stdout + after.stderr
        assert not LocalCluster(state).is_up(), "the next session started the cluster, so it stops it at its end"
    finally:
        local = LocalCluster(state)
        if local.exists() and local.leftover_processes():
            local.down()
