"""A MILP as numpy arrays, handed to HiGHS in one passModel call, and what HiGHS says back."""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import highspy
import numpy as np
import scipy.sparse as sp

log = logging.getLogger(__name__)

INF = math.inf


class Model:
    """Columns and rows collected as flat lists (maximisation); `matrix()` is CSC.

    Lists, not many small numpy arrays: a model is built from a few entries
    per job, and list appends are what is cheap at that size.
    """

    def __init__(self) -> None:
        self.cost: list[float] = []
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.integer: list[bool] = []
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.row_lo: list[float] = []
        self.row_hi: list[float] = []
        self.offset = 0.0

    @property
    def ncol(self) -> int:
        return len(self.cost)

    @property
    def nrow(self) -> int:
        return len(self.row_lo)

    def add_col(self, cost: float = 0.0, lo: float = 0.0, hi: float = INF, integer: bool = False) -> int:
        self.cost.append(float(cost))
        self.lower.append(float(lo))
        self.upper.append(float(hi))
        self.integer.append(integer)
        return len(self.cost) - 1

    def add_cols(self, n: int, cost: float | Sequence[float] = 0.0, lo: float | Sequence[float] = 0.0,
                 hi: float | Sequence[float] = INF, integer: bool = False) -> list[int]:
        """n new columns; returns their indices."""
        start = len(self.cost)
        self.cost.extend(_spread(cost, n))
        self.lower.extend(_spread(lo, n))
        self.upper.extend(_spread(hi, n))
        self.integer.extend([integer] * n)
        return list(range(start, start + n))

    def add_row(self, cols: Sequence[int], vals: Sequence[float], lo: float = -INF, hi: float = INF) -> int:
        r = len(self.row_lo)
        self.row_lo.append(float(lo))
        self.row_hi.append(float(hi))
        self.rows.extend([r] * len(cols))
        self.cols.extend(cols)
        self.vals.extend(vals)
        return r

    def add_entries(self, rows: np.ndarray, cols: np.ndarray, vals: np.ndarray) -> None:
        """Bulk entries (vectorised builders)."""
        self.rows.extend(np.asarray(rows, dtype=np.int64).tolist())
        self.cols.extend(np.asarray(cols, dtype=np.int64).tolist())
        self.vals.extend(np.asarray(vals, dtype=float).tolist())

    def add_rows(self, n: int, lo: float | Sequence[float], hi: float | Sequence[float]) -> list[int]:
        start = len(self.row_lo)
        self.row_lo.extend(_spread(lo, n))
        self.row_hi.extend(_spread(hi, n))
        return list(range(start, start + n))

    def matrix(self) -> sp.csc_matrix:
        return sp.csc_matrix((np.asarray(self.vals, float), (np.asarray(self.rows), np.asarray(self.cols))),
                             shape=(self.nrow, self.ncol))

    def objective_of(self, x: np.ndarray) -> float:
        return float(np.asarray(self.cost) @ x + self.offset)


def _spread(v: float | Sequence[float], n: int) -> list[float]:
    if isinstance(v, (int, float)):
        return [float(v)] * n
    out = [float(a) for a in v]
    if len(out) != n:
        raise ValueError(f"{len(out)} values for {n} entries")
    return out


_banner_lock = threading.Lock()
_banner_done = False


def _new_highs() -> highspy.Highs:
    """A Highs instance, without the banner HiGHS writes to fd 1 from C++ on the first one in a process.

    No option can stop that banner, and stdout belongs to the CLI (`--json`,
    `sbatch --parsable`), so fd 1 points at /dev/null while the first
    instance is made.
    """
    global _banner_done
    with _banner_lock:
        if _banner_done:
            return highspy.Highs()
        sys.stdout.flush()
        saved = os.dup(1)
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, 1)
            h = highspy.Highs()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
            os.close(devnull)
        _banner_done = True
        return h


@dataclass(frozen=True, slots=True)
class MilpResult:
    x: np.ndarray | None           # None when HiGHS has no feasible point
    status: str                    # HiGHS's model status, e.g. "Optimal", "Solution limit reached"
    objective: float
    bound: float                   # dual bound (LP bound of the MIP)
    mip_gap: float
    solve_s: float
    optimal: bool
    time_limited: bool             # stopped by the wall-clock cap (not repeatable)
    work_limited: bool = False     # stopped by a node or iteration limit (repeatable)


# HiGHS's model statuses for its deterministic limits: mip_max_nodes / mip_max_leaves /
# mip_max_improving_sols end in "Solution limit reached", simplex_iteration_limit in "Iteration limit reached".
WORK_LIMIT_STATUSES = frozenset({"Solution limit reached", "Iteration limit reached"})


