"""Where a restart's seconds went: its phases, from timestamps the controller and the job already write.

A restart the controller carried out (a journaled plan) is broken into

  failure -> detected -> ranks stopped -> checkpoint committed -> requeued -> relaunched -> running
          -> ranks attached -> first step

or, where the survivors kept their processes (train/regroup.py; kind "peer loss, ranks kept"),

  failure -> detected -> ranks stopped -> checkpoint committed -> group re-formed -> first step

and for a shrink on healthy nodes done in place (kind "resize, ranks kept"; control/protocol.py)

  plan opened -> nodes given up -> checkpoint committed -> group re-formed -> first step

from these marks (each one may be missing; a phase with a missing end is not shown):

Marks of the job's own incarnation are journaled when the controller acts (the next incarnation
removes the run directory and may replace the report), and read from the journal first.

| mark | peer loss (the job's report) | a controller resize (signal + ACK) |
|---|---|---|
| failure | only a benchmark that caused it knows | - |
| detected | the report's `detected_at` | the plan opened (journal) |
| ranks stopped | the survivors' `status-<rank>.json` in the run dir (the last one) | the signal sent (journal) |
| checkpoint committed | the report, once `commit` is `done` (its mtime) | the ACK file (its mtime) |
| group re-formed | `regroup.json` in the run dir saying go (its mtime) | the same, after an in-place shrink |
| requeued / relaunched | the journal's `hold` step / the plan done (right after the release) | the same |
| running | Slurm's start time of the next incarnation (1 s resolution) | the same |
| ranks attached | `geometry.json` (written by rank 0 at every start) | the same |
| first step | the first `metrics.jsonl` row of the next incarnation | the same |

The job's files are its user's: only their mtimes are used (lstat, no link followed) except the
report and the metrics, which are read as control/peer_loss.py and control/requests/ read them
(owner, size, fields). A mark from a job's file is shown, never used to decide anything. The first
metrics row comes up to the shim's metrics interval (5 s) after the first step.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Mapping, Sequence

from slurm_elastic.cluster.model import Job
from slurm_elastic.control.journal import Journal, PlanRecord
from slurm_elastic.control.peer_loss import owned_mtime, read_report
from slurm_elastic.control.plan import PlanEntry
from slurm_elastic.control.protocol import IN_PLACE_NOTE, KEPT_SHRINK_NOTE
from slurm_elastic import jobfiles as shim
from slurm_elastic.jobfiles import read_metrics, read_user_file

METRICS_TAIL_BYTES = 256 * 1024   # the rows after a restart are near the end

MARKS = ("failed", "detected", "stopped", "committed", "regrouped", "requeued", "relaunched", "running", "attached",
         "first_step")
PHASE_NAMES = {
    "detected": "failure -> detected", "stopped": "detected -> ranks stopped",
    "committed": "ranks stopped -> checkpoint committed", "regrouped": "committed -> group re-formed",
    "requeued": "committed -> requeued",
    "relaunched": "requeued -> relaunched", "running": "relaunched -> running",
    "attached": "running -> ranks attached", "first_step": "ranks attached -> first step",
}

SKIP_NAMES = {("regrouped", "first_step"): "group re-formed -> first step"}   # ranks kept: no relaunch between


@dataclass(frozen=True, slots=True)
class RestartPhases:
    """The marks of one restart (unix times; None where not known)."""

    job_id: int
    plan_id: int | None
    kind: str   # "peer loss" | "peer loss, in place" | "peer loss, ranks kept" | "resize" | "resize, ranks kept"
    failed: float | None = None
    detected: float | None = None
    stopped: float | None = None
    committed: float | None = None
    regrouped: float | None = None
    requeued: float | None = None
    relaunched: float | None = None
    running: float | None = None
    attached: float | None = None
    first_step: float | None = None

    def phases(self) -> list[tuple[str, float]]:
        """(phase, seconds) from each known mark to the next known one, in order."""
        out: list[tuple[str, float]] = []
        last: tuple[str, float] | None = None
        for mark in MARKS:
            at = getattr(self, mark)
            if at is None:
                continue
            if last is not None:
                name = (PHASE_NAMES[mark] if last[0] == _before(mark)
                        else SKIP_NAMES.get((last[0], mark), f"{last[0]} -> {mark}"))
                if self.kind.endswith("in place"):
                    name = name.replace("requeued", "shrunk")   # the same mark: the hold step, no requeue
                if self.kind == "resize, ranks kept":   # the plan opened; the shrink stopped the ranks given up
                    name = name.replace("failure -> detected", "plan opened").replace(
                        "detected", "plan opened").replace("ranks stopped", "nodes given up")
                out.append((name, round(at - last[1], 2)))
            last = (mark, at)
        return out

    def total_s(self) -> float | None:
        start = self.failed if self.failed is not None else self.detected
        end = self.first_step if self.first_step is not None else self.running
        return None if start is None or end is None else round(end - start, 2)

    def to_json(self) -> dict[str, object]:
        return {"job_id": self.job_id, "plan_id": self.plan_id, "kind": self.kind,
                "marks": {m: getattr(self, m) for m in MARKS if getattr(self, m) is not None},
                "phases": [{"phase": p, "s": s} for p, s in self.phases()], "total_s": self.total_s()}

    def line(self) -> str:
        parts = ", ".join(f"{p} {s:.1f}s" for p, s in self.phases())
        total = self.total_s()
        return f"{self.kind} (plan {self.plan_id}): {parts}" + ("" if total is None else f"; total {total:.1f}s")


def _before(mark: str) -> str:
    return MARKS[MARKS.index(mark) - 1]


def last_restart(job: Job, journal: Journal, *, owner_uid: int | None) -> RestartPhases | None:
    """The phases of the controller's last finished running-job plan for `job`, or None."""
    records = [r for r in journal.plans(job.job_id, limit=20)
               if r.status == "done" and r.plan.entry is PlanEntry.RUNNING]
    if not records:
        return None
    rec = records[0]
    return restart_phases(job, rec, journal.steps(rec.plan_id), owner_uid=owner_uid, marks=journal.marks(rec.plan_id))


