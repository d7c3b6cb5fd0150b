"""Types shared across protocols and services."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import NewType, TypeVar, dataclass_transform

#: A transport address as asyncio reports it: (host, port). IPv6 addresses may come
#: with flow info and scope id from the OS; transports normalise to two elements.
Address = tuple[str, int]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

InviteCode = NewType("InviteCode", str)
JoinCode = NewType("JoinCode", str)
AllocationId = NewType("AllocationId", bytes)

_Value = TypeVar("_Value")


@dataclass_transform(frozen_default=True, field_specifiers=(field,))
def frozen(cls: type[_Value]) -> type[_Value]:
    """Make ``cls`` an immutable value: a frozen dataclass with slots.

    Every message, event and request record of the protocol cores is one; the
    one decorator keeps them alike (hashable, no stray attributes, no ``__dict__``)
    and says what they are at a glance.
    """
    return dataclass(frozen=True, slots=True)(cls)


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
