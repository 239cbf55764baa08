"""Bad input gets a clear AllocationError or an explicit "not placed" answer, never a trace."""

from __future__ import annotations

import math

import pytest

from slurm_elastic.allocate import (AllocationError, AllocationProblem, JobRequest, NodeCapacity, Policy,
                                    render_explanation, solve)
from slurm_elastic.allocate import solver as solver_module
from slurm_elastic.allocate.highs import MilpResult

NODES = (NodeCapacity("n0", 8, 64, 256_000), NodeCapacity("n1", 8, 64, 256_000))


def test_infeasible_minimum_is_reported_not_dropped():
    jobs = (JobRequest("big", 12, 12), JobRequest("ok", 1, 4))   # 12 on 8-GPU nodes is no whole-node shape
    alloc = solve(AllocationProblem(jobs, NODES))
    assert alloc.gpus == {"big": 0, "ok": 4}
    (u,) = alloc.unplaceable
    assert u.key == "big" and "not placeable" in u.reason
    big = next(d for d in alloc.decisions if d.key == "big")
    assert big.cause == "min-not-placeable" and big.gpus_after == 0


def test_minimum_too_big_for_memory_names_memory():
    job = JobRequest("fat", 2, 4, mem_per_gpu_mb=200_000)
    alloc = solve(AllocationProblem((job,), NODES))
    assert alloc.gpus["fat"] == 0
    assert "memory 400000 MB > largest free 256000 MB" in alloc.unplaceable[0].reason


@pytest.mark.parametrize("nodes", [(), (NodeCapacity("n0", 0, 0, 0),)], ids=["no-nodes", "all-down"])
def test_empty_cluster_places_nothing_and_says_why(nodes):
    jobs = (JobRequest("a", 1, 4, current={"n0": 2}), JobRequest("b", 2, 2))
    alloc = solve(AllocationProblem(jobs, nodes))
    assert alloc.gpus == {"a": 0, "b": 0}
    assert alloc.status == "nothing-placeable"
    assert {u.key for u in alloc.unplaceable} == {"a", "b"}
    assert "no free GPUs" in alloc.unplaceable[0].reason
    assert "a" in render_explanation(alloc)


def test_no_jobs():
    alloc = solve(AllocationProblem((), NODES))
    assert alloc.gpus == {} and alloc.status == "no-jobs" and alloc.decisions == ()


def test_zero_capacity_resource_only_stops_jobs_that_need_it():
    nodes = (NodeCapacity("n0", 8, 0, 256_000),)                # no CPUs left for elastic work
    jobs = (JobRequest("needs-cpu", 1, 4, cpus_per_gpu=2), JobRequest("no-cpu", 1, 4, cpus_per_gpu=0))
    alloc = solve(AllocationProblem(jobs, nodes))
    assert alloc.gpus == {"needs-cpu": 0, "no-cpu": 4}
    assert "CPUs" in alloc.unplaceable[0].reason


@pytest.mark.parametrize("change", [
    dict(weight=math.nan), dict(weight=-1.0), dict(weight=0.0), dict(weight=math.inf),
    dict(min_gpus=0), dict(min_gpus=5, max_gpus=4), dict(gpu_step=0), dict(cpus_per_gpu=-1),
    dict(mem_per_gpu_mb=math.nan), dict(restart_cost_s=-5.0), dict(restart_cost_s=math.nan),
    dict(current={"n0": -2}), dict(key=""),
])
def test_malformed_job_is_an_allocation_error(change):
    job = JobRequest(**{**dict(key="j", min_gpus=1, max_gpus=4), **change})
    with pytest.raises(AllocationError):
        solve(AllocationProblem((job,), NODES))


@pytest.mark.parametrize("change", [dict(alpha=math.nan), dict(beta=-1.0), dict(gamma=math.inf),
                                    dict(time_limit_s=-1.0), dict(mip_rel_gap=math.nan)])
def test_malformed_policy_is_an_allocation_error(change):
    with pytest.raises(AllocationError):
        solve(AllocationProblem((JobRequest("j", 1, 4),), NODES, Policy(**change)))


@pytest.mark.parametrize("nodes", [(NodeCapacity("n0", -1, 4, 100),), (NodeCapacity("n0", 4, math.nan, 100),),
                                   (NodeCapacity("n0", 4, 4, 100), NodeCapacity("n0", 4, 4, 100))])
