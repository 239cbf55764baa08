"""The progress objective's request side: heSRPT rank weights, the restart's stay fraction, LAS for jobs of
unknown size, and finish-time-fairness floors as penalised slacks instead of must-run rules."""

from __future__ import annotations

import dataclasses
import getpass
import json
import math
import os

import numpy as np
import pytest
from scipy.optimize import minimize

from slurm_elastic.allocate import AllocationProblem, NodeCapacity, solve
from slurm_elastic.allocate.problem import JobRequest, Policy
from slurm_elastic.cluster.memory import InMemorySlurm
from slurm_elastic.control.requests import (MeasuredRequests, ProgressRequests, RequestSettings,
                                            default_request_source)
from slurm_elastic.control.requests.progress import (ProgressTerms, ftf_floor, hesrpt_weights, speedup_curve,
                                                     stay_fraction)
from slurm_elastic.spec import ElasticSpec
from slurm_elastic import jobfiles as shim

ME = getpass.getuser()
PROGRESS = Policy(objective="progress")


def _rows(path, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def _row(step, t, gpus, sps, total=None):
    r = {"step": step, "time": t, "gpus": gpus, "nodes": 1, "steps_per_s": sps, "samples_per_s": sps * 64}
    if total is not None:
        r["total_steps"] = total
    return r


# -- heSRPT ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [0.3, 0.5, 0.8])
def test_rank_weights_give_hesrpts_optimal_shares_under_g_to_the_p(p):
    # heSRPT (SIGMETRICS 2020, Theorem): jobs indexed 1 (largest) .. m (smallest), speedup s(k) = k^p, the
    # optimal shares are theta_i = (i/m)^c - ((i-1)/m)^c, c = 1/(1-p). The continuous optimum of the linear
    # weighted objective sum_j omega_j theta_j^p over the simplex must be exactly those shares.
    work = {"big": 9000.0, "mid": 3000.0, "small": 500.0}
    w = hesrpt_weights(work, p)
    keys = ["big", "mid", "small"]
    omega = np.array([w[k] for k in keys])
    res = minimize(lambda th: -float(np.sum(omega * np.maximum(th, 1e-12) ** p)), x0=np.full(3, 1 / 3),
                   bounds=[(1e-9, 1)] * 3, constraints=[{"type": "eq", "fun": lambda th: th.sum() - 1}],
                   method="SLSQP", options={"ftol": 1e-12, "maxiter": 500})
    c = 1 / (1 - p)
    paper = np.array([(i / 3) ** c - ((i - 1) / 3) ** c for i in (1, 2, 3)])
    assert res.success
    assert res.x == pytest.approx(paper, abs=2e-4)
    assert res.x[0] < res.x[1] < res.x[2]                 # the least work left gets the largest share
    assert w["big"] == pytest.approx(1.0)                 # omega_1 = 1: the scale is fixed


def test_rank_weights_depend_on_the_order_of_work_only():
    a = hesrpt_weights({"x": 10.0, "y": 20.0, "z": 30.0}, 0.5)
    b = hesrpt_weights({"x": 1.0, "y": 2e6, "z": 3e9}, 0.5)
    assert a == b                  # no clamp, no quantisation: a 1000x smaller job is not 1000x heavier
    assert max(a.values()) / min(a.values()) == pytest.approx(5 ** 0.5)     # (3^2 - 2^2)^(1/2) / 1


def test_the_milp_gives_the_smallest_job_the_most_gpus():
    p = 0.5
    w = hesrpt_weights({"big": 9000.0, "mid": 3000.0, "small": 500.0}, p)
    jobs = tuple(JobRequest(k, 1, 12, values=tuple((g, w[k] * g ** p) for g in range(1, 13))) for k in w)
    alloc = solve(AllocationProblem(jobs, (NodeCapacity("n0", 12, 96, 10 ** 6),), PROGRESS))
    assert sum(alloc.gpus.values()) == 12
    assert alloc.gpus["big"] < alloc.gpus["mid"] < alloc.gpus["small"]


# -- pure terms --------------------------------------------------------------------------------------------
def test_speedup_is_capped_at_g_and_never_falls():
    model = {1: 1.0, 2: 2.5, 4: 2.0}                       # a super-linear claim, then slower at 4
    curve = speedup_curve(lambda g, n=1: model[g], [1, 2, 4], lambda g: 1)
    assert curve == ((1, 1.0), (2, 2.0), (4, 2.0))


def test_stay_fraction_is_the_restart_over_the_horizon():
    assert stay_fraction(30.0, 300.0, None) == pytest.approx(0.1)
    assert stay_fraction(30.0, 300.0, 60.0) == pytest.approx(0.5)      # a job about to end is costly to move
    assert stay_fraction(30.0, 300.0, 10.0) == 1.0


def _terms(work, per_gpu=1.0, top=8, trusted=True):
    return ProgressTerms(tuple((g, per_gpu * g) for g in range(1, top + 1)), work, trusted, None, "")


def test_a_young_job_has_no_floor_and_a_starved_one_gets_up_to_its_share():
    counts = list(range(1, 9))
    # new, 1000 1-GPU-s left, fair share 4: on its share it would end in 250 s, well within 2x
    assert ftf_floor(_terms(1000.0), age_s=0.0, attained_s=0.0, fair=4, counts=counts, hold_s=300.0, target=2.0,
                     ever_ran=True)[0] == 0
    # old and held small: 8000 1-GPU-s left after 4 h with 2000 done; its floor rises to its share
    phi, overdue, why = ftf_floor(_terms(8000.0), age_s=14400.0, attained_s=2000.0, fair=4, counts=counts,
                                  hold_s=300.0, target=2.0, ever_ran=True)
    assert phi == 4 and overdue > 2.0 and "floor 4" in why
    # a job seconds from its end is not overdue by the hold alone
    assert ftf_floor(_terms(20.0), age_s=100.0, attained_s=100.0, fair=4, counts=counts, hold_s=300.0,
                     target=2.0, ever_ran=True)[0] == 0


# -- the source ------------------------------------------------------------------------------------------
@pytest.fixture
def two(tmp_path):
    slurm = InMemorySlurm(nodes=2)
    ckpt = str(tmp_path / "ckpt")
    a = slurm.add_job(ElasticSpec(1, 8, ckpt_dir=ckpt), nodes=1, gpus_per_node=2, user=ME)
    b = slurm.add_job(ElasticSpec(1, 8, ckpt_dir=ckpt), nodes=1, gpus_per_node=2, user=ME)
    return slurm, ckpt, a, b


def test_the_setting_picks_the_source():
    assert type(default_request_source(RequestSettings())) is MeasuredRequests
    assert type(default_request_source(RequestSettings(objective="progress"))) is ProgressRequests


def test_less_work_left_ranks_higher_without_a_clamp_or_must_run(two):
    slurm, ckpt, a, b = two
    _rows(shim.metrics_path(ckpt, str(a)), [_row(100, 1000, 2, 1.0, total=10_000),
                                            _row(115, 1045, 4, 2.0, total=10_000)])
    _rows(shim.metrics_path(ckpt, str(b)), [_row(10, 0, 2, 1.0, total=2_000), _row(190, 90, 2, 1.0, total=2_000)])
    got = ProgressRequests().requests(slurm.snapshot(), 0.0, PROGRESS)
    reqs = {r.key: r for r in got}
    ra, rb = reqs[str(a)], reqs[str(b)]
    va, vb = dict(ra.values), dict(rb.values)
    assert vb[2] > va[2]                               # 1810 steps left against 9885
    assert va[1] == pytest.approx(1.0)                 # rank 1 (most work): omega 1, S(1) = 1
    assert not ra.must_run and not rb.must_run and ra.weight == rb.weight == 1.0
    # X = 9885 steps / 1 step/s at 2 GPUs x S(2); the 4-GPU row is one Slurm never ran (ignored), and the
    # step-time model's prior charges 2 GPUs a little communication: S(2) = 1.96, not 2.
    assert "rank 2/2" in got.basis[str(b)] and "X 19382 1-GPU-s" in got.basis[str(a)]
    # the restart its rows show (45 s - 15 steps / 2 per s) is at that size too: ignored, the default 30 s
    assert ra.stay_fraction == pytest.approx(30.0 / 300.0)


def test_a_job_of_unknown_size_is_ranked_by_attained_service(two):
    slurm, ckpt, a, b = two
    _rows(shim.metrics_path(ckpt, str(a)), [_row(10, 0, 2, 1.0), _row(20, 10, 2, 1.0)])       # no total_steps
    _rows(shim.metrics_path(ckpt, str(b)), [_row(10, 0, 2, 1.0, total=10 ** 6), _row(20, 10, 2, 1.0, total=10 ** 6)])
    src = ProgressRequests()
    src.requests(slurm.snapshot(), 0.0, PROGRESS)
    got = src.requests(slurm.snapshot(), 100.0, PROGRESS)     # 100 s on 2 GPUs as Slurm ran it, S(2) = 1.96
    assert "LAS 196s" in got.basis[str(a)] and "[LAS]" in got.basis[str(a)]
    reqs = {r.key: r for r in got}
    # 196 1-GPU-s attained ranks it as far smaller than b's ~500000 declared: a heavier weight
    assert dict(reqs[str(a)].values)[1] > dict(reqs[str(b)].values)[1]


def test_an_overdue_job_gets_a_penalised_floor_not_a_must_run(two):
    slurm, ckpt, a, b = two
    # a: a long job, submitted 4 h ago; b: short
    _rows(shim.metrics_path(ckpt, str(a)), [_row(100, 0, 2, 1.0, total=40_000), _row(200, 100, 2, 1.0)])
    _rows(shim.metrics_path(ckpt, str(b)), [_row(10, 0, 2, 1.0, total=400), _row(20, 10, 2, 1.0)])
    state = slurm.snapshot()
    state = dataclasses.replace(state, jobs=tuple(dataclasses.replace(j, submit_time=0.0) for j in state.jobs))
    src = ProgressRequests()
    got = src.requests(state, 4 * 3600.0, PROGRESS)
    reqs = {r.key: r for r in got}
    assert reqs[str(a)].floor_gpus >= 1 and reqs[str(a)].floor_priority > 2.0
    assert not reqs[str(a)].must_run and "floor" in got.basis[str(a)]
    # giving GPUs back to a rigid job: no floor holds against that
    assert {r.key: r for r in src.requests(state, 4 * 3600.0, PROGRESS, yielding=True)}[str(a)].floor_gpus == 0


def test_a_bad_file_gives_the_default_request_only_for_its_job(two):
    slurm, ckpt, a, b = two
    os.makedirs(os.path.dirname(shim.metrics_path(ckpt, str(a))), exist_ok=True)
    with open(shim.metrics_path(ckpt, str(a)), "w") as f:
        f.write("[" * 100_000 + "\n")
    _rows(shim.metrics_path(ckpt, str(b)), [_row(10, 0, 2, 1.0, total=400), _row(20, 10, 2, 1.0)])
    got = ProgressRequests().requests(slurm.snapshot(), 0.0, PROGRESS)
    assert {r.key for r in got} == {str(a), str(b)}
    assert dict({r.key: r for r in got}[str(b)].values)[2] > 0
    assert not math.isnan(sum(v for r in got if r.values for _, v in r.values))


def test_the_controller_decides_with_the_objective_its_policy_names(two, tmp_path):
    from slurm_elastic.control.journal import Journal
    from slurm_elastic.control.reconcile import ControllerConfig, Reconciler

    slurm, ckpt, a, b = two
    _rows(shim.metrics_path(ckpt, str(a)), [_row(100, 0, 2, 1.0, total=40_000), _row(200, 100, 2, 1.0, total=40_000)])
    _rows(shim.metrics_path(ckpt, str(b)), [_row(10, 0, 2, 1.0, total=400), _row(20, 10, 2, 1.0, total=400)])
    legacy = Reconciler(slurm, Journal(tmp_path / "l.sqlite"), ControllerConfig())
    assert type(legacy.requests) is MeasuredRequests
    rec = Reconciler(slurm, Journal(tmp_path / "p.sqlite"), ControllerConfig(policy=PROGRESS))
    assert type(rec.requests) is ProgressRequests
    decision = rec.decide(slurm.snapshot(), 1000.0)
    basis = decision.allocation.basis
    assert "[progress]" in basis[str(a)] and "rank 1/2" in basis[str(a)] and "rank 2/2" in basis[str(b)]
