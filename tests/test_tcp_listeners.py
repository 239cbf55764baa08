"""The /proc/net reader the loopback tests rely on instead of `ss`."""

from __future__ import annotations

import socket

import pytest

import tcp_listeners  # tests/tcp_listeners.py


@pytest.mark.parametrize("family,address", [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")])
def test_a_listening_socket_is_found_with_its_address(family: int, address: str) -> None:
    if family == socket.AF_INET6 and not socket.has_ipv6:
        pytest.skip("this kernel has no IPv6")
    with socket.socket(family, socket.SOCK_STREAM) as server:
        server.bind((address, 0))
        port = server.getsockname()[1]
        assert tcp_listeners.listeners_on(port) == []      # bound, not yet listening
        server.listen()
        assert tcp_listeners.listeners_on(port) == [address]
