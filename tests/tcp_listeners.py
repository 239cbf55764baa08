"""The TCP sockets listening on this host, read from /proc/net/tcp{,6}.

Read from the kernel rather than through `ss`: a minimal Debian (CI's
chroots) has no iproute2, and the tests must not need it to say where a
daemon listens.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

LISTEN = "0A"   # TCP_LISTEN in include/net/tcp_states.h


def _address(hex_address: str) -> str:
    # The kernel prints each 32-bit word of the address in host byte order (little-endian here).
    words = [bytes.fromhex(hex_address[i:i + 8])[::-1] for i in range(0, len(hex_address), 8)]
    return str(ipaddress.ip_address(b"".join(words)))


def listening(proc_net: Path = Path("/proc/net")) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket in this network namespace."""
    found: list[tuple[str, int]] = []
    for name in ("tcp", "tcp6"):
        table = proc_net / name
        if not table.exists():   # a kernel without IPv6
            continue
        for line in table.read_text().splitlines()[1:]:
            fields = line.split()
            local, state = fields[1], fields[3]
            if state != LISTEN:
                continue
            address, _, port = local.partition(":")
            found.append((_address(address), int(port, 16)))
    return found


def listeners_on(port: int) -> list[str]:
    """The addresses a listening socket on `port` is bound to."""
    return [address for address, bound in listening() if bound == port]
