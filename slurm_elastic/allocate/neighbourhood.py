"""The exact per-node model over each job's likely nodes: a relaxation-enforced neighbourhood search.

Where packing fragments (memory that binds, small clusters) the two-stage answer loses what only
per-node moves find: one job moved to another node's free memory so that a third fits. The full exact
model finds those moves but spends 0.3-3.3 s in its root node's cuts at 960 memory-bound job-node pairs
(docs/allocator.md). Its LP relaxation, though, is cheap and says where each job is worth placing: the
MIP is solved again on each job's nodes in that LP optimum's support, where it runs now and where
packing put it (RENS, Berthold 2014), a model of tens to a few hundred pairs.

The answer is a feasible placement of the full problem; the restricted model's own dual bound says
nothing about the full one (unless the neighbourhood is every pair), so the bound handed back is the
full LP's.
"""

from __future__ import annotations

import math
from typing import Sequence

from slurm_elastic.allocate import highs
from slurm_elastic.allocate.formulation import Formulation, Row
from slurm_elastic.allocate.instance import Instance

_SUPPORT = 1e-6        # an LP value above this puts the node in the job's neighbourhood


def nodes_near(inst: Instance, lp: Formulation, x, start: Sequence[Row]) -> list[set[int]]:
    """Per job: the nodes the full model's LP optimum `x` gives it GPUs on, where it runs, and where `start` puts it."""
    near = []
    for i, c in enumerate(lp.cols):
        nodes = {n for n, col in c.x.items() if x[col] > _SUPPORT}
        nodes |= set(inst.current[i]) | set(start[i])
        near.append(nodes)
    return near


def solve_near(inst: Instance, start: Sequence[Row], limits: highs.Limits,
               mip_rel_gap: float) -> tuple[list[Row] | None, highs.MilpResult, float]:
    """(placement or None, the restricted MIP's result, the full model's LP bound: inf when not proven).

    `start` is a valid placement (the two-stage answer): the restricted model's warm start, which it
    contains, so the MIP's answer is never worse than it.
    """
    full = Formulation(inst, exact=True)
    lp = highs.solve(full.model, limits=limits, mip_rel_gap=mip_rel_gap, relax=True)
    if lp.x is None:
        return None, lp, math.inf
    form = Formulation(inst, exact=True, allowed=nodes_near(inst, full, lp.x, start))
    res = highs.solve(form.model, limits=limits, mip_rel_gap=mip_rel_gap, warm=form.point(start))
    rows = form.rows_of(res.x) if res.x is not None else None
    whole = sum(len(c.x) for c in form.cols) == sum(len(c.x) for c in full.cols)
    # where the neighbourhood is every pair, the restricted model is the full one and its bound holds
    return rows, res, min(lp.bound, res.bound) if whole else lp.bound
