"""A MILP as numpy arrays, handed to HiGHS in one passModel call, and what HiGHS says back."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import highspy
import numpy as np
import scipy.sparse as sp

log = logging.getLogger(__name__)

INF = math.inf


class Model:
    """Columns and rows collected as arrays (maximisation); `matrix()` is CSC."""

    def __init__(self) -> None:
        self.cost: list[np.ndarray] = []
        self.lower: list[np.ndarray] = []
        self.upper: list[np.ndarray] = []
        self.integer: list[np.ndarray] = []
        self.ncol = 0
        self.rows: list[np.ndarray] = []
        self.cols: list[np.ndarray] = []
        self.vals: list[np.ndarray] = []
        self.row_lo: list[np.ndarray] = []
        self.row_hi: list[np.ndarray] = []
        self.nrow = 0
        self.offset = 0.0

    def add_cols(self, n: int, cost: float | np.ndarray = 0.0, lo: float | np.ndarray = 0.0,
                 hi: float | np.ndarray = INF, integer: bool = False) -> np.ndarray:
        """n new columns; returns their indices."""
        idx = np.arange(self.ncol, self.ncol + n)
        self.cost.append(np.broadcast_to(np.asarray(cost, float), (n,)).copy())
        self.lower.append(np.broadcast_to(np.asarray(lo, float), (n,)).copy())
        self.upper.append(np.broadcast_to(np.asarray(hi, float), (n,)).copy())
        self.integer.append(np.full(n, integer))
        self.ncol += n
        return idx

    def add_rows(self, n: int, lo: float | np.ndarray, hi: float | np.ndarray) -> np.ndarray:
        idx = np.arange(self.nrow, self.nrow + n)
        self.row_lo.append(np.broadcast_to(np.asarray(lo, float), (n,)).copy())
        self.row_hi.append(np.broadcast_to(np.asarray(hi, float), (n,)).copy())
        self.nrow += n
        return idx

    def coef(self, rows: np.ndarray | int, cols: np.ndarray | int, vals: np.ndarray | float) -> None:
        rows, cols = np.atleast_1d(rows), np.atleast_1d(cols)
        vals = np.broadcast_to(np.asarray(vals, float), np.broadcast_shapes(rows.shape, cols.shape))
        rows, cols = np.broadcast_arrays(rows, cols)
        self.rows.append(rows.ravel())
        self.cols.append(cols.ravel())
        self.vals.append(np.asarray(vals).ravel())

    def matrix(self) -> sp.csc_matrix:
        if not self.rows:
            return sp.csc_matrix((self.nrow, self.ncol))
        r, c, v = (np.concatenate(a) for a in (self.rows, self.cols, self.vals))
        return sp.csc_matrix((v, (r, c)), shape=(self.nrow, self.ncol))


@dataclass(frozen=True, slots=True)
class MilpResult:
    x: np.ndarray | None           # None when HiGHS has no feasible point
    status: str                    # HiGHS's model status, e.g. "Optimal", "Time limit reached"
    objective: float
    bound: float                   # dual bound (LP bound of the MIP)
    mip_gap: float
    solve_s: float
    optimal: bool
    time_limited: bool


def solve(model: Model, *, time_limit_s: float, mip_rel_gap: float, threads: int | None = None,
          warm: np.ndarray | None = None) -> MilpResult:
    """Pass the model in one call, warm-start it if a point is given, and solve."""
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(max(time_limit_s, 0.01)))
    h.setOptionValue("mip_rel_gap", float(mip_rel_gap))
    if threads:
        h.setOptionValue("threads", int(threads))
    lp = highspy.HighsLp()
    lp.num_col_ = model.ncol
    lp.num_row_ = model.nrow
    cat = (lambda parts: np.concatenate(parts) if parts else np.zeros(0))
    lp.col_cost_ = cat(model.cost)
    lp.col_lower_ = cat(model.lower)
    lp.col_upper_ = cat(model.upper)
    lp.row_lower_ = cat(model.row_lo)
    lp.row_upper_ = cat(model.row_hi)
    lp.offset_ = model.offset
    lp.sense_ = highspy.ObjSense.kMaximize
    a = model.matrix()
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.num_col_ = model.ncol
    lp.a_matrix_.num_row_ = model.nrow
    lp.a_matrix_.start_ = a.indptr.astype(np.int32)
    lp.a_matrix_.index_ = a.indices.astype(np.int32)
    lp.a_matrix_.value_ = a.data.astype(float)
    integ = cat(model.integer).astype(bool)
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
    bound = float(info.mip_dual_bound) if integ.any() else objective
    gap = float(info.mip_gap) if integ.any() else 0.0
    log.debug("HiGHS %s in %.3fs: obj %.6g bound %.6g gap %.3g (%d cols, %d rows)",
              status, solve_s, objective, bound, gap, model.ncol, model.nrow)
    return MilpResult(x, status, objective, bound, gap, solve_s, status == "Optimal",
                      status == "Time limit reached")
