"""Scenarios: node loss, multi-resource limits, stability under a high restart weight."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from slurm_elastic.allocate import AllocationProblem, JobRequest, LinearThroughput, NodeCapacity, Policy, solve

MODES = ["exact", "two-stage"]


def node(name: str, gpus: int = 8, cpus: int = 64, mem: int = 512_000) -> NodeCapacity:
    return NodeCapacity(name, gpus, cpus, mem)


@pytest.mark.parametrize("mode", MODES)
def test_losing_a_node_moves_only_its_jobs(mode):
    jobs = (
        JobRequest("a", 4, 8, current={"n0": 8}),
        JobRequest("b", 4, 8, current={"n1": 8}),
        JobRequest("c", 2, 4, current={"n2": 4}),
        JobRequest("d", 2, 4, current={"n2": 4}),
        JobRequest("e", 1, 4, current={"n3": 4}),
    )
    nodes = (node("n0", 0, 0, 0), node("n1"), node("n2"), node("n3"))   # n0 went down
    alloc = solve(AllocationProblem(jobs, nodes, Policy()), mode=mode)
    for key in "bcd":
        assert alloc.placement[key] == dict(next(j for j in jobs if j.key == key).current), key
    assert "n0" not in alloc.placement["a"]
    assert alloc.gpus["a"] >= 4                 # it restarts on what n3 has left
    assert alloc.placement["a"].keys() == {"n3"}


@pytest.mark.parametrize("mode", MODES)
def test_another_job_moves_only_when_the_gain_beats_its_restart_cost(mode):
    # a needs a whole 8-GPU node; n1 and n2 each hold a 4-GPU job. Running a means moving c next to b.
    def problem(kappa: float) -> AllocationProblem:
        jobs = (
            JobRequest("a", 8, 8, current={"n0": 8}, restart_cost_s=kappa),
            JobRequest("b", 4, 4, current={"n1": 4}, restart_cost_s=kappa),
            JobRequest("c", 4, 4, current={"n2": 4}, restart_cost_s=kappa),
        )
        return AllocationProblem(jobs, (node("n0", 0, 0, 0), node("n1"), node("n2")), Policy(beta=0.01))

    cheap = solve(problem(kappa=5.0), mode=mode)      # moving c costs 0.01*5*8 = 0.4 < running a (1.0 + alpha)
    assert cheap.gpus["a"] == 8
    moved = [k for k, home in (("b", "n1"), ("c", "n2")) if cheap.placement[k] != {home: 4}]
    assert len(moved) == 1                           # one of the two (equal cost) moves, the other stays
    assert cheap.placement["b"] == cheap.placement["c"]
    dear = solve(problem(kappa=50.0), mode=mode)      # moving c costs 4.0: a waits, c stays
    assert dear.gpus["a"] == 0
    assert dear.placement["b"] == {"n1": 4} and dear.placement["c"] == {"n2": 4}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("resource", ["cpus", "mem"])
def test_cpu_or_memory_bound_node_limits_gpu_jobs(mode, resource):
    # 8 free GPUs, but only room for 3 GPUs' worth of CPUs (or memory) of this job
    tight = node("n0", 8, 12, 512_000) if resource == "cpus" else node("n0", 8, 64, 96_000)
    job = JobRequest("j", 1, 8, cpus_per_gpu=4, mem_per_gpu_mb=32_000)
    alloc = solve(AllocationProblem((job,), (tight,), Policy()), mode=mode)
    assert alloc.gpus["j"] == 3
    (decision,) = alloc.decisions
    assert decision.cause == "capacity"
    want = "cpu" if resource == "cpus" else "mem"
    assert f"capacity of {want} on node n0" in decision.reason


@pytest.mark.parametrize("mode", MODES)
def test_high_beta_resolve_of_unchanged_cluster_changes_nothing(mode):
    nodes = tuple(node(f"n{i}", 8, 48, 256_000) for i in range(6))
    jobs = tuple(JobRequest(f"j{i}", 1 + i % 2, 8 + 4 * (i % 3), cpus_per_gpu=2 + i % 4,
                            mem_per_gpu_mb=16_000 * (1 + i % 3), weight=1 + 0.3 * i) for i in range(9))
    first = solve(AllocationProblem(jobs, nodes, Policy()), mode=mode)
    placed = tuple(replace(j, current=dict(first.placement[j.key])) for j in jobs)
    again = solve(AllocationProblem(placed, nodes, Policy(beta=1.0)), mode=mode)
    assert again.placement == first.placement
    assert all(d.gpus_before == d.gpus_after for d in again.decisions)


def test_high_beta_resolve_at_benchmark_scale_changes_nothing():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from solver import make_problem  # noqa: PLC0415  (the benchmark's generator, not a copy of it)

    problem = make_problem(jobs=150, nodes=80, gpn=8, mixed=True, seed=3)
    first = solve(problem)
    placed = tuple(replace(j, current=dict(first.placement[j.key])) for j in problem.jobs)
    again = solve(AllocationProblem(placed, problem.nodes, Policy(beta=1.0)))
    assert again.placement == first.placement


@pytest.mark.parametrize("mode", MODES)
def test_a_job_whose_node_died_restarts_elsewhere_whatever_its_restart_cost(mode):
    # its restart is forced, so kappa must not keep it stopped
    jobs = (JobRequest("a", 2, 8, current={"n0": 8}, restart_cost_s=10_000.0),)
    alloc = solve(AllocationProblem(jobs, (node("n0", 0, 0, 0), node("n1", 4)), Policy()), mode=mode)
    assert alloc.placement["a"] == {"n1": 4}
    assert "n0 gives nothing now" in alloc.decisions[0].reason


def test_losing_a_node_at_scale_with_high_beta_moves_only_its_jobs():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from solver import make_problem  # noqa: PLC0415

    problem = make_problem(jobs=200, nodes=100, gpn=8, mixed=False, seed=5)
    first = solve(problem)
    placed = tuple(replace(j, current=dict(first.placement[j.key])) for j in problem.jobs)
    busy = next(n for n in problem.nodes if sum(first.placement[j.key].get(n.name, 0) for j in problem.jobs) > 0)
    nodes = tuple(NodeCapacity(n.name, 0, 0, 0) if n.name == busy.name else n for n in problem.nodes)
    after = solve(AllocationProblem(placed, nodes, Policy(beta=1.0)))
    assert any("two-stage" in note for note in after.notes)
    on_lost = {j.key for j in placed if busy.name in j.current}
    assert on_lost
    for j in placed:
        if j.key not in on_lost:
            assert after.placement[j.key] == dict(j.current), j.key
        else:
            assert busy.name not in after.placement[j.key]


@pytest.mark.parametrize("mode", MODES)
def test_a_job_running_off_the_shape_rule_stays_when_nothing_asks_it_to_move(mode):
    # Slurm placed a 2-GPU job as 2 x 1 on 4-GPU nodes, a shape the rule would not choose (spanning jobs
    # take whole nodes). Staying asks Slurm for nothing, so it stays: a move to 1 x 2 would restart it for
    # one node fewer. It still moves when another job's gain pays for the restart.
    nodes = (node("n0", 4), node("n1", 4), node("n2", 4))
    jobs = (JobRequest("a", 2, 2, current={"n0": 1, "n1": 1}, restart_cost_s=30.0),)
    alloc = solve(AllocationProblem(jobs, nodes, Policy()), mode=mode)
    assert alloc.placement["a"] == {"n0": 1, "n1": 1}
    # a whole-node job b arrives with one node free: a stays; with none free, a moves to make room
    b = JobRequest("b", 4, 4, restart_cost_s=5.0)
    alloc = solve(AllocationProblem(jobs + (b,), nodes, Policy(beta=0.01)), mode=mode)
    assert alloc.placement["a"] == {"n0": 1, "n1": 1} and alloc.placement["b"] == {"n2": 4}
    alloc = solve(AllocationProblem(jobs + (b,), nodes[:2], Policy(beta=0.01)), mode=mode)
    assert alloc.gpus["b"] == 4 and alloc.gpus["a"] == 2 and len(alloc.placement["a"]) == 1


@pytest.mark.parametrize("mode", MODES)
def test_a_job_placed_anew_takes_free_gpus_before_a_running_jobs(mode):
    # b starts (it must run: it starved); the cluster has a free node, so no running job is moved for it.
    nodes = (node("n0", 4), node("n1", 4), node("n2", 4))
    jobs = (JobRequest("a", 4, 4, current={"n0": 4}, restart_cost_s=30.0),
            JobRequest("c", 4, 4, current={"n1": 4}, restart_cost_s=30.0),
            JobRequest("b", 4, 4, must_run=True, commitment=2))
    alloc = solve(AllocationProblem(jobs, nodes, Policy()), mode=mode)
    assert alloc.placement["a"] == {"n0": 4} and alloc.placement["c"] == {"n1": 4}
    assert alloc.placement["b"] == {"n2": 4}


@pytest.mark.parametrize("mode", MODES)
def test_a_restart_costs_the_same_however_many_gpus_change(mode):
    # Growing 4 -> 5 restarts the whole job, as a move of all 4 would: the fixed charge (the default) is
    # the share of its value now a restart loses, beta kappa gmax s(4)/s(5) = 0.4 here, more than one GPU
    # adds (speed 0.2 plus its demand term); charged per GPU changed (0.1) the same grow looks worth it.
    job = JobRequest("a", 4, 5, current={"n0": 4}, restart_cost_s=10.0)
    fixed = solve(AllocationProblem((job,), (node("n0"),), Policy(beta=0.01)), mode=mode)
    per_gpu = solve(AllocationProblem((job,), (node("n0"),), Policy(beta=0.01, restart_charge="per-gpu")), mode=mode)
    assert fixed.gpus["a"] == 4 and per_gpu.gpus["a"] == 5
    # and a grow that pays for its restart still happens: 4 -> 8 adds speed 0.5 plus 4 GPUs of demand
    # term against a charge of 0.01 x 10 x 8 x s(4)/s(8) = 0.4
    wide = solve(AllocationProblem((JobRequest("a", 4, 8, current={"n0": 4}, restart_cost_s=10.0),), (node("n0"),),
                                   Policy(beta=0.01)), mode=mode)
    assert wide.gpus["a"] == 8


@pytest.mark.parametrize("mode", MODES)
def test_a_restart_is_charged_in_the_jobs_own_value_so_its_weight_does_not_keep_it_small(mode):
    # Alone on an idle node, 4 -> 8 GPUs doubles its speed: worth the restart whatever the job's weight.
    # The charge is the value of the progress the restart loses, weight included; charged without the
    # weight, a job of weight 0.05 (most of its work ahead, as remaining-work weights say) stayed at 4:
    # 0.05 x 0.5 of speed gained against 0.01 x 10 x 8 x s(4)/s(8) = 0.4 (seen in the simulator: a job
    # held at 4 GPUs on an emptied cluster for 147,000 s).
    for weight in (1.0, 0.05):
        job = JobRequest("a", 4, 8, current={"n0": 4}, restart_cost_s=10.0, weight=weight)
        alloc = solve(AllocationProblem((job,), (node("n0"),), Policy(beta=0.01)), mode=mode)
        assert alloc.gpus["a"] == 8, (weight, alloc.decisions)


def test_when_memory_runs_out_first_packing_loses_the_job_worth_least_per_gb_not_per_gpu():
    """Three jobs of 150 GB fit two nodes of 256 GB in all but one per node: the counts solve asks for all
    three and packing must drop one. Per GPU, a 6-GPU job at 25 GB is worth least; per GB, the scarce
    resource here, it is worth most (two 2-GPU jobs at 75 GB give 4 GPUs of work for the same memory)."""
    def job(key: str, gpus: int, mem_mb: int) -> JobRequest:
        return JobRequest(key=key, min_gpus=gpus, max_gpus=gpus, cpus_per_gpu=4, mem_per_gpu_mb=mem_mb,
                          restart_cost_s=60, throughput=LinearThroughput(per_gpu=100.0))
    problem = AllocationProblem((job("a", 2, 75_000), job("b", 2, 75_000), job("c", 6, 25_000)),
                                (node("n1", mem=256_000), node("n2", mem=256_000)), Policy(threads=1))
    exact, two = solve(problem, mode="exact"), solve(problem, mode="two-stage")
    assert exact.status in ("optimal", "within-gap") and exact.gpus["c"] == 6
    assert two.gpus == exact.gpus and two.objective == pytest.approx(exact.objective)


@pytest.mark.parametrize("mode", MODES + ["auto"])
def test_a_shrink_that_keeps_its_processes_is_charged_its_own_cost(mode):
    # a holds both nodes; b waits for one. Relaunching a costs 0.01 x 50 x 16 = 8 of its value, far more
    # than b's 1.0 gains; giving up n0 in place, its batch script's n1 kept, costs 0.01 x 2 x 16 = 0.32.
    def problem(in_place: float | None, batch: str | None) -> AllocationProblem:
        jobs = (JobRequest("a", 8, 16, current={"n0": 8, "n1": 8}, restart_cost_s=50.0, in_place_cost_s=in_place,
                           batch_node=batch),
                JobRequest("b", 8, 8))
        return AllocationProblem(jobs, (node("n0"), node("n1")), Policy(beta=0.01))

    shrunk = solve(problem(2.0, "n1"), mode=mode)
    assert shrunk.placement == {"a": {"n1": 8}, "b": {"n0": 8}}, shrunk.decisions
    for in_place, batch in ((None, "n1"), (2.0, None), (2.0, "gone")):   # no such path: a relaunch's cost
        kept = solve(problem(in_place, batch), mode=mode)
        assert kept.placement["a"] == {"n0": 8, "n1": 8} and kept.gpus["b"] == 0, (in_place, batch)


def test_a_grow_after_a_shrink_in_place_is_charged_a_relaunch():
    # Shrunk in place to n1, a would grow back onto the free n0 only by a relaunch: the in-place bonus is
    # for shrinks alone, so a grow is charged as before (8 of value against 0.5 gained: it stays).
    job = JobRequest("a", 8, 16, current={"n1": 8}, restart_cost_s=50.0, in_place_cost_s=2.0, batch_node="n1")
    alloc = solve(AllocationProblem((job,), (node("n0"), node("n1")), Policy(beta=0.01)), mode="exact")
    assert alloc.placement["a"] == {"n1": 8}


@pytest.mark.parametrize("mode", MODES)
def test_a_job_a_reservation_takes_a_node_from_shrinks_in_place_rather_than_relaunch(mode):
    # n1's GPUs went to a rigid job's reservation: a cannot stay as it is. Keeping its processes on n0 costs
    # 2 s; relaunching onto n0 + n2 costs 60 s, which it must be charged though staying is not open to it.
    def problem(in_place: float | None) -> AllocationProblem:
        a = JobRequest("a", 4, 8, current={"n0": 4, "n1": 4}, restart_cost_s=60.0, in_place_cost_s=in_place,
                       batch_node="n0")
        return AllocationProblem((a, JobRequest("b", 4, 4)),
                                 (node("n0", 4), node("n1", 0, 0, 0), node("n2", 4), node("n3", 4)), Policy(beta=0.05))

    kept = solve(problem(2.0), mode=mode)
    assert kept.placement["a"] == {"n0": 4} and kept.gpus["b"] == 4, kept.decisions
    relaunched = solve(problem(None), mode=mode)      # no such path: the restart is not the solver's choice
    assert relaunched.gpus["a"] == 8 and "n1" not in relaunched.placement["a"]
