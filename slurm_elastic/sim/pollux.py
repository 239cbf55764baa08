"""Pollux (OSDI'21) application profiles and workloads: step times at placements, iterations to finish."""

from __future__ import annotations

import functools
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from slurm_elastic import goodput
from slurm_elastic.goodput import GradientNoise
from slurm_elastic.errors import TraceError
from slurm_elastic.sim.jobs import Segment, SimJob, packed_placement
from slurm_elastic.sim.tables import integer, number, read_rows

log = logging.getLogger(__name__)

# Epochs each application trains for in the original simulator (traces README).
EPOCHS = {"bert": 2, "cifar10": 100, "ncf": 10, "imagenet": 90, "deepspeech2": 80, "yolov3": 50}
# Largest per-GPU batch the original allows, where it is lower than the largest measured one.
MAX_LOCAL_BSZ = {"yolov3": 8}
MAX_INTERP_NODES = 16

WORKLOAD_COLUMNS = ("name", "time", "application", "num_replicas", "batch_size")


@dataclass(eq=False)
class ApplicationProfile:
    """Measured step times of one application, and its iterations per epoch at each validated batch size."""

    name: str
    placements: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray, np.ndarray]]  # bsz, step, sync (sorted)
    points: np.ndarray          # (num_nodes, num_replicas, local_bsz) rows for interpolation
    values: np.ndarray          # (step_time, sync_time) rows
    iterations: dict[int, np.ndarray]  # global batch -> cumulative iterations after each epoch
    epochs: int
    min_local_bsz: float
    max_local_bsz: float
    # global batch -> per-epoch (cumulative statistical progress, grad_sqr, grad_var)
    statistics: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)
    _interp: object = field(default=None, repr=False)
    _nearest: object = field(default=None, repr=False)

    @classmethod
    def load(cls, folder: Path) -> ApplicationProfile:
        name = folder.name
        if not folder.is_dir():
            raise TraceError(f"no application profile folder {folder}")
        placements: dict[tuple[int, ...], list[tuple[float, float, float]]] = {}
        path = folder / "placements.csv"
        for line, row in read_rows(path, ("placement", "local_bsz", "step_time", "sync_time")):
            digits = row["placement"]
            if not re.fullmatch(r"[1-9]+", digits):
                raise TraceError(f"{path}:{line}: placement must be digits 1-9 (GPUs per node), got {digits!r}")
            key = _canonical(tuple(int(c) for c in digits))
            placements.setdefault(key, []).append((
                number(path, line, "local_bsz", row["local_bsz"]),
                number(path, line, "step_time", row["step_time"]),
                number(path, line, "sync_time", row["sync_time"]),
            ))
        if not placements:
            raise TraceError(f"{path}: no measurements")
        grouped: dict[tuple[int, int, float], list[tuple[float, float]]] = {}
        table = {}
        for key, rows in placements.items():
            rows.sort()
            # Rotations measured twice at one batch: average them, as the original's groupby does.
            by_bsz: dict[float, list[tuple[float, float]]] = {}
            for b, st, sy in rows:
                by_bsz.setdefault(b, []).append((st, sy))
                grouped.setdefault((len(key), sum(key), b), []).append((st, sy))
            bsz = np.array(sorted(by_bsz))
            step = np.array([np.mean([v[0] for v in by_bsz[b]]) for b in bsz])
            sync = np.array([np.mean([v[1] for v in by_bsz[b]]) for b in bsz])
            table[key] = (bsz, step, sync)
        points = [k for k in grouped]
        values = [tuple(np.mean(grouped[k], axis=0)) for k in points]
        path = folder / "scalability.csv"
        if path.exists():
            for line, row in read_rows(path, ("num_nodes", "num_replicas", "local_bsz", "step_time", "sync_time")):
                points.append((integer(path, line, "num_nodes", row["num_nodes"]),
                               integer(path, line, "num_replicas", row["num_replicas"]),
                               number(path, line, "local_bsz", row["local_bsz"])))
                values.append((number(path, line, "step_time", row["step_time"]),
                               number(path, line, "sync_time", row["sync_time"])))
        iterations: dict[int, np.ndarray] = {}
        statistics: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for vpath in sorted(folder.glob("validation-*.csv")):
            m = re.fullmatch(r"validation-([0-9]+)\.csv", vpath.name)
            if not m:
                continue
            rows = list(read_rows(vpath, ("progress", "iteration")))
            iterations[int(m.group(1))] = np.array([number(vpath, line, "iteration", r["iteration"])
                                                    for line, r in rows])
            if rows and "grad_sqr" in rows[0][1] and "grad_var" in rows[0][1]:
                statistics[int(m.group(1))] = tuple(np.array([number(vpath, line, k, r[k]) for line, r in rows])
                                                    for k in ("progress", "grad_sqr", "grad_var"))  # type: ignore[assignment]
        if not iterations:
            raise TraceError(f"{folder}: no validation-<batch>.csv files (needed for the iterations to finish)")
        epochs = EPOCHS.get(name, min(len(v) for v in iterations.values()))
        short = [b for b, v in iterations.items() if len(v) < epochs]
        if short:
            raise TraceError(f"{folder}: validation files for batch {short} have fewer than {epochs} epochs")
        all_bsz = np.concatenate([v[0] for v in table.values()])
        max_local = min(float(all_bsz.max()), MAX_LOCAL_BSZ.get(name, math.inf))
        return cls(name=name, placements=table, points=np.array(points, dtype=float),
                   values=np.array(values, dtype=float), iterations=iterations, epochs=epochs,
                   statistics=statistics if len(statistics) == len(iterations) else {},
                   min_local_bsz=float(all_bsz.min()), max_local_bsz=max_local)

    @property
    def init_batch(self) -> int:
        """The batch the original tunes every job for (the smallest validated one): goodput's base batch."""
        return min(self.iterations)

    @property
    def max_batch(self) -> int:
        """The largest global batch an adaptive job may take (the largest validated one, as the original)."""
        return max(self.iterations)

    def iterations_after(self, batch_size: float, epoch: int) -> float:
        """The validation trace's iterations after epoch index `epoch` at `batch_size` (linear between files)."""
        sizes = sorted(self.iterations)
        if batch_size <= sizes[0]:
            return float(self.iterations[sizes[0]][epoch] * sizes[0] / batch_size)
        if batch_size >= sizes[-1]:
            return float(self.iterations[sizes[-1]][epoch] * sizes[-1] / batch_size)
        for lo, hi in zip(sizes, sizes[1:]):
            if lo <= batch_size <= hi:
                a, b = self.iterations[lo][epoch], self.iterations[hi][epoch]
                return float(a + (b - a) * (batch_size - lo) / (hi - lo))
        raise AssertionError("unreachable")

    def work_iterations(self, batch_size: int) -> float:
        """Iterations to train `epochs` epochs at global batch `batch_size` (interpolated between files)."""
        return self.iterations_after(batch_size, self.epochs - 1)

    @functools.cached_property
    def progress_targets(self) -> np.ndarray:
        """Statistical progress a job must have made to finish each epoch (the original's rule: the least
        cumulative progress any validated batch had made by then); the last one finishes the job."""
        return np.array([min(float(v[0][e]) for v in self.statistics.values()) for e in range(self.epochs)])

    @functools.lru_cache(maxsize=4096)
    def noise(self, batch_size: float, epoch: int) -> GradientNoise:
        """The gradient statistics during `epoch` at `batch_size`, per sample (linear between validated batches).

        The traces' grad_var is the variance of the gradient averaged over the
        smallest validated batch B0, not of one sample: the original's gain
        (var + sqr) / (var / scale + sqr), scale = B / B0, treats it so. So one
        sample's variance, goodput.py's convention, is grad_var x B0; then
        goodput.gain(B, B0, noise) is exactly the original's gain.
        """
        sizes = sorted(self.statistics)
        b = min(max(batch_size, sizes[0]), sizes[-1])
        lo = max(s for s in sizes if s <= b)
        hi = min(s for s in sizes if s >= b)
        w = 0.0 if hi == lo else (b - lo) / (hi - lo)
        sqr = (1 - w) * self.statistics[lo][1][epoch] + w * self.statistics[hi][1][epoch]
        var = (1 - w) * self.statistics[lo][2][epoch] + w * self.statistics[hi][2][epoch]
        return GradientNoise(grad_sqr=float(sqr), grad_var=float(var) * self.init_batch)

    def gain(self, batch_size: float, epoch: int) -> float:
        """Statistical progress of one iteration at `batch_size` during `epoch` (AdaScale's gain, goodput.py)."""
        return goodput.gain(batch_size, self.init_batch, self.noise(batch_size, epoch))

    @functools.lru_cache(maxsize=1024)
    def epoch_ends(self, batch_size: int) -> np.ndarray:
        """Cumulative iterations at a fixed `batch_size` when each epoch ends, counting statistical progress.

        An iteration at batch B adds gain(B, epoch) progress, constant within
        an epoch, so the iterations to the end of each epoch are exact: the
        running sum of each epoch's progress step / its gain. Without gradient
        statistics, the validation trace's iteration counts.
        """
        if not self.statistics:
            return np.array([self.iterations_after(batch_size, e) for e in range(self.epochs)])
        targets = self.progress_targets
        steps = np.diff(targets, prepend=0.0)
        return np.cumsum([steps[e] / self.gain(batch_size, e) for e in range(self.epochs)])

    def work_statistical(self, batch_size: int) -> float:
        """Iterations at `batch_size` to reach the statistical progress the original simulator asks for."""
        return float(self.epoch_ends(batch_size)[-1])

    def epochs_done(self, batch_size: int, iterations_done: float) -> int:
        """Epochs a fixed-batch job has completed after `iterations_done` iterations (statistical progress)."""
        ends = self.epoch_ends(batch_size)
        return int(np.searchsorted(ends, iterations_done + 1e-9 * ends[-1], side="right"))

    @functools.lru_cache(maxsize=65536)
    def step_times(self, placement: tuple[int, ...], local_bsz: float) -> tuple[float, float]:
        """(step_time, sync_time) at a placement and per-GPU batch, interpolated as the original simulator does."""
        key = _canonical(placement)
        if key in self.placements:
            bsz, step, sync = self.placements[key]
            return float(np.interp(local_bsz, bsz, step)), float(np.interp(local_bsz, bsz, sync))
        if self._interp is None:
            try:
                from scipy.interpolate import LinearNDInterpolator, NearestNDInterpolator
            except ImportError:
                raise TraceError("interpolating Pollux profiles needs scipy: pip install 'slurm-elastic[sim]' "
                                 "or pip install scipy") from None

            self._interp = LinearNDInterpolator(self.points, self.values)
            self._nearest = NearestNDInterpolator(self.points, self.values)
        q = np.array([[min(len(key), MAX_INTERP_NODES), sum(key), local_bsz]], dtype=float)
        out = self._interp(q)[0]
        if not np.all(np.isfinite(out)):
            # Outside the measured hull (e.g. more replicas than ever profiled): nearest measurement.
            out = self._nearest(q)[0]
        return float(out[0]), float(out[1])

    def iteration_time(self, placement: tuple[int, ...], batch_size: int, *,
                       one_gpu_accumulates: bool | None = None) -> float:
        """Seconds per global-batch iteration, with gradient accumulation past the largest per-GPU batch.

        As the original: a fixed-batch job on one GPU with a batch above the
        smallest validated one always accumulates at least once
        (`one_gpu_accumulates` None; True: on one GPU always, as the original's
        Optimus predicts; False: never, as a goodput-chosen batch), and the
        per-GPU batch never exceeds the largest validated batch / (GPUs x
        accumulation steps).
        """
        replicas = sum(placement)
        local = math.ceil(batch_size / replicas - 1e-8)
        accum = max(0, math.ceil(local / self.max_local_bsz - 1e-8) - 1)
        if one_gpu_accumulates is None:
            one_gpu_accumulates = bool(self.iterations) and batch_size > min(self.iterations)
        if replicas == 1 and one_gpu_accumulates:
            accum = max(1, accum)
        atomic = math.ceil(local / (accum + 1) - 1e-8)
        if self.iterations:
            atomic = min(atomic, int(max(self.iterations) / (replicas * (accum + 1))))
        step, sync = self.step_times(placement, float(max(atomic, self.min_local_bsz)))
        return step + accum * (step - sync)

    def __hash__(self) -> int:
        return id(self)


