"""The ranks of one srun step talking through the job directory: heartbeats, loss detection, agreement (no torch).

A collective against a peer that stopped without closing its sockets (a
frozen node, SIGSTOP, dropped traffic) waits for the whole collective
timeout (300 s by default). So each rank runs a liveness thread that
rewrites a heartbeat counter every `interval_s` and watches the counters of
the next few ranks: a counter that does not move for `timeout_s` (seconds of
this node's clock, so clock skew between nodes does not matter) is a lost
peer. A slow step is not: the liveness thread runs beside the training
thread, which may take as long as it likes. The first rank to see a loss
writes `lost`; every liveness thread looks for that file, so all survivors
learn of it within about one interval, whatever their own collective is
blocked on.

The survivors then agree, still without the process group, on the step to
commit: each writes its status (completed step, digest of its state), waits
until every other rank has either reported or is gone, and the first to get
there creates `decision.json` (exclusively: a later decider reads the first
one instead). File names are in `protocol`.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from slurm_elastic import jobfiles as protocol
from slurm_elastic.jobfiles import read_record

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 1.0
DEFAULT_TIMEOUT_S = 5.0
RUNNING, DONE, FAILED = "running", "done", "failed"   # FAILED: ended by an error; its peers are stuck
STARTUP_GRACE_S = 60.0


class RunDirectory:
    """`<job dir>/run-<job>-<restart>-<step>[.<generation>]/`: small JSON files, each replaced whole by a rename."""

    def __init__(self, job_dir: str, job_id: str, restart_count: int, step_id: int, generation: int = 0) -> None:
        self.job_dir = job_dir
        # A group the survivors re-formed meets in a directory of its own (.1, .2, ...).
        self.name = protocol.run_dir_name(job_id, restart_count, step_id) + (f".{generation}" if generation else "")
        self.path = os.path.join(job_dir, self.name)
        self.restart_count = restart_count

    def create(self) -> None:
        try:
            os.mkdir(self.path, 0o700)
        except FileExistsError:
            if os.path.islink(self.path) or not os.path.isdir(self.path):
                raise OSError(errno.EEXIST, f"{self.path} exists and is not a directory") from None

    def remove_older_runs(self) -> None:
        """Run directories of earlier restarts of this job: their ranks are gone."""
        import shutil

        for name in os.listdir(self.job_dir):
            base, dot, generation = name.rpartition(".")
            parsed = protocol.parse_run_dir_name(name) or (
                protocol.parse_run_dir_name(base) if dot and generation.isdigit() else None)
            if parsed is not None and parsed[1] < self.restart_count:
                shutil.rmtree(os.path.join(self.job_dir, name), ignore_errors=True)

    def publish(self, name: str, body: Mapping[str, Any]) -> None:
        """Replace `name` with `body` (temp name, rename; not fsynced: this is the job's own
        chatter during one incarnation, not state that must survive a crash)."""
        self.publish_bytes(name, json.dumps(body, allow_nan=False).encode())

    def publish_bytes(self, name: str, data: bytes) -> None:
        tmp = os.path.join(self.path, f".{name}.{os.getpid()}.{threading.get_ident()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, os.path.join(self.path, name))

    def create_once(self, name: str, body: Mapping[str, Any]) -> bool:
        """Create `name` unless it exists (link(2) of a complete temp file: atomic, also on NFS)."""
        tmp = os.path.join(self.path, f".{name}.{os.getpid()}.{threading.get_ident()}")
        self._write_new(tmp, body)
        try:
            os.link(tmp, os.path.join(self.path, name))
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)

    def read(self, name: str) -> dict[str, Any] | None:
        """The file's JSON object, or None when it does not exist (yet)."""
        try:
            fd = os.open(os.path.join(self.path, name), os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as f:
            data = f.read(1 << 22)
        body = json.loads(data)
        if not isinstance(body, dict):
            raise ValueError(f"{self.path}/{name} is not a JSON object")
        return body

    def exists(self, name: str) -> bool:
        return os.path.lexists(os.path.join(self.path, name))

    @staticmethod
    def _write_new(path: str, body: Mapping[str, Any]) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(body, allow_nan=False).encode())


