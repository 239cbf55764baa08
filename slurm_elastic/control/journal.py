"""The SQLite (WAL) journal of resize plans: every protocol step is written before it is taken.

The journal holds every user's plans, so it is 0600 (SQLite gives its -wal and -shm files the
database's mode) in a directory only the controller's user can write.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from slurm_elastic.cluster.shape import RequestShape, ShapeError
from slurm_elastic.control.plan import Plan, PlanEntry
from slurm_elastic.control.state_dir import USER_DIR_MODE, open_private_file, open_state_dir
from slurm_elastic.errors import ElasticError

log = logging.getLogger(__name__)

# Steps in protocol order. A step is journaled as an *intent* just before it
# is taken, so after a crash the last recorded step may or may not have
# happened; every step is idempotent, so recovery redoes it and goes on.
STEPS = ("open", "signal", "ack", "hold", "resize", "release")
OPEN, DONE, ROLLED_BACK, ABANDONED = "open", "done", "rolled_back", "abandoned"

_PLANS_TABLE = """
CREATE TABLE IF NOT EXISTS {table} (
    plan_id        INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id         INTEGER NOT NULL,
    from_gpus      INTEGER NOT NULL,
    to_gpus        INTEGER NOT NULL,
    shape          TEXT    NOT NULL,
    entry          TEXT    NOT NULL,
    reason         TEXT    NOT NULL,
    user           TEXT    NOT NULL DEFAULT '',
    exclude        TEXT    NOT NULL DEFAULT '',
    keep           TEXT    NOT NULL DEFAULT '',
    place          TEXT    NOT NULL DEFAULT '',
    forced         INTEGER NOT NULL,
    restarts       INTEGER NOT NULL,
    step           TEXT    NOT NULL,
    status         TEXT    NOT NULL,
    created_at     REAL    NOT NULL,
    updated_at     REAL    NOT NULL,
    note           TEXT    NOT NULL DEFAULT ''
)"""
_PLANS_INDEXES = ("CREATE INDEX IF NOT EXISTS plans_open ON plans(status)",
                  "CREATE INDEX IF NOT EXISTS plans_job ON plans(job_id, created_at)")
_SCHEMA = _PLANS_TABLE.format(table="plans") + ";\n" + ";\n".join(_PLANS_INDEXES) + """;
CREATE TABLE IF NOT EXISTS steps (
    plan_id INTEGER NOT NULL REFERENCES plans(plan_id),
    step    TEXT    NOT NULL,
    at      REAL    NOT NULL,
    note    TEXT    NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS marks (
    plan_id INTEGER NOT NULL REFERENCES plans(plan_id),
    name    TEXT    NOT NULL,
    at      REAL    NOT NULL
);
CREATE TABLE IF NOT EXISTS revivals (
    job_id   INTEGER NOT NULL,
    restarts INTEGER NOT NULL,
    at       REAL    NOT NULL,
    PRIMARY KEY (job_id, restarts)
);
CREATE TABLE IF NOT EXISTS ran_at (
    job_id INTEGER NOT NULL,
    gpus   INTEGER NOT NULL,
    nodes  INTEGER NOT NULL,
    at     REAL    NOT NULL,
    PRIMARY KEY (job_id, gpus, nodes)
);
CREATE TABLE IF NOT EXISTS drains (
    node    TEXT    NOT NULL,
    user    TEXT    NOT NULL,
    job_id  INTEGER NOT NULL,
    at      REAL    NOT NULL,
    reason  TEXT    NOT NULL
);
"""
# Drains journaled before drains expired get an hour, the default of ControllerConfig.drain_expiry_s.
_DRAINS_BEFORE_EXPIRY_S = 3600.0


@dataclass(frozen=True, slots=True)
class DrainRecord:
    """A node drained on a job's report of losing it, until when, and how the drain ended (if it has)."""

    drain_id: int
    node: str
    user: str
    job_id: int
    at: float
    reason: str
    until: float
    ended_at: float | None = None
    end_note: str = ""

    def to_json(self) -> dict[str, object]:
        return {"node": self.node, "user": self.user, "job_id": self.job_id, "at": self.at, "reason": self.reason,
                "until": self.until, "ended_at": self.ended_at, "end_note": self.end_note}

# Journals written before the request shape had one type kept it in these columns; such a journal
# is rewritten to the `shape` column when opened, so a plan in flight across the upgrade is replayed.
_OLD_SHAPE_COLUMNS = ("nodes", "gpus_per_node", "cpus_per_gpu", "mem_per_gpu_mb")
_PLAN_COLUMNS = ("plan_id", "job_id", "from_gpus", "to_gpus", "entry", "reason", "user", "exclude", "keep", "place", "forced",
                 "restarts", "step", "status", "created_at", "updated_at", "note")


@dataclass(frozen=True, slots=True)
class PlanRecord:
    """One journaled plan and how far it got."""

    plan_id: int
    plan: Plan
    restarts: int          # the job's Slurm restart count when the plan opened (names the ACK file)
    step: str
    status: str
    created_at: float
    updated_at: float
    note: str = ""

    @property
    def job_id(self) -> int:
        return self.plan.job_id

    def to_json(self) -> dict[str, object]:
        return {"plan_id": self.plan_id, **self.plan.to_json(), "exclude": list(self.plan.exclude),
                "keep": list(self.plan.keep),
                "step": self.step,
                "status": self.status, "created_at": self.created_at, "updated_at": self.updated_at,
                "note": self.note}


class JournalError(ElasticError):
    """The journal cannot be read or written (a full disk, a damaged file)."""


class Journal:
    """Plans and their steps in one SQLite file (WAL, synchronous=FULL: a step is on disk before it runs)."""

    def __init__(self, path: str | os.PathLike[str], *, lifelong: bool = True) -> None:
        """`lifelong` False: a one-shot view's empty journal, which has seen no job's earlier sizes
        (measuring.SizesRan)."""
        self.path = Path(path)
        self.lifelong = lifelong
        if str(path) != ":memory:":
            _secure(self.path)
        try:
            self._db = sqlite3.connect(str(self.path), isolation_level=None, timeout=30.0)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)
            columns = {row[1] for row in self._db.execute("PRAGMA table_info(plans)")}
            if "user" not in columns:   # a journal from before plans named the job's owner
                self._db.execute("ALTER TABLE plans ADD COLUMN user TEXT NOT NULL DEFAULT ''")
            if "exclude" not in columns:   # from before plans acted on a job's lost node
                self._db.execute("ALTER TABLE plans ADD COLUMN exclude TEXT NOT NULL DEFAULT ''")
            if "keep" not in columns:   # from before rebalance shrinks in place
                self._db.execute("ALTER TABLE plans ADD COLUMN keep TEXT NOT NULL DEFAULT ''")
            if "place" not in columns:   # from before plans named the nodes a job starts on
                self._db.execute("ALTER TABLE plans ADD COLUMN place TEXT NOT NULL DEFAULT ''")
            self._db.execute("CREATE INDEX IF NOT EXISTS plans_lost ON plans(job_id) WHERE exclude != ''")
            if "shape" not in columns:
                self._move_shapes()
            drain_columns = {row[1] for row in self._db.execute("PRAGMA table_info(drains)")}
            if "until" not in drain_columns:   # from before drains expired
                self._db.execute("ALTER TABLE drains ADD COLUMN until REAL")
                self._db.execute("ALTER TABLE drains ADD COLUMN ended_at REAL")
                self._db.execute("ALTER TABLE drains ADD COLUMN end_note TEXT NOT NULL DEFAULT ''")
                self._db.execute("UPDATE drains SET until = at + ? WHERE until IS NULL", (_DRAINS_BEFORE_EXPIRY_S,))
        except sqlite3.Error as exc:
            raise JournalError(f"cannot open the controller journal {self.path}: {exc}{_full(self.path)}") from None

    def close(self) -> None:
        self._db.close()

    # -- writing -----------------------------------------------------------------------
    def open_plan(self, plan: Plan, *, restarts: int, now: float | None = None) -> int:
        """Step 1: 'plan P: job J g0 -> g1' is durable before anything touches the job."""
        at = time.time() if now is None else now
        with self._tx():
            cur = self._db.execute(
                "INSERT INTO plans (job_id, from_gpus, to_gpus, shape, entry, reason, user, exclude, keep, place, forced,"
                " restarts, step, status, created_at, updated_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (plan.job_id, plan.from_gpus, plan.to_gpus, plan.shape.dumps(), plan.entry.value, plan.reason,
                 plan.user, ",".join(plan.exclude), ",".join(plan.keep), ",".join(plan.place), int(plan.forced),
                 restarts, "open", OPEN, at, at))
            plan_id = int(cur.lastrowid)
            self._db.execute("INSERT INTO steps (plan_id, step, at, note) VALUES (?,?,?,?)",
                             (plan_id, "open", at, json.dumps(plan.describe())))
        log.log(plan.log_level, "job %d: plan %d opened: %s", plan.job_id,
                plan_id, plan.describe())
        return plan_id

    def record(self, plan_id: int, step: str, note: str = "", now: float | None = None) -> None:
        if step not in STEPS:
            raise ValueError(f"unknown protocol step {step!r}")
        at = time.time() if now is None else now
        with self._tx():
            self._db.execute("UPDATE plans SET step=?, updated_at=? WHERE plan_id=?", (step, at, plan_id))
            self._db.execute("INSERT INTO steps (plan_id, step, at, note) VALUES (?,?,?,?)",
                             (plan_id, step, at, note))

    def finish(self, plan_id: int, status: str, note: str = "", now: float | None = None) -> None:
        if status not in (DONE, ROLLED_BACK, ABANDONED):
            raise ValueError(f"unknown final status {status!r}")
        at = time.time() if now is None else now
        with self._tx():
            self._db.execute("UPDATE plans SET status=?, note=?, updated_at=? WHERE plan_id=?",
                             (status, note, at, plan_id))
            self._db.execute("INSERT INTO steps (plan_id, step, at, note) VALUES (?,?,?,?)",
                             (plan_id, status, at, note))

    def mark(self, plan_id: int, name: str, at: float) -> None:
        """A moment of the restart a plan carried out that the protocol's steps do not show (when the job
        detected a lost peer, stopped, committed: control/phases.py), kept here because the job's own
        files of that incarnation are replaced or removed by the next one."""
        with self._tx():
            self._db.execute("INSERT INTO marks (plan_id, name, at) VALUES (?,?,?)", (plan_id, name, float(at)))

    def marks(self, plan_id: int) -> dict[str, float]:
        rows = self._db.execute("SELECT name, at FROM marks WHERE plan_id=? ORDER BY rowid", (plan_id,)).fetchall()
        return {str(n): float(a) for n, a in rows}

    def record_drain(self, node: str, *, user: str, job_id: int, reason: str, until: float,
                     now: float | None = None) -> None:
        """A node drained on a job's report of losing it (admin daemon --drain-on-peer-loss), to be
        resumed at `until`."""
        at = time.time() if now is None else now
        with self._tx():
            self._db.execute("INSERT INTO drains (node, user, job_id, at, reason, until) VALUES (?,?,?,?,?,?)",
                             (node, user, job_id, at, reason, until))

    def end_drain(self, drain_id: int, note: str, now: float | None = None) -> None:
        """The drain is over (resumed on expiry, or no longer ours to resume)."""
        at = time.time() if now is None else now
        with self._tx():
            self._db.execute("UPDATE drains SET ended_at=?, end_note=? WHERE rowid=? AND ended_at IS NULL",
                             (at, note, drain_id))

    def claim_revival(self, job_id: int, restarts: int, *, per_hour: int, now: float | None = None) -> bool:
        """Whether this incarnation (job, restart count) may be requeued by control/revive.py: not claimed
        before, and fewer than `per_hour` claims for the job in the last hour. True records the claim."""
        at = time.time() if now is None else now
        with self._tx():
            if self._db.execute("SELECT 1 FROM revivals WHERE job_id=? AND restarts=?",
                                (job_id, restarts)).fetchone():
                return False
            (recent,) = self._db.execute("SELECT COUNT(*) FROM revivals WHERE job_id=? AND at>=?",
                                         (job_id, at - 3600.0)).fetchone()
            if recent >= per_hour:
                return False
            self._db.execute("INSERT INTO revivals (job_id, restarts, at) VALUES (?,?,?)", (job_id, restarts, at))
            return True

    def release_revival(self, job_id: int, restarts: int) -> None:
        """Undo a claim whose requeue failed, so a later cycle tries again."""
        with self._tx():
            self._db.execute("DELETE FROM revivals WHERE job_id=? AND restarts=?", (job_id, restarts))

    # -- reading -----------------------------------------------------------------------
    def drains_since(self, user: str, since: float) -> int:
        """Nodes drained on the word of this user's jobs since `since` (the bound on what one user can drain)."""
        row = self._db.execute("SELECT COUNT(*) FROM drains WHERE user=? AND at>=?", (user, since)).fetchone()
        return int(row[0])

    def drains(self, *, active: bool = True, limit: int = 100) -> list[DrainRecord]:
        """The drains made on jobs' reports, oldest first: those not ended yet (`active`), or the latest `limit`."""
        where = "WHERE ended_at IS NULL ORDER BY rowid" if active else "ORDER BY rowid DESC LIMIT ?"
        rows = self._db.execute("SELECT rowid, node, user, job_id, at, reason, until, ended_at, end_note FROM drains "
                                + where, () if active else (limit,)).fetchall()
        out = [DrainRecord(int(r[0]), str(r[1]), str(r[2]), int(r[3]), float(r[4]), str(r[5]), float(r[6]),
                           None if r[7] is None else float(r[7]), str(r[8])) for r in rows]
        return out if active else out[::-1]

    def record_ran_at(self, job_id: int, size: tuple[int, int], now: float | None = None) -> None:
        """Slurm was seen running `job_id` at `size` (gpus, nodes): kept across daemon restarts and read by dry
        runs, so a speed row at that size stays believed (requests.measuring)."""
        with self._tx() as db:
            db.execute("INSERT OR IGNORE INTO ran_at(job_id, gpus, nodes, at) VALUES (?,?,?,?)",
                       (job_id, size[0], size[1], time.time() if now is None else now))

    def ran_at(self, job_id: int) -> frozenset[tuple[int, int]]:
        """The (gpus, nodes) sizes Slurm has been seen running `job_id` at."""
        rows = self._db.execute("SELECT gpus, nodes FROM ran_at WHERE job_id=?", (job_id,)).fetchall()
        return frozenset((int(g), int(n)) for g, n in rows)

    def lost_nodes(self, job_ids: Iterable[int]) -> dict[int, dict[str, float]]:
        """Job id (of `job_ids`) -> {node its ranks reported lost in a plan (the plans' `exclude`): when
        the latest such plan opened}, whatever became of the plan: the job stays off the node until it
        comes back (control/peer_loss.py `still_lost`). Read through a partial index: only plans that
        excluded a node."""
        wanted = set(job_ids)
        out: dict[int, dict[str, float]] = {}
        for job_id, exclude, at in self._db.execute(
                "SELECT job_id, exclude, created_at FROM plans WHERE exclude != ''"):
            if int(job_id) in wanted:
                nodes = out.setdefault(int(job_id), {})
                for n in str(exclude).split(","):
                    if n:
                        nodes[n] = max(nodes.get(n, 0.0), float(at))
        return out

    def open_plans(self) -> list[PlanRecord]:
        return self._select("WHERE status=? ORDER BY plan_id", (OPEN,))

    def plans(self, job_id: int | None = None, limit: int = 100) -> list[PlanRecord]:
        if job_id is None:
            return self._select("ORDER BY plan_id DESC LIMIT ?", (limit,))
        return self._select("WHERE job_id=? ORDER BY plan_id DESC LIMIT ?", (job_id, limit))

    def steps(self, plan_id: int) -> list[tuple[str, float, str]]:
        rows = self._db.execute("SELECT step, at, note FROM steps WHERE plan_id=? ORDER BY rowid",
                                (plan_id,)).fetchall()
        return [(str(s), float(a), str(n)) for s, a, n in rows]

    def last_change_at(self, job_id: int) -> float | None:
        """When the controller last resized this job (a plan that finished), for hysteresis."""
        row = self._db.execute("SELECT MAX(updated_at) FROM plans WHERE job_id=? AND status=?",
                               (job_id, DONE)).fetchone()
        return None if row[0] is None else float(row[0])

    def first_size(self, job_id: int, since: float = 0.0) -> int | None:
        """The GPUs the job had when the controller first planned for it (a plan created at or after `since`:
        an earlier one was for another job that had the id), None without such a plan."""
        row = self._db.execute("SELECT from_gpus FROM plans WHERE job_id=? AND created_at>=? ORDER BY plan_id "
                               "LIMIT 1", (job_id, since)).fetchone()
        return None if row is None or int(row[0]) < 1 else int(row[0])

    def restarts_after_last_plan(self, job_id: int, since: float = 0.0) -> int | None:
        """The job's Slurm restart count right after the controller's last finished plan for it.

        A job still PENDING with that count is pending because of our own requeue (StartTime=now
        already set), not because Slurm requeued it after a node failure.
        """
        row = self._db.execute("SELECT restarts, entry FROM plans WHERE job_id=? AND status=? AND updated_at>=? "
                               "ORDER BY plan_id DESC LIMIT 1", (job_id, DONE, since)).fetchone()
        if row is None:
            return None
        return int(row[0]) + (1 if row[1] == PlanEntry.RUNNING.value else 0)

    def restarts_since(self, job_id: int, since: float) -> int:
        """Restarts the controller caused (running jobs it requeued) since `since`, for the budget."""
        row = self._db.execute(
            "SELECT COUNT(*) FROM plans WHERE job_id=? AND entry=? AND created_at>=? AND status IN (?,?)",
            (job_id, PlanEntry.RUNNING.value, since, DONE, OPEN)).fetchone()
        return int(row[0])

    # -- internals -----------------------------------------------------------------------
    def _select(self, where: str, args: tuple[object, ...]) -> list[PlanRecord]:
        rows = self._db.execute(
            "SELECT plan_id, job_id, from_gpus, to_gpus, shape, entry, reason, forced, restarts, step, status,"
            " created_at, updated_at, note, user, exclude, keep, place FROM plans " + where,
            args).fetchall()
        out = []
        for r in rows:
            try:
                shape = RequestShape.loads(r[4])
            except ShapeError as exc:
                raise JournalError(f"the controller journal {self.path} is damaged: plan {r[0]}: {exc}") from None
            plan = Plan(job_id=int(r[1]), from_gpus=int(r[2]), to_gpus=int(r[3]), shape=shape,
                        entry=PlanEntry(r[5]), reason=str(r[6]), forced=bool(r[7]), user=str(r[14]),
                        exclude=tuple(n for n in str(r[15]).split(",") if n),
                        keep=tuple(n for n in str(r[16]).split(",") if n),
                        place=tuple(n for n in str(r[17]).split(",") if n))
            out.append(PlanRecord(plan_id=int(r[0]), plan=plan, restarts=int(r[8]), step=str(r[9]),
                                  status=str(r[10]), created_at=float(r[11]), updated_at=float(r[12]),
                                  note=str(r[13])))
        return out

    def _move_shapes(self) -> None:
        """Rewrite a journal of the column layout (one column per shape field) to the `shape` column.

        One transaction: a crash leaves the old layout, and the next open moves it again. The
        columns are checked again inside it, as another process may have moved them meanwhile.
        """
        with self._tx() as db:
            columns = {row[1] for row in db.execute("PRAGMA table_info(plans)")}
            if "shape" in columns:
                return
            kept = ", ".join(_PLAN_COLUMNS)
            rows = db.execute(f"SELECT {kept}, {', '.join(_OLD_SHAPE_COLUMNS)} FROM plans").fetchall()
            # A new table renamed into place (not the old one renamed away): renaming `plans` would
            # rewrite the steps' and marks' references to it.
            db.execute(_PLANS_TABLE.format(table="plans_moved"))
            width = len(_PLAN_COLUMNS)
            db.executemany(f"INSERT INTO plans_moved ({kept}, shape) VALUES ({', '.join('?' * (width + 1))})",
                           [(*r[:width], RequestShape(*(int(v) for v in r[width:])).dumps()) for r in rows])
            db.execute("DROP TABLE plans")
            db.execute("ALTER TABLE plans_moved RENAME TO plans")
            for index in _PLANS_INDEXES:
                db.execute(index)
        log.info("journal %s: %d plans moved to the shape column", self.path, len(rows))

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE ... COMMIT, so a record is whole or absent after a crash.

        A write that fails (a full disk) is a JournalError: the step it announced is not taken.
        """
        try:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
        except sqlite3.Error as exc:
            if self._db.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute("ROLLBACK")
            raise JournalError(f"cannot write the controller journal {self.path}: {exc}{_full(self.path)}") from None


def _full(path: Path) -> str:
    """SQLite says 'disk I/O error' for a full disk; say what it is."""
    try:
        st = os.statvfs(path.parent)
    except OSError:
        return ""
    return " (no space left on the device)" if st.f_bavail == 0 or st.f_favail == 0 else ""


def _secure(path: Path) -> None:
    """The journal file 0600 and ours, in a directory that is ours and that nobody else can write.

    A directory that does not exist yet is made 0700; the daemon's own (made by its lock, 0711)
    is only checked. Older versions left the journal 0644: it is narrowed, with its -wal/-shm.
    """
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        st = None
    if os.geteuid() == 0 and st is not None and stat.S_ISREG(st.st_mode) and st.st_uid != 0:
        # Root reading a user's own watch journal (an admin looking, the tests): that user's file to
        # keep private, not ours to chmod. Controllers never get here for a foreign directory: their
        # lock (state_dir.InstanceLock) refuses it first.
        return
    dir_fd = open_state_dir(path.parent, mode=USER_DIR_MODE)
    try:
        for name in (path.name, f"{path.name}-wal", f"{path.name}-shm"):
            if name != path.name:
                try:
                    os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
            os.close(open_private_file(dir_fd, name, path.parent, what="controller journal"))
    finally:
        os.close(dir_fd)
