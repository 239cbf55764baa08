"""The progress objective in the allocator: the stay bonus prices a restart, floors are penalised slacks,
and every scorer (exact MILP, two-stage, greedy, brute force) agrees on what "better" means."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_elastic.allocate import AllocationProblem, JobRequest, NodeCapacity, Policy, highs, solve
from slurm_elastic.allocate.formulation import Formulation
from slurm_elastic.allocate.instance import Instance
from tests.allocate.test_properties import brute_force, check_rules, clusters

PROGRESS = Policy(objective="progress")
MODES = ["exact", "two-stage", "greedy"]


def node(name: str, gpus: int = 8) -> NodeCapacity:
    return NodeCapacity(name, gpus, 64, 512_000)


def linear(top: int, per_gpu: float = 1.0) -> tuple[tuple[int, float], ...]:
    return tuple((g, per_gpu * g) for g in range(1, top + 1))


@pytest.mark.parametrize("mode", MODES)
def test_a_job_stays_when_the_gain_is_below_its_stay_bonus(mode):
    # staying at 4 keeps V(4) = 4; growing to 8 keeps (1 - 0.6) V(8) = 3.2: the restart costs more than it gains
    job = JobRequest("a", 1, 8, current={"n0": 4}, values=linear(8), stay_fraction=0.6)
    alloc = solve(AllocationProblem((job,), (node("n0"), node("n1")), PROGRESS), mode=mode)
    assert alloc.placement["a"] == {"n0": 4}


@pytest.mark.parametrize("mode", MODES)
def test_a_job_changes_when_the_gain_beats_its_stay_bonus(mode):
    # (1 - 0.3) V(8) = 5.6 > V(4) = 4
    job = JobRequest("a", 1, 8, current={"n0": 4}, values=linear(8), stay_fraction=0.3)
    alloc = solve(AllocationProblem((job,), (node("n0"), node("n1")), PROGRESS), mode=mode)
    assert alloc.gpus["a"] == 8


def test_the_stay_bonus_is_only_for_the_exact_placement():
    job = JobRequest("a", 1, 8, current={"n0": 4}, values=linear(8), stay_fraction=0.5)
    inst = Instance(AllocationProblem((job,), (node("n0"), node("n1")), PROGRESS))
    gamma = PROGRESS.gamma
    assert inst.job_objective(0, {0: 4}) == pytest.approx(4.0 - gamma)              # V(4), as it is
    assert inst.job_objective(0, {1: 4}) == pytest.approx(0.5 * 4.0 - gamma)        # same count, moved
    assert inst.job_objective(0, {0: 6}) == pytest.approx(0.5 * 6.0 - gamma)        # grown in place


@pytest.mark.parametrize("mode", MODES)
def test_a_displaced_job_pays_nothing_for_where_it_goes(mode):
    # n0 is gone: job a restarts whatever happens, so it keeps no stay bonus and every placement of a
    # count is worth the same to it as to a job that was never running
    a = JobRequest("a", 1, 8, current={"n0": 4}, values=linear(8), stay_fraction=0.5)
    twin = JobRequest("t", 1, 8, values=linear(8), stay_fraction=0.5)
    problem = AllocationProblem((a, twin), (node("n0", 0), node("n1"), node("n2")), PROGRESS)
    inst = Instance(problem)
    assert inst.terms[0].objective.stay == 0
    for row in ({1: 4}, {2: 8}, {1: 8}):
        assert inst.job_objective(0, row) == pytest.approx(inst.job_objective(1, row))
    alloc = solve(problem, mode=mode)
    assert alloc.gpus == {"a": 8, "t": 8}


@pytest.mark.parametrize("mode", MODES)
def test_floors_beyond_capacity_are_relaxed_lowest_priority_first(mode):
    # three floors of 2 GPUs on a 4-GPU node: the two most overdue keep theirs, however much more job
    # x's GPUs are worth, and the problem stays feasible (no must-run is dropped: there is none)
    jobs = (JobRequest("x", 1, 4, values=linear(4, 5.0), floor_gpus=2, floor_priority=1.5),
            JobRequest("y", 1, 4, values=linear(4), floor_gpus=2, floor_priority=3.0),
            JobRequest("z", 1, 4, values=linear(4), floor_gpus=2, floor_priority=2.0))
    alloc = solve(AllocationProblem(jobs, (node("n0", 4),), PROGRESS), mode=mode)
    assert alloc.gpus == {"x": 0, "y": 2, "z": 2}
    assert not any("given up" in n for n in alloc.notes)


@pytest.mark.parametrize("mode", MODES)
def test_a_floor_holds_against_more_valuable_progress(mode):
    # without its floor job y would get nothing (x's GPUs are worth 5x); with it y keeps 2
    x = JobRequest("x", 1, 4, values=linear(4, 5.0))
    y = JobRequest("y", 1, 4, values=linear(4))
    nodes = (node("n0", 4),)
    assert solve(AllocationProblem((x, y), nodes, PROGRESS), mode=mode).gpus == {"x": 4, "y": 0}
    held = JobRequest("y", 1, 4, values=linear(4), floor_gpus=2, floor_priority=1.0)
    assert solve(AllocationProblem((x, held), nodes, PROGRESS), mode=mode).gpus == {"x": 2, "y": 2}


def _three_jobs_two_nodes(pi: float, floors: tuple[int, int, int]) -> AllocationProblem:
    concave = ((1, 1.0), (2, 1.8), (3, 2.4), (4, 2.8))
    jobs = (JobRequest("a", 1, 4, current={"n0": 2}, values=concave, stay_fraction=pi, floor_gpus=floors[0],
                       floor_priority=1.2),
            JobRequest("b", 1, 4, current={"n1": 3}, values=tuple((g, 0.6 * v) for g, v in concave),
                       stay_fraction=pi / 2, floor_gpus=floors[1], floor_priority=2.0),
            JobRequest("c", 2, 4, gpu_step=2, values=tuple((g, 1.5 * v) for g, v in concave),
                       stay_fraction=pi, floor_gpus=floors[2], floor_priority=1.0))
    return AllocationProblem(jobs, (node("n0", 4), node("n1", 4)), PROGRESS)


@pytest.mark.parametrize("pi", [0.0, 0.2, 0.5, 0.9])
@pytest.mark.parametrize("floors", [(0, 0, 0), (2, 3, 4), (3, 0, 2)])
def test_brute_force_agrees_with_the_milp(pi, floors):
    problem = _three_jobs_two_nodes(pi, floors)
    best = brute_force(problem)
    exact = solve(problem, mode="exact")
    check_rules(problem, exact)
    assert exact.objective == pytest.approx(best, rel=1e-6, abs=1e-9)
    for mode in ("two-stage", "greedy"):
        other = solve(problem, mode=mode)
        check_rules(problem, other)
        assert other.objective <= best + 1e-9
        # the scorers agree: what a path reports is what Instance scores for its placement
        inst = Instance(problem)
        rows = [{inst.node_index[n]: g for n, g in other.placement[j.key].items()} for j in problem.jobs]
        assert other.objective == pytest.approx(inst.objective(rows))


def test_the_legacy_objective_ignores_the_progress_fields():
    job = JobRequest("a", 1, 8, current={"n0": 4}, values=linear(8), stay_fraction=0.9, floor_gpus=8,
                     floor_priority=5.0)
    plain = JobRequest("a", 1, 8, current={"n0": 4})
    nodes = (node("n0"), node("n1"))
    assert (solve(AllocationProblem((job,), nodes)).placement
            == solve(AllocationProblem((plain,), nodes)).placement)


@pytest.mark.parametrize("bad", [dict(stay_fraction=1.5), dict(floor_gpus=-1), dict(values=((0, 1.0),)),
                                 dict(values=()), dict(floor_priority=float("nan"))])
def test_bad_progress_fields_are_refused(bad):
    from slurm_elastic.errors import AllocationError
    with pytest.raises(AllocationError):
        solve(AllocationProblem((JobRequest("a", 1, 4, **bad),), (node("n0"),), PROGRESS))
    with pytest.raises(AllocationError, match="objective"):
        solve(AllocationProblem((JobRequest("a", 1, 4),), (node("n0"),), Policy(objective="fastest")))


def test_explain_names_the_restart_when_the_stay_bonus_decided():
    job = JobRequest("a", 1, 8, current={"n0": 4}, values=linear(8), stay_fraction=0.6)
    alloc = solve(AllocationProblem((job,), (node("n0"), node("n1")), PROGRESS))
    (decision,) = alloc.decisions
    assert decision.cause == "restart-cost" and "the restart loses 2.4" in decision.reason
    assert "50% of its best" in decision.reason          # V(4) of V(8), not of a normaliser it has not got


@st.composite
def progress_clusters(draw):
    """test_properties' random clusters, every job with values, a stay fraction and a floor instead."""
    base = draw(clusters(max_jobs=3, max_nodes=2, max_node_gpus=4, max_gpus=4))
    jobs = []
    for j in base.jobs:
        values = tuple((g, draw(st.floats(0.0, 5.0))) for g in range(1, j.max_gpus + 1))
        jobs.append(dataclasses.replace(
            j, must_run=False, values=values, stay_fraction=draw(st.sampled_from([0.0, 0.1, 0.5, 1.0])),
            floor_gpus=draw(st.integers(0, j.max_gpus)), floor_priority=draw(st.floats(0.0, 4.0))))
    policy = dataclasses.replace(base.policy, objective="progress")
    return AllocationProblem(tuple(jobs), base.nodes, policy)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(progress_clusters())
