"""Property tests on random small clusters: every rule holds, and the exact MILP matches brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from slurm_elastic.allocate import AllocationProblem, JobRequest, NodeCapacity, Policy, solve, table_throughput
from slurm_elastic.allocate import commitments
from slurm_elastic.allocate.formulation import Formulation
from slurm_elastic.allocate.instance import Instance
from slurm_elastic.allocate.shapes import placement_is_valid_shape


@st.composite
def clusters(draw, max_jobs: int = 4, max_nodes: int = 3, max_node_gpus: int = 4, max_gpus: int = 6):
    n_nodes = draw(st.integers(1, max_nodes))
    nodes = []
    for n in range(n_nodes):
        down = draw(st.booleans()) and draw(st.booleans())  # ~1 in 4 nodes gives nothing
        g = 0 if down else draw(st.integers(0, max_node_gpus))
        c = 0 if down else draw(st.integers(0, 16))
        m = 0 if down else draw(st.sampled_from([0, 4000, 8000, 16000]))
        nodes.append(NodeCapacity(f"n{n}", g, c, m))
    names = [x.name for x in nodes]
    jobs = []
    for j in range(draw(st.integers(1, max_jobs))):
        step = draw(st.sampled_from([1, 1, 2]))
        lo = step * draw(st.integers(1, 2))
        hi = lo + step * draw(st.integers(0, max(0, (max_gpus - lo) // step)))
        current = {}
        if draw(st.booleans()):
            node = draw(st.sampled_from(names))
            current = {node: draw(st.integers(1, max_node_gpus))}
            if len(names) > 1 and draw(st.booleans()):     # spanning, as Slurm runs it: alike on each node
                current[draw(st.sampled_from([n for n in names if n != node]))] = current[node]
        # a shrink keeping its processes costs its own seconds (allocate/instance.py `in_place`)
        batch = draw(st.sampled_from(sorted(current))) if current else None
        in_place = draw(st.one_of(st.none(), st.floats(0, 60)))
        model = None
        if draw(st.booleans()):
            model = table_throughput({g: draw(st.floats(0.1, 10.0)) for g in range(1, hi + 1)})
        jobs.append(JobRequest(
            key=f"j{j}", min_gpus=lo, max_gpus=hi, gpu_step=step,
            cpus_per_gpu=draw(st.integers(0, 4)), mem_per_gpu_mb=draw(st.sampled_from([0, 1000, 2000, 4000])),
            weight=draw(st.floats(0.1, 3.0)), current=current, restart_cost_s=draw(st.floats(0, 60)),
            in_place_cost_s=in_place, batch_node=batch,
            throughput=model, must_run=draw(st.sampled_from([False, False, False, True]))))
    policy = Policy(alpha=draw(st.sampled_from([0.0, 0.5, 2.0])), beta=draw(st.sampled_from([0.0, 0.002, 0.05])),
                    gamma=draw(st.sampled_from([0.0, 0.01, 0.3])),
                    whole_nodes_when_spanning=draw(st.booleans()), mip_rel_gap=0.0, time_limit_s=20)
    return AllocationProblem(tuple(jobs), tuple(nodes), policy)


def check_rules(problem: AllocationProblem, alloc) -> None:
    cap = {n.name: np.array([n.gpus, n.cpus, n.mem_mb], float) for n in problem.nodes}
    used = {n: np.zeros(3) for n in cap}
    node_gpus = {n.name: n.gpus for n in problem.nodes}
    for job in problem.jobs:
        where = alloc.placement[job.key]
        g = alloc.gpus[job.key]
        assert g == sum(where.values())
        if g:
            assert job.min_gpus <= g <= job.max_gpus, (job, g)
            assert g % job.gpu_step == 0
            # a job may stay exactly where it runs, whatever the shape rule says (allocate/instance.py `stays`)
            assert (dict(where) == dict(job.current)
                    or placement_is_valid_shape(where, node_gpus, problem.policy.whole_nodes_when_spanning)), where
        for n, v in where.items():
            assert v > 0 and node_gpus[n] > 0, f"{job.key} got GPUs on {n}, which gives none"
            used[n] += v * np.array([1, job.cpus_per_gpu, job.mem_per_gpu_mb], float)
    for n in cap:
        assert np.all(used[n] <= cap[n] + 1e-9), (n, used[n], cap[n])


def brute_force(problem: AllocationProblem) -> float:
    """Best objective over every placement the rules allow (independent of the candidate filtering)."""
    inst = Instance(problem)
    nn = len(problem.nodes)
    node_gpus = {n.name: n.gpus for n in problem.nodes}
    options = []
    for i, job in enumerate(problem.jobs):
        rows = [({}, np.zeros((nn, 3)))]
        for g in job.candidate_gpus():
            for split in itertools.product(range(g + 1), repeat=nn):
                if sum(split) != g:
                    continue
                row = {n: v for n, v in enumerate(split) if v > 0}
                named = {problem.nodes[n].name: v for n, v in row.items()}
                if not placement_is_valid_shape(named, node_gpus, problem.policy.whole_nodes_when_spanning):
                    continue
                use = np.zeros((nn, 3))
                for n, v in row.items():
                    use[n] = v * inst.rho[i]
                if np.all(use <= inst.cap + 1e-9):
                    rows.append((row, use))
        if inst.stays_off_shape(i):            # staying asks Slurm for nothing: an answer off the shape rule too
            use = np.zeros((nn, 3))
            for n, v in inst.current[i].items():
                use[n] = v * inst.rho[i]
            if np.all(use <= inst.cap + 1e-9):
                rows.append((dict(inst.current[i]), use))
        options.append([(inst.job_objective(i, r), use, bool(r)) for r, use in rows])
    # must-run jobs (that can run at all) run; when their minimums cannot all fit the cluster in all, the
    # stated order (allocate/commitments.py) gives up the fewest, lowest-ranked ones; when the rest still
    # cannot all run on the nodes, the rule is dropped (one rank here)
    kept, _ = commitments.feasible_subset(inst.commitment_ranks(), inst.min_demand(), inst.usable(),
                                          [j.key for j in problem.jobs])
    must = [i in kept and len(options[i]) > 1 for i in range(len(problem.jobs))]
    best = {True: -np.inf, False: -np.inf}

    def dfs(j: int, free: np.ndarray, acc: float, ok: bool) -> None:
        if j == len(options):
            best[ok] = max(best[ok], acc)
            return
        for value, use, runs in options[j]:
            left = free - use
            if np.all(left >= -1e-9):
                dfs(j + 1, left, acc + value, ok and (runs or not must[j]))

    dfs(0, inst.cap.copy(), 0.0, True)
    return best[True] if best[True] > -np.inf else best[False]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters())
def test_exact_milp_equals_brute_force(problem):
    alloc = solve(problem, mode="exact")
    check_rules(problem, alloc)
    if alloc.method == "greedy":
        # only when nothing at all can be placed (a MILP answer that broke a rule would also land here)
        assert alloc.status == "nothing-placeable", alloc.notes
    assert abs(alloc.objective - brute_force(problem)) <= 1e-6 * max(1.0, abs(alloc.objective))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters(max_jobs=8, max_nodes=6, max_node_gpus=8, max_gpus=16))
def test_every_mode_respects_capacity_shapes_and_ranges(problem):
    for mode in ("auto", "exact", "neighbourhood", "two-stage", "greedy"):
        alloc = solve(problem, mode=mode)
        check_rules(problem, alloc)
        assert set(alloc.gpus) == {j.key for j in problem.jobs}
        if mode == "exact":
            # a must-run job that can run at all runs, or the answer says the rule was dropped
            unplaceable = {u.key for u in alloc.unplaceable}
            stopped = [j.key for j in problem.jobs if j.must_run and j.key not in unplaceable
                       and alloc.gpus[j.key] == 0]
            assert not stopped or any("must-run" in n for n in alloc.notes), (stopped, alloc.notes)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters(max_jobs=6, max_nodes=4, max_node_gpus=8, max_gpus=16))
def test_two_stage_objective_never_above_exact_bound(problem):
    # with must-run jobs the two models may disagree on whether all of them can run (aggregate vs per-node
    # capacity), and each drops the rule on its own; compare them only without it
    assume(not any(j.must_run for j in problem.jobs))
    exact = solve(problem, mode="exact")
    two = solve(problem, mode="two-stage")
    # the counts model relaxes the exact one, so its bound is >= the exact optimum
    if two.method != "greedy" and np.isfinite(two.bound):
        assert two.bound >= exact.objective - 1e-6
    assert two.objective <= exact.objective + 1e-6


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters(max_jobs=6, max_nodes=4, max_node_gpus=8, max_gpus=16))
def test_the_neighbourhood_answer_lies_between_two_stage_and_the_exact_optimum_and_its_bound_holds(problem):
    assume(not any(j.must_run for j in problem.jobs))     # as above: the models drop that rule each on its own
    exact = solve(problem, mode="exact")
    two = solve(problem, mode="two-stage")
    near = solve(problem, mode="neighbourhood")
    assert near.objective >= two.objective - 1e-6
    assert near.objective <= (exact.bound if np.isfinite(exact.bound) else exact.objective) + 1e-6
    if near.method != "greedy" and np.isfinite(near.bound):
        assert near.bound >= exact.objective - 1e-6


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters(max_jobs=6, max_nodes=4, max_node_gpus=8, max_gpus=16))
def test_no_answer_is_reported_above_its_own_bound_and_the_neighbourhood_keeps_commitments(problem):
    # must-run jobs included: an answer that drops one the bound's model ran could score above that bound
    two = solve(problem, mode="two-stage")
    for mode in ("auto", "neighbourhood", "exact", "two-stage"):
        alloc = solve(problem, mode=mode)
        if np.isfinite(alloc.bound):
            assert alloc.bound >= alloc.objective - 1e-6 * max(1.0, abs(alloc.objective)), (mode, alloc.notes)
        if mode != "two-stage" and not any(n.startswith("must-run commitments given up") for n in alloc.notes):
            # a per-node model that held every commitment runs at least the must-run jobs packing placed
            ran = sum(1 for j in problem.jobs if j.must_run and alloc.gpus[j.key])
            assert ran >= sum(1 for j in problem.jobs if j.must_run and two.gpus[j.key]), (mode, alloc.notes)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters(max_jobs=6, max_nodes=4, max_node_gpus=8, max_gpus=12))
def test_both_milps_score_a_placement_with_the_one_objective(problem):
    # the exact MILP's objective at a placement is the scorers' (allocate/objective.py); the counts MILP's
    # bounds it from above (its restart and node terms are lower bounds of the per-node ones)
    alloc = solve(problem, mode="two-stage")
    inst = Instance(problem)
    rows = [{inst.node_index[n]: g for n, g in alloc.placement[j.key].items()} for j in problem.jobs]
    exact = Formulation(inst, exact=True)
    counts = Formulation(inst, exact=False)
    scored = inst.objective(rows)
    assert alloc.objective == pytest.approx(scored, rel=1e-12, abs=1e-12)
    assert exact.value(exact.point(rows)) == pytest.approx(scored, rel=1e-9, abs=1e-9)
    assert counts.value(counts.point_from_counts([sum(r.values()) for r in rows])) >= scored - 1e-9


@st.composite
def shrinking_clusters(draw):
    """A job spanning whole nodes that it could give up in place, beside jobs that want them."""
    per = draw(st.integers(1, 4))
    nodes = tuple(NodeCapacity(f"n{n}", per, 16, 16000) for n in range(draw(st.integers(2, 4))))
    held = draw(st.integers(2, len(nodes)))
    current = {n.name: per for n in nodes[:held]}
    jobs = [JobRequest("big", per, per * held, current=current, restart_cost_s=draw(st.floats(5, 60)),
                       in_place_cost_s=draw(st.floats(0, 5)), batch_node=draw(st.sampled_from(sorted(current))),
                       weight=draw(st.floats(0.1, 3.0)))]
    for j in range(draw(st.integers(1, 3))):
        lo = draw(st.integers(1, per))
        jobs.append(JobRequest(f"j{j}", lo, lo * draw(st.integers(1, 2)), weight=draw(st.floats(0.1, 3.0))))
    policy = Policy(alpha=draw(st.sampled_from([0.0, 0.5])), beta=draw(st.sampled_from([0.002, 0.05])),
                    gamma=draw(st.sampled_from([0.0, 0.01])), whole_nodes_when_spanning=draw(st.booleans()),
                    mip_rel_gap=0.0, time_limit_s=20)
    return AllocationProblem(tuple(jobs), nodes, policy)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shrinking_clusters())
def test_a_shrink_in_place_is_scored_alike_by_every_path_and_the_exact_milp_finds_the_best(problem):
    exact = solve(problem, mode="exact")
    assert abs(exact.objective - brute_force(problem)) <= 1e-6 * max(1.0, abs(exact.objective))
    inst = Instance(problem)
    counts = Formulation(inst, exact=False)
    form = Formulation(inst, exact=True)
    for mode in ("two-stage", "auto"):
        alloc = solve(problem, mode=mode)
        check_rules(problem, alloc)
        rows = [{inst.node_index[n]: g for n, g in alloc.placement[j.key].items()} for j in problem.jobs]
        assert alloc.objective == pytest.approx(inst.objective(rows), rel=1e-12, abs=1e-12)
        assert form.value(form.point(rows)) == pytest.approx(inst.objective(rows), rel=1e-9, abs=1e-9)
        assert counts.value(counts.point_from_counts([sum(r.values()) for r in rows])) >= inst.objective(rows) - 1e-9
        assert alloc.objective <= exact.objective + 1e-6
