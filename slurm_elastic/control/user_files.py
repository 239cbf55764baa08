"""Reading a small file a job's user wrote into their own directory: input, never authority.

Opened without following links or blocking, it must be a regular file owned
by that user and at most a bounded size; anything else is a one-line problem.
The request source (metrics, geometry, batch range) and the peer-loss reader
share this one reader.
"""

from __future__ import annotations

import errno
import os
import stat


def read_user_file(path: str, *, owner_uid: int | None, max_bytes: int, what: str) -> tuple[bytes | None, str]:
    """The file's bytes and a problem ("" when none; None, "" when there is no file).

    `what` names the kind of file in the size problem ("a report", "a geometry").
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None, ""
    except OSError as exc:
        return None, "is a symbolic link" if exc.errno == errno.ELOOP else f"cannot be opened ({exc.strerror})"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, "is not a regular file"
        if owner_uid is not None and st.st_uid != owner_uid:
            return None, f"is owned by uid {st.st_uid}, not the job's user (uid {owner_uid})"
        if st.st_size > max_bytes:
            return None, f"is {st.st_size} bytes, more than the {max_bytes} {what} takes"
        return os.read(fd, max_bytes + 1), ""
    finally:
        os.close(fd)
