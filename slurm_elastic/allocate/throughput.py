"""Throughput models s_j(g, nodes): linear with a node penalty, from a profile table, fitted from measured steps/s,
or an adaptive-batch job's goodput at its best batch."""

from __future__ import annotations

import json
import logging
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from slurm_elastic.allocate.stepmodel import StepTimeModel
from slurm_elastic.goodput import GradientNoise, best_batch
from slurm_elastic.errors import AllocationError

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


@dataclass(frozen=True, slots=True)
class LinearThroughput:
    """`per_gpu * g`, times `(1 - node_penalty)` for every node beyond the first.

    The default model: data-parallel training scales about linearly inside a
    node, and every extra node adds inter-node traffic.
    """

    per_gpu: float = 1.0
    node_penalty: float = 0.05

    def __call__(self, gpus: int, nodes: int = 1) -> float:
        if gpus <= 0:
            return 0.0
        return self.per_gpu * gpus * (1.0 - self.node_penalty) ** max(nodes - 1, 0)


@dataclass(frozen=True, slots=True)
class PiecewiseThroughput:
    """A concave piecewise-linear curve through `points` ((gpus, speed), gpus ascending, starting at (0, 0)).

    Beyond the last point the curve continues with the last segment's slope
    (never below the last value: more GPUs never slow a job down in the model),
    unless the table went on past its peak (`largest` beyond the last point):
    then it is flat, as the hull is.
    """

    points: tuple[tuple[float, float], ...]
    largest: float = 0.0       # the largest GPU count the table gave

    def __call__(self, gpus: int, nodes: int = 1) -> float:
        if self.points and self.largest > self.points[-1][0] and gpus >= self.points[-1][0]:
            return self.points[-1][1]
        return _interpolate(self.points, float(gpus))


