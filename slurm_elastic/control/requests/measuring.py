"""Measuring: what one job's own files say (metrics rows, batch range, geometry), read by the contract's
validating readers into a typed per-job Measurement (speed model, restart costs, progress).

The request source is split by responsibility: this module measures, `rules.py` turns a Measurement into
a request by named rules in one declared order, and `source.py` (MeasuredRequests) runs both each cycle.

What is read, per job, from `<ckpt_dir>/<job id>/`:

- `metrics.jsonl` (the rows the training shim appends): steps/s per GPU count and node count (a step-time
  model fitted online predicts the sizes never run: `allocate.stepmodel`, inside
  `allocate.throughput.MeasuredThroughput`), samples/s and gradient noise for adaptive-batch jobs,
  restart costs from the job's own restarts (the wall time from the last row before a restart to the first
  after it, less the steps that interval did at the new speed: startup plus lost work), per path: a relaunch,
  or the ranks going on in their processes (the first row after it says `in_place`), and progress (the
  last row's `step` and declared `total_steps`);
- `batch.json` ({"min", "max", "base"}), only once its speed is measured and used: an adaptive job;
- `geometry.json`: the world sizes its global batch splits over.

A job's file is input, never authority: it is opened without following links, must be a regular file
owned by the job's user, is read up to a bounded size, and every field is validated; anything else gives
the default model and one log line. A speed row counts only at a size Slurm ran the job at (gpus, nodes as
the snapshots showed it RUNNING, `JobFiles.observe`, remembered in the controller's journal so a restarted
daemon and a dry run believe the same rows): a row at any other size is ignored, with one log line per job,
so a job cannot claim a speed at a size nobody saw it run.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import pwd
import re
import statistics
from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

from slurm_elastic import jobfiles as shim
from slurm_elastic.allocate.stepmodel import step_time_model
from slurm_elastic.allocate.throughput import MeasuredThroughput, concave_hull
from slurm_elastic.cluster.model import ClusterState, Job, JobState
from slurm_elastic.control.requests.settings import RESTART_MIN_S, RequestSettings
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
    restart_costs_s: tuple[float, ...] = ()                 # relaunches (new processes), in file order
    in_place_costs_s: tuple[float, ...] = ()                # the ranks went on in their processes
    step: int | None = None
    total_steps: int | None = None
    batch: int | None = None                                # the newest row's global batch (its steps' unit)
    rows: int = 0
    first_gpus: int | None = None                           # the size of its first row: the size it asked for
    problem: str = ""                         # why the file was not used ("" = used, or absent)
    ignored: tuple[tuple[int, int], ...] = ()  # (gpus, nodes) of speed rows at sizes Slurm never ran it at

    @property
    def restart_cost_s(self) -> float | None:
        """What a relaunch costs the job: the median of its newest five."""
        recent = self.restart_costs_s[-5:]
        return statistics.median(recent) if recent else None

    @property
    def in_place_cost_s(self) -> float | None:
        """What a resize that kept its processes costs the job: the median of its newest five."""
        recent = self.in_place_costs_s[-5:]
        return statistics.median(recent) if recent else None


def validate_row(row: object) -> dict[str, float | int] | None:
    """A line's fields as the request source uses them, typed and in range (jobfiles.MetricsRow); None if refused."""
    parsed = parse_row(row)
    return parsed.fields() if parsed is not None else None


