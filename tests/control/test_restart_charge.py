"""The restart charge spreads a restart over the hysteresis the controller was given, not a fixed 300 s."""

from __future__ import annotations

import getpass

import pytest

from slurm_elastic.allocate.problem import Policy
from slurm_elastic.cluster.memory import InMemorySlurm
from slurm_elastic.control.journal import Journal
from slurm_elastic.control.reconcile import ControllerConfig, Reconciler
from slurm_elastic.spec import ElasticSpec


def _reconciler(hysteresis_s: float, tmp_path) -> tuple[Reconciler, InMemorySlurm, int]:
    slurm = InMemorySlurm(nodes=2)
    job = slurm.add_job(ElasticSpec(1, 8, ckpt_dir=str(tmp_path / "ckpt")), nodes=1, gpus_per_node=2,
                        user=getpass.getuser())
    return Reconciler(slurm, Journal(":memory:"), ControllerConfig(min_resize_interval_s=hysteresis_s)), slurm, job


@pytest.mark.parametrize("hysteresis_s", [0.0, 45.0, 1200.0])
def test_the_request_source_holds_a_new_size_for_the_controllers_hysteresis(hysteresis_s, tmp_path):
    rec, _, _ = _reconciler(hysteresis_s, tmp_path)
    assert rec.requests.settings.hold_s == hysteresis_s  # type: ignore[attr-defined]


def _charge(hysteresis_s: float, tmp_path) -> float:
    rec, slurm, job = _reconciler(hysteresis_s, tmp_path)
    (req,) = [r for r in rec.requests.requests(slurm.snapshot(), 0.0, Policy()) if r.key == str(job)]
    return req.restart_cost_s


def test_a_longer_hysteresis_spreads_the_restart_charge_over_longer(tmp_path):
    default = _charge(300.0, tmp_path / "a")
    assert _charge(1200.0, tmp_path / "b") == pytest.approx(default / 4)


def test_a_short_hysteresis_charges_as_the_measuring_time_and_stays_finite(tmp_path):
    # A restarted job keeps its size until it has measured there (measure_first_s, 300 s), so a
    # hysteresis of 0 charges as 300 s would, never an infinite cost that forbids every resize.
    assert _charge(0.0, tmp_path / "a") == pytest.approx(_charge(300.0, tmp_path / "b"))


def test_a_measured_restart_is_remembered_however_many_rows_follow_it():
    from slurm_elastic.control.requests.measuring import measure
    from slurm_elastic.control.requests.settings import RequestSettings

    # As the real shim writes them: a row as a step ends, steps/s over the window since the previous row.
    rows, t, step = [], 0.0, 0
    for i in range(60):
        t += 45.0 if i == 10 else 15.0        # one restart: 30 s that did no steps
        step += 30
        rows.append({"step": step, "time": t, "gpus": 4, "nodes": 1, "steps_per_s": 2.0})
    costs = measure(rows, RequestSettings()).restart_costs_s
    assert costs == (30.0,)                   # 49 ordinary rows later, not pushed out by them
