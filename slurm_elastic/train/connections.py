"""The TCP connections a gloo process group opened, so a survivor of a lost peer can cut them.

Destroying a process group does not close its connections while anything still holds the group
(DDP's reducer does, for as long as the user's model lives): a peer blocked in a collective with this
rank then waits for the collective timeout, not for this rank's exit. Measured with torch 2.13 on
gloo: `destroy_process_group`, `abort` and `shutdown` all left a peer waiting until this process
ended. Shutting the sockets down does what the exit would: both sides see the connection closed at
once, and a thread of this process blocked in a collective gets its error.

The sockets are told apart by what the process had open before the group was formed; each is checked
by its inode before it is cut, so a descriptor number reused since for another socket is left alone.
Connected sockets only: a listening one (the store's, gloo's) is closed with its owner.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
from collections.abc import Callable

log = logging.getLogger(__name__)

_FD_DIR = "/proc/self/fd"


def _open_sockets() -> dict[int, int]:
    """This process's socket descriptors and their inodes (empty where /proc is not there)."""
    out: dict[int, int] = {}
    try:
        names = os.listdir(_FD_DIR)
    except OSError:
        return out
    for name in names:
        try:
            st = os.fstat(int(name))
        except (OSError, ValueError):
            continue
        if stat.S_ISSOCK(st.st_mode):
            out[int(name)] = st.st_ino
    return out


class GroupConnections:
    """The sockets opened while a process group was formed."""

    def __init__(self, sockets: dict[int, int]) -> None:
        self._sockets = dict(sockets)

    @classmethod
    def opened_by(cls, form_group: Callable[[], None]) -> GroupConnections:
        before = _open_sockets()
        form_group()
        return cls({fd: ino for fd, ino in _open_sockets().items() if before.get(fd) != ino})

    def __len__(self) -> int:
        return len(self._sockets)

    def sever(self) -> int:
        """Shut down every one of those connections still open; how many were."""
        cut = 0
        for fd, ino in self._sockets.items():
            try:
                dup = os.dup(fd)      # checked and cut through a copy: `fd` may be closed and reused meanwhile
            except OSError:
                continue
            sock = None
            try:
                if os.fstat(dup).st_ino != ino:
                    continue
                sock = socket.socket(fileno=dup)
                dup = -1
                sock.getpeername()    # a listening socket has none
                sock.shutdown(socket.SHUT_RDWR)
                cut += 1
            except OSError:
                pass                  # not connected, or already shut down
            finally:
                if sock is not None:
                    sock.close()      # the copy; the group's own descriptor stays for its owner to close
                elif dup >= 0:
                    os.close(dup)
        log.debug("cut %d of the process group's %d connections", cut, len(self._sockets))
        return cut