def test_malformed_nodes_are_an_allocation_error(nodes):
    with pytest.raises(AllocationError):
        solve(AllocationProblem((JobRequest("j", 1, 4),), nodes))


@pytest.mark.parametrize("speed", [math.nan, -1.0, math.inf])
def test_broken_throughput_model_is_an_allocation_error(speed):
    job = JobRequest("j", 1, 4, throughput=lambda g, n=1: speed)
    with pytest.raises(AllocationError, match="throughput"):
        solve(AllocationProblem((job,), NODES))


def test_zero_throughput_everywhere_is_an_allocation_error():
    job = JobRequest("j", 1, 4, throughput=lambda g, n=1: 0.0)
    with pytest.raises(AllocationError, match="must be > 0"):
        solve(AllocationProblem((job,), NODES))


def test_duplicate_job_keys_and_wrong_argument():
    with pytest.raises(AllocationError):
        solve(AllocationProblem((JobRequest("j", 1, 4), JobRequest("j", 1, 2)), NODES))
    with pytest.raises(AllocationError):
        solve("not a problem")  # type: ignore[arg-type]
    with pytest.raises(AllocationError):
        solve(AllocationProblem((JobRequest("j", 1, 4),), NODES), mode="fastest")


@pytest.mark.parametrize("mode", ["exact", "two-stage"])
def test_no_incumbent_falls_back_to_greedy_and_says_so(monkeypatch, mode):
    # Mock: HiGHS returning nothing at its time limit cannot be provoked reliably on a model this small.
    def nothing(model, **kwargs):
        return MilpResult(None, "Time limit reached", -math.inf, math.inf, math.inf, 0.0, False, True)

    monkeypatch.setattr(solver_module.highs, "solve", nothing)
    jobs = (JobRequest("a", 1, 8, current={"n0": 4}), JobRequest("b", 2, 4))
    alloc = solve(AllocationProblem(jobs, NODES), mode=mode)
    assert alloc.method == "greedy" and alloc.status == "time-limit-reached"
    assert any("greedy" in n for n in alloc.notes)
    assert alloc.gpus["a"] >= 4 and alloc.gpus["b"] >= 2


def test_incumbent_at_time_limit_is_used(monkeypatch):
    # Mock: wrap the real HiGHS answer and mark it as stopped by the time limit (HiGHS's incumbent).
    real = solver_module.highs.solve

    def limited(model, **kwargs):
        res = real(model, **kwargs)
        return MilpResult(res.x, "Time limit reached", res.objective, res.bound + 0.5, 0.1, res.solve_s, False, True)

    monkeypatch.setattr(solver_module.highs, "solve", limited)
    alloc = solve(AllocationProblem((JobRequest("a", 1, 8),), NODES), mode="exact")
    assert alloc.method == "milp-time-limit" and alloc.status == "time-limit-reached" and alloc.gpus["a"] == 8
    assert alloc.bound >= alloc.objective


@pytest.mark.parametrize("change", [dict(weight="1"), dict(weight=True), dict(restart_cost_s="30"),
                                    dict(current={"n0": 1.5}), dict(current=[("n0", 2)]),
                                    dict(allowed_gpus=(1.5,)), dict(throughput=42)])
def test_wrongly_typed_job_fields_are_an_allocation_error(change):
    job = JobRequest(**{**dict(key="j", min_gpus=1, max_gpus=4), **change})
    with pytest.raises(AllocationError):
        solve(AllocationProblem((job,), NODES))


def test_throughput_model_that_raises_names_the_job():
    def broken(gpus, nodes=1):
        raise ZeroDivisionError("profile missing")

    with pytest.raises(AllocationError, match="job j: throughput model failed at 1 GPUs: profile missing"):
        solve(AllocationProblem((JobRequest("j", 1, 4, throughput=broken),), NODES))


def test_things_that_are_not_jobs_or_nodes():
    with pytest.raises(AllocationError):
        solve(AllocationProblem(({"key": "j"},), NODES))  # type: ignore[arg-type]
    with pytest.raises(AllocationError):
        solve(AllocationProblem((JobRequest("j", 1, 4),), (("n0", 8, 8, 8),)))  # type: ignore[arg-type]
