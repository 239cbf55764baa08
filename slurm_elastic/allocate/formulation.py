"""The L1 allocation MILP in two forms: exact (GPUs per job and node) and counts (GPUs per job against aggregate capacity).

Symbols follow docs/allocator.md. Per job j the count g_j is written over
the arithmetic runs of its allowed counts (run k: start s_k, step d_k,
length L_k): g_j = sum_k s_k b_k + d_k m_k, b_k binary, 0 <= m_k <= (L_k-1) b_k,
sum_k b_k <= 1. That is exact for any allowed set (steps, powers of two, the
counts a shape rule leaves) with a handful of variables per job.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from slurm_elastic.allocate import throughput as tp
from slurm_elastic.allocate.highs import INF, Model
from slurm_elastic.allocate.instance import Instance

Row = dict[int, int]


def runs(counts: Sequence[int]) -> list[tuple[int, int, int]]:
    """Split ascending counts into arithmetic runs (start, step, length)."""
    out: list[tuple[int, int, int]] = []
    i = 0
    counts = list(counts)
    while i < len(counts):
        start = counts[i]
        if i + 1 == len(counts):
            out.append((start, 1, 1))
            break
        step = counts[i + 1] - start
        j = i + 1
        while j + 1 < len(counts) and counts[j + 1] - counts[j] == step:
            j += 1
        out.append((start, step, j - i + 1))
        i = j + 1
    return out


@dataclass
class JobCols:
    """Where job j's variables sit in the model."""

    g: int = -1
    t: int = -1
    b: list[int] = field(default_factory=list)
    m: list[int] = field(default_factory=list)
    runs: list[tuple[int, int, int]] = field(default_factory=list)
    d: int = -1                                   # counts model: |g - g0|
    n: int = -1                                   # counts model: nodes spanned (lower bound)
    x: dict[int, int] = field(default_factory=dict)   # exact model: node -> column
    u: dict[int, int] = field(default_factory=dict)
    e: dict[int, int] = field(default_factory=dict)   # |x - x0| on nodes the job holds now
    G: int = -1                                   # GPUs per node when spanning
    span: int = -1


