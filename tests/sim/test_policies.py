"""Each policy on tiny traces whose outcome is worked out by hand (linear speed, no restart overhead)."""

from __future__ import annotations

import pytest

from slurm_elastic.sim import RestartModel, SimConfig, Simulation, parse_cluster
from slurm_elastic.sim.controller import ControllerPolicy
from slurm_elastic.sim.optimus import OptimusPolicy
from slurm_elastic.sim.static import StaticPolicy
from slurm_elastic.sim.jobs import SimJob
from slurm_elastic.sim.speed import TableSpeed
from slurm_elastic.sim.tiresias import TiresiasPolicy

from tests.sim.conftest import job

NO_OVERHEAD = RestartModel(overhead_s=0.0)


def run(jobs, policy, cluster="1x4", **kw):
    result = Simulation(jobs, policy, SimConfig(parse_cluster(cluster), restart=NO_OVERHEAD, **kw)).run()
    return {r.key: r for r in result.jobs}, result


def test_static_fifo_waits_in_order():
    recs, _ = run([job("a", 0, 4, 100), job("b", 10, 2, 50), job("c", 20, 1, 30)], StaticPolicy())
    assert (recs["a"].start_s, recs["a"].finish_s) == (0, 100)
    assert (recs["b"].start_s, recs["b"].finish_s) == (100, 150)
    assert (recs["c"].start_s, recs["c"].finish_s) == (100, 130)
    assert all(r.restarts == 0 for r in recs.values())


def test_static_easy_backfill_only_when_it_does_not_delay_the_head():
    # a holds 2 of 4 GPUs until t=100; b (4 GPUs) is blocked and reserved for t=100.
    # c (2 GPUs, 50 s) ends by t=52 <= 100: backfilled at once. d (2 GPUs, 200 s) would delay b: waits.
    recs, _ = run([job("a", 0, 2, 100), job("b", 1, 4, 10), job("c", 2, 2, 50), job("d", 3, 2, 200)],
                  StaticPolicy())
    assert recs["c"].start_s == pytest.approx(2) and recs["c"].finish_s == pytest.approx(52)
    assert recs["b"].start_s == pytest.approx(100) and recs["b"].finish_s == pytest.approx(110)
    assert recs["d"].start_s == pytest.approx(110) and recs["d"].finish_s == pytest.approx(310)


def test_tiresias_preempts_a_demoted_job_for_a_new_one():
    # a (4 GPUs) passes the 100 GPU-s threshold at t=25 and is demoted; b arrives at t=50 in queue 0,
    # preempts a, runs 50..70; a resumes with 50 s left and ends at 120.
    recs, result = run([job("a", 0, 4, 100), job("b", 50, 4, 20)], TiresiasPolicy(thresholds_gpu_s=(100.0,)))
    assert recs["b"].start_s == pytest.approx(50) and recs["b"].finish_s == pytest.approx(70)
    assert recs["a"].finish_s == pytest.approx(120)
    assert recs["a"].restarts == 1 and recs["b"].restarts == 0
    assert any("preempt a" in n for d in result.decisions for n in d.notes)


def test_tiresias_keeps_fifo_inside_the_first_queue():
    recs, _ = run([job("a", 0, 4, 100), job("b", 50, 4, 20)], TiresiasPolicy(thresholds_gpu_s=(1e9,)))
    assert recs["a"].finish_s == pytest.approx(100) and recs["a"].restarts == 0
    assert recs["b"].start_s == pytest.approx(100)


def test_optimus_gives_gpus_by_marginal_gain():
    # Both start with 1 GPU; gains remaining x (1/s(g) - 1/s(g+1)): a 400*(1-1/2)=200 > b 100*(1/2)=50,
    # then a 400*(1/2-1/3)=66.7 > 50: a=3, b=1. b ends at 100; a has 100 GPU-s left at 4 GPUs: ends 125.
    a = job("a", 0, 1, 400, lo=1, hi=4)
    b = job("b", 0, 1, 100, lo=1, hi=4)
    recs, result = run([a, b], OptimusPolicy())
    first = result.decisions[0]
    assert dict((k, after) for k, _, after in first.changes) == {"a": 3, "b": 1}
    assert recs["b"].finish_s == pytest.approx(100)
    assert recs["a"].finish_s == pytest.approx(125)
    assert recs["a"].restarts == 1