@dataclass(frozen=True, slots=True)
class PolluxSpeed:
    """Iterations per second of an application at a fixed global batch, from its measured profile."""

    profile: ApplicationProfile = field(repr=False)
    batch_size: int

    def __call__(self, placement: tuple[int, ...]) -> float:
        placement = tuple(g for g in placement if g > 0)
        if not placement:
            return 0.0
        return 1.0 / self.profile.iteration_time(placement, self.batch_size)

    def epoch(self, done: float) -> int:
        """Epochs completed after `done` iterations."""
        return self.profile.epochs_done(self.batch_size, done)

    def noise(self, done: float) -> GradientNoise | None:
        """The gradient statistics the job measures now (per sample), None without statistics in the trace."""
        if not self.profile.statistics:
            return None
        return self.profile.noise(self.batch_size, min(self.epoch(done), self.profile.epochs - 1))

    # -- what the original's Optimus+Oracle knows (sim/optimus.py asks for it) --
    def oracle_remaining(self, done: float) -> float:
        """The iterations Optimus+Oracle counts as left: the validation trace's, from the last finished epoch.

        The original's oracle counts whole epochs of the trace's iterations
        (not statistical progress) and at least 1 once the last epoch began.
        """
        epoch = self.epoch(done)
        last = self.profile.epochs - 1
        if epoch >= last:
            return 1.0
        return (self.profile.iterations_after(self.batch_size, last)
                - self.profile.iterations_after(self.batch_size, epoch))

    def oracle_step_time(self, gpus: int, gpus_per_node: int) -> float:
        """Optimus+Oracle's predicted seconds per iteration at `gpus` packed GPUs (on one GPU it assumes
        accumulation whatever the batch, as the original's prediction does)."""
        return self.profile.iteration_time(packed_placement(gpus, gpus_per_node), self.batch_size,
                                           one_gpu_accumulates=True)


