"""The progress objective's request terms: heSRPT rank weights, the restart's stay fraction and the
finish-time-fairness floor of every elastic job, built from what the request rules measured.

Units (docs/allocator.md, "The progress objective"): a job's speedup S_j(g) is its rate at g GPUs over
its rate at one (capped at g, non-decreasing); its remaining work X_j is in 1-GPU-seconds (remaining
steps / steps per second at one GPU, so only the job's own measured ratios enter); its value
V_j(g) = w_j omega_j S_j(g) is weighted 1-GPU-seconds of progress per second. The rules of the legacy
chain this replaces: remaining-work (clamped 3600/remaining weights) -> rank weights;
restart-charge (beta kappa per GPU moved) -> stay fraction pi_j; share-floor, starvation and
floor-holds (must-run rows, dropped when infeasible) -> one penalised floor per job.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from slurm_elastic.cluster.model import JobState
from slurm_elastic.control.requests.rules import (AskedSize, BatchGeometry, GoodputNote, JobContext, MeasureFirst,
                                                  RestartCost, Rule, SpeedFrontier, SpeedModel)

# The legacy rules kept on this path: they say what the job can run at and what it measured; what the
# objective does with that is below. (The weight, restart charge and floor rules are not among them.)
PROGRESS_RULES: tuple[Rule, ...] = (SpeedModel(), BatchGeometry(), AskedSize(), SpeedFrontier(), MeasureFirst(),
                                    GoodputNote(), RestartCost())

DEFAULT_ELASTICITY = 0.5          # p while fewer than two jobs have a fair share above one GPU
ELASTICITY_RANGE = (0.2, 0.9)     # p is clipped here: p -> 1 makes the rank weights flat, p -> 0 all-or-nothing
LAS_MIN_WORK_S = 60.0             # a job of unknown size ranks as if this much were left, at the least


@dataclass(frozen=True, slots=True)
class ProgressTerms:
    """One job's measured side of the progress objective (before the cross-job rank weights)."""

    speedup: tuple[tuple[int, float], ...]    # (g, S_j(g)) at the counts it may take
    work_s: float                             # X_j, remaining 1-GPU-seconds (trusted) or LAS's stand-in
    trusted: bool                             # X_j is from its declared total and measured speed
    left_s: float | None                      # remaining seconds at its current size (trusted X only)
    why: str                                  # where X_j came from

    def at(self, g: int) -> float:
        best = 0.0
        for count, s in self.speedup:
            if count <= g:
                best = max(best, s)
        return best


def speedup_curve(model: Callable[..., float], counts: Sequence[int],
                  nodes_for: Callable[[int], int]) -> tuple[tuple[int, float], ...]:
    """(g, S(g)) with S(g) = model(g) / model(1): never above g (no super-linear credit) and non-decreasing
    (a job can leave GPUs idle). () when the model gives nothing at one GPU."""
    one = float(model(1, 1))
    if not one > 0 or not math.isfinite(one):
        return ()
    out: list[tuple[int, float]] = []
    best = 0.0
    for g in sorted(set(counts)):
        s = float(model(g, nodes_for(g)))
        s = min(s / one, float(g)) if math.isfinite(s) and s > 0 else 0.0
        best = max(best, s)
        out.append((g, best))
    return tuple(out)


def progress_terms(ctx: JobContext, attained_s: float) -> ProgressTerms:
    """S_j over the counts the rules allow and X_j: its remaining work's seconds at one GPU
    (`JobContext.seconds_left`) when the job declared its total and measured its speed, else LAS (attained
    1-GPU-seconds, at least a minute)."""
    assert ctx.model is not None and ctx.steps_model is not None
    counts = [g for g in (ctx.allowed if ctx.allowed is not None else ctx.counts) if ctx.placeable(g)]
    curve = speedup_curve(ctx.model, counts, ctx.nodes_for)
    m = ctx.measured.metrics
    las = max(attained_s, LAS_MIN_WORK_S)
    if not ctx.measured_speed:
        return ProgressTerms(curve, las, False, None, f"LAS {las:.0f}s (speed not measured)")
    if m.total_steps is None or m.step is None:
        return ProgressTerms(curve, las, False, None, f"LAS {las:.0f}s (no total_steps)")
    work = ctx.seconds_left(1)
    if work is None:
        return ProgressTerms(curve, las, False, None, f"LAS {las:.0f}s (no speed at one GPU)")
    left_steps = max(m.total_steps - m.step, 0)
    left_s = ctx.seconds_left(ctx.job.gpus) if ctx.job.state is JobState.RUNNING else None
    return ProgressTerms(curve, work, True, left_s, f"X {work:.0f} 1-GPU-s ({left_steps} of {m.total_steps} steps)")