def restart_phases(job: Job, rec: PlanRecord, steps: Sequence[tuple[str, float, str]], *,
                   owner_uid: int | None, failed: float | None = None,
                   marks: Mapping[str, float] | None = None) -> RestartPhases:
    """The marks of the restart `rec` carried out: journaled `marks` and steps, then the job's own files."""
    marks = marks or {}
    at = {name: when for name, when, _ in steps}
    spec = job.spec
    directory = None
    if spec is not None and spec.ckpt_dir:
        try:
            directory = shim.job_dir(spec.ckpt_dir, shim.job_key(job.job_id))
        except ValueError:
            directory = None
    detected = stopped = committed = None
    lost_step: int | None = None
    in_place = any(note == IN_PLACE_NOTE for _, _, note in steps)
    kind = ("peer loss, in place" if in_place else "peer loss") if rec.plan.peer_lost else "resize"
    if any(note == KEPT_SHRINK_NOTE for _, _, note in steps) and directory is not None and owner_uid is not None:
        return _kept_shrink_phases(job, rec, at, directory, owner_uid, marks)
    if directory is not None and owner_uid is not None and rec.plan.peer_lost:
        for step_id in range(8):
            name = shim.peer_lost_file_name(job.job_id, rec.restarts, step_id)
            report, _ = read_report(os.path.join(directory, name), owner_uid=owner_uid)
            if report is None:
                continue
            detected = report.detected_at
            if report.commit == "done":
                committed = owned_mtime(os.path.join(directory, name), owner_uid)
            run_dir = os.path.join(directory, shim.run_dir_name(job.job_id, rec.restarts, step_id))
            stops = [owned_mtime(os.path.join(run_dir, shim.status_file_name(r)), owner_uid)
                     for r in range(min(report.world_size, 4096))]
            stopped = max((m for m in stops if m is not None), default=None)
            lost_step = step_id
            break
    elif directory is not None and owner_uid is not None:
        detected = at.get("open")
        stopped = at.get("signal")
        committed = owned_mtime(os.path.join(directory, shim.ack_file_name(job.job_id, rec.restarts)), owner_uid)
    # The start of the incarnation the plan released, not of a later one (a requeue of Slurm's own since)
    running = job.start_time if job.restarts == rec.restarts + 1 and job.start_time is not None else None
    relaunched = at.get("done", at.get("release"))
    if running is not None and relaunched is not None and relaunched - 1 < running < relaunched:
        running = relaunched      # Slurm's start time is in whole seconds
    if in_place:
        # The same incarnation goes on: its batch script relaunched the ranks as the next srun step,
        # whose rank 0 writes the step's rendezvous file once at start (the "requeued" mark is the shrink).
        relaunched = running = None
        if directory is not None and owner_uid is not None and lost_step is not None:
            run_dir = os.path.join(directory, shim.run_dir_name(job.job_id, rec.restarts, lost_step + 1))
            relaunched = running = owned_mtime(os.path.join(run_dir, shim.RENDEZVOUS_FILE), owner_uid)
    regrouped = _regrouped_at(directory, job, rec, lost_step, owner_uid) if in_place else None
    if regrouped is not None:
        # The survivors went on in their processes, before the daemon's shrink: that is not on the path.
        kind, relaunched, running = "peer loss, ranks kept", None, None
        first = (first_row_after(os.path.join(directory, shim.METRICS_FILE), regrouped - 1, owner_uid=owner_uid)
                 if directory is not None and owner_uid is not None else None)
        return RestartPhases(job_id=job.job_id, plan_id=rec.plan_id, kind=kind, failed=marks.get("failed", failed),
                             detected=marks.get("detected", detected), stopped=marks.get("stopped", stopped),
                             committed=marks.get("committed", committed), regrouped=regrouped, first_step=first)
    attached = first = None
    since = at.get("hold") if in_place else running   # in place: what follows the shrink (a 1-rank step has
    if since is not None and directory is not None and owner_uid is not None:   # no rendezvous file)
        attached = owned_mtime(os.path.join(directory, shim.GEOMETRY_FILE), owner_uid)
        attached = attached if attached is not None and attached >= since - 1 else None
        first = first_row_after(os.path.join(directory, shim.METRICS_FILE), since - 1, owner_uid=owner_uid)
    detected = marks.get("detected", detected)
    stopped = marks.get("stopped", stopped)
    committed = marks.get("committed", committed)
    return RestartPhases(job_id=job.job_id, plan_id=rec.plan_id, kind=kind, failed=marks.get("failed", failed),
                         detected=detected, stopped=stopped, committed=committed, requeued=at.get("hold"),
                         # "release" is journaled before the credential gap is waited out; "done" right after it
                         relaunched=relaunched, running=running, attached=attached,
                         first_step=first)


