"""The kernel's own account of listening TCP sockets (``/proc/net/tcp{,6}``), never riskserve's."""

from __future__ import annotations

import socket
from pathlib import Path


def listening_sockets() -> dict[str, tuple[str, int]]:
    """Socket inode -> (address, port) of every listening TCP socket of this network namespace.

    gRPC binds 127.0.0.1 on an IPv6 socket, so such a socket reads as ``::ffff:127.0.0.1``.
    """
    found: dict[str, tuple[str, int]] = {}
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # LISTEN
                continue
            hex_address, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_address)
            # The kernel prints each 32-bit word in host (little-endian) order.
            words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            family = socket.AF_INET if width == 4 else socket.AF_INET6
            found[fields[9]] = (socket.inet_ntop(family, words), int(hex_port, 16))
    return found


def is_loopback(address: str) -> bool:
    """Whether a listening address is reachable from this machine only."""
    return address.startswith(("127.", "::ffff:127.")) or address == "::1"


def free_port() -> int:
    """A loopback TCP port free now (the kernel's pick; another process may take it before it is bound)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
