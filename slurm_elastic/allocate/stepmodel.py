"""A job's step-time model (Pollux's, with gamma = 1): fitted from the sizes it ran, it predicts the sizes it never ran.

T(g, n, B) = a_c + b_c*B/g + [n=1, g>1]*(a_r + b_r*(g-2)+) + [n>1]*(a_n + b_n*(g-2)+), all six parameters >= 0:
compute per step (a fixed part and one that shrinks with the batch per GPU) plus the all-reduce, whose cost
depends on whether the ranks share a node. The model is linear in its parameters, so the fit is a
non-negative least squares with six unknowns, solved exactly by trying every active set (no iteration
limit, no scipy: the controller imports this). The error is relative (a 10 % miss counts the same at
every size, as Pollux's log-RMSE), and a MAP prior anchored at the job's smallest measured point keeps
what few rows cannot pin down at the physics of a ring all-reduce; parameters the rows cannot identify at
all stay at the prior, as Pollux's fit keeps them fixed.

Predictions (`StepTimeModel.speed`) are ratios of the model applied to a measured speed (the nearest
size measured), never the model's absolute value: a measured size is what was measured, and the model
says only how a size it never ran compares. A gain beyond the largest size measured is credited at
(1 - eta) (a lower-confidence credit: a size is worth trying only when the discounted gain pays for
the restart), a size is never credited more than linear scaling from its anchor nor, below it, faster
than the anchor, and never more than g times the job's 1-GPU speed (S(g) <= g).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Iterable, Literal

import numpy as np

from slurm_elastic.errors import AllocationError

PARAMETERS = ("alpha_c", "beta_c", "alpha_r", "beta_r", "alpha_n", "beta_n")

# The prior's all-reduce latencies as fractions of the 1-GPU compute time C1 = beta_c * B: a ring inside a
# node (PCIe/NVLink) costs little next to a step, one across the network several times more. Defaults from
# that physics, not tuned on any trace.
PRIOR_ALPHA_R_FRACTION = 0.01
PRIOR_ALPHA_N_FRACTION = 0.04
PRIOR_ROWS = 1.0          # the prior weighs as much as one measured row per parameter
MAX_ROW_WEIGHT = 8        # a (g, n, B) point measured often counts as at most 8 rows


@dataclass(frozen=True, slots=True)
class StepTimeParams:
    """The six parameters, in seconds (beta_c: seconds per sample per GPU)."""

    alpha_c: float = 0.0
    beta_c: float = 0.0
    alpha_r: float = 0.0
    beta_r: float = 0.0
    alpha_n: float = 0.0
    beta_n: float = 0.0

    def __post_init__(self) -> None:
        for name in PARAMETERS:
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise AllocationError(f"step-time parameter {name}={v!r} must be a finite number >= 0")

    def as_array(self) -> np.ndarray:
        return np.array([getattr(self, name) for name in PARAMETERS], dtype=float)

    def step_time(self, gpus: int, nodes: int, batch: float = 1.0) -> float:
        """Seconds per optimizer step at `gpus` GPUs on `nodes` nodes with global batch `batch`."""
        return float(features(gpus, nodes, batch) @ self.as_array())


@dataclass(frozen=True, slots=True)
class StepTimeRow:
    """One measured point: the median step time at (gpus, nodes, global batch) over `count` rows."""

    gpus: int
    nodes: int
    batch: float
    step_time_s: float
    count: int = 1

    def __post_init__(self) -> None:
        if not (self.gpus >= 1 and 1 <= self.nodes <= self.gpus and self.count >= 1):
            raise AllocationError(f"a step-time row needs gpus >= nodes >= 1 and count >= 1, got {self}")
        if not (math.isfinite(self.batch) and self.batch > 0 and math.isfinite(self.step_time_s)
                and self.step_time_s > 0):
            raise AllocationError(f"a step-time row needs a batch and a step time > 0, got {self}")


def features(gpus: int, nodes: int, batch: float) -> np.ndarray:
    """The row of the design matrix: T = features . theta."""
    extra = float(max(gpus - 2, 0))
    one_node = 1.0 if nodes == 1 and gpus > 1 else 0.0
    spans = 1.0 if nodes > 1 else 0.0
    return np.array([1.0, batch / gpus, one_node, one_node * extra, spans, spans * extra], dtype=float)


def prior_for(rows: Iterable[StepTimeRow], *, alpha_r_fraction: float = PRIOR_ALPHA_R_FRACTION,
              alpha_n_fraction: float = PRIOR_ALPHA_N_FRACTION) -> StepTimeParams:
    """The prior, anchored at the job's smallest measured point (fewest GPUs, then fewest nodes).

    alpha_c = 0 and beta_c such that the prior passes through that point, the all-reduce latencies as
    fractions of the 1-GPU compute C1 = beta_c * B, the per-GPU all-reduce growth 0.
    """
    rows = sorted(rows, key=lambda r: (r.gpus, r.nodes, r.batch))
    if not rows:
        raise AllocationError("a step-time prior needs at least one measured row")
    r = rows[0]
    fraction = alpha_n_fraction if r.nodes > 1 else alpha_r_fraction if r.gpus > 1 else 0.0
    beta_c = r.step_time_s / (r.batch * (1.0 / r.gpus + fraction))
    c1 = beta_c * r.batch
    return StepTimeParams(0.0, beta_c, alpha_r_fraction * c1, 0.0, alpha_n_fraction * c1, 0.0)


def identified(rows: Iterable[StepTimeRow]) -> tuple[bool, ...]:
    """Which parameters the rows can tell apart from the others (the rest stay at the prior).

    As Pollux: one per-GPU batch (B/g) measured leaves alpha_c fixed (it and beta_c move together); no
    single-node multi-GPU row leaves alpha_r fixed, no multi-node row alpha_n; the per-GPU all-reduce
    growth needs two distinct (g-2)+ values among the rows of its kind.
    """
    rows = list(rows)
    per_gpu_batch = _batches_per_gpu(rows)
    one_node = {max(r.gpus - 2, 0) for r in rows if r.nodes == 1 and r.gpus > 1}
    spans = {max(r.gpus - 2, 0) for r in rows if r.nodes > 1}
    return (len(per_gpu_batch) >= 2, bool(rows), bool(one_node), len(one_node) >= 2, bool(spans), len(spans) >= 2)


def _batches_per_gpu(points: Iterable[StepTimeRow | MeasuredPoint]) -> set[float]:
    """The batches per GPU the points were measured at: two or more tell the cost per sample from the fixed one."""
    return {p.batch / p.gpus for p in points}


def fit_step_time(rows: Iterable[StepTimeRow], prior: StepTimeParams | None = None, *,
                  prior_rows: float = PRIOR_ROWS) -> StepTimeParams:
    """The MAP fit: minimise sum_i c_i ((phi_i theta - y_i) / y_i)^2 + prior_rows * sum_k (f_k (theta_k - theta0_k) / ybar)^2
    over theta >= 0, with the parameters `identified` says the rows cannot pin kept at `prior`.

    c_i = min(count_i, 8); ybar the mean measured step time; f_k the parameter's mean feature over the rows
    where it is not 0 (1 where it is 0 everywhere), so each prior row is in seconds of a typical step. Exact: every subset of the free parameters
    is tried as the support, each solved by least squares, and the best non-negative one kept (the
    optimum of a convex problem is the unconstrained optimum on its own support). Deterministic: the
    same rows give the same bits. `prior_rows = 0` is the plain non-negative least squares.

    An all-reduce across the network is not cheaper than one inside a node: a network parameter the
    rows do not identify is kept at least 1.1 x its single-node counterpart as fitted (Pollux's rule),
    else a job whose single-node rows show a growing all-reduce would be predicted to scale better as
    soon as it spans nodes.
    """
    rows = sorted(rows, key=lambda r: (r.gpus, r.nodes, r.batch))
    if not rows:
        raise AllocationError("a step-time fit needs at least one measured row")
    if prior_rows < 0 or not math.isfinite(prior_rows):
        raise AllocationError(f"prior_rows must be a finite number >= 0, got {prior_rows!r}")
    prior = prior if prior is not None else prior_for(rows)
    theta0 = prior.as_array()
    free = [k for k, ok in enumerate(identified(rows)) if ok]
    theta = _solve(rows, theta0, free, prior_rows)
    raised = theta0.copy()
    for net, local in ((4, 2), (5, 3)):             # (alpha_n, alpha_r), (beta_n, beta_r)
        if net not in free:
            raised[net] = min(max(theta0[net], 1.1 * theta[local]), _network_room(rows, theta, net))
    if np.any(raised != theta0):
        theta = _solve(rows, raised, free, prior_rows)
    return StepTimeParams(*(float(v) for v in theta))


def _network_room(rows: list[StepTimeRow], theta: np.ndarray, net: int) -> float:
    """The most a network parameter the rows do not identify may be raised to and still let the fit pass
    through every measured multi-node point (inf with none).

    One multi-node size measures the network's cost there, alpha_n + beta_n (g-2)+, not its two parts: a
    beta_n raised past that cost made the re-fit miss the measured point itself (by 58 % on a 12-GPU,
    3-node row) and bend the single-node rows to compensate.
    """
    room = math.inf
    for r in rows:
        f = features(r.gpus, r.nodes, r.batch)
        if r.nodes > 1 and f[net] > 0:
            network = r.step_time_s - float(f[:2] @ theta[:2])      # measured less the compute as fitted
            room = min(room, max(network, 0.0) / f[net])
    return room


def _solve(rows: list[StepTimeRow], theta0: np.ndarray, free: list[int], prior_rows: float) -> np.ndarray:
    """The exact non-negative MAP solution with the parameters not in `free` fixed at `theta0`."""
    fixed = [k for k in range(len(PARAMETERS)) if k not in free]

    y = np.array([r.step_time_s for r in rows])
    weight = np.sqrt(np.array([min(r.count, MAX_ROW_WEIGHT) for r in rows], dtype=float)) / y
    phi = np.vstack([features(r.gpus, r.nodes, r.batch) for r in rows])
    # Rows of the least squares: the data's relative errors, then one row per free parameter for the prior.
    a_data = phi * weight[:, None]
    b_data = y * weight - a_data[:, fixed] @ theta0[fixed]
    # A parameter's prior row is in the units of what it adds to a typical row's step time (its mean
    # feature where the feature is not 0), relative to the mean step time: beta_c multiplies B/g (128 at 32
    # samples per GPU on 4 GPUs), so unscaled, its prior weighed nothing and a fit to rows all on many
    # nodes put the whole step into the all-reduce, predicting 1 GPU as fast as 32.
    typical = np.array([float(np.mean(col[col > 0])) if np.any(col > 0) else 1.0 for col in phi.T])
    scale = math.sqrt(prior_rows) * typical / float(np.mean(y))
    a_prior = np.zeros((len(free), len(PARAMETERS)))
    for i, k in enumerate(free):
        a_prior[i, k] = scale[k]
    a = np.vstack([a_data, a_prior])
    b = np.concatenate([b_data, scale[free] * theta0[free]])

    # The normal equations once (6 x 6), then one small solve per support: the fit runs for every job whose
    # metrics file grew, every cycle.
    gram, rhs, bb = a.T @ a, a.T @ b, float(b @ b)
    best: tuple[float, np.ndarray] | None = None
    for size in range(len(free) + 1):
        for support in itertools.combinations(free, size):
            theta = theta0.copy()
            theta[free] = 0.0
            cols = list(support)
            if cols:
                try:
                    solution = np.linalg.solve(gram[np.ix_(cols, cols)], rhs[cols])
                except np.linalg.LinAlgError:       # rows that cannot tell these apart (no prior to break the tie)
                    solution, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
                if np.any(solution < 0):
                    continue
                theta[cols] = solution
            t = theta[free]
            cost = float(t @ gram[np.ix_(free, free)] @ t - 2.0 * t @ rhs[free] + bb)
            if best is None or cost < best[0]:
                best = (cost, theta)
    assert best is not None          # the empty support is always feasible
    return best[1]


@dataclass(frozen=True, slots=True)
class MeasuredPoint:
    """A size the job ran at (Slurm saw it there), its global batch and its median speed there."""

    gpus: int
    nodes: int
    batch: float
    speed: float


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    """A job's speed at every size: measured where it ran, predicted from its fitted step time elsewhere.

    `speed` is steps/s at the anchor's global batch (`kind="steps"`, a fixed-batch job's progress) or
    samples/s at the anchor's batch per GPU (`kind="samples"`, what an adaptive job's goodput is built on).
    """

    params: StepTimeParams
    measured: tuple[MeasuredPoint, ...]
    kind: Literal["steps", "samples"] = "steps"
    eta: float = 0.25                 # the share of a predicted gain beyond the largest size measured not credited
    # counts credited at the bound (linear from the nearest size measured, on as many nodes) until measured:
    # the size a job asked for is worth one try whatever a fit over other sizes predicts (rules.AskedSize)
    optimistic: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if not self.measured:
            raise AllocationError("a step-time model needs at least one measured point")
        if not 0.0 <= self.eta <= 1.0:
            raise AllocationError(f"eta must be in [0, 1], got {self.eta!r}")

    @property
    def fits_cost_per_sample(self) -> bool:
        """Its points span two batches per GPU: its cost per sample is its own (`identified`), not the prior's."""
        return len(_batches_per_gpu(self.measured)) >= 2

    @property
    def largest_measured(self) -> int:
        return max(p.gpus for p in self.measured)

    def speed(self, gpus: int, nodes: int = 1) -> float:
        """The job's speed at `gpus` GPUs on `nodes` nodes (0 at 0 GPUs)."""
        if gpus <= 0:
            return 0.0
        s = self._uncapped(gpus, nodes)
        if gpus > 1:
            s = min(s, gpus * self._uncapped(1, 1))      # S(g) <= g: no super-linear credit
        return s

    def speedup(self, gpus: int, nodes: int = 1) -> float:
        """S(g) = speed(g, n) / speed(1, 1): progress in units of the job's own 1-GPU rate."""
        one = self.speed(1, 1)
        return self.speed(gpus, nodes) / one if one > 0 else 0.0

    def _uncapped(self, gpus: int, nodes: int) -> float:
        nodes = max(1, min(nodes, gpus))
        for p in self.measured:
            if p.gpus == gpus and p.nodes == nodes:
                return p.speed
        anchor = min(self.measured, key=lambda p: (abs(p.gpus - gpus), p.gpus, abs(p.nodes - nodes), p.nodes))
        mine, theirs = self._time_per_unit(gpus, nodes, anchor), self._time_per_unit(anchor.gpus, anchor.nodes, anchor)
        # A fit with no compute left (rows all on many nodes, explained by the all-reduce alone) can give a
        # step time of 0 at a size far from the rows: the caps below bound what that is credited.
        ratio = theirs / mine if mine > 0 else (math.inf if theirs > 0 else 1.0)
        if gpus in self.optimistic and gpus > anchor.gpus and nodes <= anchor.nodes:
            ratio = gpus / anchor.gpus
        if gpus > self.largest_measured and ratio > 1.0:
            ratio = 1.0 + (1.0 - self.eta) * (ratio - 1.0)
        if gpus > anchor.gpus:
            ratio = min(ratio, gpus / anchor.gpus)      # never better than linear from what was measured
        else:
            ratio = min(ratio, 1.0)                     # never faster than a larger size measured
        return anchor.speed * ratio

    def _time_per_unit(self, gpus: int, nodes: int, anchor: MeasuredPoint) -> float:
        """Seconds per step at the anchor's global batch, or per sample at its batch per GPU."""
        if self.kind == "steps":
            return self.params.step_time(gpus, nodes, anchor.batch)
        batch = anchor.batch / anchor.gpus * gpus
        return self.params.step_time(gpus, nodes, batch) / batch


