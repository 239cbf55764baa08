"""CI's per-version verdict (.ci/slurm_summary.py) on junit files written by a real pytest run, and
.ci/other-slurms's choice of suites and its refusals."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SUMMARY = REPO / ".ci" / "slurm_summary.py"
OTHER_SLURMS = REPO / ".ci" / "other-slurms"

PASS_SKIP_FAIL = {
    "pass": "def test_ok():\n    assert True\n",
    "skip": "import pytest\n\ndef test_later():\n    pytest.skip('needs 2 nodes with >= 3 GPUs each')\n",
    "fail": "def test_bad():\n    assert 1 == 2\n",
    "nocluster": "import pytest\n\ndef test_live():\n"
                 "    pytest.skip('Slurm is not installed (slurmctld/slurmd/sinfo not found); install it')\n",
}


def junit_of(tmp_path: Path, *kinds: str) -> tuple[Path, int]:
    """Run a real pytest over tests of the given kinds; return its junit file and exit status."""
    tests = tmp_path / "suite"
    tests.mkdir()
    for i, kind in enumerate(kinds):
        (tests / f"test_{kind}_{i}.py").write_text(PASS_SKIP_FAIL[kind])
    junit = tmp_path / "junit.xml"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests),
                           f"--junitxml={junit}", "--rootdir", str(tests)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    return junit, proc.returncode


def summary(junit: Path, rc: int | str, seconds: str = "12") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SUMMARY), "--label", "Slurm 24.11.5 (trixie chroot)",
                           "--pytest-rc", str(rc), "--seconds", seconds, str(junit)],
                          capture_output=True, text=True, timeout=60)


def test_a_passing_run_prints_its_counts_and_passes(tmp_path: Path) -> None:
    junit, rc = junit_of(tmp_path, "pass", "pass", "skip")
    assert rc == 0
    out = summary(junit, rc)
    assert out.returncode == 0, out.stdout
    assert out.stdout.strip() == "== Slurm 24.11.5 (trixie chroot): 2 passed, 1 skipped, 0 failed in 12 s"
    assert "skipped 1x: needs 2 nodes" in out.stderr


def test_a_failed_test_fails_the_version(tmp_path: Path) -> None:
    junit, rc = junit_of(tmp_path, "pass", "fail")
    out = summary(junit, rc)
    assert out.returncode == 1
    assert out.stdout.startswith("== Slurm 24.11.5 (trixie chroot): 1 passed, 0 skipped, 1 failed in 12 s")
    assert "FAILED: pytest exit status 1 (tests failed)" in out.stdout


def test_live_tests_skipped_for_want_of_slurm_fail_even_when_pytest_passes(tmp_path: Path) -> None:
    junit, rc = junit_of(tmp_path, "pass", "nocluster")
    assert rc == 0
    out = summary(junit, rc)
    assert out.returncode == 1
    assert "FAILED: skipped for want of a live cluster: Slurm is not installed" in out.stdout


def test_no_collected_test_fails(tmp_path: Path) -> None:
    junit, rc = junit_of(tmp_path)
    assert rc == 5
    out = summary(junit, rc)
    assert out.returncode == 1
    assert "collected no tests" in out.stdout
    # Even if the caller lost pytest's exit status, an empty junit is no pass.
    assert summary(junit, 0).returncode == 1
    assert "collected no tests" in summary(junit, 0).stdout


def test_all_skipped_is_no_pass(tmp_path: Path) -> None:
    junit, rc = junit_of(tmp_path, "skip")
    out = summary(junit, rc)
    assert out.returncode == 1
    assert "no test passed" in out.stdout


def test_a_run_that_left_no_junit_or_never_ran_fails(tmp_path: Path) -> None:
    out = summary(tmp_path / "missing.xml", 124)
    assert out.returncode == 1
    assert out.stdout.strip() == "== Slurm 24.11.5 (trixie chroot): no test results (pytest exit status 124 (timed out))"
    out = summary(tmp_path / "missing.xml", "none")
    assert out.returncode == 1 and "did not run" in out.stdout


def test_garbage_junit_fails_with_one_line(tmp_path: Path) -> None:
    junit = tmp_path / "junit.xml"
    junit.write_text("<testsuites><testsuite")
    out = summary(junit, 0)
    assert out.returncode == 1
    assert "not junit XML" in out.stderr and "no test results" in out.stdout


def _host_suite() -> str:
    for line in Path("/etc/os-release").read_text().splitlines():
        if line.startswith("VERSION_CODENAME="):
            return line.split("=", 1)[1].strip('"')
    return ""


@pytest.mark.skipif(os.geteuid() != 0, reason=".ci/other-slurms runs as root")
@pytest.mark.skipif(_host_suite() not in ("bookworm", "trixie"), reason="CI's hosts are Debian 12 or 13")
def test_other_slurms_picks_the_two_suites_the_host_is_not() -> None:
    out = subprocess.run([str(OTHER_SLURMS), "--list"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    expected = [s for s in ("bookworm", "trixie", "sid") if s != _host_suite()]
    assert out.stdout.split() == expected


@pytest.mark.skipif(os.geteuid() != 0, reason=".ci/other-slurms runs as root")
def test_other_slurms_refuses_an_unknown_suite_with_one_line() -> None:
    out = subprocess.run([str(OTHER_SLURMS), "buster"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == ["[other-slurms] unknown suite 'buster' (one of: bookworm trixie sid)"]