def _kept_shrink_phases(job: Job, rec: PlanRecord, at: Mapping[str, float], directory: str, owner_uid: int,
                        marks: Mapping[str, float]) -> RestartPhases:
    """A shrink on healthy nodes done in place: the plan opened, the nodes given up (Slurm SIGKILLs the ranks
    there), the survivors' commit (their peer-lost report, the newest of the incarnation), their re-formed
    group, their first step."""
    shrunk = at.get("hold")
    committed = regrouped = first = None
    for step_id in range(8):
        path = os.path.join(directory, shim.peer_lost_file_name(job.job_id, rec.restarts, step_id))
        report, _ = read_report(path, owner_uid=owner_uid)
        if report is None:
            continue
        when = owned_mtime(path, owner_uid) if report.commit == "done" else None
        if when is not None and shrunk is not None and when >= shrunk - 1:
            committed = when
            regrouped = _regrouped_at(directory, job, rec, step_id, owner_uid, since=shrunk)
    if regrouped is not None:
        first = first_row_after(os.path.join(directory, shim.METRICS_FILE), regrouped - 1, owner_uid=owner_uid)
    return RestartPhases(job_id=job.job_id, plan_id=rec.plan_id, kind="resize, ranks kept",
                         detected=marks.get("detected", at.get("open")), stopped=shrunk,
                         committed=marks.get("committed", committed), regrouped=regrouped, first_step=first)