@dataclass(slots=True)
class MetricsTail:
    """What was read of one growing metrics file so far (the controller reads only what was appended).

    Kept bounded: the newest SPEEDS_KEPT speeds per (GPU count, node count)
    (at the batch the job last ran at with that size: a new batch there
    starts them afresh) for the SIZES_KEPT sizes written to last (a file
    that names a new size in every row must not grow each cycle's work and
    the daemon's memory with it), the newest 16 relaunches
    (intervals that lost at least RESTART_MIN_S) and, apart, the newest 16
    resizes in place (the row after one says `in_place`), the newest gradient
    noise, and the last row.
    """

    cursor: MetricsCursor = dataclasses.field(default_factory=MetricsCursor)   # where the file was read up to
    speeds: dict[tuple[int, int], collections.deque[float]] = dataclasses.field(default_factory=dict)
    batch_at: dict[tuple[int, int], int] = dataclasses.field(default_factory=dict)   # size -> batch of speeds[size]
    noise: tuple[float, float] | None = None
    # (seconds that did no steps, the (gpus, nodes) it restarted at): a restart counts only at a size Slurm ran
    lost_s: collections.deque[tuple[float, tuple[int, int]]] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=16))
    in_place_s: collections.deque[tuple[float, tuple[int, int]]] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=16))
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
            size = (g, int(row["nodes"]))
            batch = row.get("batch")
            if batch is not None and self.batch_at.get(size, batch) != batch:
                self.speeds.pop(size, None)              # measured at another batch: not comparable
            if batch is not None:
                self.batch_at[size] = int(batch)
            else:
                self.batch_at.pop(size, None)
            kept = self.speeds.pop(size, None)               # re-inserted last: the dicts run oldest first
            if kept is None and len(self.speeds) >= SIZES_KEPT:
                oldest = next(iter(self.speeds))
                del self.speeds[oldest]
                self.batch_at.pop(oldest, None)
            self.speeds[size] = kept if kept is not None else collections.deque(maxlen=SPEEDS_KEPT)
            self.speeds[size].append(v)
        if "grad_sqr" in row:
            self.noise = (float(row["grad_sqr"]), float(row["grad_var"]))
        prev = self.last
        if prev is not None and v > 0 and float(row["time"]) > float(prev["time"]):
            # The shim's steps/s covers the window since its previous row (or since the restart), so a plain
            # interval loses nothing; time that did no steps is a restart: startup, plus redone steps.
            lost = float(row["time"]) - float(prev["time"]) - (int(row["step"]) - int(prev["step"])) / v
            size = (g, int(row["nodes"]))
            if row.get("in_place"):
                # Steps before the resize, at the old (faster) speed, are counted at the new one here: a
                # lower bound of the real cost (exact where the resize follows a row, as in the simulator);
                # one at or below 0 says nothing.
                if lost > 0:
                    self.in_place_s.append((lost, size))
            elif lost >= RESTART_MIN_S:
                self.lost_s.append((lost, size))
        self.last = row
        self.count += 1


SPEEDS_KEPT = 64
SIZES_KEPT = 32
MIN_READ_BYTES = 1 << 12           # a job's part of its user's metrics budget is never less


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


def measure(rows: Sequence[Mapping[str, float | int]] | MetricsTail, settings: RequestSettings,
            ran: frozenset[tuple[int, int]] | None = None) -> JobMeasurements:
    """Speed model, restart costs and progress from validated rows (in file order) or a file's tail.

    `ran`: the (gpus, nodes) sizes Slurm ran the job at; speed rows at any other size, and restarts measured
    at one, are left out (the sizes listed in `ignored`). None: every row's size is believed (rows that came from no job directory).
    """
    if not isinstance(rows, MetricsTail):
        tail = MetricsTail()
        for row in rows:
            tail.add(dict(row))
        rows = tail
    tail = rows
    if tail.last is None:
        return JobMeasurements()
    sizes = sorted(size for size, v in tail.speeds.items() if v)
    ignored = tuple(size for size in sizes if ran is not None and size not in ran)
    at = {size: statistics.median(tail.speeds[size]) for size in sizes if ran is None or size in ran}
    model = _throughput(at, {size: tail.batch_at.get(size) for size in at}, tail, settings, "steps")
    # samples/s only where the batch is known: steps/s at different batches are not comparable
    batches = {size: tail.batch_at[size] for size in at if size in tail.batch_at}
    at_batch = {size: v * batches[size] for size, v in at.items() if size in batches}
    samples = _throughput(at_batch, batches, tail, settings, "samples")
    local = tuple(sorted({g: batches[(g, n)] / g for g, n in at_batch}.items()))
    medians = _best_per_gpus(at)
    noise = GradientNoise(*tail.noise) if tail.noise is not None else None
    def believed(lost: collections.deque[tuple[float, tuple[int, int]]], least: float) -> tuple[float, ...]:
        return tuple(c for c, size in lost
                     if least <= c <= settings.max_restart_cost_s and (ran is None or size in ran))
    costs, in_place_costs = believed(tail.lost_s, settings.restart_min_s), believed(tail.in_place_s, 0.0)
    total, batch = tail.last.get("total_steps"), tail.last.get("batch")
    return JobMeasurements(model=model, speeds=tuple(sorted(medians.items())), samples=samples, local_batch_at=local,
                           noise=noise, restart_costs_s=costs, in_place_costs_s=in_place_costs, step=int(tail.last["step"]), total_steps=int(total) if total is not None else None,
                           batch=int(batch) if batch is not None else None,
                           rows=tail.count, first_gpus=tail.first_gpus, ignored=ignored)