@dataclass(frozen=True, slots=True)
class Limits:
    """Where HiGHS stops: work (repeatable: the same answer on any machine, at any load) and a wall-clock cap.

    `max_nodes` bounds branch-and-bound nodes, `max_iterations` simplex
    iterations; with one thread and a fixed seed HiGHS then follows the same
    path on every run. `time_limit_s` (None: none) is a safety cap for a live
    controller; a solve it stops depends on the machine's load.
    """

    time_limit_s: float | None = None
    max_nodes: int | None = None
    max_iterations: int | None = None
    threads: int | None = None
    seed: int = 0


_scheduler_threads: int | None = None


def _use_threads(h: highspy.Highs, threads: int) -> None:
    """Set HiGHS's thread count, resetting its process-wide scheduler when it was started with another.

    HiGHS starts one task scheduler per process on the first MIP run; a later run asking for a
    different count fails at once with model status "Not Set" (seen in the simulator: every MIP
    with threads=1 after a first run with the default fell back to greedy).
    """
    global _scheduler_threads
    with _banner_lock:
        if _scheduler_threads != threads:
            h.resetThreadScheduler(True)   # blocking: wait for the old workers
            _scheduler_threads = threads
    h.setOptionValue("threads", threads)


def solve(model: Model, *, limits: Limits, mip_rel_gap: float, warm: np.ndarray | None = None,
          relax: bool = False) -> MilpResult:
    """Pass the model in one call, warm-start it if a point is given, and solve (`relax`: its LP relaxation)."""
    h = _new_highs()
    h.setOptionValue("output_flag", False)
    if limits.time_limit_s is not None:
        h.setOptionValue("time_limit", float(max(limits.time_limit_s, 0.01)))
    if limits.max_nodes is not None:
        h.setOptionValue("mip_max_nodes", int(limits.max_nodes))
    if limits.max_iterations is not None:
        h.setOptionValue("simplex_iteration_limit", int(limits.max_iterations))
    h.setOptionValue("random_seed", int(limits.seed))
    h.setOptionValue("mip_rel_gap", float(mip_rel_gap))
    # HiGHS 1.16's root reduced-cost heuristic, after a feasible warm start and presolve, corrupts the heap
    # on some of our models (the process aborts in free(); tests/allocate/data/highs_warm_start_abort.npz):
    # a controller must not die in its solver, so it is off.
    h.setOptionValue("mip_heuristic_run_root_reduced_cost", False)
    if limits.threads:
        _use_threads(h, int(limits.threads))
    lp = highspy.HighsLp()
    lp.num_col_ = model.ncol
    lp.num_row_ = model.nrow
    lp.col_cost_ = np.asarray(model.cost, float)
    lp.col_lower_ = np.asarray(model.lower, float)
    lp.col_upper_ = np.asarray(model.upper, float)
    lp.row_lower_ = np.asarray(model.row_lo, float)
    lp.row_upper_ = np.asarray(model.row_hi, float)
    lp.offset_ = model.offset
    lp.sense_ = highspy.ObjSense.kMaximize
    a = model.matrix()
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.num_col_ = model.ncol
    lp.a_matrix_.num_row_ = model.nrow
    lp.a_matrix_.start_ = a.indptr.astype(np.int32)
    lp.a_matrix_.index_ = a.indices.astype(np.int32)
    lp.a_matrix_.value_ = a.data.astype(float)
    integ = np.asarray(model.integer, bool)
    if relax:
        integ = np.zeros_like(integ)
    lp.integrality_ = [highspy.HighsVarType.kInteger if f else highspy.HighsVarType.kContinuous for f in integ]
    t0 = time.perf_counter()
    h.passModel(lp)
    if warm is not None:
        idx = np.arange(model.ncol, dtype=np.int32)
        h.setSolution(model.ncol, idx, np.asarray(warm, float))
    h.run()
    solve_s = time.perf_counter() - t0
    status = h.modelStatusToString(h.getModelStatus())
    info = h.getInfo()
    has_point = info.primal_solution_status == 2  # kSolutionStatusFeasible
    x = np.asarray(h.getSolution().col_value, float) if has_point else None
    objective = float(info.objective_function_value) if has_point else -INF
    # an LP stopped by a limit has a point but proves nothing: only an optimal LP's value is a bound
    bound = float(info.mip_dual_bound) if integ.any() else objective if status == "Optimal" else INF
    gap = float(info.mip_gap) if integ.any() else 0.0
    log.debug("HiGHS %s in %.3fs: obj %.6g bound %.6g gap %.3g (%d cols, %d rows)",
              status, solve_s, objective, bound, gap, model.ncol, model.nrow)
    return MilpResult(x, status, objective, bound, gap, solve_s, status == "Optimal",
                      status == "Time limit reached", status in WORK_LIMIT_STATUSES)