class Liveness:
    """This rank's heartbeat and its watch over the next ranks; calls `on_lost(reason)` once.

    `on_lost` runs in the liveness thread; the heartbeat goes on while it
    runs only if it hands the work to another thread (the session does), so
    that survivors busy agreeing are never taken for lost themselves.
    """

    def __init__(self, run: RunDirectory, *, rank: int, world_size: int, node: str, watch: int,
                 interval_s: float = DEFAULT_INTERVAL_S, timeout_s: float = DEFAULT_TIMEOUT_S,
                 on_lost: Callable[[str], None]) -> None:
        if not 0 < interval_s < timeout_s:
            raise ValueError(f"the heartbeat interval ({interval_s} s) must be positive and shorter than "
                             f"the liveness timeout ({timeout_s} s)")
        self.run = run
        self.rank = rank
        self.world_size = world_size
        self.node = node
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.watched = [(rank + k) % world_size for k in range(1, min(watch, world_size - 1) + 1)]
        self._on_lost = on_lost
        self._seq = 0
        self.state = RUNNING
        self._seen: dict[int, tuple[int, float, dict[str, Any]]] = {}   # rank -> (seq, when it last moved, body)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._fired = False
        self._quiet = False
        self._thread = threading.Thread(target=self._loop, name="liveness", daemon=True)

    def start(self) -> None:
        self.beat()
        self._thread.start()

    def stop(self, state: str = DONE) -> None:
        """The end of this rank: DONE (clean; the watchers do not take it for a loss) or FAILED."""
        self.state = state
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2 * self.interval_s + 1)
        try:
            self.beat()
        except OSError as exc:
            log.debug("last heartbeat not written: %s", exc)

    def beat(self) -> None:
        self._seq += 1
        beat = protocol.Heartbeat(seq=self._seq, rank=self.rank, node=self.node, pid=os.getpid(), state=self.state)
        self.run.publish_bytes(protocol.heartbeat_file_name(self.rank), beat.to_bytes())

    def observe(self, ranks: Iterable[int]) -> None:
        """Read the heartbeats of `ranks`; a counter that moved resets that rank's clock."""
        now = time.monotonic()
        for r in ranks:
            # Refused (being replaced right now, or not a heartbeat) reads as not written yet.
            beat, _ = read_record(os.path.join(self.run.path, protocol.heartbeat_file_name(r)),
                                  protocol.Heartbeat.parse, owner_uid=os.geteuid(),
                                  max_bytes=protocol.HEARTBEAT_MAX_BYTES, what="a heartbeat")
            body = dataclasses.asdict(beat) if beat is not None else None
            with self._lock:
                old = self._seen.get(r)
                if body is None:
                    if old is None:
                        self._seen[r] = (-1, now, {})   # never beaten yet: see `gone`
                    continue
                seq = int(body.get("seq", -1))
                if old is None or seq != old[0]:
                    self._seen[r] = (seq, now, body)

    def gone(self, rank: int, within_s: float | None = None) -> bool:
        """The rank ended cleanly, or its heartbeat stood still for the timeout (or `within_s`, shorter, where
        the caller already knows a peer process died)."""
        with self._lock:
            seen = self._seen.get(rank)
        if seen is None:
            return False
        if seen[0] < 0:
            # No heartbeat file yet: a rank starts beating only after the process group
            # is up, and a loaded node may take a while to get there.
            return time.monotonic() - seen[1] >= max(self.timeout_s, STARTUP_GRACE_S)
        still = self.timeout_s if within_s is None else min(within_s, self.timeout_s)
        return seen[2].get("state", RUNNING) != RUNNING or time.monotonic() - seen[1] >= still

    def node_of(self, rank: int) -> str | None:
        with self._lock:
            seen = self._seen.get(rank)
        return seen[2].get("node") if seen and seen[2].get("node") else None

    def quiet(self) -> None:
        """Keep beating, act on nothing: this rank is ending by an error of its own and asks
        `loss_seen` itself. Acting here would take a peer ending by the same error for a loss."""
        self._quiet = True

    def loss_seen(self) -> str | None:
        """What tells this rank that a peer is lost, if anything does now: another rank's `lost` file,
        or a watched peer whose heartbeat stopped while it was running (read afresh). A peer that says
        `failed` is not counted: on an error of every rank's own, the first to end would say it."""
        try:
            if self.run.exists(protocol.LOST_FILE):
                body = self.run.read(protocol.LOST_FILE) or {}
                return f"rank {body.get('rank')} reported: {body.get('reason')}"
            self.observe(self.watched)
        except (OSError, ValueError) as exc:
            log.debug("rank %d: looking for a lost peer failed: %s", self.rank, exc)
            return None
        stale = [r for r in self.watched if self.gone(r) and self._seen[r][2].get("state", RUNNING) == RUNNING]
        return f"no heartbeat from rank(s) {stale} for {self.timeout_s:g} s" if stale else None

    def declare_lost(self, reason: str) -> None:
        """Tell every rank (the `lost` file); this rank's own handler is not called."""
        with self._lock:
            self._fired = True
        try:
            self.run.create_once(protocol.LOST_FILE, {"rank": self.rank, "node": self.node, "reason": reason,
                                                      "time": time.time()})
        except OSError as exc:
            log.error("rank %d: cannot write %s: %s", self.rank, protocol.LOST_FILE, exc)

    def _fire(self, reason: str) -> None:
        with self._lock:
            if self._fired:
                return
            self._fired = True
        self._on_lost(reason)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
                if self._fired or self._quiet:
                    continue
                if self.run.exists(protocol.LOST_FILE):
                    body = self.run.read(protocol.LOST_FILE) or {}
                    self._fire(f"rank {body.get('rank')} reported: {body.get('reason')}")
                    continue
                self.observe(self.watched)
                stale = [r for r in self.watched if self.gone(r) and self._seen[r][2].get("state", RUNNING) != DONE]
                if stale:
                    reason = f"no heartbeat from rank(s) {stale} for {self.timeout_s:g} s"
                    self.declare_lost(reason)
                    self._on_lost(reason)
            except (OSError, ValueError) as exc:
                # A shared filesystem hiccup must not end training; the next beat tries again.
                log.warning("rank %d: liveness check failed: %s", self.rank, exc)


