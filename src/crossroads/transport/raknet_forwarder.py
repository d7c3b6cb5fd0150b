"""RakNet's UDPForwarder: one UDP port per forwarding pair (reference §5).

The coordinator (:mod:`crossroads.proto.raknet.udpproxy`) starts an entry for
two RakNet systems, side 1 (the requester) and side 2 (the target), known by
the addresses the coordinator sees them at. Both then send to the entry's
port. A datagram from a side's confirmed address goes to the other side; a
datagram from an unconfirmed side's *IP* (any port: a NAT may map the game's
socket anew toward the proxy) confirms that side's address; anything else is
dropped (UDPForwarder.cpp:181-330). Until a side is confirmed, datagrams to it
go to the address the coordinator knows.

Data plane: the socket is read with ``loop.add_reader`` in batches; per
datagram one or two tuple comparisons and one ``sendto``: no parse, no
allocation beyond the datagram, no store. An entry that forwarded nothing for
its ``timeoutOnNoDataMS`` is closed (UDPForwarder.cpp:440-510).
"""

from __future__ import annotations

import asyncio
import socket

from crossroads.proto.raknet.udpproxy import ForwarderResult
from crossroads.transport.sockets import make_udp_socket
from crossroads.types import Address

#: Datagrams read per readiness callback (as the natneg relay).
BATCH = 64
#: RakNet's MAXIMUM_MTU_SIZE: nothing larger is a RakNet datagram.
MAX_DATAGRAM = 1500
#: Idle sweep period: timeouts are seconds long.
SWEEP_INTERVAL = 0.5


class _Entry:
    __slots__ = (
        "sock",
        "fd",
        "port",
        "side1",
        "side2",
        "confirmed1",
        "confirmed2",
        "timeout",
        "last",
        "packets",
    )

    def __init__(
        self,
        sock: socket.socket,
        side1: Address,
        side2: Address,
        timeout: float,
        now: float,
    ) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.port: int = sock.getsockname()[1]
        self.side1 = side1
        self.side2 = side2
        self.confirmed1: Address | None = None
        self.confirmed2: Address | None = None
        self.timeout = timeout
        self.last = now
        self.packets = 0

    def on_readable(self) -> None:
        recvfrom = self.sock.recvfrom
        sendto = self.sock.sendto
        forwarded = 0
        for _ in range(BATCH):
            try:
                data, addr = recvfrom(MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                continue
            c1, c2 = self.confirmed1, self.confirmed2
            if addr == c1 or (c1 is None and addr != c2 and addr[0] == self.side1[0]):
                if c1 is None:
                    self.confirmed1 = addr
                dest = c2 or self.side2
            elif addr == c2 or (c2 is None and addr[0] == self.side2[0]):
                if c2 is None:
                    self.confirmed2 = addr
                dest = self.confirmed1 or self.side1
            else:
                continue
            try:
                sendto(data, dest)
                forwarded += 1
            except OSError:
                pass
        if forwarded:
            self.packets += forwarded
            self.last = asyncio.get_running_loop().time()


class ForwarderPool:
    """The built-in forwarder: implements :class:`~crossroads.proto.raknet.udpproxy.Forwarders`."""

    def __init__(self, host: str, max_entries: int) -> None:
        self.host = host
        self.max_entries = max_entries
        self.entries: dict[tuple[Address, Address], _Entry] = {}
        self.started = 0
        self.released_packets = 0
        self._loop = asyncio.get_running_loop()
        self._sweeper: asyncio.Task[None] | None = None

    def start(
        self, source: Address, target: Address, timeout_ms: int
    ) -> tuple[ForwarderResult, int]:
        existing = self.entries.get((source, target)) or self.entries.get(
            (target, source)
        )
        if existing is not None:
            return ForwarderResult.FORWARDING_ALREADY_EXISTS, existing.port
        if len(self.entries) >= self.max_entries:
            return ForwarderResult.NO_SOCKETS, 0
        try:
            sock = make_udp_socket(self.host, 0)
        except OSError:
            return ForwarderResult.BIND_FAILED, 0
        entry = _Entry(sock, source, target, timeout_ms / 1000, self._loop.time())
        self.entries[(source, target)] = entry
        self._loop.add_reader(entry.fd, entry.on_readable)
        self.started += 1
        if self._sweeper is None:
            self._sweeper = asyncio.ensure_future(self._sweep_forever())
        return ForwarderResult.SUCCESS, entry.port

    def packets(self) -> int:
        return self.released_packets + sum(e.packets for e in self.entries.values())

    def sweep(self, now: float) -> None:
        for key, entry in list(self.entries.items()):
            if now - entry.last > entry.timeout:
                self._release(key)

    def _release(self, key: tuple[Address, Address]) -> None:
        entry = self.entries.pop(key)
        self.released_packets += entry.packets
        self._loop.remove_reader(entry.fd)
        entry.sock.close()

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL)
            self.sweep(self._loop.time())

    async def close(self) -> None:
        for key in list(self.entries):
            self._release(key)
        if self._sweeper is not None:
            self._sweeper.cancel()
            try:
                await self._sweeper
            except asyncio.CancelledError:
                pass
            self._sweeper = None
