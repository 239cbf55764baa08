"""The demo's numbers, computed from a timeline: runs, restarts, steps lost, recovery time per node event."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slurm_elastic.demo.timeline import (NODE_ACTIONS, NODE_GAINED, NODE_LOST, Acked, DemoAction, JobSeen, NodeSeen,
                                         Progress, Timeline)

RUNNING = "RUNNING"
# Slurm prints start times in whole seconds (truncated), and the metrics clock is
# the same host's: a row is never earlier than its run's start by more than this.
_START_SLACK_S = 1.0


@dataclass(frozen=True, slots=True)
class Run:
    """One stretch of a job running under Slurm (between a start and a stop or requeue)."""

    start: float
    gpus: int
    restarts: int | None       # Slurm's restart count in this run (None: a run only the metrics revealed)
    end: float | None = None
    rows: tuple[Progress, ...] = ()

    @property
    def first_step(self) -> int | None:
        return self.rows[0].step if self.rows else None

    @property
    def last_step(self) -> int | None:
        return max(r.step for r in self.rows) if self.rows else None


@dataclass(frozen=True, slots=True)
class Restart:
    """The job stopped and started again; `steps_lost` = last step reached - step resumed from."""

    job: str
    index: int                  # 1 for the job's first restart
    stopped_at: float           # last training row (or last sight of the run) before it
    resumed_at: float | None    # first training row after it
    gpus_before: int
    gpus_after: int
    last_step: int | None       # highest step the job had reached before the restart
    resumed_from: int | None    # the checkpoint step the new run continued from
    signalled: bool             # the shim acknowledged a signalled checkpoint for it
    ack_step: int | None
    cause: str                  # the node event it followed, or "start-up"

    @property
    def steps_lost(self) -> int | None:
        if self.last_step is None or self.resumed_from is None:
            return None
        return self.last_step - self.resumed_from

    @property
    def downtime_s(self) -> float | None:
        return None if self.resumed_at is None else self.resumed_at - self.stopped_at

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "stopped_at_s": _r(self.stopped_at), "resumed_at_s": _r(self.resumed_at),
                "gpus_before": self.gpus_before, "gpus_after": self.gpus_after, "last_step": self.last_step,
                "resumed_from": self.resumed_from, "steps_lost": self.steps_lost, "signalled": self.signalled,
                "ack_step": self.ack_step, "cause": self.cause, "downtime_s": _r(self.downtime_s)}


@dataclass(frozen=True, slots=True)
class NodeEvent:
    """A node the demo took away or added, when it did so and when Slurm showed it."""

    label: str                  # "n2 lost", "n5 gained"
    node: str
    action: str                 # node_lost | node_gained
    t: float
    slurm_t: float | None       # Slurm first showed the node unavailable (lost) / available (gained)

    def to_json(self) -> dict[str, Any]:
        return {"label": self.label, "node": self.node, "action": self.action, "t_s": _r(self.t),
                "slurm_seen_s": _r(self.slurm_t)}


@dataclass(frozen=True, slots=True)
class JobAfterEvent:
    """How one job came through one node event."""

    event: str
    gpus_before: int
    gpus_after: int
    restarted: bool
    recovery_s: float | None    # from the node event to training again (None: it never stopped)
    trained_after: bool         # trained after the event (after its last restart, if any)

    def to_json(self) -> dict[str, Any]:
        return {"event": self.event, "gpus_before": self.gpus_before, "gpus_after": self.gpus_after,
                "restarted": self.restarted, "recovery_s": _r(self.recovery_s), "trained_after": self.trained_after}


@dataclass(frozen=True, slots=True)
class JobSummary:
    job: str
    name: str
    min_gpus: int
    max_gpus: int
    gpus_over_time: tuple[tuple[float, int], ...]   # (t, GPUs held from t on; 0 = not running)
    runs: tuple[Run, ...]
    restarts: tuple[Restart, ...]
    after_events: tuple[JobAfterEvent, ...]
    final_step: int

    @property
    def gpu_sequence(self) -> tuple[int, ...]:
        """The GPU counts it ran with, in order (consecutive repeats merged)."""
        seq: list[int] = []
        for run in self.runs:
            if not seq or seq[-1] != run.gpus:
                seq.append(run.gpus)
        return tuple(seq)

    def to_json(self) -> dict[str, Any]:
        return {"job": self.job, "name": self.name, "gpus_range": [self.min_gpus, self.max_gpus],
                "gpus": list(self.gpu_sequence),
                "gpus_over_time": [[_r(t), g] for t, g in self.gpus_over_time],
                "restarts": len(self.restarts), "restart_details": [r.to_json() for r in self.restarts],
                "steps_lost": [r.steps_lost for r in self.restarts],
                "after_events": [a.to_json() for a in self.after_events], "final_step": self.final_step}


@dataclass(frozen=True, slots=True)
class DemoSummary:
    wall_s: float
    events: tuple[NodeEvent, ...]
    jobs: tuple[JobSummary, ...]
    phases: dict[str, float] = field(default_factory=dict)   # named phase durations, seconds
    # The controller's restarts, each broken into its phases (control/phases.py), as read while the demo ran
    restart_phases: tuple[dict[str, Any], ...] = ()

    def problems(self, *, max_restarts: int = 2) -> list[str]:
        """The promises the demo did not keep: few restarts, nothing lost when signalled, training after each event."""
        out = []
        for job in self.jobs:
            if len(job.restarts) > max_restarts:
                out.append(f"{job.name}: restarted {len(job.restarts)} times (at most {max_restarts} expected)")
            for r in job.restarts:
                if r.signalled and r.steps_lost != 0:
                    out.append(f"{job.name}: signalled restart {r.index} lost {r.steps_lost} steps "
                               f"(reached {r.last_step}, resumed from {r.resumed_from})")
            for a in job.after_events:
                if not a.trained_after:
                    out.append(f"{job.name}: did not train after {a.event}")
            if not any(run.rows for run in job.runs):
                out.append(f"{job.name}: never trained")
        return out

    def to_json(self) -> dict[str, Any]:
        return {"wall_s": _r(self.wall_s), "events": [e.to_json() for e in self.events],
                "jobs": [j.to_json() for j in self.jobs], "phases_s": {k: _r(v) for k, v in self.phases.items()},
                "restart_phases": list(self.restart_phases), "problems": self.problems()}


def summarize(timeline: Timeline, *, phases: dict[str, float] | None = None,
              restart_phases: tuple[dict[str, Any], ...] = ()) -> DemoSummary:
    events = node_events(timeline)
    jobs = tuple(_job_summary(timeline, info.job, info.name, info.min_gpus, info.max_gpus, events)
                 for info in timeline.jobs)
    return DemoSummary(wall_s=timeline.duration, events=events, jobs=jobs, phases=dict(phases or {}),
                       restart_phases=tuple(restart_phases))


def node_events(timeline: Timeline) -> tuple[NodeEvent, ...]:
    seen = timeline.of(NodeSeen)
    out = []
    for action in timeline.of(DemoAction):
        if action.action not in NODE_ACTIONS:
            continue
        gained = action.action == NODE_GAINED
        slurm_t = next((s.t for s in seen if s.node == action.subject and s.t >= action.t
                        and s.available == gained), None)
        word = "gained" if gained else "lost"
        out.append(NodeEvent(label=f"{action.subject} {word}", node=action.subject, action=action.action,
                             t=action.t, slurm_t=slurm_t))
    return tuple(out)


def runs_of(timeline: Timeline, job: str) -> tuple[Run, ...]:
    """The job's runs: Slurm's starts (JobSeen) with the metrics rows of each assigned by time.

    A step that does not increase inside one run means a restart the polling
    missed, and a change of the rows' GPU count a relaunch in place (the job's
    batch script started the ranks again on the nodes it kept, Slurm's run
    going on); the run is split there.
    """
    spans: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    for e in timeline.of(JobSeen):
        if e.job != job:
            continue
        if e.state == RUNNING:
            start = e.start if e.start is not None else e.t
            if current is None or abs(current["start"] - start) > 0.5:
                current = {"start": start, "gpus": e.gpus, "restarts": e.restarts, "end": None, "rows": []}
                spans.append(current)
        elif current is not None:
            current["end"] = e.t
            current = None
    rows = [p for p in timeline.of(Progress) if p.job == job]
    for row in rows:
        owner = None
        for span in spans:
            if span["start"] <= row.t + _START_SLACK_S:
                owner = span
        if owner is None:
            owner = {"start": row.t, "gpus": row.gpus, "restarts": None, "end": None, "rows": []}
            spans.insert(0, owner)
        owner["rows"].append(row)
    runs: list[Run] = []
    for span in spans:
        pieces: list[list[Progress]] = [[]]
        in_place: list[bool] = [False]   # per piece: it began with a relaunch in place (same Slurm run)
        for row in span["rows"]:
            if pieces[-1] and (row.step <= pieces[-1][-1].step or row.gpus != pieces[-1][-1].gpus):
                in_place.append(row.step > pieces[-1][-1].step)
                pieces.append([])
            pieces[-1].append(row)
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            # A run relaunched in place held its GPUs until its successor's first row.
            end = span["end"] if last else pieces[i + 1][0].t if in_place[i + 1] else piece[-1].t if piece else span["end"]
            if i == 0:
                runs.append(Run(start=span["start"], gpus=span["gpus"], restarts=span["restarts"], end=end,
                                rows=tuple(piece)))
            else:
                runs.append(Run(start=piece[0].t, gpus=piece[0].gpus,
                                restarts=span["restarts"] if in_place[i] else None, end=end, rows=tuple(piece)))
    return tuple(sorted(runs, key=lambda r: r.start))


def _job_summary(timeline: Timeline, job: str, name: str, min_gpus: int, max_gpus: int,
                 events: tuple[NodeEvent, ...]) -> JobSummary:
    runs = runs_of(timeline, job)
    rows = [p for p in timeline.of(Progress) if p.job == job]
    acks = [a for a in timeline.of(Acked) if a.job == job]
    restarts = []
    for i in range(1, len(runs)):
        before, after = runs[i - 1], runs[i]
        # Progress at the stop is what the run just before reached; a run that restarted from an
        # older checkpoint rolled back anything earlier runs had reached beyond it.
        reached = [row.step for row in before.rows] or [row.step for run in runs[:i] for row in run.rows]
        stopped_at = before.rows[-1].t if before.rows else (before.end if before.end is not None else before.start)
        ack = next((a for a in acks if before.restarts is not None and a.restart == before.restarts
                    and before.start - _START_SLACK_S <= a.t <= after.start + _START_SLACK_S), None)
        restarts.append(Restart(
            job=job, index=i, stopped_at=stopped_at, resumed_at=after.rows[0].t if after.rows else None,
            gpus_before=before.gpus, gpus_after=after.gpus, last_step=max(reached) if reached else None,
            # The shim writes a metrics row after every step, so the first row of a run is one past its resume point.
            resumed_from=after.first_step - 1 if after.first_step is not None else None,
            signalled=ack is not None, ack_step=ack.step if ack else None,
            cause=_cause(events, after.start)))
    after_events = tuple(_after_event(events, i, runs, timeline.duration) for i in range(len(events)))
    return JobSummary(job=job, name=name, min_gpus=min_gpus, max_gpus=max_gpus,
                      gpus_over_time=_gpus_over_time(timeline, job), runs=runs, restarts=tuple(restarts),
                      after_events=after_events, final_step=max((r.step for r in rows), default=0))


def _cause(events: tuple[NodeEvent, ...], t: float) -> str:
    before = [e for e in events if e.t <= t]
    return before[-1].label if before else "start-up"


def _after_event(events: tuple[NodeEvent, ...], index: int, runs: tuple[Run, ...], end: float) -> JobAfterEvent:
    event = events[index]
    window_end = events[index + 1].t if index + 1 < len(events) else max(end, event.t)
    held_then = [r for r in runs if r.start <= event.t]
    gpus_before = held_then[-1].gpus if held_then and (held_then[-1].end is None or held_then[-1].end > event.t) else 0
    started = [r for r in runs if event.t <= r.start < window_end]
    last = started[-1] if started else (held_then[-1] if held_then else None)
    since = started[-1].start if started else event.t
    trained = last is not None and any(since <= row.t <= window_end for row in last.rows)
    recovery = None
    if started:
        first_row = started[-1].rows[0].t if started[-1].rows else None
        recovery = None if first_row is None else first_row - event.t
    return JobAfterEvent(event=event.label, gpus_before=gpus_before, gpus_after=last.gpus if last else 0,
                         restarted=bool(started), recovery_s=recovery, trained_after=trained)


def _gpus_over_time(timeline: Timeline, job: str) -> tuple[tuple[float, int], ...]:
    out: list[tuple[float, int]] = []
    for e in timeline.of(JobSeen):
        if e.job != job:
            continue
        gpus = e.gpus if e.state == RUNNING else 0
        if not out or out[-1][1] != gpus:
            out.append((e.t, gpus))
    return tuple(out)


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


__all__ = ["DemoSummary", "JobAfterEvent", "JobSummary", "NodeEvent", "Restart", "Run", "summarize", "runs_of",
           "node_events", "NODE_LOST", "NODE_GAINED"]