def hesrpt_weights(work: Mapping[str, float], p: float) -> dict[str, float]:
    """heSRPT's rank weights: jobs ranked r = 1 (most work left) .. m (least), omega_r = (r^c - (r-1)^c)^(1-p)
    with c = 1 / (1 - p). Maximising sum_r omega_r theta_r^p over shares theta gives theta_r proportional to
    omega_r^c = r^c - (r-1)^c: heSRPT's optimal shares for minimum mean completion time under speedup g^p
    (Berg, Vesilo, Harchol-Balter, SIGMETRICS 2020). Ties in work are ranked by key (deterministic)."""
    if not 0 < p < 1:
        raise ValueError(f"heSRPT needs a speedup exponent in (0, 1), got {p!r}")
    c = 1.0 / (1.0 - p)
    order = sorted(work, key=lambda k: (-work[k], k))
    return {k: (r ** c - (r - 1) ** c) ** (1.0 - p) for r, k in enumerate(order, start=1)}


def elasticity(curves: Sequence[tuple[ProgressTerms, int]]) -> float:
    """p: the median over jobs of ln S_j(f_j) / ln f_j at their fair share f_j > 1, clipped and rounded to 0.1
    (a steady p keeps the problem unchanged between cycles); DEFAULT_ELASTICITY with fewer than two."""
    ps = [math.log(max(t.at(f), 1e-9)) / math.log(f) for t, f in curves if f > 1 and t.at(f) > 0]
    if len(ps) < 2:
        return DEFAULT_ELASTICITY
    lo, hi = ELASTICITY_RANGE
    return round(min(hi, max(lo, statistics.median(ps))), 1)


def stay_fraction(restart_s: float, hold_s: float, left_s: float | None) -> float:
    """pi = restart / horizon: the share of a new size's progress one restart loses over the horizon it is
    held (the hysteresis, or what is left of the job when that is shorter: a job about to end is not resized)."""
    horizon = hold_s if left_s is None else min(hold_s, left_s)
    if horizon <= 0:
        return 1.0
    return min(1.0, max(restart_s, 0.0) / horizon)


def ftf_floor(terms: ProgressTerms, *, age_s: float, attained_s: float, fair: int, counts: Sequence[int],
              hold_s: float, target: float, ever_ran: bool) -> tuple[int, float, str]:
    """(phi, rho_FTF, why): the GPUs job j must hold so that it finishes within `target` x its time on a fair
    share (Themis's finish-time fairness: T_fair = (attained + remaining) / S(f)), and how overdue it is.

    At risk when, left at zero one more hold and then run at its fair share, it would finish later than
    target x T_fair (T_fair at least one hold); its floor is then the smallest count fast enough to finish
    by that time, capped at the fair share. A job never run has no size to judge: once it has waited a hold its floor is its smallest
    count, overdue by age / hold."""
    fits = [g for g in counts if g <= fair]
    if not fits:
        return 0, 0.0, ""
    if not ever_ran and not terms.trusted:
        if age_s < hold_s:
            return 0, 0.0, ""
        return fits[0], age_s / hold_s, f"floor {fits[0]} (waited {age_s:.0f}s, never ran)"
    s_fair = terms.at(fits[-1])
    if s_fair <= 0:
        return 0, 0.0, ""
    # no job is judged on a time scale shorter than the hold: a job a minute from its end would otherwise be
    # "overdue" by the hold alone, and outrank every starving one
    fair_s = max((attained_s + terms.work_s) / s_fair, hold_s)
    finish = age_s + hold_s + terms.work_s / s_fair
    if finish <= target * fair_s:
        return 0, 0.0, ""
    need = terms.work_s / max(target * fair_s - age_s, hold_s)
    phi = next((g for g in fits if terms.at(g) >= need), fits[-1])
    ratio = finish / fair_s
    return phi, ratio, f"floor {phi} (finish {ratio:.2f}x its fair-share time > {target:g}x)"
