"""Explain: per job before -> after and the constraint or term that decided it."""

from __future__ import annotations

import pytest

from slurm_elastic.allocate import AllocationProblem, JobRequest, NodeCapacity, Policy, render_explanation, solve


def decision(alloc, key):
    return next(d for d in alloc.decisions if d.key == key)


@pytest.mark.parametrize("mode", ["exact", "two-stage"])
def test_causes(mode):
    nodes = (NodeCapacity("n0", 8, 64, 512_000), NodeCapacity("n1", 4, 64, 512_000))
    jobs = (
        JobRequest("small", 1, 2),                                              # gets its max
        JobRequest("held", 2, 8, current={"n0": 4}, restart_cost_s=3600.0),     # growing would cost a restart
        JobRequest("huge", 16, 16),                                             # no shape anywhere
    )
    alloc = solve(AllocationProblem(jobs, nodes, Policy()), mode=mode)
    assert decision(alloc, "small").cause == "max" and alloc.gpus["small"] == 2
    held = decision(alloc, "held")
    assert (held.gpus_before, held.gpus_after, held.cause) == (4, 4, "restart-cost")
    assert "restart cost outweighed the gain" in held.reason
    assert decision(alloc, "huge").cause == "min-not-placeable"


def test_capacity_names_resource_and_node():
    nodes = (NodeCapacity("n0", 8, 64, 100_000),)
    jobs = (JobRequest("a", 1, 8, mem_per_gpu_mb=30_000),)
    alloc = solve(AllocationProblem(jobs, nodes))
    d = decision(alloc, "a")
    assert (d.gpus_after, d.cause) == (3, "capacity")
    assert "capacity of mem on node n0" in d.reason and "4 GPUs need 120000 MB" in d.reason


def test_render_lists_every_job_with_before_after():
    nodes = (NodeCapacity("n0", 8, 64, 512_000),)
    jobs = (JobRequest("alpha", 1, 4, current={"n0": 2}, restart_cost_s=0.0), JobRequest("beta", 1, 4))
    alloc = solve(AllocationProblem(jobs, nodes))
    text = render_explanation(alloc)
    lines = text.splitlines()
    assert lines[0].startswith("method lp-rounded  status optimal")
    assert any(line.startswith("alpha") and "2 -> 4" in line and "[n0:4]" in line for line in lines)
    assert any(line.startswith("beta") and "0 -> 4" in line for line in lines)
    changed_only = render_explanation(alloc, only_changes=True)
    assert "alpha" in changed_only


@pytest.mark.parametrize("mode", ["exact", "two-stage"])
def test_a_job_that_gave_up_gpus_says_so(mode):
    nodes = (NodeCapacity("n0", 8, 64, 512_000),)
    jobs = (JobRequest("cheap", 1, 8, weight=0.1, current={"n0": 8}, restart_cost_s=1.0),
            JobRequest("dear", 4, 4, weight=10.0))
    alloc = solve(AllocationProblem(jobs, nodes, Policy()), mode=mode)
    d = decision(alloc, "cheap")
    assert (d.gpus_before, d.gpus_after, d.cause) == (8, 4, "traded")
    assert d.reason.startswith("gave up 4 GPUs to jobs that gain more")


def test_counts_without_a_shape_are_explained():
    # 12 GPUs on 8-GPU nodes is no whole-node shape; 8 is the most this job can have here
    nodes = (NodeCapacity("n0", 8, 64, 512_000), NodeCapacity("n1", 8, 64, 512_000))
    alloc = solve(AllocationProblem((JobRequest("j", 4, 12, gpu_step=4),), nodes))
    d = decision(alloc, "j")
    assert (d.gpus_after, d.cause) == (8, "capacity")
    assert "no larger count has a Slurm shape" in d.reason
