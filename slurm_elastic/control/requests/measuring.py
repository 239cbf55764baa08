"""Measuring: what one job's own files say (metrics rows, batch range, geometry), read by the contract's
validating readers into a typed per-job Measurement (speed model, restart costs, progress).

The request source is split by responsibility: this module measures, `rules.py` turns a Measurement into
a request by named rules in one declared order, and `source.py` (MeasuredRequests) runs both each cycle.

What is read, per job, from `<ckpt_dir>/<job id>/`:

- `metrics.jsonl` (the rows the training shim appends): steps/s per GPU count and node count (fitted
  online: `allocate.throughput.MeasuredThroughput`), samples/s and gradient noise for adaptive-batch jobs,
  restart costs from the job's own restarts (the wall time from the last row before a restart to the first
  after it, less the steps that interval did at the new speed: startup plus lost work), and progress (the
  last row's `step` and declared `total_steps`);
- `batch.json` ({"min", "max", "base"}), only once its speed is measured and used: an adaptive job;
- `geometry.json`: the world sizes its global batch splits over.

A job's file is input, never authority: it is opened without following links, must be a regular file
owned by the job's user, is read up to a bounded size, and every field is validated; anything else gives
the default model and one log line.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import pwd
import statistics
from dataclasses import dataclass
from typing import Mapping, Sequence

from slurm_elastic import jobfiles as shim
from slurm_elastic.allocate.throughput import MeasuredThroughput, concave_hull
from slurm_elastic.cluster.model import Job
from slurm_elastic.control.requests.settings import RequestSettings
from slurm_elastic.goodput import GradientNoise
from slurm_elastic.jobfiles import BATCH_FILE, BatchRange, MetricsCursor, MetricsRow, parse_row, read_metrics, read_record
from slurm_elastic.jobfiles import Geometry as JobGeometry

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class JobMeasurements:
    """What one job's metrics file says, validated."""

    model: MeasuredThroughput | None = None
    speeds: tuple[tuple[int, float], ...] = ()              # (gpus, median steps/s) as measured, hull or not
    samples: MeasuredThroughput | None = None               # samples/s per GPU count (rows with `batch` only)
    local_batch_at: tuple[tuple[int, float], ...] = ()      # (gpus, batch / gpus) those samples/s were at
    noise: GradientNoise | None = None                      # the newest row's gradient statistics
    restart_costs_s: tuple[float, ...] = ()
    step: int | None = None
    total_steps: int | None = None
    rows: int = 0
    first_gpus: int | None = None                           # the size of its first row: the size it asked for
    problem: str = ""                         # why the file was not used ("" = used, or absent)

    @property
    def restart_cost_s(self) -> float | None:
        recent = self.restart_costs_s[-5:]
        return statistics.median(recent) if recent else None


def validate_row(row: object) -> dict[str, float | int] | None:
    """A line's fields as the request source uses them, typed and in range (jobfiles.MetricsRow); None if refused."""
    parsed = parse_row(row)
    return parsed.fields() if parsed is not None else None


@dataclass(slots=True)
class MetricsTail:
    """What was read of one growing metrics file so far (the controller reads only what was appended).

    Kept bounded: the newest SPEEDS_KEPT speeds per GPU count (at the batch
    the job last ran at with that count: a new batch there starts them
    afresh), the newest COSTS_KEPT restart intervals, the newest gradient
    noise, and the last row.
    """

    cursor: MetricsCursor = dataclasses.field(default_factory=MetricsCursor)   # where the file was read up to
    speeds: dict[int, collections.deque[float]] = dataclasses.field(default_factory=dict)
    nodes: dict[int, int] = dataclasses.field(default_factory=dict)
    batch_at: dict[int, int] = dataclasses.field(default_factory=dict)   # gpus -> batch of speeds[gpus]
    noise: tuple[float, float] | None = None
    lost_s: collections.deque[float] = dataclasses.field(default_factory=lambda: collections.deque(maxlen=16))
    last: dict[str, float | int] | None = None
    count: int = 0
    bad: int = 0
    first_gpus: int | None = None        # the size of the file's first row (the size the job asked for)

    def add(self, row: MetricsRow | Mapping[str, float | int]) -> None:
        row = row.fields() if isinstance(row, MetricsRow) else dict(row)
        if self.count == 0 and self.cursor.from_start:
            self.first_gpus = int(row["gpus"])
        self._add(row)

    def _add(self, row: dict[str, float | int]) -> None:
        g, v = int(row["gpus"]), float(row["steps_per_s"])
        if v > 0:
            batch = row.get("batch")
            if batch is not None and self.batch_at.get(g, batch) != batch:
                self.speeds.pop(g, None)                 # measured at another batch: not comparable
            if batch is not None:
                self.batch_at[g] = int(batch)
            else:
                self.batch_at.pop(g, None)
            self.speeds.setdefault(g, collections.deque(maxlen=SPEEDS_KEPT)).append(v)
            self.nodes[g] = max(self.nodes.get(g, 1), int(row["nodes"]))
        if "grad_sqr" in row:
            self.noise = (float(row["grad_sqr"]), float(row["grad_var"]))
        prev = self.last
        if prev is not None and v > 0 and float(row["time"]) > float(prev["time"]):
            # The shim's steps/s covers the window since its previous row (or since the restart), so a plain
            # interval loses nothing; time that did no steps is a restart: startup, plus redone steps.
            self.lost_s.append(float(row["time"]) - float(prev["time"]) - (int(row["step"]) - int(prev["step"])) / v)
        self.last = row
        self.count += 1


