"""The job directory as an open, verified directory fd: everything in it is reached relative to it, never via a link.

The checkpoint root is usually shared and world-writable (`/scratch`, mode
1777) and other users are adversaries. So the job directory `<root>/<key>`
must be this user's own and writable by nobody else: created 0700 when
missing, refused with one line when another user made it, when it is a
symbolic link, or when group or others may write it. Inside it, step
directories and files are opened with O_NOFOLLOW relative to the directory's
fd, and each is checked to be this user's and not writable by others before
it is read: a link is never followed, so nothing is read, written or deleted
outside the job directory.
"""

from __future__ import annotations

import errno
import logging
import os
import pwd
import shutil
import stat
import time
import weakref

from slurm_elastic.errors import CheckpointError

log = logging.getLogger(__name__)

DIR_MODE = 0o700
FILE_MODE = 0o600
# Bits that would let someone other than the owner change an entry's contents.
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO planted under a file's name must not hang; regular files ignore it.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_WARNED_ROOTS: set[str] = set()


class UnsafeJobDir(CheckpointError):
    """The job directory is not this user's own (another user prepared it, it is a link, others can write it)."""


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def check_entry(st: os.stat_result, where: str, *, directory: bool) -> None:
    """An entry inside the job directory: the right type, this user's, not writable by anyone else."""
    kind = "directory" if directory else "regular file"
    if stat.S_ISLNK(st.st_mode):
        raise CheckpointError(f"{where} is a symbolic link; links inside a job directory are never followed")
    if directory != stat.S_ISDIR(st.st_mode) or (not directory and not stat.S_ISREG(st.st_mode)):
        raise CheckpointError(f"{where} is not a {kind}")
    if st.st_uid != os.geteuid():
        raise CheckpointError(f"{where} belongs to {_user(st.st_uid)}, not to this job's user")
    if st.st_mode & _OTHERS_WRITE:
        raise CheckpointError(f"{where} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})")


def make_ancestors(path: str) -> None:
    """mkdir -p of `path` with 0700 on every directory this call creates (existing ones are left alone)."""
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for p in reversed(missing):
        try:
            os.mkdir(p, DIR_MODE)
        except FileExistsError:
            if not os.path.isdir(p):
                raise UnsafeJobDir(f"{p} exists and is not a directory") from None
            continue
        os.chmod(p, DIR_MODE)  # the umask may have removed bits we do not want anyway; make it exact


def _check_root(fd: int, path: str) -> None:
    """The directory holding job directories: others may share it only if the sticky bit keeps
    them from renaming or replacing entries that are not theirs."""
    st = os.fstat(fd)
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise UnsafeJobDir(f"checkpoint root {path} is writable by everyone without the sticky bit, so any user "
                           f"could rename or replace job directories in it; run 'chmod +t {path}' or use a "
                           f"directory of your own")
    if path in _WARNED_ROOTS:
        return
    me = os.geteuid()
    if st.st_uid not in (0, me) or (st.st_mode & stat.S_IWGRP and not st.st_mode & stat.S_ISVTX):
        _WARNED_ROOTS.add(path)
        log.warning("checkpoint root %s (owner %s, mode %04o) lets others rename job directories in it: they "
                    "cannot read or change a job's checkpoints, but can make a restore start over",
                    path, _user(st.st_uid), stat.S_IMODE(st.st_mode))


