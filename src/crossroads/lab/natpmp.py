"""A minimal NAT-PMP client (RFC 6886) for the lab: it checks that miniupnpd answers
on a router's LAN side, and gives the ladder its ``mapping`` step. (The SDK has the
full port-mapping client: UPnP-IGD, NAT-PMP and PCP.) Messages are the SDK's own
codec, :mod:`crossroads.proto.portmap.natpmp`; this module only sends one request
and waits for one answer on a raw lab socket."""

from __future__ import annotations

import socket

from crossroads.errors import DecodeError
from crossroads.lab.udp import recv, send
from crossroads.proto.portmap.natpmp import (
    PORT,
    ExternalAddressRequest,
    ExternalAddressResponse,
    MapRequest,
    MapResponse,
    Opcode,
    Response,
    decode_response,
)


async def _ask(
    sock: socket.socket, gateway: str, request: bytes, timeout: float
) -> Response | None:
    """Send ``request`` to the gateway; its decoded answer, or None when nothing
    (or nothing decodable) came back within ``timeout`` seconds."""
    send(sock, request, (gateway, PORT))
    got = await recv(sock, timeout)
    if got is None:
        return None
    try:
        return decode_response(got[0])
    except DecodeError:
        return None


async def public_address(
    sock: socket.socket, gateway: str, timeout: float = 0.5
) -> tuple[int, str] | None:
    """Section 3.2: (result code, external address), or None without an answer."""
    answer = await _ask(sock, gateway, ExternalAddressRequest().encode(), timeout)
    if not isinstance(answer, ExternalAddressResponse):
        return None
    return answer.result, answer.address


async def map_udp(
    sock: socket.socket,
    gateway: str,
    internal_port: int,
    lifetime: int = 120,
    timeout: float = 0.5,
) -> MapResponse | None:
    """Section 3.3: ask for a UDP mapping of ``internal_port`` (same port
    suggested outside). ``lifetime=0`` deletes it."""
    request = MapRequest(Opcode.MAP_UDP, internal_port, internal_port, lifetime)
    answer = await _ask(sock, gateway, request.encode(), timeout)
    if not isinstance(answer, MapResponse) or answer.opcode != Opcode.MAP_UDP:
        return None
    return answer