SPEEDS_KEPT = 64
def read_job_metrics(path: str, *, owner_uid: int | None, max_bytes: int,
                     tail: MetricsTail | None = None) -> tuple[MetricsTail, str]:
    """Validated rows of a job's metrics file (appended to `tail`), and a problem ("" when none).

    The file is read by the contract's reader (jobfiles.read_metrics: no link
    followed, no FIFO, the owner checked, at most `max_bytes` per call, a
    partial line bounded); what is kept stays bounded (MetricsTail).
    """
    tail = tail if tail is not None else MetricsTail()
    got = read_metrics(path, owner_uid=owner_uid, max_bytes=max_bytes, cursor=tail.cursor)
    if got.absent:
        return MetricsTail(), ""
    if got.problem:
        return tail, got.problem
    if got.restarted:
        tail = MetricsTail(cursor=got.cursor)      # a new or truncated file: what the old one said is void
    for row in got.rows:
        tail.add(row)
    tail.bad += got.bad
    if tail.bad > max(1, tail.count):   # a torn line is normal; mostly garbage is not a shim's file
        return tail, f"has {tail.bad} invalid lines of {tail.bad + tail.count}"
    return tail, ""


def read_job_geometry(path: str, *, owner_uid: int | None, max_bytes: int) -> tuple[JobGeometry | None, str]:
    """A job's geometry.json (jobfiles.Geometry, read by the contract's reader), and a problem ("" when none)."""
    return read_record(path, JobGeometry.parse, owner_uid=owner_uid, max_bytes=max_bytes, what="a geometry")


def read_batch_range(path: str, *, owner_uid: int | None, max_bytes: int) -> tuple[BatchRange | None, str]:
    """A job's batch.json (jobfiles.BatchRange, read by the contract's reader), and a problem ("" when none)."""
    return read_record(path, BatchRange.parse, owner_uid=owner_uid, max_bytes=max_bytes, what="a batch range")


def measure(rows: Sequence[Mapping[str, float | int]] | MetricsTail, settings: RequestSettings) -> JobMeasurements:
    """Speed model, restart costs and progress from validated rows (in file order) or a file's tail."""
    if not isinstance(rows, MetricsTail):
        tail = MetricsTail()
        for row in rows:
            tail.add(dict(row))
        rows = tail
    tail = rows
    if tail.last is None:
        return JobMeasurements()
    medians = {g: statistics.median(v) for g, v in tail.speeds.items() if v}
    nodes = tuple(sorted(tail.nodes.items()))
    model = (MeasuredThroughput(concave_hull(medians.items()), nodes, float(max(medians)), settings.prior)
             if medians else None)
    # samples/s only where the batch is known: steps/s at different batches are not comparable
    at_batch = {g: v * tail.batch_at[g] for g, v in medians.items() if g in tail.batch_at}
    samples = (MeasuredThroughput(concave_hull(at_batch.items()), nodes, float(max(at_batch)), settings.prior)
               if at_batch else None)
    local = tuple(sorted((g, tail.batch_at[g] / g) for g in at_batch))
    noise = GradientNoise(*tail.noise) if tail.noise is not None else None
    costs = tuple(c for c in tail.lost_s if settings.restart_min_s <= c <= settings.max_restart_cost_s)
    total = tail.last.get("total_steps")
    return JobMeasurements(model=model, speeds=tuple(sorted(medians.items())), samples=samples, local_batch_at=local,
                           noise=noise, restart_costs_s=costs, step=int(tail.last["step"]), total_steps=int(total) if total is not None else None,
                           rows=tail.count, first_gpus=tail.first_gpus)


