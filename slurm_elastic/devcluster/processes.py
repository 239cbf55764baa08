"""The cluster's own processes: start them, find them by pid file, verify and signal them by pid."""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from slurm_elastic import settings
from slurm_elastic.errors import ClusterSetupError, SettingError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Identity:
    """What a live process must look like to be ours: its program name and arguments it must carry."""

    program: str
    markers: tuple[str, ...]

    def matches(self, argv: Sequence[str]) -> bool:
        if not argv or Path(argv[0]).name != self.program:
            return False
        joined = "\0".join(argv)
        return all(marker in joined for marker in self.markers)


def read_pid(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        log.warning("cannot read pid file %s: %s", path, exc)
        return None
    return int(text) if text.isdigit() and int(text) > 0 else None


def cmdline(pid: int) -> list[str] | None:
    """argv of a live process; None if it is gone, a zombie, or has not finished exec yet."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    if not raw:
        return None  # a zombie or kernel thread
    return raw.rstrip(b"\0").decode(errors="replace").split("\0")


def verified_pid(pid_file: Path, identity: Identity) -> int | None:
    """The pid in pid_file if that process is alive and really is `identity`; else None.

    A pid file can outlive its daemon and the pid can be reused by an unrelated
    process, so the pid is only trusted after checking /proc/<pid>/cmdline.
    """
    pid = read_pid(pid_file)
    if pid is None:
        return None
    argv = cmdline(pid)
    if argv is None or not identity.matches(argv):
        return None
    return pid


def is_alive(pid: int) -> bool:
    """True while pid exists and is not a zombie (an orphan's zombie may wait long for its reaper)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat[stat.rfind(")") + 2 :].split()[0] not in ("Z", "X")


def send(pid: int, sig: signal.Signals) -> bool:
    """Signal one pid; False if it is already gone."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    log.debug("sent %s to pid %d", sig.name, pid)
    return True


def wait_gone(pids: Iterable[int], timeout: float) -> list[int]:
    """Wait until none of pids is alive; return those still alive at the deadline."""
    remaining = [pid for pid in pids if is_alive(pid)]
    deadline = time.monotonic() + timeout
    while remaining and time.monotonic() < deadline:
        time.sleep(0.05)
        remaining = [pid for pid in remaining if is_alive(pid)]
    return remaining


def stop(pids: Iterable[int], *, grace: float) -> list[int]:
    """SIGTERM, wait `grace` seconds, then SIGKILL what is left; return pids that survived even that."""
    pids = [pid for pid in pids if send(pid, signal.SIGTERM)]
    left = wait_gone(pids, grace)
    for pid in left:
        send(pid, signal.SIGKILL)
    return wait_gone(left, 5.0)


def _root_of(pid: int | str) -> tuple[int, int] | None:
    try:
        st = os.stat(f"/proc/{pid}/root")  # the magic link leads to the process's root even across a chroot
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _all_pids() -> list[int]:
    """Live processes under our filesystem root.

    A process in a chroot (.ci/other-slurms runs whole test suites in them) may
    carry the very paths ours do in its argv; it is never ours.
    """
    own = _root_of("self")
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit() and _root_of(entry) == own]


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses; fields after the last ')'.
    fields = stat[stat.rfind(")") + 2 :].split()
    return int(fields[1]) if len(fields) > 1 else None


def descendants(roots: Iterable[int]) -> list[int]:
    """All live descendants of roots (children first found by parent pid)."""
    children: dict[int, list[int]] = {}
    for pid in _all_pids():
        parent = _ppid(pid)
        if parent is not None:
            children.setdefault(parent, []).append(pid)
    found: list[int] = []
    stack = list(roots)
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def children_first(pids: Iterable[int]) -> list[int]:
    """pids ordered so that each comes before its parent (and every ancestor) among them."""
    members = list(pids)
    inside = set(members)

    def depth(pid: int) -> int:
        seen: set[int] = set()
        parent = _ppid(pid)
        while parent in inside and parent not in seen:
            seen.add(parent)
            parent = _ppid(parent)
        return len(seen)
    return sorted(members, key=depth, reverse=True)


def _has_open(pid: int, paths: set[str]) -> bool:
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        entries = list(fd_dir.iterdir())
    except OSError:
        return False
    for entry in entries:
        try:
            if os.readlink(entry) in paths:
                return True
        except OSError:
            continue
    return False


def stepds_writing(log_files: Iterable[Path]) -> list[int]:
    """slurmstepd processes that hold one of log_files open.

    A slurmstepd runs a job step of one node and logs to that node's
    SlurmdLogFile; the log file path (unique to this cluster and node) is how
    we know the step daemon is ours without trusting its name alone.
    """
    paths = {str(Path(p).resolve()) for p in log_files}
    found = []
    for pid in _all_pids():
        argv = cmdline(pid)
        if argv and argv[0].startswith("slurmstepd") and _has_open(pid, paths):
            found.append(pid)
    return found


def matching(identity: Identity) -> list[int]:
    """Live processes under our root that are `identity` (finds a daemon whose pid file is gone)."""
    return [pid for pid in _all_pids() if (argv := cmdline(pid)) is not None and identity.matches(argv)]


def clients_of(slurm_conf: str, programs: Iterable[str] = ("srun",)) -> list[int]:
    """Live processes of `programs` run against this cluster (SLURM_CONF=slurm_conf in their environment).

    A job's srun outlives its batch script when the script is killed (scancel) while the srun waits for a
    node that died: it is no child of any step daemon then (its parent is init), yet it is the cluster's.
    """
    names = set(programs)
    wanted = f"SLURM_CONF={slurm_conf}".encode()
    found = []
    for pid in _all_pids():
        argv = cmdline(pid)
        if not argv or Path(argv[0]).name not in names:
            continue
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if wanted in environ:
            found.append(pid)
    return found


def processes_mentioning(marker: str, programs: Iterable[str]) -> list[int]:
    """Live processes of `programs` whose argv contains marker (used to prove `down` left nothing)."""
    names = set(programs)
    found = []
    for pid in _all_pids():
        argv = cmdline(pid)
        if argv and Path(argv[0]).name in names and any(marker in arg for arg in argv):
            found.append(pid)
    return found


def port_free(port: int) -> bool:
    """True if nothing listens on 127.0.0.1:port and we could bind it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # Slurm binds with SO_REUSEADDR, so connections of a previous run still
        # in TIME_WAIT do not block it; only a listener (or a bound socket) does.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


# Where free_port_base starts looking. Test suites that run at once on one host (.ci/other-slurms, one
# per Slurm version) each get their own start, so two of them never judge the same ports free together.
PORT_SEARCH_START_ENV = settings.PORT_SEARCH_START.env


def port_search_start() -> int:
    try:
        return settings.PORT_SEARCH_START.read()
    except SettingError as exc:
        raise ClusterSetupError(str(exc)) from None


def free_port_base(count: int, start: int | None = None, stop: int = 60000, step: int = 37) -> int:
    """The first base >= start with `count` consecutive free ports on 127.0.0.1 (for a second cluster)."""
    start = port_search_start() if start is None else start
    for base in range(start, stop - count, step):
        if all(port_free(port) for port in range(base, base + count)):
            return base
    raise ClusterSetupError(f"no {count} consecutive free ports on 127.0.0.1 between {start} and {stop}")


def run_daemon(argv: Sequence[str], *, env: Mapping[str, str], startup_log: Path, timeout: float = 30.0) -> None:
    """Run a self-daemonizing program and wait for its foreground parent to exit.

    stdout/stderr go to a file rather than a pipe: the daemon child could keep
    a pipe open and we would wait for it forever. A new session keeps the
    daemon out of the caller's process group (a Ctrl-C in pytest must not kill it).
    """
    startup_log.parent.mkdir(parents=True, exist_ok=True)
    with startup_log.open("ab") as out:
        out.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} {' '.join(argv)}\n".encode())
        out.flush()
        try:
            result = subprocess.run(
                list(argv),
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise ClusterSetupError(
                f"`{' '.join(argv)}` did not return within {timeout:.0f} s; see {startup_log}"
            ) from None
        except OSError as exc:
            raise ClusterSetupError(f"cannot run {argv[0]}: {exc}") from None
    if result.returncode != 0:
        tail = startup_log.read_text(errors="replace").strip().splitlines()[-3:]
        raise ClusterSetupError(
            f"`{Path(argv[0]).name}` exited with {result.returncode}: {' | '.join(tail)} (log {startup_log})"
        )