@dataclass(frozen=True, slots=True)
class AdaptiveSpeed:
    """An adaptive-batch Pollux job: work in statistical progress, batch chosen by goodput.

    At every start and every epoch boundary the job takes the global batch
    with the highest goodput on its placement (goodput.best_batch over
    batches from max(init batch, smallest per-GPU batch x GPUs) to the
    largest validated batch, with the true step times and that epoch's
    gradient statistics), as the original's adaptive jobs do with their
    fitted models. Progress per second is gain / iteration time; the job
    finishes when it reaches the original's target after the last epoch.
    `__call__` (a placement's speed for policies that ask without a state)
    is the rate during the first epoch.
    """

    profile: ApplicationProfile = field(repr=False)
    candidates: int = 24

    def __call__(self, placement: tuple[int, ...]) -> float:
        placement = tuple(g for g in placement if g > 0)
        return self.segment(placement, 0.0).rate if placement else 0.0

    @property
    def work(self) -> float:
        return float(self.profile.progress_targets[-1])

    def epoch(self, done: float) -> int:
        targets = self.profile.progress_targets
        return int(np.searchsorted(targets, done + 1e-9 * targets[-1], side="right"))

    def segment(self, placement: tuple[int, ...], done: float) -> Segment:
        placement = _canonical(placement)
        epoch = min(self.epoch(done), self.profile.epochs - 1)
        seg = _goodput_choice(self.profile, placement, epoch, self.candidates)
        until = float(self.profile.progress_targets[epoch]) - done
        return Segment(seg.rate, max(until, 0.0), seg.batch, seg.steps_per_s, seg.noise)