@dataclass(frozen=True, slots=True)
class Measurement:
    """Everything one job's files say this cycle, validated: what the rules decide from."""

    metrics: JobMeasurements = JobMeasurements()
    batch: BatchRange | None = None          # its batch.json (read only once its measured speed is used)
    batch_problem: str = ""                  # why batch.json was not believed ("" = believed, or absent)
    geometry: JobGeometry | None = None


class JobFiles:
    """Reads each job's files for the request source: the metrics files' tails kept between cycles (only
    what was appended is read), and each problem logged once per job and kind, not every cycle."""

    def __init__(self, settings: RequestSettings) -> None:
        self.settings = settings
        self._cache: dict[str, tuple[tuple[int, int], MetricsTail, JobMeasurements]] = {}
        self._reported: dict[int, str] = {}

    def measure(self, job: Job) -> Measurement:
        """The job's Measurement, its files read in the order metrics, batch range, geometry."""
        metrics = self.metrics(job)
        batch, batch_problem = (self.batch(job) if metrics.model is not None and self.settings.measured_speed
                                else (None, ""))
        return Measurement(metrics, batch, batch_problem, self.geometry(job))

    def metrics(self, job: Job) -> JobMeasurements:
        spec = job.spec
        if spec is None or not spec.ckpt_dir:
            return JobMeasurements()
        try:
            path = shim.metrics_path(spec.ckpt_dir, shim.job_key(job.job_id))
        except ValueError as exc:
            return JobMeasurements(problem=str(exc))
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return JobMeasurements()             # nothing measured yet
        except OSError as exc:
            return self.report(job, path, f"cannot be read ({exc.strerror})")
        key = (st.st_mtime_ns, st.st_size)
        uid = owner_uid(job)
        if uid is None:
            return self.report(job, path, f"cannot be checked: user {job.user!r} is unknown here")
        cached = self._cache.get(path)
        if cached is not None and cached[0] == key:
            return cached[2]
        tail, problem = read_job_metrics(path, owner_uid=uid, max_bytes=self.settings.metrics_max_bytes,
                                         tail=cached[1] if cached is not None else None)
        result = self.report(job, path, problem) if problem else measure(tail, self.settings)
        self._cache[path] = (key, tail, result)
        return result

    def batch(self, job: Job) -> tuple[BatchRange | None, str]:
        """The job's batch.json and why it was not believed ("" when it was, or is absent)."""
        spec = job.spec
        assert spec is not None and spec.ckpt_dir
        uid = owner_uid(job)
        if uid is None:
            return None, ""
        path = os.path.join(shim.job_dir(spec.ckpt_dir, shim.job_key(job.job_id)), BATCH_FILE)
        batch, problem = read_batch_range(path, owner_uid=uid, max_bytes=self.settings.batch_max_bytes)
        if problem:
            key = -job.job_id - (1 << 40)      # its own slot in the once-per-problem memory
            if self._reported.get(key) != problem:
                log.warning("job %d: %s %s; allocated by plain speed", job.job_id, path, problem)
                self._reported[key] = problem
            return None, problem
        return batch, ""

    def geometry(self, job: Job) -> JobGeometry | None:
        """The job's own geometry.json when it can be believed (a bad one: one log line, ignored)."""
        spec = job.spec
        if spec is None or not spec.ckpt_dir:
            return None
        try:
            path = shim.geometry_path(spec.ckpt_dir, shim.job_key(job.job_id))
        except ValueError:
            return None
        uid = owner_uid(job)
        if uid is None:
            return None     # owner unknown here: the file cannot be checked, so it is not read
        geometry, problem = read_job_geometry(path, owner_uid=uid, max_bytes=self.settings.geometry_max_bytes)
        if problem:
            key = -job.job_id   # its own slot in the once-per-problem memory (metrics use the job id)
            if self._reported.get(key) != problem:
                log.warning("job %d: %s %s; ignored", job.job_id, path, problem)
                self._reported[key] = problem
        return geometry

    def report(self, job: Job, path: str, problem: str) -> JobMeasurements:
        """Log a job's problem once (until it changes); what such a file gives: nothing measured."""
        if self._reported.get(job.job_id) != problem:
            log.warning("job %d: %s %s; deciding with the default model", job.job_id, path, problem)
            self._reported[job.job_id] = problem
        return JobMeasurements(problem=problem)


def owner_uid(job: Job) -> int | None:
    """The uid a job's files must be owned by (None: its user is unknown here, so they are not read)."""
    if job.user_id is not None:
        return job.user_id
    try:
        return pwd.getpwnam(job.user).pw_uid
    except (KeyError, TypeError):
        return None