def _best_per_gpus(at: Mapping[tuple[int, int], float]) -> dict[int, float]:
    best: dict[int, float] = {}
    for (g, _), v in at.items():
        best[g] = max(best.get(g, 0.0), v)
    return best


def _throughput(at: Mapping[tuple[int, int], float], batches: Mapping[tuple[int, int], int | None],
                tail: MetricsTail, settings: RequestSettings, kind: str) -> MeasuredThroughput | None:
    """The MeasuredThroughput of speeds per (gpus, nodes), its step-time model fitted to them
    (`settings.predict_unmeasured`), or None when nothing is measured."""
    if not at:
        return None
    per_gpus = _best_per_gpus(at)
    nodes: dict[int, int] = {}
    for g, n in at:
        nodes[g] = max(nodes.get(g, 1), n)
    # The step-time model is fitted to steps/s (samples/s = steps/s x batch).
    steps = {size: v / batches[size] if kind == "samples" and batches[size] else v for size, v in at.items()}
    predicted = (step_time_model(((g, n, batches.get((g, n)), steps[(g, n)], len(tail.speeds[(g, n)]))
                                  for g, n in sorted(at)), kind=kind, eta=settings.explore_discount)  # type: ignore[arg-type]
                 if settings.predict_unmeasured else None)
    return MeasuredThroughput(concave_hull(per_gpus.items()), tuple(sorted(nodes.items())), float(max(per_gpus)),
                              settings.prior, predicted=predicted)


@dataclass(frozen=True, slots=True)
class Measurement:
    """Everything one job's files say this cycle, validated: what the rules decide from."""

    metrics: JobMeasurements = JobMeasurements()
    batch: BatchRange | None = None          # its batch.json (read only once its measured speed is used)
    batch_problem: str = ""                  # why batch.json was not believed ("" = believed, or absent)
    geometry: JobGeometry | None = None


class SizesRan(Protocol):
    """Where the sizes Slurm ran each job at are remembered (the controller's Journal, or `SizesInMemory`).

    `lifelong`: recorded by a controller over each job's life; False for a one-shot view (`status`, a
    dry run) that cannot read the controller's journal and saw only the job's current size."""

    lifelong: bool

    def record_ran_at(self, job_id: int, size: tuple[int, int]) -> None: ...

    def ran_at(self, job_id: int) -> frozenset[tuple[int, int]]: ...


class SizesInMemory:
    """SizesRan for one process's lifetime (tests and sources built without a journal)."""

    lifelong = True

    def __init__(self) -> None:
        self._ran: dict[int, frozenset[tuple[int, int]]] = {}

    def record_ran_at(self, job_id: int, size: tuple[int, int]) -> None:
        self._ran[job_id] = self._ran.get(job_id, frozenset()) | {size}

    def ran_at(self, job_id: int) -> frozenset[tuple[int, int]]:
        return self._ran.get(job_id, frozenset())


