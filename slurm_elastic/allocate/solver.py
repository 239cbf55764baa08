"""solve(problem) -> Allocation: counts MILP + packing, then the per-node MILP near its LP's answer where packing
lost the proof (up to thousands of job-node pairs); the full per-node MILP on request; greedy as the fallback."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Sequence

from slurm_elastic.allocate import commitments, explain, highs, neighbourhood, pools, users
from slurm_elastic.allocate.formulation import Formulation
from slurm_elastic.allocate.instance import Instance
from slurm_elastic.allocate.packing import Layout, Row, greedy, improve, kept, make_room, pack
from slurm_elastic.allocate.problem import (ABOVE_GAP, OPTIMAL, TIME_LIMIT, WITHIN_GAP, WORK_LIMIT, Allocation,
                                            AllocationProblem, Policy)
from slurm_elastic.errors import AllocationError

log = logging.getLogger(__name__)

# Up to this many (job, node) pairs auto runs the per-node model near the LP's answer where the two-stage
# answer is not proven (allocate/neighbourhood.py): its full LP relaxation is built over every pair, which
# stops being cheap at tens of thousands. The full per-node model is not run by auto at any size: its root
# node's cuts, which no HiGHS work limit bounds, took 0.3-3.3 s CPU at 960 memory-bound pairs and up to
# 0.65 s at 96 (docs/allocator.md, "Solving it").
NEIGHBOURHOOD_MAX_PAIRS = 10_000

# HiGHS's LP bound proved the rounded counts within the gap, so branch-and-bound was skipped: a route
# (the Allocation's method), not a certificate
LP_ROUNDED = "lp-rounded"
_ZERO_GAP = 1e-9               # relative: float noise between HiGHS's objective and ours


def solve(problem: AllocationProblem, *, mode: str = "auto") -> Allocation:
    """Choose every elastic job's GPUs and nodes.

    `mode`: "auto" (two-stage; where its answer is not proven within the gap
    asked for and the job-node pairs are at most NEIGHBOURHOOD_MAX_PAIRS, the
    exact model near the LP's answer), "exact", "neighbourhood", "two-stage", or
    "greedy" (the fallback alone, starting from the current allocation; the
    benchmarks' Optimus-style baseline from an empty cluster is
    `greedy_baseline`).
    Raises AllocationError on malformed input; jobs that cannot run are
    returned with 0 GPUs and a reason.
    """
    t0 = time.perf_counter()
    if not isinstance(problem, AllocationProblem):
        raise AllocationError(f"solve() needs an AllocationProblem, got {type(problem).__name__}")
    problem.validate()
    if pools.restricted(problem):
        return pools.solve_by_pool(problem, lambda p: solve(p, mode=mode))
    if users.claiming_users(problem):
        return users.solve_by_user(problem, lambda p: solve(p, mode=mode))
    inst = Instance(problem, validated=True)
    notes: list[str] = []
    if mode not in ("auto", "exact", "neighbourhood", "two-stage", "greedy"):
        raise AllocationError(f"unknown solve mode {mode!r} (auto, exact, neighbourhood, two-stage, greedy)")
    live = [i for i, t in enumerate(inst.terms) if t.candidates]
    if not live:
        rows: list[Row] = [{} for _ in inst.jobs]
        if inst.jobs:
            notes.append("no job can be placed at its minimum; nothing to optimise")
        return _answer(inst, rows, "nothing-placeable" if inst.jobs else "no-jobs", "greedy", inst.objective(rows),
                       inst.objective(rows), 0.0, t0, notes)
    _keep_commitments(inst, notes)
    if mode == "greedy":
        rows = greedy(inst, from_current=True).rows
        obj = inst.objective(rows)
        return _answer(inst, rows, "greedy", "greedy", obj, math.nan, math.nan, t0, notes)
    policy = inst.policy
    two_rows, two_res, fallback = _two_stage(inst, t0, notes)
    if mode == "auto":
        pairs = len(live) * int((inst.cap[:, 0] > 0).sum())
        # The counts model relaxes the exact one, so its bound holds for the exact optimum: a two-stage
        # answer proven within the gap asked for cannot be beaten by more than that gap, and the per-node
        # model is only worth running when that proof is missing and its LP is small enough to be cheap.
        # A two-stage answer that scores at its bound by dropping a must-run job packing found no room for
        # is kept too (it is reported with no bound, below): running the per-node model there to keep the
        # commitment was measured worse in the simulator (docs/allocator.md, "Solving it").
        proven = two_rows is not None and _gap(inst.objective(two_rows), two_res.bound) <= policy.mip_rel_gap
        mode = "neighbourhood" if not proven and pairs <= NEIGHBOURHOOD_MAX_PAIRS else "two-stage"
    if mode == "exact":
        # the two-stage answer (or the greedy, whichever scores higher) is the first incumbent
        greedy_rows = greedy(inst, from_current=True).rows
        if two_rows is None or inst.objective(greedy_rows) > inst.objective(two_rows):
            start, fallback_rows = greedy_rows, greedy_rows
        else:
            start, fallback_rows = two_rows, two_rows
        notes[:] = [n for n in notes if n.startswith("must-run commitments")]
        held = inst.commitment_ranks()
        form, res = _exact(inst, start, t0, notes)
        if math.isfinite(two_res.bound) and two_res.bound < res.bound and inst.commitment_ranks() == held:
            # the counts model relaxes the exact one: its bound holds here too (unless _exact gave up
            # commitments it held), and HiGHS stopped early may not have a finite dual bound of its own yet
            res = dataclasses.replace(res, bound=two_res.bound)
        rows = form.rows_of(res.x) if res.x is not None else None
        if rows is None and two_rows is not None:
            notes.append(f"the exact model found no solution ({res.status}); the two-stage answer is used")
            res, rows = two_res, two_rows
    elif mode == "neighbourhood" and two_rows is not None:
        (res, rows), fallback_rows = _near(inst, two_rows, two_res, t0, notes), None
    else:
        res, rows, fallback_rows = two_res, two_rows, None
    if rows is None:
        rows = fallback_rows if fallback_rows is not None else greedy(inst, from_current=True).rows
        notes.append(f"HiGHS found no solution ({res.status}); greedy allocation used")
        return _answer(inst, rows, _status(res.status), "greedy", inst.objective(rows), math.nan, math.nan, t0,
                       notes)
    method = ("milp-time-limit" if res.time_limited else "milp-work-limit" if res.work_limited
              else LP_ROUNDED if res.status == LP_ROUNDED else "milp")
    bad = inst.violations(rows)
    if bad:
        # should not happen; never hand Slurm an impossible placement
        log.error("MILP placement broke %d rule(s), using greedy: %s", len(bad), "; ".join(bad[:3]))
        notes.append(f"MILP placement invalid ({bad[0]}); greedy allocation used")
        rows, method = greedy(inst, from_current=True).rows, "greedy"
    obj = inst.objective(rows)
    if fallback_rows is None:
        fallback_rows = fallback.rows
    fallback_obj = inst.objective(fallback_rows)
    if fallback_obj > obj + 1e-9 and _must_runs(inst, fallback_rows) >= _must_runs(inst, rows):
        notes.append(f"the warm start scored higher ({fallback_obj:.6g} > {obj:.6g}) than the MILP answer "
                     "after placement; it is used")
        rows, obj, method = fallback_rows, fallback_obj, "greedy"
    bound = res.bound
    broken = _broken_commitments(inst, rows)
    if broken and math.isfinite(bound):
        # the bound's model ran them; an answer that does not is outside it, and may score above it
        notes.append(f"the answer does not run must-run job(s) {', '.join(broken)}, which the bound's model "
                     "ran: no bound holds for it")
        bound = math.nan
    gap = _gap(obj, bound)
    return _answer(inst, rows, _certified(res, gap, policy.mip_rel_gap), method, obj, bound, gap, t0, notes)


def _keep_commitments(inst: Instance, notes: list[str]) -> None:
    """Give up the fewest, lowest-ranked must-run commitments whose minimums do not fit the cluster in all."""
    ranks = inst.commitment_ranks()
    if not any(ranks):
        return
    keys = [j.key for j in inst.jobs]
    _, given_up = commitments.feasible_subset(ranks, inst.min_demand(), inst.usable(), keys)
    if given_up:
        _give_up(inst, given_up, ranks, notes)


def _give_up(inst: Instance, indices: Sequence[int], ranks: Sequence[int], notes: list[str]) -> None:
    inst.give_up(indices)
    named = ", ".join(f"{inst.jobs[i].key} ({commitments.Commitment(ranks[i]).name.lower()})" for i in indices)
    notes.append(f"must-run commitments given up, lowest rank first, so the rest fit: {named}")


def _relax_lowest(inst: Instance, notes: list[str]) -> bool:
    """Give up every commitment of the lowest rank still held (the per-node model found none feasible)."""
    ranks = inst.commitment_ranks()
    held = [r for r in ranks if r > 0]
    if not held:
        return False
    low = min(held)
    _give_up(inst, [i for i, r in enumerate(ranks) if r == low], ranks, notes)
    return True


def _exact(inst: Instance, start: Sequence[Row], t0: float, notes: list[str]) -> tuple[Formulation, highs.MilpResult]:
    """The per-node MILP warm-started at `start`, giving up commitments rank by rank while it is infeasible."""
    policy = inst.policy
    while True:
        form = Formulation(inst, exact=True)
        res = highs.solve(form.model, limits=_limits(policy, t0), mip_rel_gap=policy.mip_rel_gap,
                          warm=form.point(start))
        if res.x is not None or res.status != "Infeasible" or not _relax_lowest(inst, notes):
            return form, res


def _two_stage(inst: Instance, t0: float, notes: list[str]) -> tuple[list[Row] | None, highs.MilpResult, Layout]:
    """Counts MILP against aggregate capacity, then per-node packing, repair and fill."""
    policy = inst.policy
    form = Formulation(inst, exact=False)
    while any(inst.commitment_ranks()):
        # _keep_commitments made the minimums fit in all, so this is a guard, not the normal path
        probe = highs.solve(form.model, limits=_limits(policy, t0), mip_rel_gap=1.0, relax=True)
        if probe.x is not None or probe.status != "Infeasible" or not _relax_lowest(inst, notes):
            break
        form = Formulation(inst, exact=False)
    fallback = kept(inst)                                # the current allocation where it still fits
    warm = form.point_from_counts([sum(r.values()) for r in fallback.rows])
    # LP relaxation rounded down: near-optimal for the counts model (a knapsack over three rows)
    lp = highs.solve(form.model, limits=_limits(policy, t0), mip_rel_gap=policy.mip_rel_gap, relax=True)
    res = lp
    rounded = form.round_down(lp.x) if lp.x is not None else None
    if rounded is not None and any(
            j.must_run and inst.terms[i].candidates and not rounded[i] for i, j in enumerate(inst.jobs)):
        rounded = None   # rounding dropped a must-run job: not a feasible point, let branch-and-bound work
    if rounded is not None:
        point = form.point_from_counts(rounded)
        value = form.value(point)
        if value > form.value(warm):
            warm = point
        if policy.lp_certificate and _gap(value, lp.bound) <= policy.mip_rel_gap:
            # HiGHS's LP bound already proves the rounded counts within the MIP gap: branch-and-bound
            # could only confirm it, so it is skipped (the final answer's status is judged after packing)
            res = highs.MilpResult(point, LP_ROUNDED, value, lp.bound,
                                   _gap(value, lp.bound), lp.solve_s, False, False)
    if res is lp:
        res = highs.solve(form.model, limits=_limits(policy, t0), mip_rel_gap=policy.mip_rel_gap, warm=warm)
        if lp.bound < res.bound:
            # stopped early, HiGHS's MIP dual bound can be weaker than the LP bound it already has
            # (an LP stopped by a limit has bound inf: its value proves nothing)
            res = dataclasses.replace(res, bound=lp.bound)
    if res.x is None:
        return None, res, fallback
    counts = form.counts(res.x)
    lay, lowered = pack(inst, counts)
    if lowered:
        moved = make_room(inst, lay, lowered, counts)
        notes.append(f"packing placed {len(lowered)} job(s) below the counts solve (per-node fragmentation); "
                     f"{moved} got room by moving others where that paid; a fill pass reused the rest")
    rows = improve(inst, lay).rows
    dropped = [inst.jobs[i].key for i in range(len(rows)) if inst.jobs[i].must_run and counts[i] and not rows[i]]
    if dropped:
        notes.append(f"must-run job(s) {', '.join(dropped)} found no room on any node after packing")
    notes.append("two-stage: counts MILP against aggregate capacity, then per-node packing")
    return rows, res, fallback


def _near(inst: Instance, two_rows: list[Row], two_res: highs.MilpResult, t0: float,
          notes: list[str]) -> tuple[highs.MilpResult, list[Row]]:
    """The per-node model near the LP's answer, started at the two-stage answer. Its answer is taken where
    it runs more must-run jobs, or as many and scores higher. The bound is the tighter of the counts
    model's and the full per-node LP's (both relax the problem), the LP's alone once commitments were
    given up (the counts model held them)."""
    policy = inst.policy
    near = neighbourhood.solve_near(inst, two_rows, lambda: _limits(policy, t0), policy.mip_rel_gap,
                                    lambda: _relax_lowest(inst, notes))
    bound = near.bound if near.gave_up else min(two_res.bound, near.bound)
    rows, res = near.rows, near.result
    if rows is not None and not inst.violations(rows):
        start = inst.objective(two_rows)
        better = (_must_runs(inst, rows), inst.objective(rows)) > (
            _must_runs(inst, two_rows), start + _ZERO_GAP * max(1.0, abs(start)))
        if better:
            notes.append("neighbourhood: the per-node model over each job's nodes in the LP optimum, where it runs "
                         "and where packing put it, improved the two-stage answer")
            return dataclasses.replace(res, bound=bound), rows
    notes.append(f"neighbourhood: the per-node model near the LP's answer found nothing better ({res.status})")
    # the two-stage answer stands; a limit the search stopped at still says the answer may differ elsewhere
    return dataclasses.replace(two_res, bound=bound, time_limited=two_res.time_limited or res.time_limited,
                               work_limited=two_res.work_limited or res.work_limited), two_rows


def _broken_commitments(inst: Instance, rows: Sequence[Row]) -> list[str]:
    """The must-run jobs (commitments still held) a placement does not run."""
    return [inst.jobs[i].key for i, r in enumerate(inst.commitment_ranks()) if r > 0 and not rows[i]]


def _must_runs(inst: Instance, rows: Sequence[Row]) -> int:
    """How many must-run jobs a placement runs (a fallback may not beat the MILP by dropping them)."""
    return sum(1 for i, j in enumerate(inst.jobs) if j.must_run and rows[i])


def _limits(policy: Policy, t0: float) -> highs.Limits:
    """HiGHS's limits for the next solve: the policy's work limits, and what is left of its wall-clock cap."""
    left = None
    if policy.time_limit_s is not None:
        left = max(policy.time_limit_s - (time.perf_counter() - t0), 0.05)
    return highs.Limits(time_limit_s=left, max_nodes=policy.max_nodes, max_iterations=policy.max_iterations,
                        threads=policy.threads, seed=policy.random_seed)


def greedy_baseline(problem: AllocationProblem) -> tuple[Sequence[Row], float]:
    """The Optimus-style marginal-gain allocator from an empty cluster, scored with the same objective."""
    inst = Instance(problem)
    lay = greedy(inst, from_current=False)
    return lay.rows, inst.objective(lay.rows)


def _gap(obj: float, bound: float) -> float:
    if not math.isfinite(bound):
        return math.nan
    return max(bound - obj, 0.0) / max(abs(obj), 1e-9)


def _status(highs_status: str) -> str:
    return highs_status.lower().replace(" ", "-")


def _certified(res: highs.MilpResult, final_gap: float, asked_gap: float) -> str:
    """What the answer's status may claim, judged on its FINAL gap (after packing), not on the model's.

    The counts model before packing, or HiGHS's own "Optimal" (within its gap, of its model), certify
    nothing about the placement handed to Slurm; its gap to the proven bound does. A stop at a limit
    says so first (the gap field says how far the answer is).
    """
    if res.time_limited:
        return TIME_LIMIT
    if res.work_limited:
        return WORK_LIMIT     # HiGHS says "Solution limit reached" for its node limit
    if res.status not in ("Optimal", LP_ROUNDED):
        return _status(res.status)
    if not final_gap <= asked_gap + _ZERO_GAP:     # NaN (no proven bound) is not within anything
        return ABOVE_GAP
    return OPTIMAL if final_gap <= _ZERO_GAP else WITHIN_GAP


def _answer(inst: Instance, rows: Sequence[Row], status: str, method: str, objective: float, bound: float,
            gap: float, t0: float, notes: list[str]) -> Allocation:
    names = inst.node_names
    gpus = {}
    placement = {}
    for i, job in enumerate(inst.jobs):
        gpus[job.key] = int(sum(rows[i].values()))
        placement[job.key] = {names[n]: int(g) for n, g in sorted(rows[i].items()) if g > 0}
    return Allocation(
        gpus=gpus,
        placement=placement,
        status=status,
        method=method,
        objective=float(objective),
        mip_gap=float(gap),
        bound=float(bound),
        solve_s=time.perf_counter() - t0,
        decisions=explain.decide(inst, rows),
        unplaceable=inst.unplaceable,
        notes=tuple(notes),
    )


def layout_of(problem: AllocationProblem, allocation: Allocation) -> Layout:
    """The allocation as a Layout over the problem's arrays (for checks and tests)."""
    inst = Instance(problem)
    lay = Layout(inst)
    for i, job in enumerate(inst.jobs):
        lay.put(i, {inst.node_index[n]: g for n, g in allocation.placement.get(job.key, {}).items()})
    return lay
