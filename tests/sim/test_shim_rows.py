"""The simulated shim stamps each row when its last whole step ended, as the real shim writes a row as a step
ends: the controller then measures a restart's cost from restarts only, also for a job slower than a tick."""

from __future__ import annotations

import json

import pytest

from slurm_elastic import jobfiles as protocol
from slurm_elastic.control.requests.measuring import measure
from slurm_elastic.control.requests.settings import RequestSettings
from slurm_elastic.sim.jobs import SimJob
from slurm_elastic.sim.shim import SimulatedShim

SPEED = 0.03          # steps/s: one step every 33 s, slower than the 60 s ticks are fine


def _rows(tmp_path, ticks):
    """Rows at 60 s ticks for a job at SPEED that stalls `stall` seconds (a restart) at tick `at`."""
    (tmp_path / protocol.job_key("7")).mkdir()
    job = SimJob("slow", 0.0, 4, 1, 8, work=1e6, speed=lambda per_node: SPEED)
    shim = SimulatedShim(str(tmp_path), "7", job)
    for now, done in ticks:
        shim.report((4,), done, now, None)
    return [json.loads(line) for line in open(protocol.metrics_path(str(tmp_path), "7"))]


def test_a_slow_job_running_steadily_shows_no_restart(tmp_path):
    rows = _rows(tmp_path, [(t, SPEED * t) for t in range(60, 1260, 60)])
    for row in rows:     # each row is stamped when its step ended
        assert row["time"] == pytest.approx(row["step"] / SPEED)
    assert measure(rows, RequestSettings()).restart_costs_s == ()


def test_a_slow_jobs_restart_is_measured_at_what_it_cost(tmp_path):
    stall = 30.0
    ticks = [(t, SPEED * t) for t in range(60, 660, 60)]
    ticks += [(t, SPEED * (t - stall)) for t in range(660, 1860, 60)]   # no step for 30 s after t = 600
    costs = measure(_rows(tmp_path, ticks), RequestSettings()).restart_costs_s
    assert len(costs) == 1 and costs[0] == pytest.approx(stall, abs=1e-6)


def test_a_shrink_that_kept_the_processes_is_measured_apart_from_a_relaunch(tmp_path):
    # A relaunch (30 s without steps) at t = 600, then a shrink in place (3 s) at t = 1800: the first row
    # after the second says so, and each path's cost is its own.
    (tmp_path / protocol.job_key("7")).mkdir()
    job = SimJob("fast", 0.0, 4, 1, 8, work=1e6, speed=lambda per_node: 1.0)
    shim = SimulatedShim(str(tmp_path), "7", job)
    done = 0.0
    for t in range(60, 3000, 60):
        lost = 30.0 if t == 660 else 3.0 if t == 1860 else 0.0
        done += 60.0 - lost
        shim.report((4,) if t < 1860 else (2,), done, float(t), None, in_place=1 if t >= 1860 else 0)
    rows = [json.loads(line) for line in open(protocol.metrics_path(str(tmp_path), "7"))]
    assert [r["time"] for r in rows if r.get("in_place")] == [1860.0]
    m = measure(rows, RequestSettings())
    assert m.restart_costs_s == pytest.approx((30.0,)) and m.in_place_costs_s == pytest.approx((3.0,))
    assert m.restart_cost_s == pytest.approx(30.0) and m.in_place_cost_s == pytest.approx(3.0)


def test_resizes_in_place_neither_crowd_out_the_relaunches_nor_count_when_they_measure_nothing():
    # A relaunch (30 s), then twenty resizes in place: the relaunch is still remembered. An in-place row whose
    # interval lost no time (its steps before the resize were counted at the new speed) adds no sample.
    rows, t, step = [], 0.0, 0
    for i in range(50):
        lost = 30.0 if i == 5 else 4.0 if i >= 10 and i % 2 == 0 else 0.0
        t += 60.0
        step += int(60.0 - lost)
        row = {"step": step, "time": t, "gpus": 4, "nodes": 1, "steps_per_s": 1.0}
        if i >= 10 and i % 2 == 0:
            row["in_place"] = 1
        rows.append(row)
    rows.append({"step": step + 70, "time": t + 60.0, "gpus": 4, "nodes": 1, "steps_per_s": 1.0, "in_place": 1})
    m = measure(rows, RequestSettings())
    assert m.restart_costs_s == pytest.approx((30.0,))
    assert len(m.in_place_costs_s) == 16 and m.in_place_cost_s == pytest.approx(4.0)   # the newest 16
