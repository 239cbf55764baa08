"""solve(): modes, must-run jobs, throughput tables given as mappings, a quiet stdout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from slurm_elastic.allocate import AllocationProblem, JobRequest, NodeCapacity, Policy, solve

ONE_NODE = (NodeCapacity("n0", 4, 32, 128_000),)


@pytest.mark.parametrize("mode", ["exact", "two-stage"])
def test_must_run_job_runs_even_when_worth_less(mode):
    jobs = (JobRequest("rich", 4, 4, weight=10.0), JobRequest("vital", 4, 4, weight=0.1, must_run=True))
    alloc = solve(AllocationProblem(jobs, ONE_NODE), mode=mode)
    assert alloc.gpus == {"rich": 0, "vital": 4}


@pytest.mark.parametrize("mode", ["exact", "two-stage"])
def test_must_run_jobs_that_cannot_all_run_are_relaxed_with_a_note(mode):
    jobs = (JobRequest("a", 4, 4, must_run=True, weight=2.0), JobRequest("b", 4, 4, must_run=True))
    alloc = solve(AllocationProblem(jobs, ONE_NODE), mode=mode)
    assert alloc.gpus == {"a": 4, "b": 0}
    assert any("must-run" in n for n in alloc.notes)


def test_throughput_table_as_a_mapping():
    # 3 GPUs give almost nothing over 2 (a profile table says so): with a second job wanting GPUs, stop at 2
    flat = JobRequest("flat", 1, 3, throughput={1: 100.0, 2: 190.0, 3: 191.0})
    other = JobRequest("other", 1, 2)
    alloc = solve(AllocationProblem((flat, other), ONE_NODE, Policy(alpha=0.0)))
    assert alloc.gpus == {"flat": 2, "other": 2}


def test_auto_mode_keeps_a_two_stage_answer_proven_within_the_gap():
    small = solve(AllocationProblem((JobRequest("a", 1, 4),), ONE_NODE))
    assert any("two-stage" in n for n in small.notes) and small.status in ("optimal", "within-gap")
    assert small.method == "lp-rounded"
    nodes = tuple(NodeCapacity(f"n{i}", 8, 64, 512_000) for i in range(40))
    jobs = tuple(JobRequest(f"j{i}", 1, 8) for i in range(30))   # 1,200 job-node pairs
    big = solve(AllocationProblem(jobs, nodes))
    assert any("two-stage" in n for n in big.notes)
    assert sum(big.gpus.values()) == 240


def test_auto_mode_runs_the_per_node_model_when_packing_loses_the_proof():
    # 3 + 3 + 2 GPUs fit 8 in all, not on two 4-GPU nodes: the counts answer packs one job short
    nodes = (NodeCapacity("n0", 4, 32, 128_000), NodeCapacity("n1", 4, 32, 128_000))
    jobs = (JobRequest("a", 3, 3), JobRequest("b", 3, 3), JobRequest("c", 2, 2))
    two = solve(AllocationProblem(jobs, nodes), mode="two-stage")
    auto = solve(AllocationProblem(jobs, nodes))
    exact = solve(AllocationProblem(jobs, nodes), mode="exact")
    assert two.mip_gap > 0.01
    assert any(n.startswith("neighbourhood: ") and "improved" in n for n in auto.notes)
    assert auto.objective > two.objective and auto.objective == pytest.approx(exact.objective)
    # the exact model proves it; the LP bound the neighbourhood has (2.97 against 1.84) does not, and says so
    assert exact.status == "optimal" and auto.status == "above-gap" and auto.bound >= exact.objective


def test_solve_writes_nothing_to_stdout():
    code = ("from slurm_elastic.allocate import *\n"
            "solve(AllocationProblem((JobRequest('a', 1, 4),), (NodeCapacity('n', 8, 8, 8000),)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout == ""


@pytest.mark.parametrize("mode", ["exact", "two-stage"])
def test_allowed_shapes_restrict_counts(mode):
    nodes = (NodeCapacity("n0", 8, 64, 512_000),)
    jobs = (JobRequest("pow2", 1, 6), JobRequest("own", 1, 8, allowed_gpus=(1, 3)))
    alloc = solve(AllocationProblem(jobs, nodes, Policy(allowed_shapes=(1, 2, 4, 8))), mode=mode)
    assert alloc.gpus["pow2"] == 4          # 5 and 6 are not powers of two
    assert alloc.gpus["own"] == 1           # its own set {1, 3} meets the policy's at 1


def test_real_time_limit_returns_highs_incumbent():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from solver import make_problem  # noqa: PLC0415

    # the exact per-node model of 6,400 job-node pairs, asked for a proven optimum in half a second
    problem = make_problem(jobs=100, nodes=64, gpn=8, mixed=False, seed=2,
                           policy=Policy(time_limit_s=0.5, mip_rel_gap=0.0))
    alloc = solve(problem, mode="exact")
    assert alloc.method == "milp-time-limit" and alloc.status == "time-limit-reached"
    assert alloc.bound > alloc.objective and alloc.mip_gap > 0
    two = solve(problem, mode="two-stage")
    assert alloc.objective >= two.objective - 1e-9       # the incumbent starts from the two-stage answer


def test_a_thread_count_other_than_the_first_runs_still_solves():
    # HiGHS keeps one scheduler per process: a run asking for another thread count used to fail at once
    # ("Not Set") and every such solve fell back to greedy.
    from slurm_elastic.allocate import AllocationProblem, JobRequest, NodeCapacity, Policy, solve

    nodes = tuple(NodeCapacity(f"n{i}", 4, 48, 196608) for i in range(4))
    jobs = tuple(JobRequest(f"j{i}", 1, 8, current={f"n{i}": 1}) for i in range(4))
    for threads in (2, 1, 2, None):
        allocation = solve(AllocationProblem(jobs, nodes, Policy(time_limit_s=5.0, threads=threads)))
        assert allocation.method in ("milp", "lp-rounded"), (threads, allocation.notes)

