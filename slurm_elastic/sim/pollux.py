"""Pollux (OSDI'21) application profiles and workloads: step times at placements, iterations to finish."""

from __future__ import annotations

import functools
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from slurm_elastic.errors import TraceError
from slurm_elastic.sim.jobs import SimJob
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

    def work_iterations(self, batch_size: int) -> float:
        """Iterations to train `epochs` epochs at global batch `batch_size` (interpolated between files)."""
        sizes = sorted(self.iterations)
        last = self.epochs - 1
        if batch_size <= sizes[0]:
            return float(self.iterations[sizes[0]][last] * sizes[0] / batch_size)
        if batch_size >= sizes[-1]:
            return float(self.iterations[sizes[-1]][last] * sizes[-1] / batch_size)
        for lo, hi in zip(sizes, sizes[1:]):
            if lo <= batch_size <= hi:
                a, b = self.iterations[lo][last], self.iterations[hi][last]
                return float(a + (b - a) * (batch_size - lo) / (hi - lo))
        raise AssertionError("unreachable")

    def work_statistical(self, batch_size: int) -> float:
        """Iterations at `batch_size` to reach the statistical progress the original simulator asks for.

        The original counts progress, not iterations: an iteration at batch B
        adds gain = (var + sqr) / (var / scale + sqr), scale = B / the smallest
        validated batch, with the gradient statistics of that epoch (interpolated
        between the validated batches around B), and a job finishes when its
        progress reaches, after its last epoch, the least cumulative progress any
        validated batch reached by then. Gain is constant within an epoch, so the
        iterations are exact: the sum over epochs of the progress step / gain.
        """
        if not self.statistics:
            return self.work_iterations(batch_size)
        sizes = sorted(self.statistics)
        init = sizes[0]
        b = min(max(batch_size, sizes[0]), sizes[-1])
        lo = max(s for s in sizes if s <= b)
        hi = min(s for s in sizes if s >= b)
        w = 0.0 if hi == lo else (b - lo) / (hi - lo)
        scale = batch_size / init
        total, before = 0.0, 0.0
        for e in range(self.epochs):
            target = min(float(v[0][e]) for v in self.statistics.values())
            sqr = (1 - w) * self.statistics[lo][1][e] + w * self.statistics[hi][1][e]
            var = (1 - w) * self.statistics[lo][2][e] + w * self.statistics[hi][2][e]
            gain = (var + sqr) / (var / scale + sqr)
            total += (target - before) / gain
            before = target
        return float(total)

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

    def iteration_time(self, placement: tuple[int, ...], batch_size: int) -> float:
        """Seconds per global-batch iteration, with gradient accumulation past the largest per-GPU batch.

        As the original: one GPU with a batch above the smallest validated one
        always accumulates at least once, and the per-GPU batch never exceeds
        the largest validated batch / (GPUs x accumulation steps).
        """
        replicas = sum(placement)
        local = math.ceil(batch_size / replicas - 1e-8)
        accum = max(0, math.ceil(local / self.max_local_bsz - 1e-8) - 1)
        if replicas == 1 and self.iterations and batch_size > min(self.iterations):
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

    profile: ApplicationProfile
    batch_size: int

    def __call__(self, placement: tuple[int, ...]) -> float:
        placement = tuple(g for g in placement if g > 0)
        if not placement:
            return 0.0
        return 1.0 / self.profile.iteration_time(placement, self.batch_size)


def _canonical(placement: tuple[int, ...]) -> tuple[int, ...]:
    """The smallest rotation: the original treats rotations of a placement as the same."""
    p = tuple(g for g in placement if g > 0)
    return min((p[i:] + p[:i] for i in range(len(p))), default=())


def load_profiles(folder: Path, names: set[str]) -> dict[str, ApplicationProfile]:
    return {name: ApplicationProfile.load(folder / name) for name in sorted(names)}


def load_workload(path: Path, applications: Path | None = None, *,
                  max_gpus_cap: int = 64, elastic_max: str = "batch") -> list[SimJob]:
    """Jobs of a Pollux workload CSV; profiles come from `applications` (default: ../applications).

    Elastic range (used by optimus and l1): 1 .. batch_size // smallest
    measured per-GPU batch (as the original's Optimus), capped at
    `max_gpus_cap`; ncf stays at 1 GPU as in the original.
    """
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
    jobs = []
    seen = set()
    for line, row in rows:
        name = row["name"]
        if not name:
            raise TraceError(f"{path}:{line}: empty job name")
        if name in seen:
            raise TraceError(f"{path}:{line}: duplicate job name {name!r}")
        seen.add(name)
        submit = number(path, line, "time", row["time"])
        replicas = integer(path, line, "num_replicas", row["num_replicas"])
        batch = integer(path, line, "batch_size", row["batch_size"])
        profile = profiles[row["application"]]
        max_gpus = max(1, min(max_gpus_cap, int(batch // profile.min_local_bsz)))
        if profile.name == "ncf":
            max_gpus = 1
        max_gpus = max(max_gpus, replicas)
        jobs.append(SimJob(
            key=name, submit_s=submit, requested_gpus=replicas, min_gpus=1, max_gpus=max_gpus,
            work=profile.work_statistical(batch), speed=PolluxSpeed(profile, batch),
            cpus_per_gpu=1, mem_per_gpu_mb=1024, application=profile.name,
        ))
    jobs.sort(key=lambda j: (j.submit_s, j.key))
    log.info("loaded %d jobs from %s", len(jobs), path)
    return jobs
