"""Node loss and gain: typed events from successive snapshots, plus an optional strigger wake-up hint.

Level-triggered: every event follows from the current snapshot and what this watcher has
already reported (plus the previous snapshot for gains and for where a requeued job ran),
never from having seen a transition. A missed poll, or a fresh watcher, loses nothing:
a node that is down now is reported lost on the next observation, whenever that is.
Slurm's own ping marks nodes "not responding" ~15 s before DOWN, so a node that stays not
responding for `grace_s` is reported lost early; the grace (and one re-read of the cluster
before a new loss is reported) keeps a sub-second blip from counting - 24.11 once flagged a
healthy busy node that way.
"""

from __future__ import annotations

import logging
import os
import shlex
import stat
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping, Union

from slurm_elastic.cluster.backend import Backend
from slurm_elastic.cluster.model import ClusterState, Job, JobState, Node, NodeFlag, NodeState
from slurm_elastic.errors import SlurmError, SlurmUnavailable

log = logging.getLogger(__name__)

DEFAULT_GRACE_S = 5.0


@dataclass(frozen=True, slots=True)
class NodeLost:
    """`reason`: down, drained, draining, fail, not-responding, unavailable (powered down, ...) or removed."""

    node: str
    reason: str
    detail: str = ""
    observed_at: float = 0.0


@dataclass(frozen=True, slots=True)
class NodeGained:
    """`reason`: new (not in the previous snapshot) or resumed (back from a reported loss)."""

    node: str
    reason: str
    observed_at: float = 0.0


@dataclass(frozen=True, slots=True)
class JobRequeuedBySlurm:
    """An elastic job Slurm put back to PENDING after a node failure (its restart count went up)."""

    job_id: int
    restarts: int
    nodes: tuple[str, ...] = ()        # where it ran before, when this watcher saw it running
    lost_nodes: tuple[str, ...] = ()   # which of those are lost now
    observed_at: float = 0.0


@dataclass(frozen=True, slots=True)
class JobFinished:
    """An elastic job reached a final state (or left Slurm's memory, state UNKNOWN)."""

    job_id: int
    state: JobState
    observed_at: float = 0.0


Event = Union[NodeLost, NodeGained, JobRequeuedBySlurm, JobFinished]


def loss_reason(node: Node, not_responding_for: float, grace_s: float) -> str | None:
    """Why `node` gives no capacity now, or None if it serves (not responding counts after the grace)."""
    if node.state is NodeState.DOWN:
        return "down"
    if NodeFlag.FAIL in node.flags:
        return "fail"
    if NodeFlag.DRAIN in node.flags:
        return "drained" if node.drained else "draining"
    if NodeFlag.NOT_RESPONDING in node.flags:
        return "not-responding" if not_responding_for >= grace_s else None
    if not node.available:
        return "unavailable"
    return None


