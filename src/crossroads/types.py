"""Types shared across protocols and services."""

from __future__ import annotations

import ipaddress
from typing import NewType

#: A transport address as asyncio reports it: (host, port). IPv6 addresses may come
#: with flow info and scope id from the OS; transports normalise to two elements.
Address = tuple[str, int]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

InviteCode = NewType("InviteCode", str)
JoinCode = NewType("JoinCode", str)
AllocationId = NewType("AllocationId", bytes)


def show_address(address: Address) -> str:
    """``host:port``, with brackets around an IPv6 host."""
    host, port = address[0], address[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def normalize_address(addr: tuple[object, ...]) -> Address:
    """Reduce an OS socket address (2- or 4-tuple) to ``(host, port)``."""
    host, port = addr[0], addr[1]
    assert isinstance(host, str) and isinstance(port, int)
    if host.startswith("::ffff:") and "." in host:
        host = host[7:]
    return host, port