def test_random_progress_problems_the_exact_milp_equals_brute_force_and_every_path_scores_alike(problem):
    exact = solve(problem, mode="exact")
    check_rules(problem, exact)
    assert exact.objective == pytest.approx(brute_force(problem), rel=1e-6, abs=1e-6)
    inst = Instance(problem)
    for mode in ("two-stage", "greedy"):
        alloc = solve(problem, mode=mode)
        check_rules(problem, alloc)
        rows = [{inst.node_index[n]: g for n, g in alloc.placement[j.key].items()} for j in problem.jobs]
        scored = inst.objective(rows)
        assert alloc.objective == pytest.approx(scored, rel=1e-9, abs=1e-9)
        assert scored <= exact.objective + 1e-6
        # the exact model's value at a placement is the scorers'; the counts model's bounds it
        assert Formulation(inst, exact=True).value(Formulation(inst, exact=True).point(rows)) == pytest.approx(
            scored, rel=1e-9, abs=1e-9)
        counts = Formulation(inst, exact=False)
        assert counts.value(counts.point_from_counts([sum(r.values()) for r in rows])) >= scored - 1e-9


def _raw_exact(problem: AllocationProblem) -> tuple[float, list[dict[int, int]], Instance]:
    """The exact model's own optimum, without solve()'s re-scoring and fallbacks (which would hide a wrong row)."""
    inst = Instance(problem)
    form = Formulation(inst, exact=True)
    res = highs.solve(form.model, limits=highs.Limits(threads=1), mip_rel_gap=0.0)
    return res.objective, form.rows_of(res.x), inst


@pytest.mark.parametrize("mode", ["exact", "two-stage"])
def test_a_move_to_another_node_at_the_same_count_loses_the_stay_bonus(mode):
    # a holds 1 GPU of n0 (pi = 0.5: staying keeps 10, moving 5); b needs a whole 4-GPU node, and only n0
    # has one if a moves to n1. Running b must gain more than a's restart loses.
    a = JobRequest("a", 1, 1, current={"n0": 1}, values=((1, 10.0),), stay_fraction=0.5)
    nodes = (node("n0", 4), node("n1", 3))
    for b_value, expected in ((4.0, {"a": {"n0": 1}, "b": {}}), (12.0, {"a": {"n1": 1}, "b": {"n0": 4}})):
        problem = AllocationProblem((a, JobRequest("b", 4, 4, values=((4, b_value),))), nodes, PROGRESS)
        assert solve(problem, mode=mode).placement == expected
        value, rows, inst = _raw_exact(problem)
        assert value == pytest.approx(inst.objective(rows))        # the model's k = 1 only where x = x0
        assert value == pytest.approx(brute_force(problem))