def died_quiet_s(interval_s: float) -> float:
    """How long a rank's heartbeat must stand still to count it lost when a collective already said a peer
    process died (its connection reset or closed: the peer's kernel answered for a process that is gone).
    A live rank beats every interval whatever its training thread does, so two and a half intervals
    without a beat, on top of that evidence, is a dead one, and the survivors need not wait the full
    liveness timeout that a silent (frozen, unreachable) node needs."""
    return 2.5 * interval_s


def agree(run: RunDirectory, liveness: Liveness, status: Mapping[str, Any], *, world_size: int,
          deadline_s: float, poll_s: float = 0.1, died_quiet_s: float | None = None) -> dict[str, Any]:
    """Publish this survivor's status, wait until every rank has reported or is gone (its heartbeat still
    for the liveness timeout, or for `died_quiet_s` where this rank saw a peer process die), and
    return the decision (this rank's, or the one another survivor created first)."""
    rank = int(status["rank"])
    run.publish(protocol.status_file_name(rank), dict(status))
    end = time.monotonic() + deadline_s
    while True:
        decision = run.read(protocol.DECISION_FILE)
        if decision is not None:
            return decision
        statuses = read_statuses(run, world_size)
        missing = [r for r in range(world_size) if r not in statuses]
        liveness.observe(missing)
        late = time.monotonic() >= end
        if all(liveness.gone(r, died_quiet_s) for r in missing) or late:
            if late and missing:
                log.warning("rank %d: no status from ranks %s within %g s; counting them as lost",
                            rank, missing, deadline_s)
            nodes = {r: liveness.node_of(r) or "unknown" for r in missing}
            run.create_once(protocol.DECISION_FILE, decide(statuses, world_size, nodes))
            decision = run.read(protocol.DECISION_FILE)
            assert decision is not None
            return decision
        time.sleep(poll_s)


def regroup_deadline_s(liveness_timeout_s: float) -> float:
    """How long survivors wait for each other's training threads before giving up re-forming in place:
    a thread whose collective failed gets there at once; one blocked with a frozen peer would take the
    collective timeout, and the relaunch is cheaper than that."""
    return liveness_timeout_s + 2.0


