"""Reliability suite plumbing: short (CI) vs `--long` sizes, the figures each test records, the private cluster.

Every test records its figures with the `figures` fixture; they are collected
in build/reliability/last-run.json (or $SLURM_ELASTIC_RELIABILITY_RESULTS),
which benchmarks/reliability_report.py turns into docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import pwd
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

# The controller tests' private 4-node x 4-GPU cluster (with job_submit.lua) and its helpers: the daemon
# acts on every elastic job of a cluster, so these tests cannot share `slurm_cluster`.
from control import conftest as control_conftest
from control.conftest import ElasticCluster

ROOT = Path(__file__).resolve().parents[2]
RESULTS_ENV = "SLURM_ELASTIC_RELIABILITY_RESULTS"
_rows: list[dict[str, Any]] = []
_T0 = time.time()   # this conftest loads at collection, before any reliability test runs


@pytest.fixture(scope="session")
def long_run(request: pytest.FixtureRequest) -> bool:
    """True under `--long`: the full sizes of the issue (200 kill points, 2 min flapping, 200 jobs)."""
    return bool(request.config.getoption("--long"))


class Figures:
    """What one test measured: `figures.put(kill_points=200, restores_valid=200)`; kept even if it fails."""

    def __init__(self, nodeid: str) -> None:
        self.row: dict[str, Any] = {"test": nodeid, "figures": {}, "started_at": time.time()}

    def put(self, **values: Any) -> None:
        self.row["figures"].update(values)


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Iterator[Figures]:
    fig = Figures(request.node.nodeid)
    yield fig
    fig.row["duration_s"] = round(time.time() - fig.row.pop("started_at"), 2)
    _rows.append(fig.row)


def _results_path() -> Path:
    return Path(os.environ.get(RESULTS_ENV) or ROOT / "build" / "reliability" / "last-run.json")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not _rows:
        return
    outcomes: dict[str, str] = {}
    for item in session.items:
        rep = getattr(item, "_reliability_outcome", None)
        if rep is not None:
            outcomes[item.nodeid] = rep
    for row in _rows:
        row["outcome"] = outcomes.get(row["test"], "unknown")
    path = _results_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "long": bool(session.config.getoption("--long")),
        "command": " ".join(["python3", "-m", "pytest", *sys.argv[1:]]) if sys.argv else "",
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "duration_s": round(time.time() - _T0, 1),
        "exitstatus": int(exitstatus),
        "tests": _rows,
    }
    path.write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call" or (rep.when == "setup" and rep.outcome != "passed"):
        item._reliability_outcome = "xfailed" if hasattr(rep, "wasxfail") else rep.outcome  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def elastic_cluster() -> Iterator[ElasticCluster]:
    """tests/control's private cluster, but rooted in /var/tmp/slurm-elastic-reliability-*.

    Scratch directories named /tmp/se-* were seen removed by hand while tests ran on this shared
    machine; a root of our own keeps a long run's cluster alive.
    """
    import tempfile

    original = tempfile.mkdtemp

    def mkdtemp(suffix: str | None = None, prefix: str | None = None, dir: str | None = None) -> str:
        if prefix == "se-ctl-":
            prefix, dir = "slurm-elastic-reliability-", "/var/tmp"
        return original(suffix, prefix, dir)

    tempfile.mkdtemp = mkdtemp  # type: ignore[assignment]
    try:
        generator = control_conftest.elastic_cluster.__wrapped__()  # type: ignore[attr-defined]
        cluster = next(generator)
    finally:
        tempfile.mkdtemp = original  # type: ignore[assignment]
    try:
        yield cluster
    finally:
        next(generator, None)


PLAIN_USER = "se-elastic-test"


@pytest.fixture
def plain_user(elastic_cluster: ElasticCluster, user_pythons: Any) -> Iterator[str]:
    """A real unprivileged Linux user who can run slurm-elastic (tests/users.py: read-only mounts only)."""
    runner = user_pythons(PLAIN_USER)
    ent = pwd.getpwnam(PLAIN_USER)
    saved = elastic_cluster.env["SLURM_ELASTIC_STATE_DIR"], elastic_cluster.env["FAKE_PYTHON"]
    try:
        state = elastic_cluster.root / "state" / "plain-user"
        state.mkdir(parents=True, exist_ok=True)
        os.chown(state, ent.pw_uid, ent.pw_gid)
        elastic_cluster.env["SLURM_ELASTIC_STATE_DIR"] = str(state)
        elastic_cluster.env["FAKE_PYTHON"] = runner.python   # the user's jobs run the fake trainer with it
        elastic_cluster.user_python, elastic_cluster.user_site = runner.python, runner.site
        yield PLAIN_USER
    finally:
        elastic_cluster.env["SLURM_ELASTIC_STATE_DIR"], elastic_cluster.env["FAKE_PYTHON"] = saved
        elastic_cluster.user_python = elastic_cluster.user_site = None