class Watcher:
    """Compares each observed ClusterState with what it reported before and returns new events."""

    def __init__(self, *, grace_s: float = DEFAULT_GRACE_S) -> None:
        self.grace_s = grace_s
        self._previous: ClusterState | None = None
        self._lost: dict[str, NodeLost] = {}
        self._nr_since: dict[str, float] = {}
        self._restarts: dict[int, int] = {}
        self._ran_on: dict[int, tuple[str, ...]] = {}
        self._finished: set[int] = set()

    @property
    def lost(self) -> Mapping[str, NodeLost]:
        """Nodes currently reported lost."""
        return dict(self._lost)

    def suspected_losses(self, state: ClusterState) -> set[str]:
        """Nodes that `observe(state)` would newly report lost (for a re-read before reporting)."""
        return {n.name for n in state.nodes
                if n.name not in self._lost and self._reason(n, state.taken_at, update=False) is not None}

    def _reason(self, node: Node, now: float, *, update: bool) -> str | None:
        if NodeFlag.NOT_RESPONDING in node.flags:
            since = self._nr_since.get(node.name, now)
            if update:
                self._nr_since.setdefault(node.name, now)
        else:
            since = now
            if update:
                self._nr_since.pop(node.name, None)
        return loss_reason(node, now - since, self.grace_s)

    def observe(self, state: ClusterState) -> list[Event]:
        now = state.taken_at
        events: list[Event] = []
        prev = self._previous
        prev_names = {n.name for n in prev.nodes} if prev else None
        current = {n.name: n for n in state.nodes}

        for node in state.nodes:
            why = self._reason(node, now, update=True)
            if why is not None:
                if node.name not in self._lost:
                    ev = NodeLost(node.name, why, node.reason, now)
                    self._lost[node.name] = ev
                    events.append(ev)
            elif node.name in self._lost:
                del self._lost[node.name]
                events.append(NodeGained(node.name, "resumed", now))
            elif prev_names is not None and node.name not in prev_names:
                events.append(NodeGained(node.name, "new", now))
        for name in list(self._lost):
            if name not in current:
                if self._lost[name].reason != "removed":
                    self._lost[name] = NodeLost(name, "removed", "", now)
                    events.append(self._lost[name])
        if prev is not None:
            for node in prev.nodes:
                if node.name not in current and node.name not in self._lost:
                    ev = NodeLost(node.name, "removed", "", now)
                    self._lost[node.name] = ev
                    events.append(ev)

        seen_jobs = set()
        for job in state.jobs:
            if job.spec is None:
                continue
            seen_jobs.add(job.job_id)
            events.extend(self._job_events(job, now))
        for jid in sorted(set(self._ran_on) | set(self._restarts)):
            if jid not in seen_jobs:  # purged from slurmctld (MinJobAge) before we saw it end
                events.append(JobFinished(jid, JobState.UNKNOWN, now))
                self._ran_on.pop(jid, None)
                self._restarts.pop(jid, None)
        self._finished &= seen_jobs  # bounded memory: only jobs Slurm still lists
        self._nr_since = {k: v for k, v in self._nr_since.items() if k in current}
        self._previous = state
        return events

    def _job_events(self, job: Job, now: float) -> list[Event]:
        jid = job.job_id
        if job.state.finished:
            if jid in self._finished:
                return []
            self._finished.add(jid)
            self._restarts.pop(jid, None)
            self._ran_on.pop(jid, None)
            return [JobFinished(jid, job.state, now)]
        self._finished.discard(jid)  # a finished job requeued by an operator lives again
        out: list[Event] = []
        seen = self._restarts.get(jid)
        if job.state.active:
            self._ran_on[jid] = job.nodes
        elif job.state is JobState.PENDING and not job.held and job.restarts > 0 and (seen is None or
                                                                                    job.restarts > seen):
            before = self._ran_on.get(jid, ())
            lost_here = tuple(n for n in before if n in self._lost)
            # A requeue Slurm made after a node failure carries BeginTime (eligible ~120 s later);
            # the controller's own requeue goes through a hold and StartTime=now.
            if job.reason == "BeginTime" or lost_here:
                out.append(JobRequeuedBySlurm(jid, job.restarts, before, lost_here, now))
        self._restarts[jid] = job.restarts
        return out


# --- polling loop with an optional push hint ------------------------------------------------------

