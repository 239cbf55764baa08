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
                st = os.lstat(path)
            except (ValueError, OSError):
                continue            # no entry yet (the usual case), or a root we cannot look into
            if st.st_uid == uid and stat.S_ISDIR(st.st_mode):
                continue
            parent, name = os.path.split(path)
            aside = f"{name}.moved-aside-{st.st_uid}-{int(now)}"
            try:
                pfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                os.rename(name, aside, src_dir_fd=pfd, dst_dir_fd=pfd)   # the entry itself, never a link's target
            except OSError as exc:
                key = (path, st.st_ino)
                if key not in self._said:
                    self._said.add(key)
                    log.error("job %d: %s belongs to uid %d, not to the job's user %s, and cannot be moved aside "
                              "(%s): the job will refuse it at start", job.job_id, path, st.st_uid, job.user,
                              exc.strerror)
                continue
            finally:
                os.close(pfd)
            log.warning("job %d: %s was made by uid %d, not by the job's user %s: moved aside to %s; the job "
                        "creates a fresh one", job.job_id, path, st.st_uid, job.user, aside)
            moved.append(path)
        return tuple(moved)


def _uid_of(user: str) -> int | None:
    try:
        return pwd.getpwnam(user).pw_uid
    except (KeyError, TypeError):
        return None