class JobDir:
    """An open job directory. `fd` stays valid (and names the same directory) for the object's life."""

    def __init__(self, fd: int, path: str) -> None:
        self.fd = fd
        self.path = path
        self._close = weakref.finalize(self, os.close, fd)

    @classmethod
    def open(cls, path: str, *, create: bool) -> JobDir | None:
        """The job directory at `path`, verified; created 0700 (with missing parents) when `create`.

        None when it does not exist and `create` is false. UnsafeJobDir when it is
        not this user's own: a link, not a directory, another user's, or writable by others.
        """
        path = os.path.abspath(path)
        parent, name = os.path.split(path)
        if create:
            make_ancestors(parent)
        try:
            pfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            if create:
                raise
            return None
        try:
            _check_root(pfd, parent)
            created = False
            if create:
                try:
                    os.mkdir(name, DIR_MODE, dir_fd=pfd)
                    created = True
                except FileExistsError:
                    pass
            try:
                fd = os.open(name, _DIR_FLAGS, dir_fd=pfd)
            except FileNotFoundError:
                if create:
                    raise
                return None
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    raise UnsafeJobDir(f"job directory {path} is a symbolic link (made by {_user(st.st_uid)}); "
                                       f"refusing to follow it: remove it or point the checkpoint root "
                                       f"elsewhere") from None
                raise UnsafeJobDir(f"job directory {path} exists and is not a directory") from None
        finally:
            os.close(pfd)
        try:
            if created:
                os.fchmod(fd, DIR_MODE)   # exact, whatever the umask did
            st = os.fstat(fd)
            if st.st_uid != os.geteuid():
                raise UnsafeJobDir(f"job directory {path} belongs to {_user(st.st_uid)}, not to you "
                                   f"({_user(os.geteuid())}): another user prepared it; nothing is written "
                                   f"there. Remove it or point the checkpoint root elsewhere")
            if st.st_mode & _OTHERS_WRITE:
                raise UnsafeJobDir(f"job directory {path} is writable by group or others (mode "
                                   f"{stat.S_IMODE(st.st_mode):04o}), so its checkpoints could have been "
                                   f"replaced; check it and 'chmod 700 {path}'")
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, path)

    def close(self) -> None:
        self._close()

    def where(self, *names: str) -> str:
        return os.path.join(self.path, *names)

    # -- entries ---------------------------------------------------------------------------
    def names(self, dfd: int | None = None) -> list[str]:
        return os.listdir(self.fd if dfd is None else dfd)

    def lstat(self, name: str, dfd: int | None = None) -> os.stat_result | None:
        try:
            return os.stat(name, dir_fd=self.fd if dfd is None else dfd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def open_dir(self, name: str, *, create: bool = False) -> int:
        """A directory directly in the job directory (a step), verified; 0700 when created here."""
        if create:
            try:
                os.mkdir(name, DIR_MODE, dir_fd=self.fd)
            except FileExistsError:
                pass
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            st = self.lstat(name)
            if st is None:
                raise
            check_entry(st, self.where(name), directory=True)
            raise
        try:
            check_entry(os.fstat(fd), self.where(name), directory=True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def stat_file(self, dfd: int, name: str, where: str) -> os.stat_result:
        """A data file's stat, without following a link; FileNotFoundError when missing."""
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        check_entry(st, where, directory=False)
        return st

    def read_file(self, dfd: int, name: str, where: str, *, limit: int) -> bytes:
        """All of a regular file of this user's, at most `limit` bytes (more is refused unread)."""
        fd = os.open(name, _READ_FLAGS, dir_fd=dfd)
        with open(fd, "rb", buffering=0, closefd=True) as f:
            st = os.fstat(fd)
            check_entry(st, where, directory=False)
            if st.st_size > limit:
                raise CheckpointError(f"{where}: {st.st_size} bytes, more than the {limit} expected")
            data = f.read(limit + 1)
        if len(data) > limit:
            raise CheckpointError(f"{where}: more than the {limit} bytes expected")
        return data

    # -- changes -----------------------------------------------------------------------------
    def write_atomic(self, dfd: int, name: str, data: bytes, *, sync_dir: bool = True) -> None:
        write_atomic_at(dfd, name, data, sync_dir=sync_dir)

    def remove_tree(self, name: str) -> None:
        """Remove an entry of the job directory; a directory with everything in it, a link only itself."""
        st = self.lstat(name)
        if st is None:
            return
        if stat.S_ISDIR(st.st_mode):
            # fd-based: rmtree never leaves the tree through a link planted inside it.
            shutil.rmtree(name, dir_fd=self.fd, ignore_errors=True)
        else:
            self.unlink_quietly(self.fd, name)

    @staticmethod
    def unlink_quietly(dfd: int, name: str) -> None:
        try:
            os.unlink(name, dir_fd=dfd)
        except OSError:
            pass


def write_atomic_at(dfd: int, name: str, data: bytes, *, sync_dir: bool = True) -> None:
    """temp name, write, fsync, rename, (fsync the directory): readers see all or nothing.

    The temp name is created exclusively (O_EXCL does not follow links) and the rename
    replaces whatever entry `name` is, a link included, rather than writing through it.
    """
    tmp = temp_name(name)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE, dir_fd=dfd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        JobDir.unlink_quietly(dfd, tmp)
        raise
    os.close(fd)
    try:
        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        JobDir.unlink_quietly(dfd, tmp)
        raise
    if sync_dir:
        fsync_fd(dfd)


def temp_name(name: str) -> str:
    return f"{name}.tmp-{os.getpid()}-{time.monotonic_ns()}"


def fsync_fd(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some network filesystems refuse fsync on a directory; the rename is still atomic.
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise


def open_private_dir(path: str) -> None:
    """Create `path` (0700, with missing parents) or check that it is this user's own; UnsafeJobDir if not."""
    d = JobDir.open(path, create=True)
    assert d is not None
    d.close()