@functools.lru_cache(maxsize=65536)
def _goodput_choice(p: ApplicationProfile, placement: tuple[int, ...], epoch: int, candidates: int) -> Segment:
    """The goodput-best batch of an application on a placement during an epoch (shared by all its jobs)."""
    replicas = sum(placement)
    lo = max(p.init_batch, math.ceil(p.min_local_bsz * replicas))
    hi = max(p.max_batch, lo)
    grid = {lo, hi} | {int(round(b)) for b in np.geomspace(lo, hi, candidates)}
    noise = p.noise(lo, epoch)

    def samples_per_s(batch: int) -> float:
        return batch / p.iteration_time(placement, batch, one_gpu_accumulates=False)

    # The statistics are those measured at the batch being run; the choice uses the ones at the
    # smallest candidate (what a job running there would have measured), then runs at its pick.
    batch, _ = goodput.best_batch(sorted(grid), samples_per_s, p.init_batch, noise)
    step = p.iteration_time(placement, batch, one_gpu_accumulates=False)
    noise = p.noise(batch, epoch)
    return Segment(goodput.gain(batch, p.init_batch, noise) / step, math.inf, batch, 1.0 / step, noise)


def _canonical(placement: tuple[int, ...]) -> tuple[int, ...]:
    """The smallest rotation: the original treats rotations of a placement as the same."""
    p = tuple(g for g in placement if g > 0)
    return min((p[i:] + p[:i] for i in range(len(p))), default=())


