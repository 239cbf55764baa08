"""The timeline recorder: turns successive cluster snapshots and the shim's files into timeline events."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from slurm_elastic.cluster.model import ClusterState, Job, JobState, Node
from slurm_elastic.demo.timeline import (Acked, ControllerNote, DemoAction, Event, JobInfo, JobSeen, NodeSeen,
                                         Progress, Timeline, in_time_order)
from slurm_elastic import jobfiles as protocol

log = logging.getLogger(__name__)

# Controller log lines worth showing: plan descriptions ("job 12: 8->4 GPUs (...)") and node changes.
_CONTROLLER_LINE = re.compile(r"(job \d+: \d+->\d+ GPUs.*|node \S+ (lost|gained).*|job \d+: sent \S+.*"
                              r"|job \d+: released.*|cycle failed.*)")


_ASCTIME = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")


@dataclass(frozen=True, slots=True)
class _JobView:
    state: str
    gpus: int
    nodes: tuple[str, ...]
    restarts: int
    start: float | None
    held: bool
    reason: str


class TimelineRecorder:
    """Feed it snapshots (`observe`) and let it read the job directories (`read_files`); it keeps the events.

    Only changes become events, so a poll every second gives a short timeline.
    Times are seconds since `started_at` (epoch), the clock of the metrics rows.
    """

    def __init__(self, started_at: float, *, ckpt_root: Path | None = None, controller_log: Path | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.started_at = started_at
        self.ckpt_root = ckpt_root
        self.controller_log = controller_log
        self._clock = clock
        self.jobs: dict[str, JobInfo] = {}
        self.events: list[Event] = []
        self._taken = 0
        self._nodes: dict[str, tuple[str, bool]] = {}
        self._job_views: dict[str, _JobView] = {}
        self._offsets: dict[Path, int] = {}
        self._acks: set[str] = set()
        self._last_note = ""
        self.latest: ClusterState | None = None

    def now(self) -> float:
        return self._clock() - self.started_at

    def _rel(self, epoch: float) -> float:
        return epoch - self.started_at

    # -- what the demo does -------------------------------------------------------------------------
    def add_job(self, info: JobInfo) -> None:
        self.jobs[info.job] = info

    def action(self, action: str, subject: str = "", text: str = "", t: float | None = None) -> DemoAction:
        """Record what the demo did; t: when it began (self.now() taken before it), else now."""
        event = DemoAction(t=self.now() if t is None else t, action=action, subject=subject, text=text)
        self.events.append(event)
        return event

    # -- Slurm's view ---------------------------------------------------------------------------------
    def observe(self, state: ClusterState) -> list[Event]:
        """Record what changed since the previous snapshot (nodes, and the demo's jobs)."""
        self.latest = state
        t = self._rel(state.taken_at)
        new: list[Event] = []
        for node in state.nodes:
            key = (_node_state(node), node.available)
            if self._nodes.get(node.name) != key:
                self._nodes[node.name] = key
                new.append(NodeSeen(t=t, node=node.name, state=key[0], available=key[1], gpus=node.gpus))
        for job in state.jobs:
            jid = str(job.job_id)
            if jid not in self.jobs:
                continue
            view = self._view(job)
            if self._job_views.get(jid) != view:
                self._job_views[jid] = view
                new.append(JobSeen(t=t, job=jid, state=view.state, gpus=view.gpus, nodes=view.nodes,
                                   restarts=view.restarts, start=view.start, held=view.held, reason=view.reason))
        for jid in self.jobs:
            # A finished job drops out of squeue after a while: say it is gone once.
            if jid in self._job_views and all(str(j.job_id) != jid for j in state.jobs):
                if self._job_views[jid].state != "GONE":
                    self._job_views[jid] = _JobView("GONE", 0, (), self._job_views[jid].restarts, None, False, "")
                    new.append(JobSeen(t=t, job=jid, state="GONE", gpus=0, restarts=self._job_views[jid].restarts))
        self.events.extend(new)
        return new

    def _view(self, job: Job) -> _JobView:
        running = job.state is JobState.RUNNING
        start = self._rel(job.start_time) if running and job.start_time is not None else None
        return _JobView(state=job.state.value, gpus=job.gpus, nodes=tuple(job.nodes) if running else (),
                        restarts=job.restarts, start=start, held=job.held, reason=job.reason)

    # -- the shim's files and the controller's log ----------------------------------------------
    def read_files(self) -> list[Event]:
        """New metrics rows and acknowledgements of every job, and new controller log lines."""
        new: list[Event] = []
        if self.ckpt_root is not None:
            for jid in self.jobs:
                job_dir = self.ckpt_root / protocol.job_key(jid)
                new += self._metrics(jid, job_dir / protocol.METRICS_FILE)
                new += self._acks_in(jid, job_dir)
        if self.controller_log is not None:
            new += self._controller_lines(self.controller_log)
        self.events.extend(new)
        return new

    def _new_lines(self, path: Path) -> list[str]:
        """Complete lines appended since the last read (a half-written last line waits for the next read)."""
        offset = self._offsets.get(path, 0)
        try:
            with path.open("rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n")
        if end < 0:
            return []
        self._offsets[path] = offset + end + 1
        return data[:end].decode("utf-8", errors="replace").splitlines()

    def _metrics(self, jid: str, path: Path) -> list[Event]:
        rows: list[Event] = []
        for line in self._new_lines(path):
            try:
                row = json.loads(line)
                rows.append(Progress(t=self._rel(float(row["time"])), job=jid, step=int(row["step"]),
                                     gpus=int(row.get("gpus", 0)), steps_per_s=float(row.get("steps_per_s", 0.0))))
            except (ValueError, KeyError, TypeError):
                log.debug("skipping a malformed metrics row of job %s: %r", jid, line)
        return rows

    def _acks_in(self, jid: str, job_dir: Path) -> list[Event]:
        found: list[Event] = []
        try:
            names = os.listdir(job_dir)
        except FileNotFoundError:
            return []
        prefix = f"ACK-{jid}-"
        for name in sorted(names):
            if not name.startswith(prefix) or name in self._acks or not name[len(prefix):].isdigit():
                continue
            path = job_dir / name
            try:
                body = json.loads(path.read_text(encoding="utf-8"))
                step = body.get("step")
                at = float(body.get("time", path.stat().st_mtime))
            except (OSError, ValueError, AttributeError):
                continue  # being written: the next read sees it whole
            self._acks.add(name)
            found.append(Acked(t=self._rel(at), job=jid, restart=int(name[len(prefix):]),
                               step=None if step is None else int(step)))
        return found

    def _controller_lines(self, path: Path) -> list[Event]:
        notes: list[Event] = []
        for line in self._new_lines(path):
            m = _CONTROLLER_LINE.search(line)
            # The controller logs a plan when it decides and again when it journals it: tell it once.
            if m and m.group(0).strip() != self._last_note:
                self._last_note = m.group(0).strip()
                at = _logged_at(line)
                notes.append(ControllerNote(t=self.now() if at is None else self._rel(at), text=self._last_note))
        return notes

    def take_new(self) -> list[Event]:
        """Events recorded since the previous call (for the live view), in the order they were recorded."""
        new = self.events[self._taken:]
        self._taken = len(self.events)
        return new

    # -- the result ------------------------------------------------------------------------------------
    def timeline(self, *, ended: bool = False) -> Timeline:
        return Timeline(started_at=self.started_at, jobs=tuple(self.jobs.values()), events=in_time_order(self.events),
                        ended_at=self.now() if ended else None)


def _logged_at(line: str) -> float | None:
    """The epoch time of a line in logging's default asctime format ('2026-11-30 06:40:45,688 ...'), local time."""
    m = _ASCTIME.match(line)
    if m is None:
        return None
    try:
        return time.mktime(time.strptime(m[1], "%Y-%m-%d %H:%M:%S")) + int(m[2]) / 1000
    except (ValueError, OverflowError):
        return None


def _node_state(node: Node) -> str:
    flags = sorted(f.value for f in node.flags)
    return "+".join([node.state.value, *flags])