def agree_to_regroup(run: RunDirectory, *, rank: int, survivors: Iterable[int], deadline_s: float,
                     poll_s: float = 0.05) -> bool:
    """Say this survivor's training thread is ready to re-form the group; True when every survivor is.

    The outcome is one file created once (regroup.json): the first survivor to see all of them ready
    writes go, the first to reach the deadline first writes no-go, and everyone follows the file, so no
    survivor waits in a new group for one that exited.
    """
    ranks = sorted(int(r) for r in survivors)
    run.publish(protocol.ready_file_name(rank), {"rank": rank, "time": time.time()})
    end = time.monotonic() + deadline_s
    while True:
        outcome = run.read(protocol.REGROUP_FILE)
        if outcome is not None:
            return bool(outcome.get("go"))
        missing = [r for r in ranks if not run.exists(protocol.ready_file_name(r))]
        if not missing:
            run.create_once(protocol.REGROUP_FILE, {"go": True, "survivors": ranks, "time": time.time()})
        elif time.monotonic() >= end:
            log.warning("rank %d: survivors %s not ready to re-form the group within %g s", rank, missing, deadline_s)
            run.create_once(protocol.REGROUP_FILE, {"go": False, "not_ready": missing, "time": time.time(),
                                                    "why": f"survivors {missing} not ready within {deadline_s:g} s"})
        else:
            time.sleep(poll_s)


def give_up_regroup(run: RunDirectory, *, rank: int, why: str) -> None:
    """No re-forming in place for this loss (unless the others already decided it): say so at once, for the
    other survivors and for the job template, which then relaunches the ranks."""
    log.warning("rank %d: the survivors do not go on in their processes: %s; exiting to be relaunched", rank, why)
    try:
        run.create_once(protocol.REGROUP_FILE, {"go": False, "not_ready": [rank], "why": why, "time": time.time()})
    except OSError as exc:
        log.warning("rank %d: cannot write %s: %s", rank, protocol.REGROUP_FILE, exc)


def read_statuses(run: RunDirectory, world_size: int) -> dict[int, dict[str, Any]]:
    out = {}
    for r in range(world_size):
        try:
            body = run.read(protocol.status_file_name(r))
        except (OSError, ValueError):
            body = None     # being written: the next poll sees it
        if body is not None:
            out[r] = body
    return out


def decide(statuses: Mapping[int, Mapping[str, Any]], world_size: int, lost_nodes: Mapping[int, str]) -> dict[str, Any]:
    """The step to commit and who commits it, from the survivors' statuses.

    The step is the last one every survivor completed (the lowest completed
    step among them): a survivor that already applied the next one has no
    copy of the state before it, so the committer is the lowest-ranked
    survivor holding a full replica at exactly that step. Survivors at that
    step must agree on the digest of their replicated state (parameters and
    optimizer state; each rank's buffers, such as BatchNorm statistics, are
    its own under DDP, and the committer's are written); if not, nothing is
    committed (the last committed checkpoint stays the resume point).
    """
    survivors = sorted(statuses)
    lost = [{"rank": r, "node": lost_nodes.get(r, "unknown")} for r in range(world_size) if r not in statuses]
    body: dict[str, Any] = {"survivors": survivors, "lost": lost, "step": None, "committer": None,
                            "survivor_steps": {str(r): statuses[r]["step"] for r in survivors},
                            "survivor_nodes": {str(r): statuses[r].get("node", "unknown") for r in survivors},
                            "time": time.time()}
    if not survivors:
        return {**body, "reason": "no survivor reported"}
    steps = [int(statuses[r]["step"]) for r in survivors]
    agreed = min(steps)
    body["step"] = agreed
    if max(steps) - agreed > 1:
        return {**body, "reason": f"survivors are more than one step apart ({agreed}..{max(steps)}); "
                                  f"their states cannot be reconciled"}
    replicas = [r for r in survivors if statuses[r].get("replica")]
    if not replicas:
        why = statuses[survivors[0]].get("unclean") or "sharded state"
        return {**body, "reason": f"no survivor holds a full replica ({why}): resuming from the last committed "
                                  f"checkpoint"}
    at_step = [r for r in replicas if int(statuses[r]["step"]) == agreed]
    clean = [r for r in at_step if statuses[r].get("clean")]
    if not clean:
        why = "; ".join(f"rank {r}: {statuses[r].get('unclean')}" for r in at_step) or "none is at that step"
        return {**body, "reason": f"no full replica holds a clean state of step {agreed} ({why})"}
    digests = {statuses[r]["digest"] for r in clean}
    if len(digests) > 1:
        return {**body, "reason": f"the replicas at step {agreed} differ (digests "
                                  f"{', '.join(sorted(d[:12] for d in digests))}); not committing either"}
    return {**body, "committer": clean[0], "digest": digests.pop(),
            "reason": f"step {agreed} is the last step all {len(survivors)} survivors completed"}