def load_profiles(folder: Path, names: set[str]) -> dict[str, ApplicationProfile]:
    return {name: ApplicationProfile.load(folder / name) for name in sorted(names)}


ADAPTIVE = ("none", "all", "half")


def load_workload(path: Path, applications: Path | None = None, *,
                  max_gpus_cap: int = 64, adaptive: str = "none") -> list[SimJob]:
    """Jobs of a Pollux workload CSV; profiles come from `applications` (default: ../applications).

    Elastic range (used by optimus and the controller): 1 .. batch_size //
    smallest measured per-GPU batch (as the original's Optimus), capped at
    `max_gpus_cap`; ncf stays at 1 GPU as in the original.

    `adaptive`: "none" (every job at its trace batch), "all" (every job
    adaptive, as in the original's Pollux runs: work in statistical progress,
    batch chosen by goodput, range 1 .. largest validated batch // smallest
    per-GPU batch), "half" (every other job in submission order). ncf stays
    fixed at one GPU either way (its range is one GPU).
    """
    if adaptive not in ADAPTIVE:
        raise TraceError(f"unknown adaptive mode {adaptive!r} (choose {', '.join(ADAPTIVE)})")
    path = Path(path)
    applications = Path(applications) if applications else path.parent.parent / "applications"
    rows = []
    for line, row in read_rows(path, WORKLOAD_COLUMNS):
        rows.append((line, row))
    if not rows:
        raise TraceError(f"{path}: no jobs")
    known = {p.name for p in applications.iterdir() if p.is_dir()} if applications.is_dir() else set()
    if not known:
        raise TraceError(f"no application profiles under {applications} (pass the folder holding bert/, cifar10/, ...)")
    wanted = set()
    for line, row in rows:
        if row["application"] not in known:
            raise TraceError(f"{path}:{line}: unknown application {row['application']!r} "
                             f"(profiles exist for {', '.join(sorted(known))})")
        wanted.add(row["application"])
    profiles = load_profiles(applications, wanted)
    parsed = []
    seen = set()
    for line, row in rows:
        name = row["name"]
        if not name:
            raise TraceError(f"{path}:{line}: empty job name")
        if name in seen:
            raise TraceError(f"{path}:{line}: duplicate job name {name!r}")
        seen.add(name)
        parsed.append((number(path, line, "time", row["time"]), name,
                       integer(path, line, "num_replicas", row["num_replicas"]),
                       integer(path, line, "batch_size", row["batch_size"]), profiles[row["application"]]))
    parsed.sort(key=lambda p: (p[0], p[1]))
    jobs = []
    for rank, (submit, name, replicas, batch, profile) in enumerate(parsed):
        max_gpus = max(1, min(max_gpus_cap, int(batch // profile.min_local_bsz)))
        if profile.name == "ncf":
            max_gpus = 1
        max_gpus = max(max_gpus, replicas)
        speed: PolluxSpeed | AdaptiveSpeed
        if profile.statistics and profile.name != "ncf" and (
                adaptive == "all" or (adaptive == "half" and rank % 2 == 0)):
            speed = AdaptiveSpeed(profile)
            work = speed.work
            max_gpus = max(replicas, min(max_gpus_cap, int(profile.max_batch // profile.min_local_bsz)))
        else:
            speed, work = PolluxSpeed(profile, batch), profile.work_statistical(batch)
        jobs.append(SimJob(
            key=name, submit_s=submit, requested_gpus=replicas, min_gpus=1, max_gpus=max_gpus,
            work=work, speed=speed, cpus_per_gpu=1, mem_per_gpu_mb=1024, application=profile.name,
        ))
    jobs.sort(key=lambda j: (j.submit_s, j.key))
    log.info("loaded %d jobs from %s", len(jobs), path)
    return jobs