class JobFiles:
    """Reads each job's files for the request source: the metrics files' tails kept between cycles (only
    what was appended is read), and each problem logged once per job and kind, not every cycle.

    A user's metrics files share one budget a cycle (`metrics_max_bytes`), each job an equal part of it
    (its newest bytes; never less than MIN_READ_BYTES), so one user appending fast to many jobs' files
    costs the cycle one budget's parsing (more only past `metrics_max_bytes / MIN_READ_BYTES` jobs, as
    every other per-job cost) and slows no other user's reads.
    """

    def __init__(self, settings: RequestSettings, sizes: SizesRan | None = None) -> None:
        self.settings = settings
        self.sizes = sizes if sizes is not None else SizesInMemory()
        self._cache: dict[str, tuple[tuple[int, int], MetricsTail, JobMeasurements, frozenset[tuple[int, int]]]] = {}
        self._reported: dict[int, str] = {}
        self._part: dict[int | None, int] = {}    # uid -> metrics bytes each of its jobs may read this cycle
        self._job_of: dict[str, int] = {}         # metrics path -> the job it was read for

    def begin_cycle(self, state: ClusterState) -> None:
        """Share each user's metrics budget among their elastic jobs for this cycle; forget the files of
        jobs that ended or left Slurm (a job whose plan is open, seen without its spec, is kept)."""
        jobs = state.elastic_jobs
        present = {job.job_id for job in state.jobs if not job.state.finished}
        for path in [p for p, job_id in self._job_of.items() if job_id not in present]:
            self._cache.pop(path, None)
            del self._job_of[path]
        mine = collections.Counter(owner_uid(job) for job in jobs)
        self._part = {uid: max(MIN_READ_BYTES, self.settings.metrics_max_bytes // n) for uid, n in mine.items()}

    def observe(self, job: Job) -> None:
        """Remember the size Slurm runs `job` at now: only speed rows at sizes remembered are used."""
        if job.state is JobState.RUNNING and job.gpus > 0:
            size = (job.gpus, len(job.nodes) or job.num_nodes)
            if size not in self.sizes.ran_at(job.job_id):
                self.sizes.record_ran_at(job.job_id, size)

    def ran(self, job: Job) -> frozenset[tuple[int, int]]:
        """The (gpus, nodes) sizes Slurm has been seen running `job` at."""
        return self.sizes.ran_at(job.job_id)

    def measure(self, job: Job) -> Measurement:
        """The job's Measurement, its files read in the order metrics, batch range, geometry (the size
        it runs at now observed first)."""
        self.observe(job)
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
        ran = self.ran(job)
        cached = self._cache.get(path)
        if cached is not None and cached[0] == key:
            if cached[3] == ran or cached[2].problem:
                return cached[2]
            tail, problem = cached[1], ""          # the file is as read; only the sizes seen running grew
        else:
            part = self._part.get(uid, self.settings.metrics_max_bytes)
            tail, problem = read_job_metrics(path, owner_uid=uid, max_bytes=part,
                                             tail=cached[1] if cached is not None else None)
        result = self.report(job, path, problem) if problem else measure(tail, self.settings, ran)
        self._cache[path] = (key, tail, result, ran)
        self._job_of[path] = job.job_id
        if result.ignored:
            self._report_ignored(job, path, result.ignored)
        return result

    def _report_ignored(self, job: Job, path: str, ignored: tuple[tuple[int, int], ...]) -> None:
        """One log line per job (not per cycle) for speed rows at sizes Slurm never ran it at; a one-shot
        view that cannot read the controller's record of them says so instead, not as a warning."""
        key = -job.job_id - (2 << 40)          # its own slot in the once-per-problem memory
        if key not in self._reported:
            sizes = ", ".join(f"{g} GPUs on {n} node{'s' if n > 1 else ''}" for g, n in ignored[:8])
            sizes += f" and {len(ignored) - 8} more" if len(ignored) > 8 else ""
            if self.sizes.lifelong:
                log.warning("job %d: %s has speed rows at sizes Slurm never ran it at (%s); those rows are "
                            "ignored", job.job_id, path, sizes)
            else:
                log.info("job %d: speed rows at %s left out of this view: it saw Slurm run the job only at its "
                         "current size (the controller's journal, which records every size, is not readable "
                         "here)", job.job_id, sizes)
            self._reported[key] = sizes

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
            # its own slot in the once-per-problem memory
            self._say(job, -job.job_id - (1 << 40), f"{path} {problem}; allocated by plain speed")
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
            # its own slot in the once-per-problem memory (metrics use the job id)
            self._say(job, -job.job_id, f"{path} {problem}; ignored")
        return geometry

    def report(self, job: Job, path: str, problem: str) -> JobMeasurements:
        """Log a job's problem once (until it changes); what such a file gives: nothing measured."""
        self._say(job, job.job_id, f"{path} {problem}; deciding with the default model")
        return JobMeasurements(problem=problem)

    def _say(self, job: Job, key: int, line: str) -> None:
        """`line` about `job`'s files, once per `key` until it changes: a warning to the controller (root) and to
        the job's owner, a note in another user's view (their `status` cannot read that job's files, and the
        problem is not theirs to fix)."""
        kind = re.sub(r"\d+", "N", line)   # "has 7 invalid lines of 7" is the same problem as "5 of 5"
        if self._reported.get(key) == kind:
            return
        self._reported[key] = kind
        viewer = os.geteuid()
        level = logging.WARNING if viewer == 0 or viewer == owner_uid(job) else logging.INFO
        log.log(level, "job %d: %s", job.job_id, line)


def owner_uid(job: Job) -> int | None:
    """The uid a job's files must be owned by (None: its user is unknown here, so they are not read)."""
    if job.user_id is not None:
        return job.user_id
    try:
        return pwd.getpwnam(job.user).pw_uid
    except (KeyError, TypeError):
        return None