class Formulation:
    """A built model plus the map from its columns back to jobs."""

    def __init__(self, inst: Instance, exact: bool) -> None:
        self.inst = inst
        self.exact = exact
        self.model = Model()
        self.cols: list[JobCols] = [JobCols() for _ in inst.jobs]
        self._build()

    # -- building ---------------------------------------------------------------------------
    def _build(self) -> None:
        inst, mdl = self.inst, self.model
        beta = inst.policy.beta
        for i, job in enumerate(inst.jobs):
            t = inst.terms[i]
            mdl.offset -= t.demand_cost * job.max_gpus   # -alpha * sum_r rho (gmax - g)/Cap_r, constant part
            if not t.candidates:
                mdl.offset -= beta * t.kappa * sum(inst.current[i].values())
                continue
            c = self.cols[i]
            top = t.candidates[-1]
            c.g = int(mdl.add_cols(1, cost=t.demand_cost, lo=0, hi=top)[0])
            c.runs = runs(t.candidates)
            c.b = list(mdl.add_cols(len(c.runs), lo=0, hi=1, integer=True))
            link = mdl.add_rows(1, 0, 0)[0]              # g - sum_k (s_k b_k + d_k m_k) = 0
            mdl.coef(link, c.g, 1.0)
            for (s, d, length), bk in zip(c.runs, c.b):
                mdl.coef(link, bk, -s)
                if length > 1:
                    mk = int(mdl.add_cols(1, lo=0, hi=length - 1, integer=True)[0])
                    c.m.append(mk)
                    mdl.coef(link, mk, -d)
                    r = mdl.add_rows(1, -INF, 0)[0]      # m_k <= (L_k - 1) b_k
                    mdl.coef(r, [mk, bk], [1.0, -(length - 1)])
                else:
                    c.m.append(-1)
            one = mdl.add_rows(1, -INF, 1)[0]            # at most one run: the job runs at one count or not
            mdl.coef(one, np.array(c.b), 1.0)
            # throughput epigraph: t <= a_k g + c_k for every hull segment (exact at integer g: hull is concave)
            smax = tp.evaluate_curve(t.hull, top)
            c.t = int(mdl.add_cols(1, cost=t.weight / t.norm, lo=0, hi=smax)[0])
            segs = [(a, b0) for (a, b0), (g0, _) in zip(tp.segments(t.hull), t.hull) if g0 < top]
            rows = mdl.add_rows(len(segs), -INF, np.array([b0 for _, b0 in segs]))
            mdl.coef(rows, c.t, 1.0)
            mdl.coef(rows, c.g, -np.array([a for a, _ in segs]))
            if self.exact:
                self._exact_job(i)
            else:
                self._counts_job(i)
        if self.exact:
            self._exact_capacity()
        else:
            self._counts_capacity()

    def _counts_job(self, i: int) -> None:
        inst, mdl, c, t = self.inst, self.model, self.cols[i], self.inst.terms[i]
        g0 = sum(inst.current[i].values())
        if t.kappa > 0:
            # |g - g0| <= the per-node L1 of the exact model, so this model's optimum bounds the exact one
            c.d = int(mdl.add_cols(1, cost=-inst.policy.beta * t.kappa, lo=0)[0])
            r = mdl.add_rows(2, np.array([-g0, g0]), INF)
            mdl.coef(r, c.d, 1.0)
            mdl.coef(r, c.g, np.array([-1.0, 1.0]))
        # nodes spanned >= 1 when running and >= g / (largest node): a lower bound of the true count
        c.n = int(mdl.add_cols(1, cost=-inst.policy.gamma, lo=0)[0])
        r = mdl.add_rows(1, 0, INF)[0]
        mdl.coef(r, [c.n] + c.b, [1.0] + [-1.0] * len(c.b))
        r = mdl.add_rows(1, 0, INF)[0]
        mdl.coef(r, [c.n, c.g], [1.0, -1.0 / max(inst.max_node_gpus, 1)])

    def _counts_capacity(self) -> None:
        inst, mdl = self.inst, self.model
        live = [i for i, c in enumerate(self.cols) if c.g >= 0]
        if not live:
            return
        gcols = np.array([self.cols[i].g for i in live])
        rows = mdl.add_rows(3, -INF, inst.total)
        for r in range(3):
            mdl.coef(rows[r], gcols, inst.rho[live, r])

    def _exact_job(self, i: int) -> None:
        inst, mdl, c, t = self.inst, self.model, self.cols[i], self.inst.terms[i]
        beta, gamma = inst.policy.beta, inst.policy.gamma
        rho, cap = inst.rho[i], inst.cap
        with np.errstate(divide="ignore", invalid="ignore"):
            per = np.where(rho > 0, np.floor(cap / np.where(rho > 0, rho, 1) + 1e-9), np.inf)
        ub = np.minimum(per.min(axis=1), t.candidates[-1])
        nodes = [int(n) for n in np.nonzero(ub >= 1)[0]]
        cur = inst.current[i]
        for n, g0 in cur.items():
            if n not in nodes:
                mdl.offset -= beta * t.kappa * g0           # GPUs on a node that gives nothing now are lost
        k = len(nodes)
        ubs = ub[nodes]
        # restart cost on the allocation matrix: |x - x0| is x itself on nodes the job does not hold now
        xcost = np.array([-beta * t.kappa if cur.get(n, 0) == 0 else 0.0 for n in nodes]) if t.kappa > 0 \
            else np.zeros(k)
        xs = mdl.add_cols(k, cost=xcost, lo=0, hi=ubs, integer=True)
        us = mdl.add_cols(k, cost=-gamma, lo=0, hi=1, integer=True)
        c.x = dict(zip(nodes, (int(v) for v in xs)))
        c.u = dict(zip(nodes, (int(v) for v in us)))
        link = mdl.add_rows(1, 0, 0)[0]
        mdl.coef(link, np.append(xs, c.g), np.append(np.ones(k), -1.0))
        r = mdl.add_rows(k, -INF, 0)                          # x <= ub u
        mdl.coef(r, xs, 1.0)
        mdl.coef(r, us, -ubs)
        if t.kappa > 0:
            for pos, n in enumerate(nodes):
                g0 = cur.get(n, 0)
                if g0 > 0:
                    e = int(mdl.add_cols(1, cost=-beta * t.kappa, lo=0)[0])
                    c.e[n] = e
                    rr = mdl.add_rows(2, np.array([-g0, g0]), INF)   # e >= x - x0, e >= x0 - x
                    mdl.coef(rr, e, 1.0)
                    mdl.coef(rr, int(xs[pos]), np.array([-1.0, 1.0]))
        if not t.spans or k <= 1:
            r = mdl.add_rows(1, -INF, 1)[0]                   # one node
            mdl.coef(r, us, 1.0)
            return
        pmax = float(max(inst.max_node_gpus, 1))
        c.G = int(mdl.add_cols(1, lo=0, hi=pmax, integer=True)[0])
        r = mdl.add_rows(k, -INF, 0)                          # x <= G
        mdl.coef(r, xs, 1.0)
        mdl.coef(r, c.G, -1.0)
        r = mdl.add_rows(k, -pmax, INF)                       # x >= G - pmax (1 - u): equal GPUs on used nodes
        mdl.coef(r, xs, 1.0)
        mdl.coef(r, c.G, -1.0)
        mdl.coef(r, us, -pmax)
        if inst.whole:
            c.span = int(mdl.add_cols(1, lo=0, hi=1, integer=True)[0])
            r = mdl.add_rows(1, -INF, 1)[0]                   # sum u <= 1 + (k-1) span
            mdl.coef(r, np.append(us, c.span), np.append(np.ones(k), -(k - 1)))
            capg = cap[nodes, 0]
            r = mdl.add_rows(k, -capg, INF)                   # x >= C_n,gpu (u + span - 1): whole nodes
            mdl.coef(r, xs, 1.0)
            mdl.coef(r, us, -capg)
            mdl.coef(r, c.span, -capg)

    def _exact_capacity(self) -> None:
        inst, mdl = self.inst, self.model
        ii, nn, cc = [], [], []
        for i, c in enumerate(self.cols):
            for n, col in c.x.items():
                ii.append(i)
                nn.append(n)
                cc.append(col)
        if not cc:
            return
        ii, nn, cc = np.array(ii), np.array(nn), np.array(cc)
        base = mdl.add_rows(3 * len(inst.nodes), -INF, inst.cap.reshape(-1))
        for r in range(3):
            vals = inst.rho[ii, r]
            keep = vals != 0
            mdl.coef(base[nn[keep] * 3 + r], cc[keep], vals[keep])

    # -- reading back -------------------------------------------------------------------------
    def counts(self, x: np.ndarray) -> list[int]:
        return [int(round(x[c.g])) if c.g >= 0 else 0 for c in self.cols]

    def rows_of(self, x: np.ndarray) -> list[Row]:
        out = []
        for c in self.cols:
            out.append({n: int(round(x[col])) for n, col in c.x.items() if round(x[col]) > 0})
        return out

    # -- warm starts ------------------------------------------------------------------------
    def point(self, rows: Sequence[Row]) -> np.ndarray:
        """The full column vector of a placement (counts model: its counts), for setSolution."""
        inst = self.inst
        x = np.zeros(self.model.ncol)
        for i, c in enumerate(self.cols):
            if c.g < 0:
                continue
            row = rows[i]
            g = sum(row.values())
            x[c.g] = g
            if g > 0:
                for (s, d, length), bk, mk in zip(c.runs, c.b, c.m):
                    if s <= g <= s + d * (length - 1) and (g - s) % d == 0:
                        x[bk] = 1
                        if mk >= 0:
                            x[mk] = (g - s) // d
                        break
            x[c.t] = tp.evaluate_curve(inst.terms[i].hull, g)
            g0 = sum(inst.current[i].values())
            if c.d >= 0:
                x[c.d] = abs(g - g0)
            if c.n >= 0:
                x[c.n] = max(1.0 if g > 0 else 0.0, g / max(inst.max_node_gpus, 1))
            for n, col in c.x.items():
                x[col] = row.get(n, 0)
                x[c.u[n]] = 1.0 if row.get(n, 0) > 0 else 0.0
            for n, col in c.e.items():
                x[col] = abs(row.get(n, 0) - inst.current[i].get(n, 0))
            used = [v for v in row.values() if v > 0]
            if c.G >= 0:
                x[c.G] = used[0] if used else 0
            if c.span >= 0:
                x[c.span] = 1.0 if len(used) >= 2 else 0.0
        return x