def _regrouped_at(directory: str | None, job: Job, rec: PlanRecord, lost_step: int | None,
                  owner_uid: int | None, *, since: float | None = None) -> float | None:
    """When the survivors of the lost step decided to go on in their processes (regroup.json saying go), if
    they did: the file is the job's, read as its owner's (size, JSON); shown only. With `since`, the first
    such decision (of any generation of the step's group) from then on."""
    if directory is None or owner_uid is None or lost_step is None:
        return None
    base = shim.run_dir_name(job.job_id, rec.restarts, lost_step)
    if since is None:
        return _regroup_go(os.path.join(directory, base, shim.REGROUP_FILE), owner_uid)
    for generation in range(64):
        run_dir = os.path.join(directory, base + (f".{generation}" if generation else ""))
        if not os.path.isdir(run_dir):
            return None
        when = _regroup_go(os.path.join(run_dir, shim.REGROUP_FILE), owner_uid)
        if when is not None and when >= since - 1:
            return when
    return None


def _regroup_go(path: str, owner_uid: int) -> float | None:
    try:
        data = read_user_file(path, owner_uid=owner_uid, max_bytes=4096, what="a regroup record")
        body = json.loads(data) if data is not None else None
    except ValueError:
        return None
    if not isinstance(body, dict) or body.get("go") is not True:
        return None
    return owned_mtime(path, owner_uid)


def slurm_end(job: Job, *, owner_uid: int | None) -> dict[str, object] | None:
    """The job's previous incarnation ended at Slurm's signal (a time limit, a preemption) and requeued
    itself: its cause (the template's ENDED file), restart count and acknowledged step. Shown, never used."""
    spec = job.spec
    if spec is None or not spec.ckpt_dir or owner_uid is None or job.restarts < 1:
        return None
    try:
        directory = shim.job_dir(spec.ckpt_dir, shim.job_key(job.job_id))
    except ValueError:
        return None
    restart = job.restarts - 1
    cause = shim.read_end_cause(directory, job.job_id, restart, owner_uid=owner_uid)
    if cause is None:
        return None
    ack, _ = shim.read_record(os.path.join(directory, shim.ack_file_name(job.job_id, restart)), shim.Ack.parse,
                              owner_uid=owner_uid, max_bytes=shim.ACK_MAX_BYTES, what="an ACK")
    step = ack.step if ack is not None and ack.committed else None
    line = (f"restart {job.restarts} after a {cause}: " +
            (f"checkpoint of step {step} acknowledged" if step is not None else "no acknowledged checkpoint"))
    return {"restart": job.restarts, "cause": cause, "committed_step": step, "line": line}


def first_row_after(path: str, after: float, *, owner_uid: int) -> float | None:
    """The `time` of the first valid metrics row after `after` in the file's last METRICS_TAIL_BYTES."""
    got = read_metrics(path, owner_uid=owner_uid, max_bytes=METRICS_TAIL_BYTES)
    if got.absent or got.problem:
        return None
    seen_before = got.cursor.from_start   # a row from before `after` shows the window reaches back far enough
    for row in got.rows:
        if row.time <= after:
            seen_before = True
        elif seen_before:
            return row.time
        else:
            return None               # the rows since the restart outgrew the tail: the first is not known
    return None