class WakeFile:
    """A file whose mtime a trigger program bumps; the poll loop waits on it (never blocks Slurm)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._mtime = self._stamp()

    def _stamp(self) -> float:
        try:
            return self.path.stat().st_mtime_ns / 1e9
        except FileNotFoundError:
            return 0.0

    def wait(self, timeout_s: float, step_s: float = 0.2) -> bool:
        """Sleep up to timeout_s; True as soon as the file was touched since the last call."""
        deadline = time.monotonic() + timeout_s
        while True:
            stamp = self._stamp()
            if stamp != self._mtime:
                self._mtime = stamp
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(step_s, left))


def watch(backend: Backend, *, interval_s: float = 5.0, grace_s: float = DEFAULT_GRACE_S,
          wake: WakeFile | None = None, confirm_delay_s: float = 0.5,
          stop: Callable[[], bool] = lambda: False, watcher: Watcher | None = None) -> Iterator[Event]:
    """Poll `backend` every interval_s (sooner when `wake` is touched) and yield events.

    A new loss is reported only if a second snapshot, confirm_delay_s later, still shows it.
    A slurmctld that cannot be reached is logged and polled again; the watcher never dies of it.
    """
    w = watcher or Watcher(grace_s=grace_s)
    while not stop():
        try:
            state = backend.snapshot()
            if w.suspected_losses(state):
                time.sleep(confirm_delay_s)
                state = backend.snapshot()
        except SlurmUnavailable as exc:
            log.warning("watch: %s; polling again in %.0f s", exc, interval_s)
        else:
            yield from w.observe(state)
        if wake is not None:
            if wake.wait(interval_s):
                log.debug("watch: woken by %s", wake.path)
        else:
            time.sleep(interval_s)


# --- strigger hint ------------------------------------------------------------------------------------

def write_wake_program(program: str | os.PathLike[str], wake_file: str | os.PathLike[str]) -> Path:
    """A trigger program that only touches `wake_file` (strigger runs it with node names as args)."""
    path = Path(program)
    path.write_text("#!/bin/sh\n"
                    "# slurm-elastic: wake the node watcher; the watcher re-reads Slurm itself.\n"
                    f"exec /usr/bin/touch -- {shlex.quote(str(Path(wake_file).resolve()))}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def strigger_args(program: str | os.PathLike[str], event: str) -> list[str]:
    """`strigger --set --node --down|--up --flags=PERM --program=...` (event: 'down' or 'up')."""
    if event not in ("down", "up"):
        raise SlurmError(f"strigger event must be 'down' or 'up', got {event!r}")
    return ["strigger", "--set", "--node", f"--{event}", "--flags=PERM", f"--program={Path(program).resolve()}"]


def install_wake_triggers(program: str | os.PathLike[str], wake_file: str | os.PathLike[str], *,
                          env: Mapping[str, str] | None = None) -> list[int]:
    """Write the wake program and register permanent node down/up triggers (once); return their ids.

    Needs SlurmUser (or root) rights; strigger checks every ~15 s, so this only shortens the
    wait for the next poll, the watcher stays the detector. Idempotent: existing triggers
    for the same program are kept, not doubled.
    """
    prog = write_wake_program(program, wake_file).resolve()
    have = _triggers_for(prog, env)
    for event in ("down", "up"):
        if event in have.values():
            continue
        _strigger(strigger_args(prog, event), env)
    ids = sorted(_triggers_for(prog, env))
    log.info("strigger wake-up hints %s installed (%s -> %s)", ids, prog, wake_file)
    return ids


def _strigger(argv: list[str], env: Mapping[str, str] | None) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, env=dict(env or os.environ), timeout=30, check=False)
    if proc.returncode != 0:
        raise SlurmError(f"strigger: {proc.stderr.strip() or proc.stdout.strip()}", command=tuple(argv),
                         returncode=proc.returncode)
    return proc.stdout


def _triggers_for(program: Path, env: Mapping[str, str] | None) -> dict[int, str]:
    """{trigger id: 'down'|'up'} of the node triggers that run `program` (strigger --set prints no id)."""
    out: dict[int, str] = {}
    for line in _strigger(["strigger", "--get", "--noheader"], env).splitlines():
        cols = line.split()
        # TRIG_ID RES_TYPE RES_ID TYPE OFFSET USER FLAGS PROGRAM
        if len(cols) >= 5 and cols[0].isdigit() and cols[1] == "node" and cols[-1] == str(program):
            out[int(cols[0])] = cols[3]
    return out


def clear_triggers(ids: list[int], *, env: Mapping[str, str] | None = None) -> None:
    for tid in ids:
        _strigger(["strigger", "--clear", f"--id={int(tid)}"], env)
