"""solve(): modes, must-run jobs, throughput tables given as mappings, a quiet stdout."""

from __future__ import annotations

import subprocess
import sys

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


def test_auto_mode_picks_by_size():
    small = solve(AllocationProblem((JobRequest("a", 1, 4),), ONE_NODE))
    assert not any("two-stage" in n for n in small.notes)
    nodes = tuple(NodeCapacity(f"n{i}", 8, 64, 512_000) for i in range(40))
    jobs = tuple(JobRequest(f"j{i}", 1, 8) for i in range(30))   # 1,200 job-node pairs
    big = solve(AllocationProblem(jobs, nodes))
    assert any("two-stage" in n for n in big.notes)
    assert sum(big.gpus.values()) == 240


def test_solve_writes_nothing_to_stdout():
    code = ("from slurm_elastic.allocate import *\n"
            "solve(AllocationProblem((JobRequest('a', 1, 4),), (NodeCapacity('n', 8, 8, 8000),)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout == ""
