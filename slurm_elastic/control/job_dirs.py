"""Another user's entry at an elastic job's directory name is moved aside before the job starts (admin daemon).

A job's directory is `<checkpoint root>/<job id>`, a name anyone can predict, and the root is
usually shared (`/scratch`, mode 1777). Another user can create that name before the job exists;
the job's shim then refuses it (train/jobdir.py, UnsafeJobDir) and the job fails at start. In a
sticky root the job's user cannot remove or rename an entry that is not theirs, but root can: each
cycle, the admin daemon looks (one `lstat`, no listing, no link followed) at the directory name of
every pending or running elastic job and renames an entry that is not the job's user's own
(another owner, or not a directory) to `<job id>.moved-aside-<owner uid>-<time>` beside it, with
one log line; the job's shim then creates a fresh one. Nothing in the entry is opened or read.
A user-mode controller cannot (the rename is refused) and does not try.

Only where that is the squat it undoes: the root is a shared sticky one (world-writable, sticky bit:
the job's user can create the name but not take it back), as the directory the rename happens in
is (checked on the opened directory, not its path), and the entry is another user's (not root's).
The root comes from the job's comment, which its user writes: anywhere else (a root-owned
directory, another user's private one) the daemon would rename, as root, whatever the user's job
id names there (seen: `--ckpt-dir /home/bob/private`, a comment naming `/etc/postgresql`).
"""

from __future__ import annotations

import logging
import os
import pwd
import stat
from typing import Callable

from slurm_elastic.cluster.model import ClusterState, JobState
from slurm_elastic import jobfiles as shim

log = logging.getLogger(__name__)


class JobDirGuard:
    """Moves another user's entry away from each live elastic job's directory name, once per entry."""

    def __init__(self, *, uid_of: Callable[[str], int | None] | None = None) -> None:
        self._uid_of = uid_of or _uid_of
        self._said: set[tuple[str, int]] = set()

    def guard(self, state: ClusterState, now: float) -> tuple[str, ...]:
        """Rename every foreign entry at a pending or running elastic job's directory name; the paths moved."""
        moved: list[str] = []
        for job in state.elastic_jobs:
            spec = job.spec
            if job.state not in (JobState.PENDING, JobState.RUNNING) or spec is None or not spec.ckpt_dir:
                continue
            uid = job.user_id if job.user_id is not None else self._uid_of(job.user)
            if uid is None:
                continue
            try:
                path = shim.job_dir(spec.ckpt_dir, shim.job_key(job.job_id))
            except ValueError:
                continue
            parent, name = os.path.split(path)
            try:
                pfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError:
                continue            # a root we cannot look into
            try:
                try:
                    st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
                except OSError:
                    continue        # no entry yet (the usual case)
                if st.st_uid == uid and stat.S_ISDIR(st.st_mode):
                    continue
                why = _not_a_squat(os.fstat(pfd), st)
                if why:
                    self._once(path, st, f"job {job.job_id}: {path} is not its user's own directory and is left as "
                                         f"it is ({why}): the job will refuse it at start")
                    continue
                aside = f"{name}.moved-aside-{st.st_uid}-{int(now)}"
                try:
                    os.rename(name, aside, src_dir_fd=pfd, dst_dir_fd=pfd)   # the entry itself, never a link's target
                except OSError as exc:
                    self._once(path, st, f"job {job.job_id}: {path} belongs to uid {st.st_uid}, not to the job's "
                                         f"user {job.user}, and cannot be moved aside ({exc.strerror}): the job will "
                                         f"refuse it at start")
                    continue
            finally:
                os.close(pfd)
            what = (f"is its user's own {'link' if stat.S_ISLNK(st.st_mode) else 'file'}, not a directory"
                    if st.st_uid == uid else f"was made by uid {st.st_uid}, not by the job's user {job.user}")
            log.warning("job %d: %s %s: moved aside to %s; the job creates a fresh one", job.job_id, path, what,
                        aside)
            moved.append(path)
        return tuple(moved)

    def _once(self, path: str, st: os.stat_result, line: str) -> None:
        key = (path, st.st_ino)
        if key not in self._said:
            self._said.add(key)
            log.error("%s", line)


def _not_a_squat(root: os.stat_result, entry: os.stat_result) -> str:
    """Why an entry at a job's directory name is not the squat the guard undoes ("" when it is): only in a
    shared sticky root (world-writable, sticky) and only another user's entry, never root's."""
    if not (root.st_mode & stat.S_ISVTX and root.st_mode & stat.S_IWOTH):
        return "its checkpoint root is not a shared sticky directory, where another user's entry could squat it"
    if entry.st_uid == 0:
        return "it is root's"
    return ""


def _uid_of(user: str) -> int | None:
    try:
        return pwd.getpwnam(user).pw_uid
    except (KeyError, TypeError):
        return None
