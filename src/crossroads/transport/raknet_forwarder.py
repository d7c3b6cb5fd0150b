"""RakNet's UDPForwarder: one UDP port per forwarding pair (reference §5).

The coordinator (:mod:`crossroads.proto.raknet.udpproxy`) starts an entry for
two RakNet systems, side 1 (the requester) and side 2 (the target), known by
the addresses the coordinator sees them at. Both then send to the entry's
port. A datagram from a side's confirmed address goes to the other side; a
datagram from an unconfirmed side's *IP* (any port: a NAT may map the game's
socket anew toward the proxy) confirms that side's address; anything else is
dropped (UDPForwarder.cpp:181-330). Until a side is confirmed, datagrams to it
go to the address the coordinator knows.

Data plane: the socket is a :class:`~crossroads.transport.dataplane.RouteTap`
whose route table holds a route per *confirmed* side (its address -> the other
side's confirmed address, else the one the coordinator knows). The tap forwards
those datagrams itself (in C with recvmmsg/sendmmsg when built): no parse, no
Python per datagram, no store. The runtime's route table
(:mod:`crossroads.transport.routes`) writes them; with ``--dataplane kernel``
also into the eBPF program's map, which forwards them before the socket, and
they leave both planes with the entry. A datagram without a route reaches
:meth:`_Entry.unrouted`, which confirms a side (and rewrites both routes) or
drops it. An entry that forwarded nothing for its ``timeoutOnNoDataMS`` is
closed (UDPForwarder.cpp:440-510); the sweep sees forwarding as a change in the
routes' packet counts, so an entry closes at most one sweep period late, never
early.

Bounds (docs/security.md, "RakNet UDPProxy forwarders"): every entry holds
one UDP socket, so the pool admits entries through one table of the process's
:class:`~crossroads.transport.admission.ResourceBudget`
(:func:`forwarder_table`, ``raknet-forwarders``): its global cap is the
smaller of ``--raknet-proxy-max-forwarders`` and its share of the descriptors
left for per-client sockets, and the client that asked (its IPv4 address or
IPv6 /64) holds at most ``--raknet-proxy-max-forwarders-per-ip`` and never
more than an eighth of that cap. Over either cap the answer is NO_SOCKETS
(stock UDPForwarder's answer when its entries are used up), which the
coordinator turns into ALL_SERVERS_BUSY when no other server is left. A
``timeoutOnNoDataMS`` outside RakNet's range is INVALID_PARAMETERS
(UDPForwarder.cpp:121-123). An entry ends when it has been idle for its
timeout, or, if it has forwarded nothing yet, when the coordinator connection
of a client it was made for closes (:meth:`ForwarderPool.end_client`).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

from crossroads.proto.raknet.udpproxy import ForwarderResult, timeout_valid
from crossroads.transport.admission import Admission, Pool, ResourceBudget
from crossroads.transport.dataplane import (
    RouteLike,
    RouteTapLike,
    TapReaders,
    make_route,
    make_tap,
)
from crossroads.transport.kernel_drops import KernelDropCollector
from crossroads.transport.routes import InstalledRoute, RewriteRoute, RouteTable
from crossroads.transport.sockets import make_udp_socket
from crossroads.transport.tasks import Sweeper
from crossroads.types import Address, frozen

#: RakNet's MAXIMUM_MTU_SIZE: nothing larger is a RakNet datagram (dropped and
#: counted as malformed by the tap).
MAX_DATAGRAM = 1500
#: Idle sweep period: timeouts are seconds long.
SWEEP_INTERVAL = 0.5
#: The budget table of the forwarders (metrics, admin API, doctor).
TABLE = "raknet-forwarders"
#: Fixed memory of one entry, measured (benchmarks/raknet_forwarders.py, 400
#: and 1,000 forwarders): ~1.6 KB of process RSS (the socket object, the
#: entry, its tap and routes, the pool's and the coordinator's records) and
#: ~2.3 KB of kernel slab (UDP sock, socket inode, file, dentry, epoll item),
#: rounded up. Datagrams waiting in its buffers are the kernel's, bounded per
#: socket by its receive buffer.
FORWARDER_BYTES = 4096


def forwarder_table(
    budget: ResourceBudget, max_items: int, max_per_source: int
) -> Admission:
    """Register the forwarders of one pool with ``budget``: one UDP socket each
    from the per-client socket pool, :data:`FORWARDER_BYTES` each."""
    return budget.table(
        TABLE,
        max_items=max_items,
        max_per_source=max_per_source,
        pool=Pool.RELAY,
        descriptors_per_item=1,
        bytes_per_item=FORWARDER_BYTES,
    )


@frozen
class ForwarderUsage:
    """What one forwarder carried, read from its routes when it is released
    (for the insight record; nothing is counted per datagram for it). ``up``
    is from ``side1`` (the proxy request's source) to ``side2``."""

    side1: Address
    side2: Address
    requester: Address
    #: The forwarder's port (what the clients were told to send to).
    port: int
    #: Loop time the forwarder was opened and released.
    opened: float
    released: float
    packets_up: int
    bytes_up: int
    packets_down: int
    bytes_down: int
    #: Why it ended: "idle", "client-left", "closed".
    reason: str


@dataclass(eq=False, slots=True)
class _Entry:
    sock: socket.socket
    side1: Address
    side2: Address
    timeout: float
    last: float
    #: The client that asked (charged for the entry in the budget table).
    requester: Address
    #: The runtime's route table: the only writer of ``routes``.
    table: RouteTable = field(default_factory=RouteTable)
    port: int = field(init=False)
    confirmed1: Address | None = field(default=None, init=False)
    confirmed2: Address | None = field(default=None, init=False)
    #: The tap's routes, a route per confirmed side: its address -> where its
    #: datagrams go (written by ``table`` only).
    routes: dict[Address, RouteLike] = field(default_factory=dict, init=False)
    tap: RouteTapLike = field(init=False)
    #: The same routes as the entry holds them (every plane's counts).
    installed: dict[Address, InstalledRoute] = field(default_factory=dict, init=False)
    #: Datagrams forwarded by hand or by routes since replaced.
    forwarded_elsewhere: int = field(default=0, init=False)
    #: ``packets`` at the last sweep (a change means the entry is alive).
    seen_packets: int = field(default=0, init=False)
    #: When it was opened (loop time).
    opened: float = field(default=0.0, init=False)
    #: Datagrams and bytes each way (side1 -> side2: 0, back: 1) forwarded by
    #: hand or by routes since replaced; the live routes hold the rest.
    done: list[int] = field(default_factory=lambda: [0, 0, 0, 0], init=False)

    def __post_init__(self) -> None:
        self.opened = self.last
        self.port = self.sock.getsockname()[1]
        self.tap = make_tap(
            self.sock, self.routes, self.unrouted, max_size=MAX_DATAGRAM
        )

    @property
    def kernel_routes(self) -> dict[Address, RewriteRoute]:
        """The routes the kernel forwards now, by source."""
        return {
            source: route.twin
            for source, route in self.installed.items()
            if route.twin is not None
        }

    @property
    def packets(self) -> int:
        return self.forwarded_elsewhere + sum(
            r.packets for r in self.installed.values()
        )

    def end(self) -> None:
        """Take the routes out of every plane (forwarding stops at once),
        keeping their counts."""
        for source, route in self.installed.items():
            route.remove()
            self.forwarded_elsewhere += route.packets
            way = 0 if source == self.confirmed1 else 2
            self.done[way] += route.packets
            self.done[way + 1] += route.octets
        self.installed.clear()

    def unrouted(self, data: bytes, addr: Address) -> None:
        """A datagram from an unconfirmed address: confirm a side by its IP
        (UDPForwarder.cpp:181-330), forward it and route that side from now on;
        anything else is dropped."""
        c1, c2 = self.confirmed1, self.confirmed2
        if c1 is None and addr != c2 and addr[0] == self.side1[0]:
            self.confirmed1 = addr
            dest = c2 or self.side2
        elif c2 is None and addr[0] == self.side2[0]:
            self.confirmed2 = addr
            dest = self.confirmed1 or self.side1
        else:
            return
        self._route()
        try:
            self.sock.sendto(data, dest)
        except OSError:
            return
        self.forwarded_elsewhere += 1
        way = 0 if addr == self.confirmed1 else 2
        self.done[way] += 1
        self.done[way + 1] += len(data)
        self.last = asyncio.get_running_loop().time()

    def _route(self) -> None:
        """Rewrite the routes for the confirmed sides (in every plane)."""
        self.end()
        c1, c2 = self.confirmed1, self.confirmed2
        for side, dest in ((c1, c2 or self.side2), (c2, c1 or self.side1)):
            if side is not None:
                self.installed[side] = self.table.install(
                    self.routes, side, make_route(self.sock, dest), via=self.sock
                )

    def usage(self, released: float, reason: str) -> ForwarderUsage:
        counts = list(self.done)
        for source, route in self.installed.items():
            way = 0 if source == self.confirmed1 else 2
            counts[way] += route.packets
            counts[way + 1] += route.octets
        return ForwarderUsage(
            self.side1,
            self.side2,
            self.requester,
            self.port,
            self.opened,
            released,
            counts[0],
            counts[1],
            counts[2],
            counts[3],
            reason,
        )


class ForwarderPool:
    """The built-in forwarder: implements :class:`~crossroads.proto.raknet.udpproxy.Forwarders`.

    ``admission`` is its table in the process's resource budget
    (:func:`forwarder_table`); the pool admits and releases every entry.
    ``kernel_drops`` closes the entries' sockets, counting their kernel drops
    first (the runtime's collector: an entry may live between two scrapes).
    """

    def __init__(
        self,
        host: str,
        admission: Admission,
        kernel_drops: KernelDropCollector | None = None,
        table: RouteTable | None = None,
    ) -> None:
        self.host = host
        #: The runtime's route table (with ``--dataplane kernel``, confirmed
        #: sides are forwarded in the kernel too).
        self.table = RouteTable() if table is None else table
        self.admission = admission
        self.kernel_drops = kernel_drops or KernelDropCollector(dict)
        self.entries: dict[tuple[Address, Address], _Entry] = {}
        self.started = 0
        self.released_packets = 0
        #: Oversized datagrams dropped by entries already released.
        self.released_oversized = 0
        #: Entries ended because a client left before anything was forwarded.
        self.ended_unused = 0
        self._loop = asyncio.get_running_loop()
        #: Every entry's tap: one epoll set drained in C (one wakeup for all).
        self._readers = TapReaders()
        self._closed = False
        self._sweeper = Sweeper(self.sweep, SWEEP_INTERVAL)
        #: Told what each forwarder carried when it is released (insight).
        self.on_release: Callable[[ForwarderUsage], None] | None = None

    def start(
        self,
        source: Address,
        target: Address,
        timeout_ms: int,
        requester: Address | None = None,
    ) -> tuple[ForwarderResult, int]:
        if not timeout_valid(timeout_ms):
            return ForwarderResult.INVALID_PARAMETERS, 0
        existing = self.entries.get((source, target)) or self.entries.get(
            (target, source)
        )
        if existing is not None:
            return ForwarderResult.FORWARDING_ALREADY_EXISTS, existing.port
        if self._closed:
            return ForwarderResult.NO_SOCKETS, 0
        requester = requester or source
        if self.admission.admit(requester[0]) is not None:
            return ForwarderResult.NO_SOCKETS, 0  # counted by the admission
        try:
            sock = make_udp_socket(self.host, 0)
        except OSError:
            self.admission.release(requester[0])
            return ForwarderResult.BIND_FAILED, 0
        entry = _Entry(
            sock,
            source,
            target,
            timeout_ms / 1000,
            self._loop.time(),
            requester,
            self.table,
        )
        self.entries[(source, target)] = entry
        self._readers.add(entry.tap)
        self.started += 1
        self._sweeper.start()
        return ForwarderResult.SUCCESS, entry.port

    def end_client(self, address: Address) -> int:
        ended = 0
        for key, entry in list(self.entries.items()):
            if address not in (entry.side1, entry.side2, entry.requester):
                continue
            if entry.packets == 0:
                self._release(key, "client-left")
                self.admission.closed("client-left")
                ended += 1
        self.ended_unused += ended
        return ended

    def packets(self) -> int:
        return self.released_packets + sum(e.packets for e in self.entries.values())

    def oversized(self) -> int:
        """Datagrams over RakNet's MTU dropped so far (counted by the data plane)."""
        live = sum(e.tap.malformed for e in self.entries.values())
        return self.released_oversized + live

    def sweep(self, now: float) -> None:
        for key, entry in list(self.entries.items()):
            packets = entry.packets
            if packets != entry.seen_packets:
                entry.seen_packets = packets
                entry.last = max(entry.last, now)
            elif now - entry.last > entry.timeout:
                self._release(key, "idle")
                self.admission.closed("idle")

    def _release(self, key: tuple[Address, Address], reason: str) -> None:
        entry = self.entries.pop(key)
        entry.end()
        if self.on_release is not None:
            self.on_release(entry.usage(self._loop.time(), reason))
        self.released_packets += entry.packets
        self.released_oversized += entry.tap.malformed
        self._readers.remove(entry.tap)
        entry.tap.close()
        self.kernel_drops.close(entry.sock)
        self.admission.release(entry.requester[0])

    async def close(self) -> None:
        self._closed = True
        for key in list(self.entries):
            self._release(key, "closed")
        self._readers.close()
        await self._sweeper.stop()
