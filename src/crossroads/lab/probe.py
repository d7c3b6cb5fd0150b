"""The lab's own NAT behaviour probe: a tiny UDP reflector on the server's two
addresses and two ports, and a client that measures a site's mapping, port
allocation, filtering and hairpinning the way RFC 5780 section 4 does — but with
nothing of crossroads' STUN in the loop, so it can check the lab itself.

Wire format (lab-internal; every datagram at most 32 bytes, a reply never larger
than its request, so the reflector cannot amplify)::

    request  "XRP1" | token (8) | reply-from (1: 0 same, 1 other port,
                                               2 other address, 3 both) | pad (3)
    reply    "XRP1" | token (8) | observed IPv4 (4) | observed port (2) | pad (2)
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct

from crossroads.lab.kinds import Allocation, Filtering, Mapping
from crossroads.lab.topology import SERVER_IPS, Lab, Site
from crossroads.lab.udp import local, recv, send
from crossroads.types import Address, frozen

MAGIC = b"XRP1"
_REQUEST = struct.Struct("!4s8sB3x")
_REPLY = struct.Struct("!4s8s4sH2x")
#: Wait for a reply that should come (the lab drops nothing on its own).
ANSWER_TIMEOUT_S = 0.5
#: Wait for a reply that a filter is expected to drop: the lab's one-way delay is
#: well under a millisecond, so a quarter second is long.
DROP_TIMEOUT_S = 0.25


class Reflector:
    """Four UDP sockets in the server namespace: (IP1|IP2) x (port1|port2)."""

    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        first = lab.server_udp_socket(SERVER_IPS[0])
        port1 = local(first)[1]
        second = lab.server_udp_socket(SERVER_IPS[0])
        port2 = local(second)[1]
        self.ports = (port1, port2)
        self.socks: dict[Address, socket.socket] = {
            (SERVER_IPS[0], port1): first,
            (SERVER_IPS[0], port2): second,
        }
        for port in self.ports:
            self.socks[(SERVER_IPS[1], port)] = lab.server_udp_socket(
                SERVER_IPS[1], port
            )
        self._tasks: list[asyncio.Task[None]] = []

    def address(self, ip_index: int = 0, port_index: int = 0) -> Address:
        return (SERVER_IPS[ip_index], self.ports[port_index])

    async def __aenter__(self) -> Reflector:
        self._tasks = [asyncio.create_task(self._serve(addr)) for addr in self.socks]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for sock in self.socks.values():
            sock.close()

    async def _serve(self, addr: Address) -> None:
        loop = asyncio.get_running_loop()
        sock = self.socks[addr]
        ip_index = SERVER_IPS.index(addr[0])
        port_index = self.ports.index(addr[1])
        while True:
            try:
                data, src = await loop.sock_recvfrom(sock, 64)
            except OSError:
                continue
            if len(data) != _REQUEST.size:
                continue  # not ours: dropped
            magic, token, reply_from = _REQUEST.unpack(data)
            if magic != MAGIC or reply_from > 3:
                continue
            out_ip = ip_index ^ (1 if reply_from & 2 else 0)
            out_port = port_index ^ (1 if reply_from & 1 else 0)
            reply = _REPLY.pack(MAGIC, token, socket.inet_aton(src[0]), int(src[1]))
            send(self.socks[self.address(out_ip, out_port)], reply, src)


async def ask(
    sock: socket.socket,
    server: Address,
    reply_from: int = 0,
    timeout: float = ANSWER_TIMEOUT_S,
    tries: int = 2,
) -> Address | None:
    """Send one probe; return the mapped address the reflector saw, or None."""
    token = os.urandom(8)
    request = _REQUEST.pack(MAGIC, token, reply_from)
    for _ in range(tries):
        send(sock, request, server)
        deadline = asyncio.get_running_loop().time() + timeout
        while (left := deadline - asyncio.get_running_loop().time()) > 0:
            got = await recv(sock, left)
            if got is None:
                break
            data, _src = got
            if len(data) != _REPLY.size:
                continue
            magic, got_token, ip, port = _REPLY.unpack(data)
            if magic == MAGIC and got_token == token:
                return socket.inet_ntoa(ip), port
    return None


@frozen
class Behaviour:
    """What the probe measured for one site."""

    udp: bool
    mapping: Mapping
    filtering: Filtering
    allocation: Allocation
    hairpin: bool
    public_ip: str


async def measure(lab: Lab, site: Site, reflector: Reflector) -> Behaviour:
    """Measure a site the RFC 5780 way (mapping: section 4.3; filtering: 4.4;
    hairpinning: 4.5), plus the port allocation pattern."""
    socks: list[socket.socket] = []

    def new() -> socket.socket:
        sock = lab.udp_socket(site)
        socks.append(sock)
        return sock

    try:
        first = new()
        m1 = await ask(first, reflector.address(0, 0))
        if m1 is None:
            return Behaviour(
                False, Mapping.NONE, Filtering.NONE, Allocation.NONE, False, ""
            )
        m2 = await ask(first, reflector.address(1, 0))
        m3 = await ask(first, reflector.address(1, 1))
        assert m2 is not None and m3 is not None, "UDP works but a probe was lost"
        if m1 == local(first):
            mapping = Mapping.NONE
        elif m1 == m2 == m3:
            mapping = Mapping.ENDPOINT_INDEPENDENT
        elif m2 == m3:
            mapping = Mapping.ADDRESS_DEPENDENT
        else:
            mapping = Mapping.ADDRESS_AND_PORT_DEPENDENT

        # Allocation: three new mappings in a row from fresh sockets.
        if mapping is Mapping.NONE:
            allocation = Allocation.NONE
        elif m1[1] == local(first)[1]:
            allocation = Allocation.PRESERVE
        else:
            ports = [m1[1], m2[1], m3[1]]
            steps = [b - a for a, b in zip(ports, ports[1:], strict=False)]
            if all(step == 1 for step in steps):
                allocation = Allocation.SEQUENTIAL
            else:
                allocation = Allocation.RANDOM

        # Filtering: a fresh socket per test, so no test opens the next one's way.
        if await ask(new(), reflector.address(0, 0), 3, DROP_TIMEOUT_S, 1):
            filtering = Filtering.ENDPOINT_INDEPENDENT
        elif await ask(new(), reflector.address(0, 0), 1, DROP_TIMEOUT_S, 1):
            filtering = Filtering.ADDRESS_DEPENDENT
        else:
            filtering = Filtering.ADDRESS_AND_PORT_DEPENDENT
        if mapping is Mapping.NONE and filtering is Filtering.ENDPOINT_INDEPENDENT:
            filtering = Filtering.NONE

        # Hairpinning: a second socket sends to the first one's mapped address.
        target = new()
        mapped = await ask(target, reflector.address(0, 0))
        assert mapped is not None
        sender = new()
        send(sender, b"hairpin", mapped)
        got = await recv(target, DROP_TIMEOUT_S * 2)
        hairpin = got is not None and got[0] == b"hairpin"
        return Behaviour(True, mapping, filtering, allocation, hairpin, m1[0])
    finally:
        for sock in socks:
            sock.close()
