"""The L1 allocation MILP in two forms: exact (GPUs per job and node) and counts (GPUs per job against aggregate capacity).

Symbols follow docs/allocator.md. Per job j the count g_j is written over
the arithmetic runs of its allowed counts (run k: start s_k, step d_k,
length L_k): g_j = sum_k s_k b_k + d_k m_k, b_k binary, 0 <= m_k <= (L_k-1) b_k,
sum_k b_k <= 1. That is exact for any allowed set (steps, powers of two, the
counts a shape rule leaves) with a handful of variables per job.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AbstractSet, Sequence

import numpy as np

from slurm_elastic.allocate import throughput as tp
from slurm_elastic.allocate.highs import Model
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
    d: int = -1                                   # counts model: |g - g0_alive|
    g0_alive: int = 0
    n: int = -1                                   # counts model: nodes spanned (lower bound)
    x: dict[int, int] = field(default_factory=dict)   # exact model: node -> column
    u: dict[int, int] = field(default_factory=dict)
    e: dict[int, int] = field(default_factory=dict)   # |x - x0| on nodes the job holds now
    G: int = -1                                   # GPUs per node when spanning
    span: int = -1
    k: int = -1                                   # 1 = stays exactly as it is
    kin: int = -1                                 # 1 = shrinks keeping its processes (Instance.in_place)
    kin_nodes: int = -1                           # counts model: the nodes it keeps when kin (g = per node x it)
    sigma: int = -1                               # progress objective: GPUs short of its fairness floor


class Formulation:
    """A built model plus the map from its columns back to jobs."""

    def __init__(self, inst: Instance, exact: bool, must_run: bool = True,
                 allowed: Sequence[AbstractSet[int]] | None = None) -> None:
        """`allowed` (exact model only): per job, the nodes it may use; None: every node that can host it."""
        self.inst = inst
        self.exact = exact
        self.must_run = must_run
        self.allowed = allowed
        self.model = Model()
        self.cols: list[JobCols] = [JobCols() for _ in inst.jobs]
        self._build()

    # -- building ---------------------------------------------------------------------------
    def _build(self) -> None:
        inst, mdl = self.inst, self.model
        for i, job in enumerate(inst.jobs):
            t = inst.terms[i]
            obj = t.objective
            mdl.offset += obj.constant                  # -d_j gmax: the demand term's constant part
            if not t.candidates:
                mdl.offset -= obj.per_moved_gpu * sum(inst.current[i].values())
                continue
            c = self.cols[i]
            top = t.candidates[-1]
            c.g = mdl.add_col(cost=obj.per_gpu, lo=0, hi=top)
            c.runs = runs(t.candidates)
            c.b = mdl.add_cols(len(c.runs), lo=0, hi=1, integer=True)
            link_cols, link_vals = [c.g], [1.0]                # g - sum_k (s_k b_k + d_k m_k) = 0
            for (start, d, length), bk in zip(c.runs, c.b):
                link_cols.append(bk)
                link_vals.append(-start)
                if length > 1:
                    mk = mdl.add_col(lo=0, hi=length - 1, integer=True)
                    c.m.append(mk)
                    link_cols.append(mk)
                    link_vals.append(-d)
                    mdl.add_row([mk, bk], [1.0, -(length - 1)], hi=0)   # m_k <= (L_k - 1) b_k
                else:
                    c.m.append(-1)
            mdl.add_row(link_cols, link_vals, 0, 0)
            if len(c.b) > 1 or (self.must_run and job.must_run):
                lo = 1 if self.must_run and job.must_run else -np.inf
                mdl.add_row(c.b, [1.0] * len(c.b), lo=lo, hi=1)   # one run at most: one count, or not running
            # throughput epigraph: t <= a_k g + c_k for every hull segment (exact at integer g: hull is concave)
            smax = tp.evaluate_curve(t.hull, top)
            c.t = mdl.add_col(cost=obj.per_speed, lo=0, hi=smax)
            for (a, b0), (g0, _) in zip(tp.segments(t.hull), t.hull):
                if g0 < top:
                    mdl.add_row([c.t, c.g], [1.0, -a], hi=b0)
            if self.exact:
                self._exact_job(i)
            else:
                self._counts_job(i)
            self._progress_job(i)
        if self.exact:
            self._exact_capacity()
        else:
            self._counts_capacity()

    def _progress_job(self, i: int) -> None:
        """The progress objective's stay binary k_j and floor slack sigma_j (nothing under the legacy one)."""
        inst, mdl, c, obj = self.inst, self.model, self.cols[i], self.inst.terms[i].objective
        if obj.stay > 0 and c.k < 0:
            self._stay_col(i)
        if obj.in_place > 0:
            self._in_place_col(i)
        if obj.floor > 0 and obj.per_short_gpu > 0:
            c.sigma = mdl.add_col(cost=-obj.per_short_gpu, lo=0, hi=float(obj.floor))
            mdl.add_row([c.g, c.sigma], [1.0, 1.0], lo=float(obj.floor))   # g + sigma >= phi

    def _stay_col(self, i: int) -> None:
        """k_j = 1 only when the job stays exactly as it runs: g = g0 (and, in the exact model, x_n >= x0_n on
        every node it holds, so x = x0). Its cost is the progress objective's stay bonus (0 otherwise)."""
        inst, mdl, c = self.inst, self.model, self.cols[i]
        g0 = float(sum(inst.current[i].values()))
        top = float(inst.terms[i].candidates[-1])
        c.k = mdl.add_col(cost=inst.terms[i].objective.stay, lo=0, hi=1, integer=True)
        mdl.add_row([c.g, c.k], [1.0, top], hi=g0 + top)           # g - g0 <= top (1 - k)
        mdl.add_row([c.g, c.k], [1.0, -g0], lo=0)                  # g >= g0 k
        if self.exact:
            for n, x0 in inst.current[i].items():
                mdl.add_row([c.x[n], c.k], [1.0, -float(x0)], lo=0)   # x_n >= x0_n k

    def _in_place_col(self, i: int) -> None:
        """kin_j = 1 only when the job shrinks keeping its processes (Instance.in_place): fewer GPUs than g0,
        and in the exact model x_n in {0, x0_n} on the nodes it holds, its batch node kept, nothing elsewhere.
        The counts model asks only for fewer GPUs, in whole nodes of its size where its nodes are alike (a
        relaxation, as for the rest of that model). Its cost is the in-place bonus; it excludes k_j."""
        inst, mdl, c = self.inst, self.model, self.cols[i]
        cur, b = inst.current[i], inst.batch[i]
        if b is None or (self.exact and b not in c.x):
            return
        g0 = float(sum(cur.values()))
        top = float(inst.terms[i].candidates[-1])
        c.kin = kin = mdl.add_col(cost=inst.terms[i].objective.in_place, lo=0, hi=1, integer=True)
        mdl.add_row([c.g, kin], [1.0, top + 1.0], hi=g0 + top)          # g <= g0 - 1 when kin
        if c.k >= 0:
            mdl.add_row([c.k, kin], [1.0, 1.0], hi=1)
        if self.exact:
            for n, x in c.x.items():
                x0 = float(cur.get(n, 0))
                mdl.add_row([x, kin], [1.0, top], hi=x0 + top)             # x_n <= x0_n when kin
                if x0 > 0:
                    mdl.add_row([x, c.u[n], kin], [1.0, -x0, -x0], lo=-x0)   # x_n >= x0_n u_n when kin
            mdl.add_row([c.x[b], kin], [1.0, -float(cur[b])], lo=0)         # its batch node kept
            return
        mdl.add_row([c.g, kin], [1.0, -float(cur[b])], lo=0)
        if len(set(cur.values())) == 1:
            per = float(next(iter(cur.values())))
            c.kin_nodes = m = mdl.add_col(lo=0, hi=len(cur), integer=True)   # g = per m when kin
            mdl.add_row([c.g, m, kin], [1.0, -per, top], hi=top)
            mdl.add_row([c.g, m, kin], [1.0, -per, -top], lo=-top)

    def _counts_job(self, i: int) -> None:
        inst, mdl, c, t = self.inst, self.model, self.cols[i], self.inst.terms[i]
        if t.objective.per_moved_gpu > 0:
            # GPUs on nodes that cannot host the job any more are lost whatever happens; the rest is
            # |g - g0_alive| at the least, so this model's optimum bounds the exact (per-node L1) one
            lost = sum(g for n, g in inst.current[i].items() if not inst.hosts(i, n))
            g0 = sum(inst.current[i].values()) - lost
            c.g0_alive = g0
            mdl.offset -= t.objective.per_moved_gpu * lost
            c.d = mdl.add_col(cost=-t.objective.per_moved_gpu, lo=0)
            mdl.add_row([c.d, c.g], [1.0, -1.0], lo=-g0)      # d >= g - g0
            mdl.add_row([c.d, c.g], [1.0, 1.0], lo=g0)        # d >= g0 - g
        # nodes spanned >= 1 when running and >= g / (largest node): a lower bound of the true count
        c.n = mdl.add_col(cost=-t.objective.per_node, lo=0)
        mdl.add_row([c.n] + c.b, [1.0] + [-1.0] * len(c.b), lo=0)
        mdl.add_row([c.n, c.g], [1.0, -1.0 / max(inst.max_node_gpus, 1)], lo=0)

    def _counts_capacity(self) -> None:
        inst, mdl = self.inst, self.model
        live = [i for i, c in enumerate(self.cols) if c.g >= 0]
        if not live:
            return
        gcols = [self.cols[i].g for i in live]
        # only nodes with GPUs count: CPUs or memory on a GPU-less node can serve no GPU job
        usable = inst.cap[inst.cap[:, 0] > 0].sum(axis=0) if len(inst.nodes) else np.zeros(3)
        for r in range(3):
            if usable[r] <= 0:
                continue  # no job needing resource r has a candidate count then
            # sum_j rho[j,r] g_j <= Cap_r, scaled to 1 (memory in MB would make the row 1e8-sized)
            mdl.add_row(gcols, (inst.rho[live, r] / usable[r]).tolist(), hi=1.0)

    def _exact_job(self, i: int) -> None:
        inst, mdl, c, t = self.inst, self.model, self.cols[i], self.inst.terms[i]
        per_moved, per_node = t.objective.per_moved_gpu, t.objective.per_node
        ub_all = np.minimum(inst.max_per_node(i), t.candidates[-1])
        nodes = [int(n) for n in np.nonzero(ub_all >= 1)[0]]
        if self.allowed is not None:
            nodes = [n for n in nodes if n in self.allowed[i]]
        cur = inst.current[i]
        for n, g0 in cur.items():
            if n not in nodes:
                mdl.offset -= per_moved * g0                # GPUs on a node that cannot host the job are lost
        k = len(nodes)
        ubs = [float(ub_all[n]) for n in nodes]
        # restart cost on the allocation matrix: |x - x0| is x itself on nodes the job does not hold now
        xcost = [-per_moved if cur.get(n, 0) == 0 else 0.0 for n in nodes]
        xs = mdl.add_cols(k, cost=xcost, lo=0, hi=ubs, integer=True)
        us = mdl.add_cols(k, cost=-per_node, lo=0, hi=1, integer=True)
        c.x = dict(zip(nodes, xs))
        c.u = dict(zip(nodes, us))
        mdl.add_row(xs + [c.g], [1.0] * k + [-1.0], 0, 0)       # sum_n x = g
        for x, u, ub in zip(xs, us, ubs):
            mdl.add_row([x, u], [1.0, -ub], hi=0)              # x <= ub u
        if per_moved > 0:
            for x, n in zip(xs, nodes):
                g0 = cur.get(n, 0)
                if g0 > 0:
                    e = mdl.add_col(cost=-per_moved, lo=0)
                    c.e[n] = e
                    mdl.add_row([e, x], [1.0, -1.0], lo=-g0)   # e >= x - x0
                    mdl.add_row([e, x], [1.0, 1.0], lo=g0)     # e >= x0 - x
        # Staying where it runs is always an answer, even off the shape rule (staying asks Slurm for
        # nothing): with k = 1 (x = x0) the shape rows below are relaxed by k's column.
        free = inst.stays_off_shape(i)
        if free:
            self._stay_col(i)
        kc, kv = ([c.k], 1.0) if free else ([], 0.0)
        if not t.spans or k <= 1:
            mdl.add_row(us + kc, [1.0] * k + [-(k - 1.0) * kv][:len(kc)], hi=1)   # one node (unless it stays)
            return
        pmax = float(max(inst.max_node_gpus, 1))
        c.G = mdl.add_col(lo=0, hi=pmax, integer=True)
        for x, u in zip(xs, us):
            mdl.add_row([x, c.G] + kc, [1.0, -1.0] + [-pmax][:len(kc)], hi=0)     # x <= G
            # x >= G - pmax (1 - u): equal on used nodes
            mdl.add_row([x, c.G, u] + kc, [1.0, -1.0, -pmax] + [pmax][:len(kc)], lo=-pmax)
        if inst.whole:
            c.span = mdl.add_col(lo=0, hi=1, integer=True)
            mdl.add_row(us + [c.span], [1.0] * k + [-(k - 1.0)], hi=1)   # sum u <= 1 + (k-1) span
            for x, u, n in zip(xs, us, nodes):
                cg = float(inst.cap[n, 0])
                # x >= C_n (u + span - 1): whole nodes
                mdl.add_row([x, u, c.span] + kc, [1.0, -cg, -cg] + [cg][:len(kc)], lo=-cg)

    def _exact_capacity(self) -> None:
        inst, mdl = self.inst, self.model
        per_node: dict[int, list[tuple[int, int]]] = {}
        for i, c in enumerate(self.cols):
            for n, col in c.x.items():
                per_node.setdefault(n, []).append((i, col))
        scale = 1.0 / np.maximum(inst.cap, 1.0)                 # rows in units of the node's capacity
        for n, pairs in sorted(per_node.items()):
            for r in range(3):
                cols = [col for i, col in pairs if inst.rho[i, r] > 0]
                vals = [float(inst.rho[i, r] * scale[n, r]) for i, col in pairs if inst.rho[i, r] > 0]
                if cols:
                    mdl.add_row(cols, vals, hi=float(inst.cap[n, r] * scale[n, r]))

    # -- reading back -------------------------------------------------------------------------
    def counts(self, x: np.ndarray) -> list[int]:
        return [int(round(x[c.g])) if c.g >= 0 else 0 for c in self.cols]

    def rows_of(self, x: np.ndarray) -> list[Row]:
        out = []
        for c in self.cols:
            out.append({n: int(round(x[col])) for n, col in c.x.items() if round(x[col]) > 0})
        return out

    def round_down(self, x: np.ndarray) -> list[int]:
        """Counts from an LP point: each job at the largest allowed count not above its LP value.

        Capacity rows have non-negative coefficients, so rounding down stays
        feasible; the LP of this model is nearly integral (a knapsack with
        three rows), so this is a strong incumbent to warm-start the MIP with.
        """
        out = []
        for i, c in enumerate(self.cols):
            if c.g < 0:
                out.append(0)
                continue
            v = x[c.g] + 1e-6
            below = [k for k in self.inst.terms[i].candidates if k <= v]
            out.append(below[-1] if below else 0)
        return out

    def point_from_counts(self, counts: Sequence[int]) -> np.ndarray:
        return self.point([{0: g} if g else {} for g in counts])

    def value(self, x: np.ndarray) -> float:
        return self.model.objective_of(x)

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
            if c.d >= 0:
                x[c.d] = abs(g - c.g0_alive)
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
            if c.k >= 0:
                cur = inst.current[i]
                same = ({n: v for n, v in row.items() if v > 0} == cur) if self.exact else g == sum(cur.values())
                x[c.k] = 1.0 if same else 0.0
            if c.kin >= 0:
                cur = inst.current[i]
                if self.exact:
                    shrinks = inst.in_place(i, row)
                else:
                    per = set(cur.values())
                    shrinks = (cur.get(inst.batch[i], 0) <= g < sum(cur.values())   # type: ignore[arg-type]
                               and (len(per) != 1 or g % next(iter(per)) == 0))
                x[c.kin] = 1.0 if shrinks else 0.0
                if c.kin_nodes >= 0:
                    x[c.kin_nodes] = g // next(iter(cur.values())) if shrinks else 0.0
            if c.sigma >= 0:
                x[c.sigma] = max(inst.terms[i].objective.floor - g, 0)
        return x