@functools.lru_cache(maxsize=4096)
def _fit_remembered(rows: tuple[StepTimeRow, ...]) -> StepTimeParams:
    """fit_step_time with the default prior: a pure function of its rows (the same rows give the same bits)."""
    return fit_step_time(rows)


def step_time_model(points: Iterable[tuple[int, int, float | None, float, int]], *, kind: Literal["steps", "samples"],
                    eta: float) -> StepTimeModel | None:
    """The model of a job's measured points (gpus, nodes, global batch or None, steps/s, rows), or None without one.

    A point without a batch (a fixed-batch job that does not say its batch) is fitted at B = 1, and then
    so are all: the feature B/g is 1/g for a batch that does not change. `kind="samples"` needs batches.
    """
    pts = [(g, n, b, s, c) for g, n, b, s, c in points if s > 0 and math.isfinite(s)]
    if not pts:
        return None
    batched = all(b is not None for _, _, b, _, _ in pts)
    if kind == "samples" and not batched:
        raise AllocationError("a samples/s model needs the batch of every measured point")
    # a count weighs at most MAX_ROW_WEIGHT rows in the fit: capped here, a job whose medians did not move
    # gives the same rows cycle after cycle, and its fit is remembered
    rows = tuple(StepTimeRow(g, n, float(b) if batched else 1.0, 1.0 / s, min(c, MAX_ROW_WEIGHT))
                 for g, n, b, s, c in pts)
    params = _fit_remembered(rows)
    measured = tuple(MeasuredPoint(r.gpus, r.nodes, r.batch, (r.batch if kind == "samples" else 1.0) / r.step_time_s)
                     for r in rows)
    return StepTimeModel(params, measured, kind, eta)