def _sizes(result, key):
    return [after for d in result.decisions for k, _, after in d.changes if k == key]


def test_controller_measures_a_lone_job_first_then_gives_it_the_whole_cluster():
    recs, result = run([job("a", 0, 2, 4000, lo=1, hi=8)], ControllerPolicy(max_scale=None), cluster="2x4")
    assert _sizes(result, "a")[:2] == [2, 8]
    times = [d.time_s for d in result.decisions if any(k == "a" for k, _, _ in d.changes)]
    assert times[1] - times[0] >= 60                  # kept at its size until its first metrics row
    assert recs["a"].finish_s < 4000 * 2 / 4


def test_controller_caps_at_twice_the_request_by_default():
    _, result = run([job("a", 0, 2, 4000, lo=1, hi=8)], ControllerPolicy(), cluster="2x4")
    assert max(_sizes(result, "a")) == 4


def test_controller_runs_rigid_jobs_that_fit_side_by_side():
    recs, _ = run([job("a", 0, 2, 100), job("b", 0, 2, 50)], ControllerPolicy())
    assert recs["a"].start_s == 0 and recs["b"].start_s == 0
    assert recs["a"].finish_s == pytest.approx(100) and recs["b"].finish_s == pytest.approx(50)


def test_controller_is_the_shipped_reconciler_reading_what_the_jobs_wrote():
    from slurm_elastic.control.reconcile import Reconciler
    from slurm_elastic.control.requests import MeasuredRequests

    policy = ControllerPolicy(max_scale=None)
    seen = []
    real = policy.reconciler.decide

    def spy(state, now, **kw):
        decision = real(state, now, **kw)
        seen.append((now, decision))
        return decision

    policy.reconciler.decide = spy
    # a scales, b does not (its speed is the same at any size): once measured, b is not grown
    flat = TableSpeed(((1, 1.0), (2, 1.0), (4, 1.0), (8, 1.0)))
    b = SimJob("b", 0.0, 2, 1, 8, work=4000.0, speed=flat, restart_overhead_s=0.0)
    run([job("a", 0, 2, 4000, lo=1, hi=8), b], policy, cluster="4x4", immediate=False)
    assert type(policy.reconciler) is Reconciler and isinstance(policy.reconciler.requests, MeasuredRequests)
    assert all(t % 60 == 0 for t, _ in seen)                      # on the virtual clock, at the 60 s ticks
    last = seen[-1][1]
    basis = last.allocation.basis
    assert any("speed measured" in why for why in basis.values())
    assert policy.journal.plans()                                  # the protocol ran and journaled
    b_id = str(policy.slurm.jobs and next(j.job_id for j in policy.slurm.jobs.values() if j.name == "b"))
    req = next(r for r in seen[-1][1].problem.jobs if r.key == b_id)
    assert req.allowed_gpus is not None and max(req.allowed_gpus) <= 2   # measured: no faster with more


def test_controller_gives_the_job_that_scales_more_gpus_once_both_are_measured():
    flat = TableSpeed(((1, 1.0), (2, 1.0), (4, 1.0), (8, 1.0)))
    b = SimJob("b", 0.0, 2, 1, 8, work=20000.0, speed=flat, restart_overhead_s=0.0)
    _, result = run([job("a", 0, 2, 20000, lo=1, hi=8), b], ControllerPolicy(max_scale=None), cluster="2x4",
                    immediate=False)
    at = {}
    for d in result.decisions:
        for k, _, after in d.changes:
            at[k] = after
        if d.time_s >= 1500:
            break
    assert at["a"] > at["b"], result.decisions[:8]
