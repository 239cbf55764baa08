"""Cutting the connections a process group opened (train/connections.py), on plain loopback sockets."""

from __future__ import annotations

import socket
import threading

from slurm_elastic.train.connections import GroupConnections


def test_a_thread_blocked_on_a_cut_connection_gets_its_end_at_once_and_other_sockets_are_left_alone() -> None:
    before = socket.create_server(("127.0.0.1", 0))          # open before: not the group's
    made: dict[str, socket.socket] = {}

    def form_group() -> None:
        made["listener"] = socket.create_server(("127.0.0.1", 0))
        made["client"] = socket.create_connection(made["listener"].getsockname())
        made["accepted"], _ = made["listener"].accept()
        made["doomed"] = socket.create_connection(made["listener"].getsockname())
        made["doomed_peer"], _ = made["listener"].accept()

    group = GroupConnections.opened_by(form_group)
    assert len(group) == 5
    # A descriptor of the group closed and its number reused by a socket opened since: not cut.
    number = made["doomed"].fileno()
    made["doomed"].close()
    made["doomed_peer"].close()
    reused = socket.create_connection(before.getsockname())
    reused_peer, _ = before.accept()
    assert reused.fileno() == number
    got: list[bytes] = []
    blocked = threading.Thread(target=lambda: got.append(made["accepted"].recv(16)))
    blocked.start()
    assert group.sever() == 2                               # the client and the accepted end
    blocked.join(timeout=30)
    assert not blocked.is_alive() and got == [b""]          # the peer's end: closed
    reused.sendall(b"ping")
    assert reused_peer.recv(4) == b"ping"                   # the reused number's socket works on
    late = socket.create_connection(made["listener"].getsockname())   # the listener still listens
    assert late.getpeername() == made["listener"].getsockname()
    assert group.sever() == 0                               # nothing left to cut
    for sock in [before, reused, reused_peer, late, *made.values()]:
        sock.close()
