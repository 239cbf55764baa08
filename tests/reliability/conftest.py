"""Reliability suite plumbing: short (CI) vs `--long` sizes, the figures each test records, the private cluster.

Every test records its figures with the `figures` fixture; they are collected
in build/reliability/last-run.json (or $SLURM_ELASTIC_RELIABILITY_RESULTS),
which benchmarks/reliability_report.py turns into docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

# The controller tests' private 4-node x 4-GPU cluster (with job_submit.lua) is reused, not rebuilt:
# the daemon acts on every elastic job of a cluster, so these tests cannot share `slurm_cluster`.
from control.conftest import ElasticCluster, elastic_cluster  # noqa: F401  (a fixture, re-exported)

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
        item._reliability_outcome = rep.outcome  # type: ignore[attr-defined]
