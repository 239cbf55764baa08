"""Where controllers keep their state: journal paths, the one-instance lock and the daemon heartbeat."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from slurm_elastic.errors import ElasticError

DAEMON_DIR_ENV = "SLURM_ELASTIC_DAEMON_DIR"
DEFAULT_DAEMON_DIR = "/var/lib/slurm-elastic"
USER_DIR_ENV = "SLURM_ELASTIC_STATE_DIR"

HEARTBEAT_FILE = "daemon.heartbeat"
LOCK_FILE = "controller.lock"
JOURNAL_FILE = "journal.sqlite"


class ControllerBusy(ElasticError):
    """Another controller already holds this state directory's lock."""


def daemon_dir() -> Path:
    """The admin daemon's directory (journal, lock, heartbeat); user mode reads the heartbeat here."""
    return Path(os.environ.get(DAEMON_DIR_ENV) or DEFAULT_DAEMON_DIR)


def user_dir() -> Path:
    """A user's own watch state: $SLURM_ELASTIC_STATE_DIR, else $XDG_STATE_HOME/slurm-elastic."""
    if os.environ.get(USER_DIR_ENV):
        return Path(os.environ[USER_DIR_ENV])
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "slurm-elastic"


class InstanceLock:
    """An exclusive flock on `<dir>/controller.lock`: one controller per journal.

    flock is released by the kernel when the process dies (even by SIGKILL),
    so a crashed controller never blocks its successor.
    """

    def __init__(self, directory: Path, what: str) -> None:
        self.path = directory / LOCK_FILE
        self.what = what
        self._fd: int | None = None

    def acquire(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise ElasticError(f"cannot create the lock {self.path}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise ControllerBusy(f"another {self.what} is already running ({holder}; lock {self.path}); "
                                 "stop it first or use it") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> InstanceLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass(frozen=True, slots=True)
class Heartbeat:
    pid: int
    host: str
    at: float
    interval_s: float

    def fresh(self, now: float | None = None) -> bool:
        """Alive: beat within three cycles (at least 30 s, so a slow solve is no false alarm)."""
        now = time.time() if now is None else now
        return now - self.at <= max(3 * self.interval_s, 30.0)


def write_heartbeat(directory: Path, interval_s: float) -> None:
    """Each daemon cycle: atomically replace `<dir>/daemon.heartbeat` (world-readable)."""
    path = directory / HEARTBEAT_FILE
    tmp = directory / f".{HEARTBEAT_FILE}.{os.getpid()}"
    body = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "at": time.time(),
                       "interval_s": interval_s})
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, body.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def clear_heartbeat(directory: Path) -> None:
    try:
        (directory / HEARTBEAT_FILE).unlink()
    except FileNotFoundError:
        pass


def read_heartbeat(directory: Path) -> Heartbeat | None:
    try:
        data = json.loads((directory / HEARTBEAT_FILE).read_text())
        return Heartbeat(pid=int(data["pid"]), host=str(data["host"]), at=float(data["at"]),
                         interval_s=float(data["interval_s"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
