"""Where controllers keep their state: a directory only the controller's user can write, the one-instance lock
and the daemon heartbeat.

Other users are adversaries here: they must not take the lock (flock works on a
read-only descriptor, so a lock file others can open is a lock others can hold),
read the journal, or plant a heartbeat that makes a user's `watch` defer.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import pwd
import socket
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from slurm_elastic import settings
from slurm_elastic.errors import ElasticError

log = logging.getLogger(__name__)

DAEMON_DIR_ENV = settings.DAEMON_DIR.env
DEFAULT_DAEMON_DIR = settings.DAEMON_DIR.default
USER_DIR_ENV = settings.STATE_DIR.env

HEARTBEAT_FILE = "daemon.heartbeat"
LOCK_FILE = "controller.lock"
JOURNAL_FILE = "journal.sqlite"

# The daemon's directory: others may open a file they know the name of (the heartbeat, 0644)
# but may neither list nor create anything. A user's own watch state is theirs alone.
DAEMON_DIR_MODE = 0o711
USER_DIR_MODE = 0o700
HEARTBEAT_EVERY_S = 5.0      # the daemon's heartbeat thread writes this often, whatever the cycle interval
CLOCK_SKEW_S = 5.0           # a heartbeat dated further in the future than this is not believed
_MAX_HEARTBEAT_BYTES = 4096


class ControllerBusy(ElasticError):
    """Another controller already holds this state directory's lock."""


class StateDirError(ElasticError):
    """A controller state directory or file is unsafe (someone else's, writable by others) or unwritable."""


def daemon_dir() -> Path:
    """The admin daemon's directory (journal, lock, heartbeat); user mode reads the heartbeat here."""
    return settings.daemon_dir()


def user_dir() -> Path:
    """A user's own watch state (settings.user_state_dir)."""
    return settings.user_state_dir()


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


# -- the directory and its files -----------------------------------------------------------------------
def open_state_dir(directory: Path, *, mode: int = DAEMON_DIR_MODE) -> int:
    """An O_DIRECTORY fd of `directory`, created with `mode` if missing, after checking it is safe.

    Refused with one line: a symlink, not a directory, owned by another user, or writable by group
    or others (anyone could then replace the lock, the journal or the heartbeat).
    """
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(directory, mode)
            os.chmod(directory, mode)   # the umask must not widen or narrow what we chose
        except FileExistsError:
            pass
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP or (exc.errno == errno.ENOTDIR and directory.is_symlink()):
            raise StateDirError(f"controller state dir {directory} is a symlink: give the real path") from None
        if exc.errno == errno.ENOTDIR:
            raise StateDirError(f"controller state dir {directory} is not a directory") from None
        raise StateDirError(f"cannot use the controller state dir {directory}: {exc.strerror}") from None
    try:
        check_owned(os.fstat(fd), directory, what="controller state dir")
    except StateDirError:
        os.close(fd)
        raise
    return fd


def check_owned(st: os.stat_result, path: Path, *, what: str) -> None:
    """Refuse what another user owns or others may write (one line saying how to fix it)."""
    me = os.geteuid()
    if st.st_uid != me:
        raise StateDirError(f"{what} {path} belongs to {user_name(st.st_uid)} (uid {st.st_uid}), not "
                            f"{user_name(me)}: refusing it; remove it or choose another directory")
    if st.st_mode & 0o022:
        raise StateDirError(f"{what} {path} is writable by group or others (mode "
                            f"{stat.S_IMODE(st.st_mode):04o}): refusing it; run chmod go-w on it")


