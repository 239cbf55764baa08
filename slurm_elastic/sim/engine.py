"""The discrete-event core: arrivals, scheduling points, node failures, restarts, and what they cost."""

from __future__ import annotations

import heapq
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

from slurm_elastic.errors import AllocationError, TraceError
from slurm_elastic.sim.cluster import FailureSchedule, NodeEvent, SimNode
from slurm_elastic.sim.jobs import Segment, SegmentedSpeed, SimJob
from slurm_elastic.sim.policy import ClusterView, Decision, FreeResources, JobView, SchedulingPolicy

log = logging.getLogger(__name__)

RESTART_METHODS = ("forward-layer", "traditional")


@dataclass(frozen=True, slots=True)
class RestartModel:
    """What a restart costs.

    Every start pays `overhead_s` of no progress while holding its GPUs (the
    first start too, as in the Pollux simulator; only later ones count as
    restarts). Checkpoints are taken every `checkpoint_interval_s` of running.

    - `forward-layer` (this project): a controller-signalled restart
      checkpoints through the next forward pass, so it loses no work;
      periodic checkpoints are written in the background (no stall).
    - `traditional`: every checkpoint is a full synchronous one that stalls
      the job `sync_checkpoint_s`, periodic ones included, and a signalled
      restart first writes one.
    Either way a node failure loses the work since the last periodic checkpoint.

    With `forward-layer`, a job a policy shrinks to some of its own nodes with
    its ranks kept (Decision.in_place), past its start, pays `in_place_s`
    instead of the overhead: the survivors commit and re-form their group in
    their processes, and lose no work (2.6-2.7 s to the first step at the new
    size on the local cluster: docs/controller.md, "What each resize path
    costs"). It still counts as a restart (a resize).
    """

    method: str = "forward-layer"
    overhead_s: float = 30.0
    checkpoint_interval_s: float = 1800.0
    sync_checkpoint_s: float = 30.0
    in_place_s: float = 3.0

    def __post_init__(self) -> None:
        if self.method not in RESTART_METHODS:
            raise TraceError(f"unknown restart method {self.method!r} (choose {', '.join(RESTART_METHODS)})")
        for name in ("overhead_s", "sync_checkpoint_s", "in_place_s"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                raise TraceError(f"restart {name} must be >= 0 seconds, got {v!r}")
        if not math.isfinite(self.checkpoint_interval_s) or self.checkpoint_interval_s <= 0:
            raise TraceError(f"checkpoint interval must be > 0 seconds, got {self.checkpoint_interval_s!r}")


@dataclass(frozen=True, slots=True)
class SimConfig:
    nodes: tuple[SimNode, ...]
    interval_s: float = 60.0
    restart: RestartModel = RestartModel()
    failures: FailureSchedule = FailureSchedule()
    max_time_s: float = 60 * 86400.0
    immediate: bool = True       # re-solve at arrivals, completions and node events, not only at ticks
    # Each incarnation of an elastic job ends at this time limit: it commits at Slurm's warning (a signalled
    # stop: the restart method's cost), requeues itself and waits for the policy to start it again.
    wall_time_s: float | None = None

    def __post_init__(self) -> None:
        if not self.nodes:
            raise TraceError("the cluster has no nodes")
        if self.wall_time_s is not None and (not math.isfinite(self.wall_time_s) or self.wall_time_s <= 0):
            raise TraceError(f"wall time must be > 0 seconds, got {self.wall_time_s!r}")
        if len({n.name for n in self.nodes}) != len(self.nodes):
            raise TraceError("node names must be unique")
        if not math.isfinite(self.interval_s) or self.interval_s <= 0:
            raise TraceError(f"scheduling interval must be > 0 seconds, got {self.interval_s!r}")


@dataclass(frozen=True, slots=True)
class JobRecord:
    key: str
    application: str
    submit_s: float
    start_s: float | None
    finish_s: float | None
    requested_gpus: int
    restarts: int
    gpu_s: float                # GPU-seconds held
    restart_loss_gpu_s: float   # restart stalls + redone work + synchronous checkpoint stalls
    elastic: bool = True        # False: a rigid job (min = max GPUs)
    time_limits: int = 0        # incarnations ended at SimConfig.wall_time_s (each also a restart)

    @property
    def jct_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.submit_s

    @property
    def wait_s(self) -> float | None:
        """Submission to first start."""
        return None if self.start_s is None else self.start_s - self.submit_s


@dataclass(frozen=True, slots=True)
class DecisionRecord:
    """One scheduling point: when, why, what changed (key, GPUs before, after) and the policy's notes."""

    time_s: float
    reasons: tuple[str, ...]
    changes: tuple[tuple[str, int, int], ...]
    notes: tuple[str, ...]
    solve_s: float


@dataclass(frozen=True, slots=True)
class SimResult:
    policy: str
    restart_method: str
    jobs: tuple[JobRecord, ...]
    decisions: tuple[DecisionRecord, ...]
    # (time, allocated GPUs, up GPUs) after each event; piecewise constant until the next sample
    utilisation: tuple[tuple[float, int, int], ...]
    # (time, job key, GPUs) whenever a job's GPU count changes
    timeline: tuple[tuple[float, str, int], ...]
    node_failures: int
    end_s: float
    wall_s: float
    unfinished: tuple[str, ...] = ()


class _Run:
    """Mutable progress of one job inside the engine (hot loop; never leaves this module)."""

    __slots__ = ("job", "placement", "remaining", "stall", "stall_counts", "since_ckpt_run", "since_ckpt_work",
                 "attained", "executed", "start", "finish", "restarts", "in_place", "loss", "speed",
                 "pending_stall", "segment_left", "segment", "incarnation_start", "time_limits")

    def __init__(self, job: SimJob) -> None:
        self.job = job
        self.placement: dict[str, int] = {}
        self.remaining = job.work
        self.stall = 0.0
        self.stall_counts = False       # is the current stall a restart (not the first start)?
        self.since_ckpt_run = 0.0
        self.since_ckpt_work = 0.0
        self.attained = 0.0
        self.executed = 0.0
        self.start: float | None = None
        self.finish: float | None = None
        self.restarts = 0
        self.in_place = 0               # of those restarts, shrinks that kept its processes
        self.loss = 0.0
        self.speed = 0.0                # effective work/s while running (after checkpoint stalls)
        self.pending_stall = 0.0        # traditional: synchronous checkpoint owed before the next start
        self.segment_left = math.inf    # work before the speed changes (SegmentedSpeed: the epoch's end)
        self.segment: Segment | None = None
        self.incarnation_start = 0.0    # when the current placement began (a time limit counts from it)
        self.time_limits = 0

    @property
    def gpus(self) -> int:
        return sum(self.placement.values())


class Simulation:
    """One policy over one workload on one cluster; `run()` returns the result."""

    def __init__(self, jobs: list[SimJob], policy: SchedulingPolicy, config: SimConfig,
                 progress: Callable[[int, int, float], None] | None = None) -> None:
        if not jobs:
            raise TraceError("the workload has no jobs")
        keys = [j.key for j in jobs]
        if len(set(keys)) != len(keys):
            raise TraceError("job names must be unique")
        empty = FreeResources.of(config.nodes, {}, {})
        too_big = [j for j in jobs if empty.total_usable(j) < j.requested_gpus]
        if too_big:
            j = too_big[0]
            raise TraceError(
                f"{len(too_big)} job(s) cannot run even on the empty cluster, e.g. {j.key}: {j.requested_gpus} GPUs "
                f"with {j.cpus_per_gpu} CPUs and {j.mem_per_gpu_mb} MB per GPU, the cluster holds "
                f"{empty.total_usable(j)} such GPUs ({sum(n.gpus for n in config.nodes)} GPUs in all)")
        self.jobs = sorted(jobs, key=lambda j: (j.submit_s, j.key))
        self.policy = policy
        self.config = config
        self.progress = progress

    # -- costs ------------------------------------------------------------------------------
    def _interval(self, job: SimJob) -> float:
        return job.checkpoint_interval_s or self.config.restart.checkpoint_interval_s

    def _overhead(self, job: SimJob) -> float:
        return self.config.restart.overhead_s if job.restart_overhead_s is None else job.restart_overhead_s

    def _effective_speed(self, run: _Run) -> float:
        placement = tuple(sorted(run.placement.values(), reverse=True))
        model = run.job.speed
        if isinstance(model, SegmentedSpeed):
            run.segment = model.segment(placement, run.job.work - run.remaining)
            run.segment_left = run.segment.until
            raw = run.segment.rate
        else:
            raw = model(placement)
        if self.config.restart.method == "traditional" and self.config.restart.sync_checkpoint_s > 0:
            interval = self._interval(run.job)
            return raw * interval / (interval + self.config.restart.sync_checkpoint_s)
        return raw

    def run(self) -> SimResult:
        wall0 = time.perf_counter()
        cfg = self.config
        nodes = {n.name: n for n in cfg.nodes}
        up: dict[str, SimNode] = dict(nodes)
        repairs: list[tuple[float, str]] = []          # heap of (time, node)
        failures: Iterator[NodeEvent] = cfg.failures.iterate(cfg.nodes)
        next_failure = next(failures, None)
        runs = {j.key: _Run(j) for j in self.jobs}
        active: dict[str, _Run] = {}
        arrivals = list(self.jobs)
        ai = 0
        now = 0.0
        next_tick = cfg.interval_s
        done = 0
        total = len(self.jobs)
        decisions: list[DecisionRecord] = []
        util: list[tuple[float, int, int]] = [(0.0, 0, sum(n.gpus for n in up.values()))]
        timeline: list[tuple[float, str, int]] = []
        n_failures = 0
        sync = cfg.restart.sync_checkpoint_s if cfg.restart.method == "traditional" else 0.0
        wall = cfg.wall_time_s

        while done < total:
            # 1. the next event time
            t_next = next_tick
            if ai < total:
                t_next = min(t_next, arrivals[ai].submit_s)
            if next_failure is not None:
                t_next = min(t_next, next_failure.time_s)
            if repairs:
                t_next = min(t_next, repairs[0][0])
            for run in active.values():
                if run.placement and run.speed > 0:
                    t_next = min(t_next, now + run.stall + min(run.remaining, run.segment_left) / run.speed)
                if run.placement and wall is not None and run.job.elastic:
                    t_next = min(t_next, run.incarnation_start + wall)
            if t_next > cfg.max_time_s:
                log.warning("stopping at the time limit %.0f s with %d jobs unfinished", cfg.max_time_s, total - done)
                break
            t_next = max(t_next, now)
            # 2. advance every running job to t_next
            dt = t_next - now
            if dt > 0:
                for run in active.values():
                    if run.placement:
                        self._advance(run, dt)
            now = t_next
            reasons: list[str] = []
            # 2b. a job whose speed follows its progress starts its next segment (a new epoch: batch re-chosen)
            for run in active.values():
                if run.placement and run.segment_left <= 1e-9 * run.job.work + 1e-12 and run.remaining > 0:
                    run.speed = self._effective_speed(run)
            # 3. completions
            for key in [k for k, r in active.items() if r.placement and r.remaining <= 1e-9 * r.job.work + 1e-12]:
                run = active.pop(key)
                run.remaining = 0.0
                run.finish = now
                if run.placement:
                    timeline.append((now, key, 0))
                run.placement = {}
                done += 1
                reasons.append("completion")
            # 3b. time limits: the incarnation commits at the warning and requeues itself
            if wall is not None:
                for key, run in active.items():
                    if run.placement and run.job.elastic and now >= run.incarnation_start + wall - 1e-9:
                        self._stop_signalled(run, sync)
                        run.time_limits += 1
                        timeline.append((now, key, 0))
                        reasons.append("time-limit")
            # 4. node repairs and failures
            while repairs and repairs[0][0] <= now:
                _, name = heapq.heappop(repairs)
                if name not in up and not any(n == name for _, n in repairs):
                    up[name] = nodes[name]
                    reasons.append("node-up")
            while next_failure is not None and next_failure.time_s <= now:
                ev = next_failure
                next_failure = next(failures, None)
                if ev.node not in up:
                    heapq.heappush(repairs, (ev.time_s + ev.down_s, ev.node))
                    continue
                n_failures += 1
                del up[ev.node]
                heapq.heappush(repairs, (ev.time_s + ev.down_s, ev.node))
                reasons.append("node-down")
                for key, run in active.items():
                    if ev.node in run.placement:
                        self._kill_on_failure(run)
                        timeline.append((now, key, 0))
            # 5. arrivals
            while ai < total and arrivals[ai].submit_s <= now:
                job = arrivals[ai]
                active[job.key] = runs[job.key]
                ai += 1
                reasons.append("arrival")
            if now >= next_tick:
                reasons.append("tick")
                next_tick = (math.floor(now / cfg.interval_s) + 1) * cfg.interval_s
            # 6. decide
            if active and reasons and (cfg.immediate or "tick" in reasons):
                view = ClusterView(
                    now=now, nodes=tuple(up.values()),
                    jobs=tuple(JobView(r.job, dict(r.placement), r.remaining, r.attained, r.executed,
                                       r.restarts, r.start is not None, r.segment if r.placement else None,
                                       r.in_place)
                               for r in active.values()),
                    reasons=tuple(dict.fromkeys(reasons)))
                decision = self.policy.decide(view)
                changes = self._apply(decision, active, up, now, sync)
                for key, _, after in changes:
                    timeline.append((now, key, after))
                if changes or decision.notes:
                    decisions.append(DecisionRecord(now, view.reasons, tuple(changes), tuple(decision.notes),
                                                    decision.solve_s))
            util.append((now, sum(r.gpus for r in active.values()), sum(n.gpus for n in up.values())))
            if self.progress and reasons:
                self.progress(done, total, now)

        records = tuple(JobRecord(
            key=r.job.key, application=r.job.application, submit_s=r.job.submit_s, start_s=r.start,
            finish_s=r.finish, requested_gpus=r.job.requested_gpus, restarts=r.restarts, gpu_s=r.attained,
            restart_loss_gpu_s=r.loss, elastic=r.job.elastic, time_limits=r.time_limits) for r in runs.values())
        return SimResult(policy=self.policy.name, restart_method=cfg.restart.method, jobs=records,
                         decisions=tuple(decisions), utilisation=tuple(util), timeline=tuple(timeline),
                         node_failures=n_failures, end_s=now, wall_s=time.perf_counter() - wall0,
                         unfinished=tuple(r.job.key for r in runs.values() if r.finish is None))

    # -- one job ----------------------------------------------------------------------------
    def _advance(self, run: _Run, dt: float) -> None:
        gpus = run.gpus
        run.attained += gpus * dt
        run.executed += dt
        stalled = min(run.stall, dt)
        run.stall -= stalled
        if run.stall_counts:
            run.loss += gpus * stalled
        if run.stall <= 0:
            run.stall_counts = False
        running = dt - stalled
        if running <= 0:
            return
        work = min(run.remaining, run.speed * running)
        run.remaining -= work
        run.segment_left -= work
        if self.config.restart.method == "traditional" and self.config.restart.sync_checkpoint_s > 0:
            interval = self._interval(run.job)
            # The share of running time spent in synchronous checkpoints.
            run.loss += gpus * running * self.config.restart.sync_checkpoint_s / (
                interval + self.config.restart.sync_checkpoint_s)
        interval = self._interval(run.job)
        run.since_ckpt_run += running
        run.since_ckpt_work += work
        if run.since_ckpt_run >= interval:
            run.since_ckpt_run %= interval
            run.since_ckpt_work = run.speed * run.since_ckpt_run

    def _kill_on_failure(self, run: _Run) -> None:
        """A node under the job died: the whole job stops and redoes the work since its last checkpoint."""
        if run.since_ckpt_work > 0 and run.speed > 0:
            run.loss += run.since_ckpt_work / run.speed * run.gpus
        run.remaining = min(run.job.work, run.remaining + run.since_ckpt_work)
        run.since_ckpt_run = run.since_ckpt_work = 0.0
        run.placement = {}
        run.speed = 0.0
        run.stall = 0.0
        run.segment, run.segment_left = None, math.inf

    def _stop_signalled(self, run: _Run, sync: float) -> None:
        """A signalled stop (a resize, a time limit): the checkpoint it takes loses no work; the traditional
        method stops only after a full synchronous checkpoint, owed before the next start."""
        run.pending_stall += sync
        run.since_ckpt_run = run.since_ckpt_work = 0.0
        run.placement = {}
        run.speed = 0.0
        run.stall = 0.0
        run.segment, run.segment_left = None, math.inf

    def _shrunk_in_place(self, run: _Run, new: Mapping[str, int], decision: Decision) -> bool:
        """The policy shrank the job to some of its nodes, each whole, its ranks kept (our restart method only),
        once its ranks have started: a job still in its start stall has no group to go on in, and pays a
        restart as the requeue the controller would then make."""
        old = run.placement
        return (run.job.key in decision.in_place and self.config.restart.method == "forward-layer"
                and run.stall <= 0 and bool(new) and set(new) < set(old) and all(old[n] == g for n, g in new.items()))

    def _apply(self, decision: Decision, active: dict[str, _Run], up: Mapping[str, SimNode], now: float,
               sync: float) -> list[tuple[str, int, int]]:
        unknown = sorted(set(decision.placements) - set(active))
        if unknown:
            raise AllocationError(f"policy {self.policy.name} placed job(s) that are not active: {unknown[:5]}")
        used_g = {n: 0 for n in up}
        used_c = {n: 0 for n in up}
        used_m = {n: 0 for n in up}
        target: dict[str, dict[str, int]] = {}
        for key, run in active.items():
            placement = {n: int(g) for n, g in decision.placements.get(key, {}).items() if g > 0}
            g = sum(placement.values())
            if g and not run.job.min_gpus <= g <= run.job.max_gpus:
                raise AllocationError(f"policy {self.policy.name} gave job {key} {g} GPUs, outside "
                                      f"[{run.job.min_gpus}, {run.job.max_gpus}]")
            for node, count in placement.items():
                if node not in up:
                    raise AllocationError(f"policy {self.policy.name} placed job {key} on node {node}, "
                                          f"which is down or unknown")
                used_g[node] += count
                used_c[node] += count * run.job.cpus_per_gpu
                used_m[node] += count * run.job.mem_per_gpu_mb
            target[key] = placement
        for node, spec in up.items():
            if used_g[node] > spec.gpus or used_c[node] > spec.cpus or used_m[node] > spec.mem_mb:
                raise AllocationError(
                    f"policy {self.policy.name} over-committed node {node} at t={now:.0f}: "
                    f"{used_g[node]}/{spec.gpus} GPUs, {used_c[node]}/{spec.cpus} CPUs, "
                    f"{used_m[node]}/{spec.mem_mb} MB")
        changes = []
        for key, run in active.items():
            new = target[key]
            if new == run.placement:
                continue
            before = run.gpus
            if self._shrunk_in_place(run, new, decision):
                run.placement = new
                run.restarts += 1
                run.in_place += 1
                run.stall = self.config.restart.in_place_s
                run.stall_counts = True
                run.since_ckpt_run = run.since_ckpt_work = 0.0     # the survivors committed as they went on
                run.speed = self._effective_speed(run)
                changes.append((key, before, sum(new.values())))
                continue
            if run.placement:
                self._stop_signalled(run, sync)
            run.placement = new
            if new:
                run.incarnation_start = now
                if run.start is None:
                    run.start = now
                    run.stall = self._overhead(run.job)
                    run.stall_counts = False
                else:
                    run.restarts += 1
                    run.stall = self._overhead(run.job) + run.pending_stall
                    run.stall_counts = True
                run.pending_stall = 0.0
                run.speed = self._effective_speed(run)
            changes.append((key, before, sum(new.values())))
        return changes
