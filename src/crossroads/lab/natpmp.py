"""A minimal NAT-PMP client (RFC 6886) for the lab: it checks that miniupnpd answers
on a router's LAN side, and gives the ladder its ``mapping`` step. (The SDK has the
full port-mapping client: UPnP-IGD, NAT-PMP and PCP.)"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

from crossroads.lab.udp import recv, send

#: RFC 6886 section 3: the NAT gateway listens on UDP 5351.
NATPMP_PORT = 5351
#: RFC 6886 section 3.1: responses have the request's opcode + 128.
RESPONSE_BIT = 128
OP_PUBLIC_ADDRESS = 0
OP_MAP_UDP = 1


@dataclass(frozen=True, slots=True)
class Mapping:
    result: int
    internal_port: int
    external_port: int
    lifetime: int


async def public_address(
    sock: socket.socket, gateway: str, timeout: float = 0.5
) -> tuple[int, str] | None:
    """Section 3.2: (result code, external address), or None without an answer."""
    send(sock, struct.pack("!BB", 0, OP_PUBLIC_ADDRESS), (gateway, NATPMP_PORT))
    got = await recv(sock, timeout)
    if got is None or len(got[0]) < 12:
        return None
    _version, opcode, result, _epoch = struct.unpack_from("!BBHI", got[0])
    if opcode != RESPONSE_BIT + OP_PUBLIC_ADDRESS:
        return None
    return result, socket.inet_ntoa(got[0][8:12])


async def map_udp(
    sock: socket.socket,
    gateway: str,
    internal_port: int,
    lifetime: int = 120,
    timeout: float = 0.5,
) -> Mapping | None:
    """Section 3.3: ask for a UDP mapping of ``internal_port`` (same port
    suggested outside). ``lifetime=0`` deletes it."""
    request = struct.pack(
        "!BBHHHI", 0, OP_MAP_UDP, 0, internal_port, internal_port, lifetime
    )
    send(sock, request, (gateway, NATPMP_PORT))
    got = await recv(sock, timeout)
    if got is None or len(got[0]) < 16:
        return None
    _v, opcode, result, _epoch, internal, external, granted = struct.unpack_from(
        "!BBHIHHI", got[0]
    )
    if opcode != RESPONSE_BIT + OP_MAP_UDP:
        return None
    return Mapping(result, internal, external, granted)
