"""The request source: how each elastic job becomes a JobRequest, decided from what the job itself measured.

Every controller (daemon, `admin rebalance`, user-mode `watch`, the
simulator) gets its source from `default_request_source`, so they decide alike.

What the default source (`MeasuredRequests`) reads, per job, from
`<ckpt_dir>/<job id>/metrics.jsonl` (the rows the training shim appends):

- speed: steps/s per GPU count and node count, fitted online
  (`allocate.throughput.MeasuredThroughput`, with its rule for sizes never
  run: a GPU past the largest size measured adds at most what the last
  measured one did); the default model (linear, a penalty per extra node)
  until a row exists, and a job just started keeps its size until its first
  rows exist (`measure_first_s`), so it is measured at the size it asked for
  (a size the shape rule cannot place, such as 6 GPUs as 2 x 3 on 4-GPU
  nodes, cannot be kept: the job is kept at the placeable counts nearest it);
- restart cost: from the job's own restarts seen in its rows (the wall time
  from the last row before a restart to the first after it, less the steps
  that interval did at the new speed: startup plus lost work); 30 s until one
  was measured;
- remaining work: the last row's `step` against its declared `total_steps`
  (written when the training loop declares its length).

A size measured no faster than a smaller one is not allowed (the speed
frontier), and "faster" means each added GPU gains at least
`min_marginal_gain` (5 %) of what a GPU gives at the smaller size: timing
noise between two sizes of a job that does not scale is not a reason to move.

Adaptive-batch jobs (issue 18): a job whose directory holds `batch.json`
({"min", "max", "base"}: the batch range the shim may choose from and the
batch its learning rate was tuned for) and whose rows carry the batch they ran
at and the gradient noise (`batch`, `grad_sqr`, `grad_var`) is allocated by
goodput: its speed at g GPUs is samples/s times statistical efficiency at the
best batch for g (`allocate.throughput.GoodputThroughput`, arithmetic in
`slurm_elastic.goodput`). The rule for batches never run, stated there: above the
batch per GPU measured, per-GPU compute time grows in proportion to the batch
per GPU (samples/s no higher than measured); below it, a step takes no less
time than measured (steps/s no higher than measured). Speeds at one GPU count
are those measured at the batch it last ran there. Until the noise is
measured (or when batch.json is absent or not believable) the job is
allocated by plain measured speed, as a fixed-batch job is; fixed-batch jobs
always are. Both kinds are in one problem: each job's throughput term is
normalised by its own best, so steps/s and goodput need no common unit.
Remaining time (for the weight) is always from steps/s at the batch measured.

Weights favour short remaining time (shortest remaining time first is what
minimises average completion time): w = user weight x clamp(H / remaining s),
in steps of 19 % (`quantised`).
Anti-starvation, stated: a job that has waited without GPUs for
`starve_after_s` must run (at its minimum, if anything fits at all), and a job
the controller has taken to zero GPUs once is not taken to zero again while it
runs; the restart budget and hysteresis in the Reconciler bound the rest.

The share floor, stated (`share_floor`): a running job is not taken below
min(the size it asked for, its fair share, the size it holds) GPUs, rounded
down to a size it can take, nor to zero, while it runs. The size it asked
for is the GPUs it was submitted at, as this source first saw it pending (before any plan resized it: a job the
controller started below its request, because the cluster was full, still
asked for its request); for a job first seen running (started at once, or
seen first after a restart of the daemon) the GPU count of its metrics file's
first row (a file whose beginning was not read gives no floor). On workload 1
most deepspeech2 jobs were started at 1-3 GPUs of the 6-12 they asked for, so
their floor from the first row was 1-3. Its fair share is the GPUs elastic
work can use (up nodes less non-elastic jobs) x its user weight / the sum of
the user weights of the elastic jobs that want GPUs (running, or pending and
not held), rounded down. The floor never asks a job to grow (it is at most
what it holds) and stops when the share is below one GPU. Why: remaining-time
weights alone make a long job lose every trade against each shorter arrival,
so over its life it was shrunk, grown back and shrunk again, each a restart
(workload 1 before the floor: yolov3 on 2.2 GPUs of the 4 it asked for, 27.7
restarts per job, 1.77x its Tiresias JCT; with it: 3.6 GPUs, 5 restarts,
1.14x). Shortest-remaining-first still decides everything above the floor.

A job's file is input, never authority: it is opened without following
links, must be a regular file owned by the job's user, is read up to a bounded
size, and every field is validated; anything else gives the default model and
one log line. It only ever shapes that one job's own request, whose throughput
term is normalised by its own best speed, so no file can claim more than the
job's weight.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import pwd
import statistics
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, Sequence

from slurm_elastic.allocate.commitments import Commitment
from slurm_elastic.allocate.from_state import DEFAULT_RESTART_COST_S, job_request
from slurm_elastic.goodput import GradientNoise
from slurm_elastic.allocate.problem import Allocation, JobRequest, Policy
from slurm_elastic.allocate.shapes import spanning_widths
from slurm_elastic.allocate.throughput import (GoodputThroughput, LinearThroughput, MeasuredThroughput, concave_hull,
                                               speed_frontier)
from slurm_elastic.cluster.model import ClusterState, Job, JobState
from slurm_elastic import jobfiles as shim
from slurm_elastic.jobfiles import BATCH_FILE, BatchRange, MetricsCursor, MetricsRow, parse_row, read_metrics, read_record
from slurm_elastic.jobfiles import Geometry as JobGeometry
from slurm_elastic.settings import HYSTERESIS, SPEED

log = logging.getLogger(__name__)


class RequestSource(Protocol):
    """Turns the elastic jobs of a (scoped) state into JobRequests, and says what each was built from."""

    def requests(self, state: ClusterState, now: float, policy: Policy,
                 yielding: bool = False) -> tuple[JobRequest, ...]:
        """`yielding`: elastic jobs give GPUs back to a rigid job this cycle; rules that keep a running
        job at its size (measure first, the share floor) do not hold against that."""
        ...

    def basis(self) -> Mapping[str, str]:
        """Job key -> one line on what its latest request was decided from (for `--explain`)."""
        ...

    def decided(self, allocation: Allocation, now: float) -> None:
        """The allocation chosen from the latest requests (the source's memory for anti-starvation)."""
        ...

    def waits(self) -> Mapping[int, str]:
        """Job id -> why the source keeps that job at its size now ("kept ... until measured")."""
        ...

    def bad_geometry(self) -> Mapping[int, str]:
        """Job id -> why its ranks cannot run at its current size (it wrote geometry.json and exited 87):
        such a job is re-planned at once, whatever hysteresis and the restart budget say."""
        ...


@dataclass(frozen=True, slots=True)
class RequestSettings:
    """How measurements become requests (the defaults are written here once)."""

    default_restart_cost_s: float = DEFAULT_RESTART_COST_S
    weight_horizon_s: float = 3600.0          # remaining H seconds => weight 1
    weight_range: tuple[float, float] = (0.05, 20.0)
    hold_s: float = HYSTERESIS.default        # a new size is kept at least this long (the controller's hysteresis)
    starve_after_s: float = 1800.0            # waiting longer without GPUs => must run
    share_floor: bool = True                  # a running job keeps min(asked, fair share, current) (docstring)
    max_restart_cost_s: float = 600.0         # a longer gap between rows was a wait in the queue, not a restart
    measure_first_s: float = 300.0            # a job just started keeps its size this long unless measured
    restart_min_s: float = 2.0                # less lost time between two rows is noise, not a restart
    metrics_max_bytes: int = 1 << 20          # only the file's last MiB is read
    geometry_max_bytes: int = 1 << 14         # geometry.json is a few hundred bytes; more is not the shim's
    batch_max_bytes: int = 1 << 12            # batch.json is three numbers
    min_marginal_gain: float = 0.05           # a GPU gaining less than 5 % of an average one's speed is noise
    prior: LinearThroughput = LinearThroughput()
    # False: speed from the prior even when rows exist - for GPUs that are not real (the demo's fake GPUs
    # share a few CPU cores, so more "GPUs" measure slower); restart cost and remaining work stay measured.
    measured_speed: bool = SPEED.default == "measured"


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


class MeasuredRequests:
    """The default request source (see the module docstring)."""

    def __init__(self, settings: RequestSettings = RequestSettings()) -> None:
        self.settings = settings
        self._cache: dict[str, tuple[tuple[int, int], MetricsTail, JobMeasurements]] = {}
        self._reported: dict[int, str] = {}
        self._waiting_since: dict[int, float] = {}
        self._running: dict[int, bool] = {}
        self._preempted: dict[int, int] = {}
        self._asked: dict[int, int] = {}          # job id -> GPUs it was submitted at (first seen pending)
        self._basis: dict[str, str] = {}
        self._waits: dict[int, str] = {}
        self._bad_geometry: dict[int, str] = {}

    # -- the RequestSource protocol ------------------------------------------------------------
    def requests(self, state: ClusterState, now: float, policy: Policy,
                 yielding: bool = False) -> tuple[JobRequest, ...]:
        node_sizes = {n.gpus for n in state.nodes if n.gpus > 0}
        biggest = max(node_sizes, default=1)
        out = []
        basis: dict[str, str] = {}
        self._waits, self._bad_geometry = {}, {}
        shares = fair_shares(state)
        for job in state.elastic_jobs:
            running = job.state is JobState.RUNNING
            if job.job_id not in self._asked and job.state is JobState.PENDING and job.gpus > 0 and job.spec:
                # The size it was submitted at, seen before any plan resized it (see "The share floor").
                self._asked[job.job_id] = min(max(job.gpus, job.spec.min_gpus), job.spec.max_gpus)
            if running:
                self._waiting_since.pop(job.job_id, None)
            elif not job.held:
                self._waiting_since.setdefault(job.job_id, now if job.submit_time is None else
                                               min(now, job.submit_time))
            self._running[job.job_id] = running
            try:
                req, why = self._request(job, now, policy, node_sizes, biggest, shares.get(job.job_id, 0), yielding)
            except Exception as exc:
                # The job's own files are its user's input: whatever reading them raises (deep JSON, a
                # defect a crafted file finds), only this job falls back to the default model.
                req, why = job_request(job), f"default model: its files could not be used ({exc!r})"
                self._report(job, "its job directory", f"raised {type(exc).__name__} while read ({exc!r:.200})")
            out.append(req)
            basis[req.key] = why
        self._basis = basis
        return tuple(out)

    def basis(self) -> Mapping[str, str]:
        return dict(self._basis)

    def waits(self) -> Mapping[int, str]:
        return dict(self._waits)

    def bad_geometry(self) -> Mapping[int, str]:
        return dict(self._bad_geometry)

    def decided(self, allocation: Allocation, now: float) -> None:
        for key, g in allocation.gpus.items():
            if key.isdigit() and g == 0 and self._running.get(int(key)):
                self._preempted[int(key)] = self._preempted.get(int(key), 0) + 1

    # -- one job ---------------------------------------------------------------------------------
    def _request(self, job: Job, now: float, policy: Policy, node_sizes: set[int],
                 biggest: int, share: int, yielding: bool = False) -> tuple[JobRequest, str]:
        s = self.settings
        m = self._measurements(job)
        spec = job.spec
        assert spec is not None
        notes: list[str] = []
        model: MeasuredThroughput | LinearThroughput | GoodputThroughput
        steps_model: MeasuredThroughput | LinearThroughput = s.prior
        if m.model is not None and s.measured_speed:
            model = steps_model = m.model
            pts = ", ".join(f"{g}:{v:.3g}" for g, v in m.speeds)
            notes.append(f"speed measured ({m.rows} rows; GPUs:steps/s {pts})")
            adaptive, why_not = self._goodput(job, m)
            if adaptive is not None:
                model = adaptive
            if why_not:
                notes.append(why_not)
        else:
            model = s.prior
            notes.append(f"speed not measured yet: default model (linear, {s.prior.node_penalty:.0%} per extra node)"
                         + (f"; metrics file ignored: {m.problem}" if m.problem else ""))

        def nodes_for(g: int) -> int:
            return max(1, math.ceil(g / biggest))

        def placeable(g: int) -> bool:
            return g <= biggest or bool(spanning_widths(g, node_sizes, policy.whole_nodes_when_spanning))

        counts: Sequence[int] = range(spec.min_gpus, spec.max_gpus + 1, spec.gpu_step)
        geometry = self._geometry(job)
        stuck = False
        fits: tuple[int, ...] = ()
        if geometry is not None:
            # Only sizes the job's global batch splits over: any other size ends its ranks with exit 87.
            fits = tuple(g for g in counts if g in geometry.valid_world_sizes)
            stuck = job.state is JobState.RUNNING and job.gpus == geometry.world_size and geometry.stuck
            if stuck:
                self._bad_geometry[job.job_id] = (
                    f"bad geometry: its batch cannot be split over {job.gpus} GPUs (exit 87; valid "
                    f"{', '.join(map(str, geometry.valid_world_sizes[:12]))}): re-planned at once")
                notes.append(self._bad_geometry[job.job_id])
            if fits:
                counts = fits
            else:
                notes.append(f"no size in {spec.min_gpus}-{spec.max_gpus} splits its batch (valid "
                             f"{', '.join(map(str, geometry.valid_world_sizes[:12]))})")
        measured = m.model is not None and s.measured_speed
        allowed = speed_frontier(counts, model, nodes_for, placeable, s.min_marginal_gain) if measured else None
        if allowed and max(allowed) < max((g for g in counts if placeable(g)), default=0):
            notes.append(f"allowed up to {max(allowed)} GPUs: no larger count is faster in its measured speed "
                         f"model (by {s.min_marginal_gain:.0%} of an average GPU's speed per GPU added)")
        if allowed is None and fits:
            allowed = fits
        started = job.start_time if job.start_time is not None else now
        if (s.measured_speed and m.model is None and job.state is JobState.RUNNING and m.problem == "" and not stuck
                and now - started < s.measure_first_s and not yielding):
            # Measure first: a job that has just started keeps its size until its first rows exist, so
            # every job is measured at the size it asked for before it is moved. A size the shape rule
            # cannot place (6 GPUs as 2 x 3 on 4-GPU nodes) cannot be kept: pinned to it, the job had no
            # placeable count and went back to the queue at its minimum (1 GPU, on an empty cluster), and
            # was measured there. So it is kept at the placeable counts nearest its size instead.
            keep = nearest_placeable(job.gpus, counts, placeable)
            if keep:
                allowed = keep
                at = (f"{job.gpus} GPUs" if keep == (job.gpus,) else
                      f"{' or '.join(map(str, keep))} GPUs ({job.gpus} is no shape Slurm is given here)")
                wait = (f"kept at {at} until measured (started {now - started:.0f}s ago, "
                        f"{s.measure_first_s - (now - started):.0f}s left)")
                self._waits[job.job_id] = wait
                notes.append(wait)
        floor = 0
        asked = self._asked.get(job.job_id, m.first_gpus)
        if (s.share_floor and job.state is JobState.RUNNING and not stuck and asked is not None
                and job.gpus > 0 and job.job_id not in self._waits and not yielding):
            floor = min(asked, share, job.gpus)
            pool = tuple(allowed if allowed is not None else counts)
            # The floor is the largest size it can take at or under that bound, not the next one above:
            # rounded up (a share of 5 on a 4-GPU step is 8), the floors of two jobs took all 16 GPUs and
            # left the third its share of nothing. Rounded down, the floors never sum past what is usable.
            floor = max((g for g in pool if g <= floor and placeable(g)), default=floor)
            keep = tuple(g for g in pool if g >= floor)
            if floor >= 1 and keep:
                allowed = keep
                notes.append(f"kept at >= {floor} GPUs while it runs: min(asked {asked}, fair share "
                             f"{share}, holds {job.gpus})")
            else:
                floor = 0
        if isinstance(model, GoodputThroughput):
            shown = ", ".join(f"{g}:{model.batch_for(g, nodes_for(g))[0]}@{model(g, nodes_for(g)):.3g}"
                              for g in (allowed or counts) if placeable(g))
            notes.append(f"goodput at the best batch (GPUs:batch@goodput {shown}; noise scale "
                         f"{model.noise.noise_scale:.3g}, base batch {model.base_batch})")
        # remaining time from steps/s at the batch measured, whatever the speed model is in
        best = max((steps_model(g, nodes_for(g)) for g in (allowed or counts) if placeable(g)), default=0.0)

        restart = m.restart_cost_s
        if restart is None:
            restart = s.default_restart_cost_s
            notes.append(f"restart {restart:.0f}s (default; none measured)")
        else:
            notes.append(f"restart {restart:.0f}s measured ({len(m.restart_costs_s)} restarts)")

        weight = 1.0
        if m.total_steps is not None and m.step is not None and best > 0:
            left_s = max(m.total_steps - m.step, 0) / best
            lo, hi = s.weight_range
            weight = quantised(min(hi, max(lo, s.weight_horizon_s / max(left_s, 1e-9))))
            notes.append(f"{m.total_steps - m.step} of {m.total_steps} steps left, ~{left_s:.0f}s at its best")
        else:
            notes.append("remaining work unknown (no total_steps)")

        must_run = False
        commitment = Commitment.NONE
        waiting = now - self._waiting_since.get(job.job_id, now)
        if waiting >= s.starve_after_s:
            must_run, commitment = True, Commitment.STARVING
            weight = max(weight, 1.0)
            notes.append(f"waited {waiting:.0f}s without GPUs: must run")
        if job.state is JobState.RUNNING and self._preempted.get(job.job_id, 0) >= 1:
            must_run, commitment = True, Commitment.SHARE_FLOOR
            notes.append("preempted before: not taken to zero again while it runs")
        if floor >= 1:
            # the floor holds against zero too (the solver gives it up, in rank order, only if nothing fits)
            must_run, commitment = True, Commitment.SHARE_FLOOR
        # beta * kappa per GPU changed = the share of the throughput term a restart of `restart` seconds
        # loses over a size held `hold_s` (linear approximation), at this job's weight but never below the
        # neutral 1: scaled by a small remaining-time weight, restarts of long jobs were nearly free and
        # they were resized again and again (yolov3: 27 restarts each on workload 1).
        total_w = spec.weight * weight
        charge_w = spec.weight * max(weight, 1.0)
        # The hold is at least measure_first_s: a restarted job keeps its new size until it has measured
        # there, and a charge spread over a hysteresis of 0 s would be infinite (no resize, ever).
        hold = max(s.hold_s, s.measure_first_s)
        kappa = (restart * charge_w / (policy.beta * hold * spec.max_gpus)) if policy.beta > 0 else restart
        notes.append(f"weight {total_w:.3g}" + (f" (user {spec.weight:g})" if spec.weight != 1 else ""))
        req = dataclasses.replace(job_request(job, restart_cost_s=kappa, throughput=model, weight=weight,
                                              allowed_gpus=allowed, must_run=must_run), commitment=commitment)
        return req, "; ".join(notes)

    def _measurements(self, job: Job) -> JobMeasurements:
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
            return self._report(job, path, f"cannot be read ({exc.strerror})")
        key = (st.st_mtime_ns, st.st_size)
        uid = job.user_id if job.user_id is not None else _uid_of(job.user)
        if uid is None:
            return self._report(job, path, f"cannot be checked: user {job.user!r} is unknown here")
        cached = self._cache.get(path)
        if cached is not None and cached[0] == key:
            return cached[2]
        tail, problem = read_job_metrics(path, owner_uid=uid, max_bytes=self.settings.metrics_max_bytes,
                                         tail=cached[1] if cached is not None else None)
        result = self._report(job, path, problem) if problem else measure(tail, self.settings)
        self._cache[path] = (key, tail, result)
        return result

    def _goodput(self, job: Job, m: JobMeasurements) -> tuple[GoodputThroughput | None, str]:
        """An adaptive job's goodput model, or None and why not ("" for a fixed-batch job)."""
        spec = job.spec
        assert spec is not None and spec.ckpt_dir
        uid = job.user_id if job.user_id is not None else _uid_of(job.user)
        if uid is None:
            return None, ""
        path = os.path.join(shim.job_dir(spec.ckpt_dir, shim.job_key(job.job_id)), BATCH_FILE)
        batch, problem = read_batch_range(path, owner_uid=uid, max_bytes=self.settings.batch_max_bytes)
        if problem:
            key = -job.job_id - (1 << 40)      # its own slot in the once-per-problem memory
            if self._reported.get(key) != problem:
                log.warning("job %d: %s %s; allocated by plain speed", job.job_id, path, problem)
                self._reported[key] = problem
            return None, f"batch.json ignored ({problem}): plain speed"
        if batch is None:
            return None, ""
        if m.samples is None or m.noise is None:
            return None, "adaptive batch, but its rows carry no batch and gradient noise yet: plain speed"
        return GoodputThroughput(m.samples, m.local_batch_at, batch.min, batch.max, batch.base, m.noise), ""

    def _geometry(self, job: Job) -> JobGeometry | None:
        """The job's own geometry.json when it can be believed (a bad one: one log line, ignored)."""
        spec = job.spec
        if spec is None or not spec.ckpt_dir:
            return None
        try:
            path = shim.geometry_path(spec.ckpt_dir, shim.job_key(job.job_id))
        except ValueError:
            return None
        uid = job.user_id if job.user_id is not None else _uid_of(job.user)
        if uid is None:
            return None     # owner unknown here: the file cannot be checked, so it is not read
        geometry, problem = read_job_geometry(path, owner_uid=uid, max_bytes=self.settings.geometry_max_bytes)
        if problem:
            key = -job.job_id   # its own slot in the once-per-problem memory (metrics use the job id)
            if self._reported.get(key) != problem:
                log.warning("job %d: %s %s; ignored", job.job_id, path, problem)
                self._reported[key] = problem
        return geometry

    def _report(self, job: Job, path: str, problem: str) -> JobMeasurements:
        if self._reported.get(job.job_id) != problem:
            log.warning("job %d: %s %s; deciding with the default model", job.job_id, path, problem)
            self._reported[job.job_id] = problem
        return JobMeasurements(problem=problem)


def fair_shares(state: ClusterState) -> dict[int, int]:
    """Job id -> its fair share of the GPUs elastic work can use: those GPUs x its user weight / the sum of
    the weights of the elastic jobs that want GPUs (running, or pending and not held), rounded down."""
    usable = sum(n.gpus for n in state.nodes if n.available)
    usable -= sum(j.gpus for j in state.jobs if j.spec is None and j.state is JobState.RUNNING)
    wanting = [j for j in state.elastic_jobs
               if j.state is JobState.RUNNING or (j.state is JobState.PENDING and not j.held)]
    total_w = sum(j.spec.weight for j in wanting if j.spec is not None)
    if usable <= 0 or total_w <= 0:
        return {}
    return {j.job_id: int(usable * j.spec.weight / total_w + 1e-9) for j in wanting if j.spec is not None}


def nearest_placeable(gpus: int, counts: Sequence[int], placeable: Callable[[int], bool]) -> tuple[int, ...]:
    """`gpus` when it is an allowed count the shape rule can place; else the nearest such counts below and
    above it (either may be missing); () when no allowed count is placeable."""
    ok = [c for c in counts if placeable(c)]
    if gpus in ok:
        return (gpus,)
    below = [c for c in ok if c < gpus]
    above = [c for c in ok if c > gpus]
    return tuple(([max(below)] if below else []) + ([min(above)] if above else []))


def quantised(weight: float) -> float:
    """The weight in steps of 2^(1/4) (19 %): it changes only when the remaining time does by that much,
    so the allocation does not churn with the drift of every cycle (and an unchanged problem is not re-solved)."""
    return 2.0 ** (round(4.0 * math.log2(weight)) / 4.0)


def job_owner_uid(job: Job) -> int | None:
    """The uid the files in `job`'s directory must belong to (None: its owner is unknown here)."""
    return job.user_id if job.user_id is not None else _uid_of(job.user)


def _uid_of(user: str) -> int | None:
    try:
        return pwd.getpwnam(user).pw_uid
    except (KeyError, TypeError):
        return None


def default_request_source(settings: RequestSettings | None = None) -> RequestSource:
    """The request source every controller uses unless told otherwise (one home for that choice)."""
    return MeasuredRequests(settings or RequestSettings())


def with_basis(allocation: Allocation, basis: Mapping[str, str]) -> Allocation:
    """The allocation carrying what each job's request was decided from (printed by `--explain`)."""
    return dataclasses.replace(allocation, basis=dict(basis))
