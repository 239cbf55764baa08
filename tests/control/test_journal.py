"""The SQLite journal: plans and steps survive a reopen; hysteresis and budget queries."""

from __future__ import annotations

import sqlite3

import pytest

from slurm_elastic.control.journal import DONE, ROLLED_BACK, Journal
from slurm_elastic.control.plan import Plan, PlanEntry


def _plan(job_id: int = 7, entry: PlanEntry = PlanEntry.RUNNING) -> Plan:
    return Plan(job_id=job_id, from_gpus=8, to_gpus=4, nodes=1, gpus_per_node=4, cpus_per_gpu=2,
                mem_per_gpu_mb=2048, entry=entry, reason="shrink")


def test_open_plan_survives_reopen_with_its_last_step(tmp_path):
    j = Journal(tmp_path / "j.sqlite")
    pid = j.open_plan(_plan(), restarts=3, now=100.0)
    j.record(pid, "signal", now=101.0)
    j.record(pid, "hold", now=102.0)
    j.close()
    j2 = Journal(tmp_path / "j.sqlite")
    [rec] = j2.open_plans()
    assert rec.plan == _plan() and rec.step == "hold" and rec.restarts == 3
    assert [s for s, _, _ in j2.steps(pid)] == ["open", "signal", "hold"]
    mode = sqlite3.connect(tmp_path / "j.sqlite").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def test_finished_plans_are_not_open_and_feed_hysteresis(tmp_path):
    j = Journal(tmp_path / "j.sqlite")
    a = j.open_plan(_plan(7), restarts=0, now=10.0)
    j.finish(a, DONE, now=20.0)
    b = j.open_plan(_plan(7), restarts=1, now=30.0)
    j.finish(b, ROLLED_BACK, "x", now=31.0)
    assert j.open_plans() == []
    assert j.last_change_at(7) == 20.0          # a rolled-back plan changed nothing
    assert j.last_change_at(8) is None
    assert j.restarts_since(7, 0.0) == 1
    assert j.restarts_since(7, 15.0) == 0


def test_pending_plans_do_not_count_as_restarts(tmp_path):
    j = Journal(tmp_path / "j.sqlite")
    j.finish(j.open_plan(_plan(9, PlanEntry.PENDING), restarts=1, now=5.0), DONE, now=6.0)
    assert j.restarts_since(9, 0.0) == 0


def test_unknown_step_is_refused(tmp_path):
    j = Journal(tmp_path / "j.sqlite")
    pid = j.open_plan(_plan(), restarts=0)
    with pytest.raises(ValueError):
        j.record(pid, "teleport")