def open_private_file(dir_fd: int, name: str, directory: Path, *, what: str) -> int:
    """Open (creating 0600) a regular file of ours in a checked directory, never through a symlink.

    A file of ours that others can read (0644, as older versions left the lock and the journal)
    is narrowed to 0600; one that others can write, or someone else's, is refused.
    """
    path = directory / name
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StateDirError(f"{what} {path} is a symlink: refusing it") from None
        raise StateDirError(f"cannot open the {what} {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise StateDirError(f"{what} {path} is not a regular file: refusing it")
        check_owned(st, path, what=what)
        if st.st_mode & 0o077:
            log.info("%s %s was mode %04o: narrowing it to 0600", what, path, stat.S_IMODE(st.st_mode))
            os.fchmod(fd, 0o600)
    except StateDirError:
        os.close(fd)
        raise
    except OSError as exc:
        os.close(fd)
        raise StateDirError(f"cannot secure the {what} {path}: {exc.strerror}") from None
    return fd


# -- the lock ----------------------------------------------------------------------------------------------
class InstanceLock:
    """An exclusive flock on `<dir>/controller.lock`: one controller per journal.

    flock is released by the kernel when the process dies (even by SIGKILL), so a crashed
    controller never blocks its successor. The file is 0600 in a directory only we can write,
    so no other user can open it, and so none can hold the lock. The holder writes
    `pid P uid U host H` into it while holding the lock.
    """

    def __init__(self, directory: Path, what: str, *, mode: int = DAEMON_DIR_MODE) -> None:
        self.directory = directory
        self.path = directory / LOCK_FILE
        self.what = what
        self.mode = mode
        self._fd: int | None = None

    def acquire(self) -> None:
        dir_fd = open_state_dir(self.directory, mode=self.mode)
        try:
            fd = open_private_file(dir_fd, LOCK_FILE, self.directory, what="controller lock")
        finally:
            os.close(dir_fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = describe_holder(fd)
            os.close(fd)
            raise ControllerBusy(f"another {self.what} is already running ({holder}; lock {self.path}); "
                                 "stop it first or use it") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} uid {os.geteuid()} host {socket.gethostname()}\n".encode(), 0)
            os.fsync(fd)
        except OSError as exc:
            os.close(fd)
            raise StateDirError(f"cannot write the controller lock {self.path}: {exc.strerror}") from None
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


def describe_holder(fd: int) -> str:
    """Who holds the lock on `fd`: what the lock file says, checked against the kernel's lock table."""
    text = os.pread(fd, 200, 0).decode(errors="replace").split()
    recorded = dict(zip(text[0::2], text[1::2]))
    st = os.fstat(fd)
    kernel = _flock_holders(st)
    pid = recorded.get("pid", "")
    if pid.isdigit() and recorded.get("host") == socket.gethostname():
        alive = _process_uid(int(pid))
        uid = recorded.get("uid", "")
        if alive is not None and (not uid.isdigit() or int(uid) == alive):
            return f"pid {pid}, uid {alive} ({user_name(alive)}), on this host"
        actual = ", ".join(f"pid {p}, uid {u} ({user_name(u)})" for p, u in kernel) or "an unknown process"
        return f"held by {actual}; the lock file names pid {pid}, which is not running"
    if pid.isdigit():
        return f"pid {pid}, uid {recorded.get('uid', '?')}, on {recorded.get('host', '?')}"
    actual = ", ".join(f"pid {p}, uid {u} ({user_name(u)})" for p, u in kernel)
    return f"held by {actual}" if actual else "held by a process that wrote no pid"


def _process_uid(pid: int) -> int | None:
    """The uid a local process runs as, or None when it is not running."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def _flock_holders(st: os.stat_result) -> list[tuple[int, int]]:
    """(pid, uid) of the processes the kernel lists as holding a flock on this inode (Linux)."""
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    holders = []
    try:
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                if "->" in parts or len(parts) < 6 or parts[1] != "FLOCK":
                    continue
                if parts[5] == dev and parts[4].isdigit():
                    uid = _process_uid(int(parts[4]))
                    holders.append((int(parts[4]), -1 if uid is None else uid))
    except OSError:
        pass
    return holders


# -- the heartbeat ----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Heartbeat:
    pid: int
    host: str
    at: float
    interval_s: float
    every_s: float = 0.0     # how often it is written (0: once a cycle, as older daemons did)
    uid: int | None = None   # the file's owner: the controller's user
    # The running controller's effective settings (ControllerConfig.settings()): what `status`,
    # `admin status` and a dry run decide with while it runs. Empty from daemons that did not say.
    settings: Mapping[str, float | int | str] = field(default_factory=dict)

    def fresh(self, now: float | None = None) -> bool:
        """Alive: beat within three periods (at least 30 s) and not from the future.

        A date in the future is a bad clock or a forged file: believing it would mean deferring
        for as long as the date says.
        """
        now = time.time() if now is None else now
        period = self.every_s or self.interval_s
        return -CLOCK_SKEW_S <= now - self.at <= max(3 * period, 30.0)


def write_heartbeat(directory: Path, interval_s: float, *, every_s: float = 0.0,
                    settings: Mapping[str, float | int | str] | None = None) -> None:
    """Atomically replace `<dir>/daemon.heartbeat` (0644: user-mode watches read it); OSError if it cannot."""
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        body = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "at": time.time(),
                           "interval_s": interval_s, "every_s": every_s, "uid": os.geteuid(),
                           "settings": dict(settings or {})})
        replace_file(dir_fd, HEARTBEAT_FILE, body.encode(), 0o644)
    finally:
        os.close(dir_fd)


def replace_file(dir_fd: int, name: str, data: bytes, mode: int, owner: tuple[int, int] | None = None) -> None:
    """Atomically replace `name` in the directory `dir_fd` with `data`, at `mode` (and `owner`, uid and gid):
    a new file, never a link followed, renamed over the old one; OSError if it cannot."""
    tmp = f".{name}.{os.getpid()}"
    try:
        os.unlink(tmp, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    try:
        os.write(fd, data)
        if owner is not None:
            os.fchown(fd, *owner)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def clear_heartbeat(directory: Path) -> None:
    try:
        (directory / HEARTBEAT_FILE).unlink()
    except FileNotFoundError:
        pass


_reported: set[str] = set()


def _untrusted(directory: Path, why: str) -> None:
    message = f"ignoring the daemon heartbeat in {directory}: {why}"
    if message not in _reported:   # a watch reads it every cycle: say it once
        _reported.add(message)
        log.warning("%s", message)


_SETTING_NAMES = ("hysteresis_s", "restart_budget_per_hour", "ack_timeout_s", "signal", "speed")


def _settings(value: object) -> dict[str, float | int | str]:
    """The announced settings we know, of the types we expect; anything else is dropped."""
    if not isinstance(value, dict):
        return {}
    out: dict[str, float | int | str] = {}
    for name in _SETTING_NAMES:
        v = value.get(name)
        if isinstance(v, bool):
            continue
        if name == "signal":
            if isinstance(v, str) and v.isalnum() and len(v) <= 16:
                out[name] = v
        elif name == "speed":
            if v in ("measured", "linear"):
                out[name] = v
        elif isinstance(v, (int, float)) and v == v and abs(v) < 1e12:
            out[name] = v
    return out


def read_heartbeat(directory: Path) -> Heartbeat | None:
    """The daemon's heartbeat if it can be believed, else None (as if no daemon ran).

    Believed only when the file and its directory belong to one user (the controller's) and
    nobody else can write them, and, when written on this host, when its pid is alive as that
    user. Whether it is recent is `Heartbeat.fresh`.
    """
    try:
        # O_PATH: the daemon's directory is 0711, so other users may not open it for reading.
        dir_fd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        dst = os.fstat(dir_fd)
        try:
            fd = os.open(HEARTBEAT_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if dst.st_mode & 0o022:
                _untrusted(directory, "the directory is writable by group or others, so anyone could have written it")
                return None
            if not stat.S_ISREG(st.st_mode) or st.st_uid != dst.st_uid or st.st_mode & 0o022:
                _untrusted(directory, f"written by {user_name(st.st_uid)}, not the directory's owner "
                                      f"{user_name(dst.st_uid)}")
                return None
            data = json.loads(os.read(fd, _MAX_HEARTBEAT_BYTES))
            beat = Heartbeat(pid=int(data["pid"]), host=str(data["host"]), at=float(data["at"]),
                             interval_s=float(data["interval_s"]), every_s=float(data.get("every_s") or 0.0),
                             uid=st.st_uid, settings=_settings(data.get("settings")))
        finally:
            os.close(fd)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None
    finally:
        os.close(dir_fd)
    if beat.host == socket.gethostname():
        running_as = _process_uid(beat.pid)
        if running_as is None:
            _untrusted(directory, f"its pid {beat.pid} is not running")
            return None
        if running_as != beat.uid:
            _untrusted(directory, f"its pid {beat.pid} now runs as {user_name(running_as)}, not "
                                  f"{user_name(beat.uid or 0)}")
            return None
    return beat
