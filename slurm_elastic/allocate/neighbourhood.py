"""The exact per-node model over each job's likely nodes: a relaxation-enforced neighbourhood search.

Where packing fragments (memory that binds, small clusters) the two-stage answer loses what only
per-node moves find: one job moved to another node's free memory so that a third fits. The full exact
model finds those moves but spends 0.3-3.3 s in its root node's cuts at 960 memory-bound job-node pairs
(docs/allocator.md). Its LP relaxation, though, is cheap and says where each job is worth placing: the
MIP is solved again on each job's nodes in that LP optimum's support, where it runs now and where
packing put it (RENS, Berthold 2014), a model of tens to a few hundred pairs. Where even the full LP
has no point, the must-run jobs cannot all run: commitments are given up as the full model gives them
up (lowest rank first) and it is solved again. A restricted model with no point (its must-run jobs do
not fit their neighbourhoods) gives no answer: the start stands. Giving must-run jobs every node
instead was measured: the larger model's answers left one job at 4 GPUs on an emptied cluster for
100,000 s in the simulator (docs/allocator.md).

The answer is a feasible placement of the full problem; the restricted model's own dual bound says
nothing about the full one (unless the neighbourhood is every pair), so the bound handed back is the
full LP's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from slurm_elastic.allocate import highs
from slurm_elastic.allocate.formulation import Formulation, Row
from slurm_elastic.allocate.instance import Instance

_SUPPORT = 1e-6        # an LP value above this puts the node in the job's neighbourhood


@dataclass(frozen=True, slots=True)
class Near:
    rows: list[Row] | None         # None: no placement found (the LP or the MIP had no point)
    result: highs.MilpResult       # the restricted MIP's (or the LP's, when it had no point)
    bound: float                   # the full per-node LP's bound (inf: none proven)
    gave_up: bool                  # commitments were given up on the way: bounds from before do not hold


def nodes_near(inst: Instance, lp: Formulation, x: np.ndarray, start: Sequence[Row]) -> list[set[int]]:
    """Per job: the nodes the full model's LP optimum `x` gives it GPUs on, where it runs, and where `start`
    puts it."""
    near = []
    for i, c in enumerate(lp.cols):
        nodes = {n for n, col in c.x.items() if x[col] > _SUPPORT}
        near.append(nodes | set(inst.current[i]) | set(start[i]))
    return near


def solve_near(inst: Instance, start: Sequence[Row], limits: Callable[[], highs.Limits], mip_rel_gap: float,
               give_up: Callable[[], bool]) -> Near:
    """The restricted MIP warm-started at `start` (a valid placement, the two-stage answer: the restricted
    model contains it wherever it runs every must-run job). `limits()` gives what is left of the solve's
    limits; `give_up()` gives up the lowest-ranked commitments still held (False: none left)."""
    gave_up = False
    while True:
        full = Formulation(inst, exact=True)
        lp = highs.solve(full.model, limits=limits(), mip_rel_gap=mip_rel_gap, relax=True)
        if lp.x is None:
            if lp.status == "Infeasible" and give_up():
                gave_up = True
                continue
            return Near(None, lp, math.inf, gave_up)
        form = Formulation(inst, exact=True, allowed=nodes_near(inst, full, lp.x, start))
        res = highs.solve(form.model, limits=limits(), mip_rel_gap=mip_rel_gap, warm=form.point(start))
        rows = form.rows_of(res.x) if res.x is not None else None
        whole = sum(len(c.x) for c in form.cols) == sum(len(c.x) for c in full.cols)
        # where the neighbourhood is every pair, the restricted model is the full one and its bound holds
        return Near(rows, res, min(lp.bound, res.bound) if whole else lp.bound, gave_up)
