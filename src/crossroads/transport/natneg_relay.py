"""The natneg relay fallback: UDP port pairs that splice two game clients together.

When the natneg core decides that two clients cannot reach each other directly
(:class:`crossroads.proto.natneg.server.RelayNeeded`), the service asks this pool for a
*pair*: two UDP sockets, side 0 for client 0 and side 1 for client 1. CONNECT tells
client 0 "your peer is at side 0" and client 1 "your peer is at side 1"; the SDK
client pings whatever address CONNECT names (ref §8), so an unmodified game talks
through the relay without knowing.

A side does not know its client's port in advance: behind a symmetric NAT the port
toward the relay is a fresh mapping. It *learns* it from the first datagram that
comes from the client's public IP (seen in its INITs) and is a CONNECT_PING carrying
the session's cookie -- the first thing the SDK sends to a CONNECT address. After
that, a side accepts datagrams from exactly that (ip, port).

Data plane: each socket is a :class:`~crossroads.transport.dataplane.RouteTap`. Once
both sides have learned their clients, each side's route table holds one route:
its client's (ip, port) -> (the partner socket, the partner's client), written
by the runtime's route table (:mod:`crossroads.transport.routes`). The tap
forwards those datagrams itself (in C with recvmmsg/sendmmsg when built): no
parsing, no Python per datagram, no store. With ``--dataplane kernel`` the
table also puts the two routes in the eBPF program's map, which then forwards
them before the socket; they leave both planes when the pair is released. Everything else reaches
:meth:`_Side.unrouted`, which learns the client and drops the rest. A pair belongs to one negotiation
(:class:`~crossroads.proto.natneg.server.SessionId`), not to its cookie: games reuse
cookies, and a new negotiation on the same cookie gets its own pair while the old
one is released (:meth:`RelayPool.release`, when the core replaces the session). A
pair is also released when no datagram crossed it for ``idle_timeout`` seconds.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field

from crossroads.proto.natneg.packets import MAGIC, PacketType
from crossroads.proto.natneg.server import SessionId
from crossroads.proto.policy import AddressPolicy, Verdict
from crossroads.transport.admission import Admission
from crossroads.transport.dataplane import (
    RouteLike,
    TapReaders,
    make_route,
    make_tap,
)
from crossroads.transport.kernel_drops import KernelDropCollector
from crossroads.transport.refusals import RefusalLog
from crossroads.transport.routes import InstalledRoute, RouteTable
from crossroads.transport.sockets import set_buffers
from crossroads.transport.tasks import Sweeper
from crossroads.types import Address

log = logging.getLogger("crossroads.natneg.relay")

#: Random ports tried in ``port_range`` before giving up on an allocation.
_BIND_ATTEMPTS = 32


class _Side:
    """One socket of a pair, serving one client."""

    __slots__ = (
        "sock",
        "expected_ip",
        "ping_prefix",
        "src",
        "partner",
        "routes",
        "tap",
        "forwarded_by_hand",
        "bytes_by_hand",
        "table",
        "route",
    )

    def __init__(
        self,
        sock: socket.socket,
        expected_ip: str,
        cookie: int,
        table: RouteTable,
    ) -> None:
        self.sock = sock
        self.expected_ip = expected_ip
        # Bytes 0-11 of a CONNECT_PING minus the version byte, which we do not check.
        self.ping_prefix = (
            MAGIC,
            bytes((PacketType.CONNECT_PING,)) + cookie.to_bytes(4, "big"),
        )
        self.src: Address | None = None
        self.partner: _Side = self
        #: At most one route: the learned client -> the partner's learned client.
        self.routes: dict[Address, RouteLike] = {}
        self.tap = make_tap(sock, self.routes, self.unrouted)
        #: The learning datagrams this side forwarded itself, and their bytes.
        self.forwarded_by_hand = 0
        self.bytes_by_hand = 0
        #: The route table (the only writer of ``routes``), and this side's
        #: route once both clients are known.
        self.table = table
        self.route: InstalledRoute | None = None

    @property
    def packets(self) -> int:
        """Datagrams relayed from this side's client to the partner's."""
        routed = self.route.packets if self.route is not None else 0
        return self.forwarded_by_hand + routed

    @property
    def octets(self) -> int:
        """Bytes relayed from this side's client to the partner's (read from
        the route's counters: nothing is counted per datagram for it)."""
        routed = self.route.octets if self.route is not None else 0
        return self.bytes_by_hand + routed

    def end(self) -> None:
        """Take the route out of every plane (forwarding stops at once),
        keeping its counts."""
        if self.route is not None:
            self.route.remove()

    def unrouted(self, data: bytes, addr: Address) -> None:
        """A datagram without a route: learn the client from it, or drop it
        (a stranger, or the client talking before its partner is known)."""
        if self.src is not None:
            return
        magic, rest = self.ping_prefix
        if addr[0] != self.expected_ip or data[:6] != magic or data[7:12] != rest:
            return
        self.src = addr
        partner = self.partner
        if partner.src is None:
            return
        self.forwarded_by_hand += 1
        self.bytes_by_hand += len(data)
        try:
            partner.sock.sendto(data, partner.src)
        except OSError:
            pass
        self.route = self.table.install(
            self.routes, addr, make_route(partner.sock, partner.src), via=self.sock
        )
        partner.route = self.table.install(
            partner.routes, partner.src, make_route(self.sock, addr), via=partner.sock
        )


@dataclass(slots=True)
class _Pair:
    session: SessionId
    sides: tuple[_Side, _Side]
    created: float
    last_active: float
    last_packets: int = 0
    #: The source the pair is charged to in the pool's admission.
    source: str = ""


@dataclass(slots=True)
class RelayStats:
    """Counters for the metrics collector."""

    allocated: int = 0
    refused: int = 0
    #: Refusals by policy verdict (``loopback``, ``private``, ``self``, ...).
    refused_by: dict[str, int] = field(default_factory=dict)
    failed: int = 0
    released: int = 0
    #: Packets relayed by pairs already released (live pairs are summed on read).
    released_packets: int = 0


@dataclass(eq=False)
class RelayPool:
    """Allocates and releases relay pairs; owns their sockets."""

    _: KW_ONLY
    bind_host: str
    advertise_host: str
    port_range: tuple[int, int] | None
    idle_timeout: float
    max_pairs: int
    #: Which client IPs may be relayed (:mod:`crossroads.proto.policy`: the
    #: class of bug behind coturn CVE-2020-26262; tests and labs opt in with
    #: their ranges).
    policy: AddressPolicy
    #: The table of the process's resource budget that admits pairs (two
    #: descriptors each), charged to the session's first client; None: only
    #: ``max_pairs`` bounds them.
    admission: Admission | None = None
    #: The runtime's route table, the only writer of the pairs' routes (with
    #: ``--dataplane kernel``, also into the kernel's map).
    table: RouteTable = field(default_factory=RouteTable)
    #: Closes the pairs' sockets, counting their kernel drops first (the
    #: runtime's collector; a pair may live between two scrapes).
    kernel_drops: KernelDropCollector = field(
        default_factory=lambda: KernelDropCollector(dict)
    )
    #: Called when a pair is released, with the session, the seconds it
    #: lived and ``(packets, bytes)`` each way (client 0 -> 1, then 1 -> 0),
    #: read from the routes' counters (connection insight).
    on_release: (
        Callable[[SessionId, float, tuple[int, int], tuple[int, int]], None] | None
    ) = None
    refusals: RefusalLog = field(init=False)
    stats: RelayStats = field(default_factory=RelayStats, init=False)
    _pairs: dict[SessionId, _Pair] = field(default_factory=dict, init=False)
    _loop: asyncio.AbstractEventLoop = field(init=False, repr=False)
    #: Every side's tap: one epoll set drained in C (one wakeup for all pairs).
    _readers: TapReaders = field(init=False, repr=False)
    _sweeper: Sweeper = field(init=False, repr=False)
    _closed: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.refusals = RefusalLog(
            log,
            "natneg relay: client",
            "a relay serves the scope of the address it advertises "
            "(--natneg-relay-host); --natneg-relay-allow admits more",
        )
        self._loop = asyncio.get_running_loop()
        self._readers = TapReaders()
        # Idle detection granularity: a quarter of the timeout, at most 5 s.
        self._sweeper = Sweeper(self.sweep, min(self.idle_timeout / 4, 5.0))

    @property
    def active(self) -> int:
        return len(self._pairs)

    def pair_summaries(self) -> list[tuple[SessionId, tuple[str, str], int]]:
        """(session, the two clients' IPs, datagrams relayed) per live pair."""
        return [
            (
                session,
                (pair.sides[0].expected_ip, pair.sides[1].expected_ip),
                sum(side.packets for side in pair.sides),
            )
            for session, pair in self._pairs.items()
        ]

    def packets(self) -> int:
        """Datagrams relayed so far (live and released pairs)."""
        live = sum(side.packets for pair in self._pairs.values() for side in pair.sides)
        return self.stats.released_packets + live

    def allocate(
        self, session: SessionId, client_ips: tuple[str, str]
    ) -> tuple[Address, Address] | None:
        """A pair for a session: the address to give client 0 and client 1."""
        if self._closed:
            return None
        for ip in client_ips:
            verdict = self.policy.judge(ip)
            if verdict != Verdict.ALLOWED:
                self.stats.refused += 1
                self.stats.refused_by[verdict.reason] = (
                    self.stats.refused_by.get(verdict.reason, 0) + 1
                )
                self.refusals.refused((ip, 0), verdict)
                return None
        if len(self._pairs) >= self.max_pairs or session in self._pairs:
            self.stats.failed += 1
            return None
        source = client_ips[0]
        if self.admission is not None and self.admission.admit(source) is not None:
            self.stats.failed += 1
            return None
        socks: list[socket.socket] = []
        try:
            for _ in range(2):
                socks.append(self._bind())
        except OSError as exc:
            for sock in socks:
                sock.close()
            if self.admission is not None:
                self.admission.release(source)
            log.warning("natneg relay: cannot bind a relay socket: %s", exc)
            self.stats.failed += 1
            return None
        side0 = _Side(socks[0], client_ips[0], session.cookie, self.table)
        side1 = _Side(socks[1], client_ips[1], session.cookie, self.table)
        side0.partner, side1.partner = side1, side0
        now = self._loop.time()
        self._pairs[session] = _Pair(session, (side0, side1), now, now, source=source)
        for side in (side0, side1):
            self._readers.add(side.tap)
        self.stats.allocated += 1
        self._sweeper.start()
        port0 = socks[0].getsockname()[1]
        port1 = socks[1].getsockname()[1]
        return (self.advertise_host, port0), (self.advertise_host, port1)

    def _bind(self) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            set_buffers(sock)
            sock.setblocking(False)
            if self.port_range is None:
                sock.bind((self.bind_host, 0))
                return sock
            low, high = self.port_range
            for _ in range(_BIND_ATTEMPTS):
                try:
                    sock.bind((self.bind_host, random.randint(low, high)))
                    return sock
                except OSError:
                    continue
            raise OSError(f"no free port in {low}-{high}")
        except BaseException:
            sock.close()
            raise

    def holds(self, session: SessionId) -> bool:
        """Has the session a live pair?"""
        return session in self._pairs

    def in_use(self, session: SessionId) -> bool:
        """Has the session's pair learned both clients (is a game using it)?"""
        pair = self._pairs.get(session)
        return pair is not None and all(side.src is not None for side in pair.sides)

    def release(self, session: SessionId) -> None:
        """Close the session's pair, if it has one."""
        pair = self._pairs.pop(session, None)
        if pair is None:
            return
        for side in pair.sides:
            side.end()
            self.stats.released_packets += side.packets
            self._readers.remove(side.tap)
            side.tap.close()
            self.kernel_drops.close(side.sock)
        if self.admission is not None:
            self.admission.release(pair.source)
        self.stats.released += 1
        if self.on_release is not None:
            first, second = pair.sides
            self.on_release(
                session,
                self._loop.time() - pair.created,
                (first.packets, first.octets),
                (second.packets, second.octets),
            )

    def sweep(self, now: float) -> None:
        """Release pairs that carried nothing for ``idle_timeout`` seconds."""
        for session, pair in list(self._pairs.items()):
            packets = pair.sides[0].packets + pair.sides[1].packets
            if packets != pair.last_packets:
                pair.last_packets = packets
                pair.last_active = now
            elif now - pair.last_active >= self.idle_timeout:
                if self.admission is not None:
                    self.admission.closed("idle-timeout")
                self.release(session)

    async def close(self) -> None:
        self._closed = True
        for session in list(self._pairs):
            self.release(session)
        self._readers.close()
        await self._sweeper.stop()