def concave_hull(points: Iterable[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    """The upper concave envelope of `points`, always through (0, 0); gpus ascending.

    Keeping only the upper hull makes the epigraph `t <= a_k g + b_k` exact
    at every breakpoint, which is what the MILP relies on.
    """
    best: dict[float, float] = {0.0: 0.0}
    for g, s in points:
        g, s = float(g), float(s)
        if not (math.isfinite(g) and math.isfinite(s)) or g < 0:
            raise AllocationError(f"throughput point ({g}, {s}) is not a finite non-negative GPU count")
        if g == 0:
            continue  # zero GPUs run at zero speed, whatever a table says
        best[g] = max(best.get(g, -math.inf), max(s, 0.0))
    pts = sorted(best.items())
    hull: list[tuple[float, float]] = []
    for p in pts:
        while len(hull) >= 2 and _cross(hull[-2], hull[-1], p) >= 0:
            hull.pop()
        hull.append(p)
    # Past the peak a concave hull would go down; keep it flat instead (a job
    # can always leave GPUs idle, so speed is non-decreasing in the model).
    peak = max(range(len(hull)), key=lambda i: hull[i][1])
    return tuple(hull[: peak + 1])


def table_throughput(table: Mapping[int, float]) -> PiecewiseThroughput:
    """A profile table (GPUs -> samples/s) as a concave piecewise-linear model."""
    if not table:
        raise AllocationError("a throughput table needs at least one (GPUs, speed) entry")
    return PiecewiseThroughput(concave_hull(table.items()), float(max(table)))


def measured_throughput(rows: Iterable[Mapping[str, object]], *, prior: LinearThroughput = LinearThroughput(),
                        speed_key: str = "steps_per_s") -> MeasuredThroughput | None:
    """The MeasuredThroughput of validated metrics rows, or None when nothing usable was measured."""
    by_gpus: dict[int, list[float]] = {}
    nodes: dict[int, int] = {}
    for row in rows:
        g, s, n = row.get("gpus"), row.get(speed_key), row.get("nodes", 1)
        if not (isinstance(g, int) and isinstance(s, (int, float)) and isinstance(n, int)) or g <= 0:
            continue
        if math.isfinite(s) and s > 0:
            by_gpus.setdefault(g, []).append(float(s))
            nodes[g] = max(nodes.get(g, 1), n)
    if not by_gpus:
        return None
    medians = {g: statistics.median(v) for g, v in by_gpus.items()}
    return MeasuredThroughput(concave_hull(medians.items()), tuple(sorted(nodes.items())), float(max(medians)),
                              prior)


def fit_throughput(rows: Iterable[Mapping[str, object]], *, default: Callable[..., float] | None = None,
                   speed_key: str = "samples_per_s") -> Callable[..., float]:
    """Fit a concave model from the training shim's metrics rows.

    Rows look like `{"step":..,"gpus":..,"nodes":..,"steps_per_s":..,"samples_per_s":..}`.
    The median speed per GPU count becomes a profile table. With measurements
    at one GPU count only, the model is linear through that point (with the
    default node penalty); with none, `default` (or LinearThroughput()) is returned.
    """
    by_gpus: dict[int, list[float]] = {}
    for row in rows:
        try:
            g = int(row["gpus"])  # type: ignore[arg-type]
            s = float(row.get(speed_key, row.get("steps_per_s")))  # type: ignore[arg-type]
        except (KeyError, TypeError, ValueError):
            continue
        if g > 0 and math.isfinite(s) and s >= 0:
            by_gpus.setdefault(g, []).append(s)
    if not by_gpus:
        return default if default is not None else LinearThroughput()
    medians = {g: statistics.median(v) for g, v in by_gpus.items()}
    if len(medians) == 1:
        ((g, s),) = medians.items()
        if s <= 0:
            return default if default is not None else LinearThroughput()
        return LinearThroughput(per_gpu=s / g)
    return table_throughput(medians)


def read_metrics(path: str | Path) -> list[dict[str, object]]:
    """Rows of a metrics.jsonl file; lines that are not JSON objects are skipped (a writer may be mid-line)."""
    rows: list[dict[str, object]] = []
    p = Path(path)
    if not p.is_file():
        return rows
    with p.open("r", encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, start=1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                log.debug("%s:%d: not JSON, skipped", p, lineno)
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


def throughput_from_checkpoints(ckpt_dir: str | Path, job_key: str, *,
                                default: Callable[..., float] | None = None) -> Callable[..., float]:
    """The model learned from `<ckpt_dir>/<job-key>/metrics.jsonl` (or `default` when nothing is measured yet)."""
    return fit_throughput(read_metrics(Path(ckpt_dir) / job_key / METRICS_FILE), default=default)


def curve(model: Callable[..., float], counts: Sequence[int], nodes_for: Callable[[int], int],
          job_key: str = "?") -> tuple[tuple[float, float], ...]:
    """The concave hull of `model` at the job's candidate GPU counts (with the nodes each count needs)."""
    pts = []
    for g in counts:
        try:
            try:
                s = float(model(g, nodes_for(g)))
            except TypeError:
                s = float(model(g))  # a plain callable of GPUs only
        except Exception as exc:  # a user's model: whatever it raises, the user needs to know which job
            raise AllocationError(f"job {job_key}: throughput model failed at {g} GPUs: {exc}") from exc
        if not math.isfinite(s) or s < 0:
            raise AllocationError(f"job {job_key}: throughput model gave {s!r} at {g} GPUs "
                                  f"(must be a finite number >= 0)")
        pts.append((g, s))
    return concave_hull(pts)


def evaluate_curve(points: Sequence[tuple[float, float]], gpus: float) -> float:
    """A hull from `curve` at `gpus`: flat past its last point.

    `curve` evaluates every candidate count, so past the hull's last point is
    past the peak (`concave_hull` cut it there). Extrapolating the last slope
    instead made the normaliser s(max_gpus) up to 3x the true best speed
    (yolov3's term was divided by 3.42 where its best is 1.13).
    """
    if gpus <= 0 or not points:
        return 0.0
    if gpus >= points[-1][0]:
        return points[-1][1]
    return _interpolate(points, gpus)


@dataclass(frozen=True, slots=True)
class MeasuredThroughput:
    """Speed fitted from a job's own measurements, with a stated rule for the sizes it never ran.

    With `predicted` (the request source always gives one): the job's step-time model
    (`allocate.stepmodel.StepTimeModel`) decides every size: the median measured where the job ran, and
    elsewhere its own fitted step time relative to the nearest size measured, a gain beyond the largest
    size measured credited at (1 - eta), never more than linear from the size measured, nor S(g) > g.

    Without it, the capped rule (kept for the ablation against the fitted model):
    - at and between measured GPU counts: the concave hull of the medians;
    - below the smallest measured count: that count's speed per GPU (scaling
      down is never credited as better than measured);
    - above the largest measured count g_hi: at most the last measured marginal
      speed per GPU (with one measured count, linear through it), and flat past
      `explore_factor` x g_hi when that is set: a GPU never adds more than the
      last one measured did (no optimism beyond what was measured), yet GPUs
      nobody else wants are not left idle;
    - a node count above the one measured at the nearest count costs `prior`'s
      node penalty per extra node.
    """

    points: tuple[tuple[float, float], ...]          # concave hull of (gpus, median speed), from (0, 0)
    nodes_at: tuple[tuple[int, int], ...] = ()      # (gpus, nodes) measured
    largest_measured: float = 0.0                   # may lie past the hull's peak (a slower large count)
    prior: LinearThroughput = LinearThroughput()
    explore_factor: float | None = None
    predicted: StepTimeModel | None = None          # the fitted step-time model; None: the capped rule

    @property
    def measured_gpus(self) -> tuple[int, ...]:
        return tuple(int(g) for g, _ in self.points if g > 0)

    def __call__(self, gpus: int, nodes: int = 1) -> float:
        if self.predicted is not None:
            return self.predicted.speed(gpus, nodes)
        if gpus <= 0 or len(self.points) < 2:
            return 0.0
        g = float(gpus)
        lo_g, lo_s = self.points[1]
        hi_g, hi_s = self.points[-1]
        if g < lo_g:
            s = lo_s * g / lo_g
        elif g <= hi_g:
            s = _interpolate(self.points, g)
        elif self.largest_measured > hi_g:
            s = hi_s                        # a larger count was measured slower: no gain past the peak
        else:
            top = g if self.explore_factor is None else min(g, self.explore_factor * hi_g)
            g0, s0 = self.points[-2]        # (0, 0) with one measured count: linear through it
            slope = max((hi_s - s0) / (hi_g - g0), 0.0)
            s = hi_s + slope * (top - hi_g)
        measured_nodes = dict(self.nodes_at)
        near = min(measured_nodes, key=lambda m: abs(m - g), default=None)
        extra = nodes - measured_nodes[near] if near is not None else 0
        if extra > 0:
            s *= (1.0 - self.prior.node_penalty) ** extra
        return s


def speed_frontier(counts: Sequence[int], model: Callable[..., float], nodes_for: Callable[[int], int],
                   placeable: Callable[[int], bool], min_marginal: float = 0.0) -> tuple[int, ...]:
    """The counts Slurm can place that are faster than every smaller placeable count.

    The allocator treats more GPUs as never slower (the hull is flat past the
    peak), so counts where the speed drops are left out. Only counts the shape
    rule can place are scanned: a count such as 10 = 4+4+2 on 4-GPU nodes
    would otherwise set the bar for 12..32 (deepspeech2 B=320 was capped at 8
    GPUs though 32 ran 36 % faster).

    With `min_marginal` m, a count g is faster than the best smaller one g0
    only if each GPU added gains at least m of what a GPU gives at g0 on
    average, s(g) - s(g0) >= m * s(g0) * (g - g0) / g0: a job that does not
    scale, measured a hair faster at 12 GPUs than at 4 by timing noise, is
    not worth 8 more GPUs (seen live: it was grown again and again).
    """
    best, best_g = 0.0, 0
    keep: list[int] = []
    for g in counts:
        if not placeable(g):
            continue
        s = float(model(g, nodes_for(g)))
        gains = s > best * (1 + 1e-6) and s - best >= min_marginal * best * (g - best_g) / max(best_g, 1)
        if gains or not keep:
            keep.append(g)
            best, best_g = max(best, s), g
    return tuple(keep)


def segments(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """(slope, intercept) of every hull segment: t <= slope*g + intercept for all of them is the epigraph."""
    out = []
    for (g0, s0), (g1, s1) in zip(points, points[1:]):
        a = (s1 - s0) / (g1 - g0)
        out.append((a, s0 - a * g0))
    return out


def _interpolate(points: Sequence[tuple[float, float]], g: float) -> float:
    if g <= 0 or len(points) < 2:
        return 0.0 if g <= 0 or not points else points[-1][1]
    for (g0, s0), (g1, s1) in zip(points, points[1:]):
        if g <= g1:
            return s0 + (s1 - s0) * (g - g0) / (g1 - g0)
    (g0, s0), (g1, s1) = points[-2], points[-1]
    return max(s1, s1 + (s1 - s0) / (g1 - g0) * (g - g1))


def _cross(o: tuple[float, float], a: tuple[float, float], b: tuple[float, float]) -> float:
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


@dataclass(frozen=True, slots=True)
class GoodputThroughput:
    """An adaptive-batch job's speed at g GPUs: its goodput at the best batch for g (`slurm_elastic.goodput`).

    `samples` is its samples/s per GPU count, each at the batch per GPU it was measured at (a
    MeasuredThroughput, with that model's rule for counts never run); b is the batch per GPU measured at
    the measured count nearest g. At another global batch M, samples/s(g, M) = samples(g) * r(M):
    - at a smaller batch (M < b g), a step takes no less time than measured (steps/s no higher than
      measured: the all-reduce and the optimizer step do not shrink with the batch): r = M / (b g);
    - at a larger one, the job's fitted step-time model (`samples.predicted`, as the request source
      always gives) once its rows span two batches per GPU (so its cost per sample is its own, not the
      prior's): r is the model's ratio of samples/s at M to samples/s at b g, within 1 and M / (b g) (a
      sample takes no more time in a larger batch, a step no less). Pollux's throughput model predicts
      every batch so; held to the samples/s measured (r = 1, the rule before, and still the rule
      without a fitted model or with one batch per GPU), a count run once at a small batch per GPU,
      where fixed per-step costs dominate, scored below smaller counts run at larger batches for good.
    The speed is max over M in [min_batch, max_batch] of samples/s(g, M) * efficiency(M).
    """

    samples: MeasuredThroughput
    local_batch_at: tuple[tuple[int, float], ...]     # (gpus, global batch / gpus) as measured
    min_batch: int
    max_batch: int
    base_batch: int
    noise: GradientNoise

    def batch_for(self, gpus: int, nodes: int = 1) -> tuple[int, float]:
        """The best global batch at `gpus` GPUs and its goodput (samples/s worth of `base_batch` samples)."""
        if gpus <= 0 or not self.local_batch_at:
            return self.min_batch, 0.0
        full = self.samples(gpus, nodes)
        near = min(self.local_batch_at, key=lambda gb: (abs(gb[0] - gpus), gb[0]))
        measured_batch = near[1] * gpus

        model = self.samples.predicted
        if model is not None and not model.fits_cost_per_sample:
            model = None      # one batch per GPU measured: its cost per sample would be the prior's, not its own

        there = model.params.step_time(gpus, nodes, measured_batch) if model is not None else 0.0

        def samples_per_s(batch: int) -> float:
            linear = batch / measured_batch
            if model is None or linear <= 1.0:
                return full * min(1.0, linear)
            at = model.params.step_time(gpus, nodes, batch)
            ratio = linear * there / at if at > 0 and there > 0 else 1.0
            return full * min(max(ratio, 1.0), linear)

        return best_batch(self._candidates(measured_batch), samples_per_s, self.base_batch, self.noise)

    def __call__(self, gpus: int, nodes: int = 1) -> float:
        return self.batch_for(gpus, nodes)[1]

    def _candidates(self, measured_batch: float) -> list[int]:
        lo, hi = self.min_batch, self.max_batch
        out = {lo, hi, min(hi, max(lo, int(measured_batch)))}
        power = 1
        while power <= hi:
            if power >= lo:
                out.add(power)
            power *= 2
        return sorted(out)
