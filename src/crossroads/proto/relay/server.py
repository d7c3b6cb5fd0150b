"""The Unity Relay server core (sans-I/O): one relay node's allocations and routes.

Theory of operation
-------------------
An *allocation* is one player's seat on this node, named by a 16-byte ID. The
allocation API hands each player a sealed ``connectionData`` token and a 64-byte
key (:mod:`crossroads.proto.relay.token`); the node needs nothing else to check a
BIND, so the API never has to reach the node before the player does.

1. **BIND** (client→relay) opens the token, derives the key, verifies the
   HMAC-SHA256 over the first 263 bytes with a constant-time compare and checks
   the little-endian nonce is *strictly greater* than the last accepted one for
   that allocation. The first BIND must come before the token's bind deadline.
   A valid BIND ties the allocation to the sender's IP:port and is answered with
   BIND_RECEIVED. A bad token or HMAC is dropped silently (Unity docs: "the Relay
   server silently rejects the BIND"); a replayed nonce is dropped too (an exact
   duplicate from the bound address gets BIND_RECEIVED again, so a lost reply
   costs nothing).
2. **CONNECT_REQUEST** from a bound joiner carries the host's connection data.
   The relay checks the joiner's token was issued for that host, and answers
   ACCEPTED (from = host, to = joiner) or REJECTED when the host already has
   ``maxConnections`` joiners. Accepting installs two *routes*.
3. **RELAY** frames are the data plane. A route is keyed by (source IP:port, the
   first 36 bytes of the frame: header + from ID + to ID) and holds the
   destination IP:port. Forwarding is one dict lookup, one length check and one
   send: no parse, no allocation per packet. The core does not write the
   forwarding table itself: it announces each route to a :class:`Forwarding`
   port the transport injects (:meth:`RelayServer.set_forwarding`: the
   transport's route table, :mod:`crossroads.transport.routes`, which writes
   it into the data plane's taps and, on the kernel plane, the eBPF map; in
   memory, :class:`MemoryForwarding`), and holds the :class:`RouteHandle` it
   gets back: the route's counts on every plane, and its removal.
   :attr:`RelayServer.routes` is that table, for reading. The transport
   forwards what the table routes and hands the core only what misses. Each
   :class:`Route` links a handle to its two allocations; the periodic *sweep*
   turns counter changes into activity (for the idle timers) and metrics.
4. Anything that misses the route table takes the *slow path*: full decode, a
   per-source token bucket, and the protocol's ERROR or a counted drop. An
   ERROR (21 bytes) can be one byte larger than what provoked it (a 20-byte
   CLOSE or PING naming an unknown allocation), so ERRORs are rate limited *and*
   go through the node's reflection budget
   (:mod:`crossroads.proto.reflection`): a source is never sent more than it
   sent plus a small allowance. A frame naming a bound allocation from a
   different IP:port gets ERROR 3 and is not forwarded: that is how a NAT
   rebinding is noticed (the client bumps its nonce and re-BINDs, which moves the
   routes) and how a spoofed source is refused.
5. **Timers** (reference §1.2), checked by the sweep: an allocation with no
   message to or from it for ``idle_timeout`` (10 s) ends, and so does a host
   with no joiner for ``host_alone_timeout`` (60 s). The ended client gets
   ERROR 1, its peers DISCONNECT, and later frames ERROR 4. A host that ends
   takes its joiners' allocations with it (there is nobody left to relay to).
   CLOSE ends an allocation at once.
6. **Admission.** An allocation exists only after an authenticated BIND (a
   token this node sealed for an API caller with a key, and its HMAC), so
   there is no pre-auth state to give a deadline. Each one is admitted by an
   injected :class:`~crossroads.proto.admission.Admitter` (the service's
   ``relay-allocations`` table of the process's resource budget; without one
   a :class:`~crossroads.proto.admission.LocalTable` of ``max_allocations``)
   under its client's source (IPv4 address or IPv6 /64), released when it
   ends, and moved to the new source when a BIND rebinds it elsewhere: one
   source, even with many valid tokens, holds at most its share of the node.
   A BIND over either cap is dropped and counted (``capacity``,
   ``source-capacity``), unanswered like any refused BIND.

Everything the service must know (metrics, the store's session records) comes
out as events from :meth:`RelayServer.pop_events`; the core does no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final, Protocol

from crossroads.errors import DecodeError
from crossroads.proto.admission import REFUSED_OVER_IP_LIMIT, Admitter, LocalTable
from crossroads.proto.budget import source_key
from crossroads.proto.core import Datagram, EventQueue, Outbox
from crossroads.proto.counting import spend_token
from crossroads.proto.policy import AddressPolicy, Verdict
from crossroads.proto.reflection import DROP_REFLECTION, ReflectionBudget
from crossroads.proto.relay import messages as m
from crossroads.proto.relay.token import AllocationClaims, TokenSealer, verify_bind_hmac
from crossroads.proto.sweep import SweepTimer
from crossroads.types import Address, frozen

#: One slow-path decision per message type, to keep dispatch a dict lookup.
RouteKey = tuple[Address, bytes]

#: The drop reason of a BIND its admission refused, by the table's reason:
#: the source holds its share, or (anything else) the node is full.
_REFUSAL_DROPS: Final = {REFUSED_OVER_IP_LIMIT: "source-capacity"}

_BIND_RECEIVED: Final = m.BindReceived().encode()


class ForwardEntry(Protocol):
    """A forwarding entry: where frames go, and what took the way (the data
    plane bumps the counters per forwarded frame; the sweep reads them)."""

    @property
    def dest(self) -> Address: ...

    packets: int
    octets: int


class RouteHandle(Protocol):
    """One installed route as the core holds it: where it goes, what took it
    on every plane (counts outlive removal), and its removal at once."""

    @property
    def dest(self) -> Address: ...
    @property
    def packets(self) -> int: ...
    @property
    def octets(self) -> int: ...

    def remove(self) -> None:
        """Stop forwarding (the next frame reaches the core)."""

    def reinstate(self) -> None:
        """Forward again after :meth:`remove`, counts carried on."""


class Forwarding(Protocol):
    """Where the core's routes are written: the only writer of the
    forwarding table the data plane reads."""

    @property
    def routes(self) -> Mapping[RouteKey, ForwardEntry]:
        """The forwarding table, for reading."""

    def install(self, key: RouteKey, dest: Address, source: Address) -> RouteHandle:
        """Forward frames keyed ``key`` (from ``source``) to ``dest``."""


class Forward:
    """The in-memory :class:`ForwardEntry` and its :class:`RouteHandle`
    (no transport: tests, simulations)."""

    __slots__ = ("dest", "packets", "octets", "_table", "_key")

    def __init__(
        self, dest: Address, table: dict[RouteKey, ForwardEntry], key: RouteKey
    ) -> None:
        self.dest = dest
        self.packets = 0
        self.octets = 0
        self._table = table
        self._key = key

    def remove(self) -> None:
        if self._table.get(self._key) is self:
            del self._table[self._key]

    def reinstate(self) -> None:
        self._table[self._key] = self


class MemoryForwarding:
    """The in-memory :class:`Forwarding`: a dict of :class:`Forward`."""

    def __init__(self) -> None:
        self.routes: dict[RouteKey, ForwardEntry] = {}

    def install(self, key: RouteKey, dest: Address, source: Address) -> RouteHandle:
        forward = Forward(dest, self.routes, key)
        self.routes[key] = forward
        return forward


@dataclass(eq=False, slots=True)
class Route:
    """One direction of a connected pair: its forwarding entry, and the two
    allocations whose activity that entry's traffic proves."""

    forward: RouteHandle
    source: Allocation
    target: Allocation
    seen_packets: int = field(default=0, init=False)
    seen_octets: int = field(default=0, init=False)

    @property
    def dest(self) -> Address:
        return self.forward.dest

    @property
    def packets(self) -> int:
        return self.forward.packets

    @property
    def octets(self) -> int:
        return self.forward.octets


@dataclass(slots=True, eq=False)
class Allocation:
    """A bound allocation (mutable state, owned by :class:`RelayServer`)."""

    allocation_id: bytes
    host_allocation_id: bytes
    is_host: bool
    max_connections: int
    bind_deadline: float
    address: Address
    last_nonce: int
    bound_at: float
    last_activity: float
    #: Host: connected joiners. Joiner: its host, once ACCEPTED.
    peers: set[bytes] = field(default_factory=set)
    #: Counted in :attr:`RelayServer.admission` under its address's source.
    admitted: bool = True
    #: Frames and bytes this allocation sent and was sent over routes since
    #: removed (added up when a route goes: a rebind moves routes, so the
    #: link's totals survive it), and when it was last ACCEPTED. For
    #: connection insight; nothing per frame.
    sent: tuple[int, int] = (0, 0)
    received: tuple[int, int] = (0, 0)
    connected_at: float = 0.0

    @property
    def weight(self) -> int:
        """Seats this allocation reserves on the node: a host reserves its joiners."""
        return 1 + self.max_connections if self.is_host else 0


# ------------------------------------------------------------------------- events


@frozen
class AllocationBound:
    """An allocation was bound (``rebind``: it moved to a new IP:port)."""

    allocation_id: bytes
    host_allocation_id: bytes
    is_host: bool
    max_connections: int
    address: Address
    rebind: bool


@frozen
class PeerConnected:
    host_allocation_id: bytes
    allocation_id: bytes
    #: Joiners now connected to the host.
    connections: int


@frozen
class PeerDisconnected:
    host_allocation_id: bytes
    allocation_id: bytes
    connections: int
    reason: str
    #: What the link carried (frames, bytes): joiner -> host, host -> joiner,
    #: read from the routes' counters; the two clients' addresses; seconds
    #: the link lived. Not compared: evidence for connection insight.
    joiner_sent: tuple[int, int] = field(default=(0, 0), compare=False)
    joiner_received: tuple[int, int] = field(default=(0, 0), compare=False)
    host_address: Address = field(default=("", 0), compare=False)
    joiner_address: Address = field(default=("", 0), compare=False)
    connected_for: float = field(default=0.0, compare=False)


@frozen
class ConnectRejected:
    host_allocation_id: bytes
    allocation_id: bytes


@frozen
class ClientRefused:
    """A BIND from an address the policy refuses (dropped, not answered)."""

    address: Address
    verdict: Verdict


@frozen
class AllocationEnded:
    allocation_id: bytes
    host_allocation_id: bytes
    is_host: bool
    #: ``idle``, ``host-alone``, ``closed``, ``host-ended``, ``revoked`` or
    #: ``over-limit``.
    reason: str


@frozen
class BindRejected:
    """A BIND failed authentication: a token this node did not seal
    (``bad-token``), a bad HMAC (``bad-hmac``) or a token past its bind
    deadline (``bind-deadline``). For the log; no key or HMAC in it."""

    reason: str
    client: Address


Event = (
    AllocationBound
    | PeerConnected
    | PeerDisconnected
    | ConnectRejected
    | AllocationEnded
    | ClientRefused
    | BindRejected
)


# ------------------------------------------------------------------------- config


@frozen
class RelayServerConfig:
    """Limits and timers of one relay node."""

    node_id: str
    #: Reference §1.2: "any message to or from the client resets it" (10 s).
    idle_timeout: float = 10.0
    #: Reference §1.2: TTL "when the host is alone" (60 s).
    host_alone_timeout: float = 60.0
    #: How often timers and counters are checked; None = a tenth of the shortest
    #: timeout, between 50 ms and 1 s (idle timers are precise to one tick).
    sweep_interval: float | None = None
    #: Hard cap on bound allocations (the node's advertised capacity is in
    #: seats) when no admission table is injected (:class:`RelayServer`).
    max_allocations: int = 100_000
    #: Which client addresses the relay serves (:mod:`crossroads.proto.policy`):
    #: by default not loopback, private, link-local, reserved or the server's
    #: own addresses -- a BIND with a spoofed internal source would otherwise
    #: turn the relay into a UDP proxy towards internal services (the coturn
    #: CVE-2020-26262 class of bug) -- except the scope the node advertises.
    policy: AddressPolicy = AddressPolicy()
    #: Slow-path datagrams per second per source IP, and the burst. Legitimate
    #: clients need a handful (BIND, CONNECT, a PING every 3 s); RELAY frames of
    #: connected peers never reach the slow path.
    slow_path_rate: float = 200.0
    slow_path_burst: float = 400.0
    #: ERROR replies per second per source IP. An ERROR (21 bytes) is at most one
    #: byte larger than what provoked it (a 20-byte CLOSE); the rate and the
    #: reflection budget keep the relay from being a reflector.
    error_rate: float = 20.0
    error_burst: float = 40.0
    #: Source IPs tracked by the token buckets; the oldest is forgotten beyond it.
    max_tracked_sources: int = 65_536
    #: RELAY frames per second per route before the route is suspended for
    #: ``rate_penalty`` seconds (0 = unlimited). Checked per sweep, so the data
    #: plane pays nothing for it.
    max_route_pps: float = 0.0
    rate_penalty: float = 1.0

    def tick(self) -> float:
        if self.sweep_interval is not None:
            return self.sweep_interval
        shortest = min(self.idle_timeout, self.host_alone_timeout)
        return min(1.0, max(0.05, shortest / 10))


# ------------------------------------------------------------------------- server


class RelayServer(Outbox[Datagram], EventQueue[Event]):
    """One relay node's protocol state. See the module docstring.

    Args:
        config: timers and limits.
        sealer: opens connection-data tokens and derives allocation keys.
        wall_offset: Unix time minus the ``now`` clock the caller uses (token
            bind deadlines are Unix times, timers run on ``now``).
        admission: admits allocations per source and in total (the service
            injects its table of the process's resource budget); None: a
            :class:`~crossroads.proto.admission.LocalTable` of
            ``config.max_allocations``.
    """

    def __init__(
        self,
        config: RelayServerConfig,
        sealer: TokenSealer,
        wall_offset: float = 0.0,
        reflection: ReflectionBudget | None = None,
        admission: Admitter | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        #: Where every bound allocation is counted under its client's source.
        self.admission: Admitter = admission or LocalTable(config.max_allocations)
        #: ERRORs to sources that are not bound where they claim to be
        #: (docs/security.md, "Reflection budget"); None: no budget.
        self.reflection = ReflectionBudget.or_unlimited(reflection)
        self.sealer = sealer
        self.wall_offset = wall_offset
        self.allocations: dict[bytes, Allocation] = {}
        #: Where routes are written (see :meth:`set_forwarding`).
        self._forwarding: Forwarding = MemoryForwarding()
        #: The allocations behind each entry of :attr:`routes` (same keys).
        self._links: dict[RouteKey, Route] = {}
        #: Seats reserved by bound hosts (sum of :attr:`Allocation.weight`).
        self.load = 0
        self.connections = 0
        # Counters, read by the service's metrics collector.
        self.drops: dict[str, int] = {}
        self.errors_sent: dict[int, int] = {}
        self.ended_total: dict[str, int] = {}
        self.relayed_packets = 0
        self.relayed_octets = 0
        # Allocation IDs that ended, until their token's bind deadline (Unix time):
        # a still-valid token must not resurrect a closed allocation.
        self._ended: dict[bytes, float] = {}
        self._suspended: dict[RouteKey, tuple[Route, float]] = {}
        self._slow_buckets: dict[str, list[float]] = {}
        self._error_buckets: dict[str, list[float]] = {}
        self._tick = config.tick()
        self._sweep = SweepTimer(self._tick)
        self._handlers: dict[m.MessageType, Callable[[bytes, Address, float], None]] = {
            m.MessageType.BIND: self._on_bind,
            m.MessageType.PING: self._on_ping,
            m.MessageType.CONNECT_REQUEST: self._on_connect_request,
            m.MessageType.DISCONNECT: self._on_disconnect,
            m.MessageType.RELAY: self._on_relay,
            m.MessageType.CLOSE: self._on_close,
        }

    # ------------------------------------------------------------- public API

    def set_forwarding(self, forwarding: Forwarding) -> None:
        """Let the transport write the routes (its route table, which makes
        each entry for the frames ``source`` sends to ``dest``: a transport
        that reaches some clients another way, DTLS, needs both ends). Call
        before the first datagram."""
        self._forwarding = forwarding

    @property
    def routes(self) -> Mapping[RouteKey, ForwardEntry]:
        """The data plane's forwarding table (written by the forwarding port)."""
        return self._forwarding.routes

    def receive_datagram(self, data: bytes, addr: Address, now: float) -> None:
        """Handle one datagram from ``addr``. Never raises on bad input."""
        route = self.routes.get((addr, data[: m.RELAY_ROUTE_SIZE]))
        if route is not None and len(data) == m.RELAY_HEADER_SIZE + int.from_bytes(
            data[36:38], "big"
        ):
            route.packets += 1
            route.octets += len(data)
            self._outbox.append((data, route.dest))
            return
        self.receive_slow(data, addr, now)

    def receive_slow(self, data: bytes, addr: Address, now: float) -> None:
        """The slow path: everything the route table does not forward."""
        if not self._take(
            self._slow_buckets,
            addr[0],
            now,
            self.config.slow_path_rate,
            self.config.slow_path_burst,
        ):
            self._drop("rate-limited")
            return
        self.reflection.received(addr[0], len(data), now)
        try:
            message_type = m.check_header(data)
        except DecodeError as exc:
            if exc.reason == "bad-version" and len(data) >= 20:
                self._error(
                    addr, bytes(data[4:20]), m.ErrorCode.INVALID_PROTOCOL_VERSION, now
                )
            elif exc.reason == "bad-version":
                self._error(addr, m.ZERO_ID, m.ErrorCode.INVALID_PROTOCOL_VERSION, now)
            self._drop(exc.reason)
            return
        handler = self._handlers.get(message_type)
        if handler is None:
            # Relay→client types (BIND_RECEIVED, ACCEPTED, REJECTED, ERROR).
            self._drop("unexpected-type")
            return
        handler(data, addr, now)
        if self.allocations or self._ended:
            self._sweep.arm(now)

    def get_timer(self) -> float | None:
        return self._sweep.deadline

    def handle_timer(self, now: float) -> None:
        if not self._sweep.due(now):
            return
        self.sweep(now)
        if not (self.allocations or self._ended or self._suspended):
            self._sweep.stop()

    def sweep(self, now: float) -> None:
        """Fold route counters into activity and metrics, then expire timers."""
        limit = self.config.max_route_pps * self._tick
        too_busy: list[RouteKey] = []
        for key, route in self._links.items():
            delta = route.packets - route.seen_packets
            if not delta:
                continue
            self.relayed_packets += delta
            self.relayed_octets += route.octets - route.seen_octets
            route.seen_packets = route.packets
            route.seen_octets = route.octets
            route.source.last_activity = now
            route.target.last_activity = now
            if limit and delta > limit:
                too_busy.append(key)
        for key in too_busy:
            route = self._links.pop(key)
            route.forward.remove()
            self._suspended[key] = (route, now + self.config.rate_penalty)
            self._drop("route-suspended")
        for key, (route, until) in list(self._suspended.items()):
            if now >= until:
                del self._suspended[key]
                still_linked = route.target.allocation_id in route.source.peers
                if (
                    still_linked
                    and key[0] == route.source.address
                    and key not in self.routes
                ):
                    route.forward.reinstate()
                    self._links[key] = route
        cfg = self.config
        for alloc in list(self.allocations.values()):
            alone = alloc.is_host and not alloc.peers
            ttl = cfg.host_alone_timeout if alone else cfg.idle_timeout
            if now - alloc.last_activity >= ttl:
                self._end(alloc, "host-alone" if alone else "idle", now, notify=True)
        wall = now + self.wall_offset
        for allocation_id, deadline in list(self._ended.items()):
            if wall > deadline:
                del self._ended[allocation_id]

    def kick(self, allocation_id: bytes, now: float, *, notify: bool = True) -> bool:
        """End an allocation on an operator's order or because its DTLS
        session closed: its peers are unlinked, and with ``notify`` its client
        gets the same ERROR as on a timeout (not when its session is gone, as
        nothing could carry it); False when unknown."""
        alloc = self.allocations.get(allocation_id)
        if alloc is None:
            return False
        self._end(alloc, "revoked", now, notify=notify)
        return True

    def relayed(self) -> tuple[int, int]:
        """Frames and bytes forwarded so far, including those not yet swept."""
        packets, octets = self.relayed_packets, self.relayed_octets
        for route in self._links.values():
            packets += route.packets - route.seen_packets
            octets += route.octets - route.seen_octets
        return packets, octets

    def stats(self) -> dict[str, int]:
        return {
            "allocations": len(self.allocations),
            "connections": self.connections,
            "routes": len(self.routes),
            "load": self.load,
        }

    # ------------------------------------------------------------- handlers

    def _on_bind(self, data: bytes, addr: Address, now: float) -> None:
        if len(data) != m.BIND_SIZE:
            self._drop("bad-size")
            return
        length = data[7]
        try:
            claims, key = self.sealer.open_with_key(
                data[8 : 8 + length], self.config.node_id
            )
        except DecodeError:
            self._drop("bad-token")
            self._events.append(BindRejected("bad-token", addr))
            return
        if not verify_bind_hmac(key, data):
            self._drop("bad-hmac")
            self._events.append(BindRejected("bad-hmac", addr))
            return
        nonce = int.from_bytes(data[5:7], "little")
        alloc = self.allocations.get(claims.allocation_id)
        if alloc is None:
            self._first_bind(claims, nonce, addr, now)
            return
        if nonce <= alloc.last_nonce:
            if nonce == alloc.last_nonce and addr == alloc.address:
                # The same BIND again from the bound address: our reply was lost.
                alloc.last_activity = now
                self._outbox.append((_BIND_RECEIVED, addr))
            else:
                self._drop("replayed-nonce")
            return
        if addr != alloc.address and not self._client_allowed(addr):
            return
        if addr != alloc.address and not self._readmit(alloc, addr, now):
            return
        alloc.last_nonce = nonce
        alloc.last_activity = now
        rebind = addr != alloc.address
        if rebind:
            self._move(alloc, addr)
        self._bound(alloc, addr, rebind)

    def _bound(self, alloc: Allocation, addr: Address, rebind: bool) -> None:
        """Answer a BIND that (re)bound ``alloc`` to ``addr`` and say so."""
        self._outbox.append((_BIND_RECEIVED, addr))
        self._events.append(
            AllocationBound(
                alloc.allocation_id,
                alloc.host_allocation_id,
                alloc.is_host,
                alloc.max_connections,
                addr,
                rebind=rebind,
            )
        )

    def _first_bind(
        self, claims: AllocationClaims, nonce: int, addr: Address, now: float
    ) -> None:
        if claims.allocation_id in self._ended:
            self._drop("ended-allocation")
            self._error(
                addr, claims.allocation_id, m.ErrorCode.ALLOCATION_ID_NOT_FOUND, now
            )
            return
        if now + self.wall_offset > claims.bind_deadline:
            # Seed 003: the host must BIND within 10 s of allocating.
            self._drop("bind-deadline")
            self._events.append(BindRejected("bind-deadline", addr))
            self._error(
                addr, claims.allocation_id, m.ErrorCode.ALLOCATION_ID_NOT_FOUND, now
            )
            return
        if not self._client_allowed(addr):
            return
        refused = self.admission.admit(addr[0])
        if refused is not None:
            self._drop(_REFUSAL_DROPS.get(refused, "capacity"))
            return
        alloc = Allocation(
            allocation_id=claims.allocation_id,
            host_allocation_id=claims.host_allocation_id,
            is_host=claims.is_host,
            max_connections=claims.max_connections if claims.is_host else 0,
            bind_deadline=claims.bind_deadline,
            address=addr,
            last_nonce=nonce,
            bound_at=now,
            last_activity=now,
        )
        self.allocations[alloc.allocation_id] = alloc
        self.load += alloc.weight
        self._bound(alloc, addr, rebind=False)

    def _readmit(self, alloc: Allocation, addr: Address, now: float) -> bool:
        """Move ``alloc``'s admission to the source of ``addr`` (a rebind):
        False, nothing moved and the BIND dropped, when that source holds its
        share already."""
        old = alloc.address[0]
        if source_key(addr[0]) == source_key(old):
            return True
        # Give back first: a full table must not refuse a move that leaves
        # the count as it was.
        self.admission.release(old)
        refused = self.admission.admit(addr[0])
        if refused is None:
            return True
        self._drop(_REFUSAL_DROPS.get(refused, "capacity"))
        if self.admission.admit(old) is not None:
            # The caps shrank meanwhile (a budget's shares move as tables
            # register): the allocation can no longer be counted, so it ends.
            alloc.admitted = False
            self._end(alloc, "over-limit", now, notify=True)
        return False

    def _sender(
        self, allocation_id: bytes, addr: Address, now: float
    ) -> Allocation | None:
        """The bound allocation a message claims to come from, or None (answered)."""
        alloc = self.allocations.get(allocation_id)
        if alloc is None:
            self._drop("unknown-allocation")
            self._error(addr, allocation_id, m.ErrorCode.ALLOCATION_ID_NOT_FOUND, now)
            return None
        if alloc.address != addr:
            # A NAT rebinding (the client re-BINDs on this error) or a spoofed
            # source; either way nothing is forwarded from here.
            self._drop("address-mismatch")
            self._error(
                addr, allocation_id, m.ErrorCode.ALLOCATION_ID_CLIENT_MISMATCH, now
            )
            return None
        alloc.last_activity = now
        return alloc

    def _fixed_size_sender(
        self, data: bytes, size: int, addr: Address, now: float
    ) -> Allocation | None:
        """The sender of a fixed-size message (its allocation id in bytes
        4-20), or None when the size is wrong or :meth:`_sender` refuses it."""
        if len(data) != size:
            self._drop("bad-size")
            return None
        return self._sender(bytes(data[4:20]), addr, now)

    def _on_ping(self, data: bytes, addr: Address, now: float) -> None:
        if self._fixed_size_sender(data, m.PING_SIZE, addr, now) is not None:
            # Echo it: UTP re-binds when it hears nothing for 3 heartbeats.
            self._outbox.append((data, addr))

    def _on_connect_request(self, data: bytes, addr: Address, now: float) -> None:
        joiner = self._fixed_size_sender(data, m.CONNECT_REQUEST_SIZE, addr, now)
        if joiner is None:
            return
        length = data[20]
        try:
            host_claims = self.sealer.open(data[21 : 21 + length], self.config.node_id)
        except DecodeError:
            self._drop("bad-token")
            self._error(addr, joiner.allocation_id, m.ErrorCode.UNAUTHORIZED, now)
            return
        host_id = host_claims.allocation_id
        if host_id == joiner.allocation_id:
            self._drop("self-connect")
            self._error(
                addr, joiner.allocation_id, m.ErrorCode.SELF_CONNECT_NOT_ALLOWED, now
            )
            return
        if (
            joiner.is_host
            or not host_claims.is_host
            or joiner.host_allocation_id != host_id
        ):
            # A joiner may only connect to the host its join code named.
            self._drop("wrong-host")
            self._error(addr, joiner.allocation_id, m.ErrorCode.UNAUTHORIZED, now)
            return
        host = self.allocations.get(host_id)
        if host is None:
            wall = now + self.wall_offset
            if host_id in self._ended or wall > host_claims.bind_deadline:
                self._drop("host-gone")
                self._error(
                    addr, joiner.allocation_id, m.ErrorCode.ALLOCATION_ID_NOT_FOUND, now
                )
            else:
                # The host may still BIND ("not required to BIND before a join
                # code"); the joiner retries CONNECT every second (UTP).
                self._drop("host-not-bound")
            return
        if joiner.allocation_id in host.peers:
            self._outbox.append(
                (m.Accepted(host_id, joiner.allocation_id).encode(), addr)
            )
            return
        if len(host.peers) >= host.max_connections:
            self._outbox.append(
                (m.Rejected(host_id, joiner.allocation_id).encode(), addr)
            )
            self._events.append(ConnectRejected(host_id, joiner.allocation_id))
            return
        for old_host in list(joiner.peers):
            # Joiners have one host; a new ACCEPT replaces nothing but be tidy.
            self._unlink(joiner, old_host, "reconnect", now, notify=False)
        host.peers.add(joiner.allocation_id)
        joiner.peers.add(host_id)
        joiner.connected_at = now
        self.connections += 1
        self._install_routes(host, joiner)
        self._outbox.append((m.Accepted(host_id, joiner.allocation_id).encode(), addr))
        self._events.append(
            PeerConnected(host_id, joiner.allocation_id, len(host.peers))
        )

    def _on_disconnect(self, data: bytes, addr: Address, now: float) -> None:
        sender = self._fixed_size_sender(data, m.DISCONNECT_SIZE, addr, now)
        if sender is None:
            return
        to_id = bytes(data[20:36])
        if to_id not in sender.peers:
            self._drop("not-connected")
            self._error(addr, sender.allocation_id, m.ErrorCode.NOT_CONNECTED, now)
            return
        self._unlink(sender, to_id, "disconnect", now, notify=True)

    def _on_relay(self, data: bytes, addr: Address, now: float) -> None:
        if len(data) < m.RELAY_HEADER_SIZE:
            self._drop("bad-size")
            return
        if len(data) != m.RELAY_HEADER_SIZE + int.from_bytes(data[36:38], "big"):
            self._drop("bad-length")
            return
        sender = self._sender(bytes(data[4:20]), addr, now)
        if sender is None:
            return
        to_id = bytes(data[20:36])
        if to_id == sender.allocation_id:
            self._drop("self-relay")
            self._error(
                addr, sender.allocation_id, m.ErrorCode.SELF_CONNECT_NOT_ALLOWED, now
            )
            return
        if to_id not in sender.peers:
            self._drop("not-connected")
            self._error(addr, sender.allocation_id, m.ErrorCode.NOT_CONNECTED, now)
            return
        # Connected but no route: the route is suspended for exceeding its rate.
        self._drop("rate-limited")

    def _on_close(self, data: bytes, addr: Address, now: float) -> None:
        alloc = self._fixed_size_sender(data, m.CLOSE_SIZE, addr, now)
        if alloc is not None:
            self._end(alloc, "closed", now, notify=False)

    # ------------------------------------------------------------- helpers

    def _route_key(self, source: Allocation, target: Allocation) -> RouteKey:
        return (
            source.address,
            m.relay_route(source.allocation_id, target.allocation_id),
        )

    def _install_routes(self, a: Allocation, b: Allocation) -> None:
        for source, target in ((a, b), (b, a)):
            key = self._route_key(source, target)
            forward = self._forwarding.install(key, target.address, source.address)
            self._links[key] = Route(forward, source, target)

    def _remove_routes(self, a: Allocation, b: Allocation) -> None:
        for key in (self._route_key(a, b), self._route_key(b, a)):
            route = self._links.pop(key, None)
            if route is not None:
                route.forward.remove()
            if route is None:
                suspended = self._suspended.pop(key, None)
                route = suspended[0] if suspended else None
            if route is not None:
                self.relayed_packets += route.packets - route.seen_packets
                self.relayed_octets += route.octets - route.seen_octets
                source, target = route.source, route.target
                source.sent = (
                    source.sent[0] + route.packets,
                    source.sent[1] + route.octets,
                )
                target.received = (
                    target.received[0] + route.packets,
                    target.received[1] + route.octets,
                )

    def reroute(self, allocation_id: bytes) -> bool:
        """Make the forwarding entries of every link of one allocation again
        (through the transport's factory, which decides their kind: a link
        under QA impairment leaves the data plane). Counters carry over as on
        a rebind. False when no such allocation."""
        alloc = self.allocations.get(allocation_id)
        if alloc is None:
            return False
        self._move(alloc, alloc.address)
        return True

    def _move(self, alloc: Allocation, addr: Address) -> None:
        peers = [self.allocations[p] for p in alloc.peers if p in self.allocations]
        for peer in peers:
            self._remove_routes(alloc, peer)
        alloc.address = addr
        for peer in peers:
            self._install_routes(alloc, peer)

    def _unlink(
        self, a: Allocation, b_id: bytes, reason: str, now: float, *, notify: bool
    ) -> None:
        """End the link between ``a`` and ``b_id``; ``notify`` tells ``b``."""
        b = self.allocations.get(b_id)
        a.peers.discard(b_id)
        if b is None:
            return
        b.peers.discard(a.allocation_id)
        self._remove_routes(a, b)
        self.connections -= 1
        if notify:
            b.last_activity = now
            self._outbox.append(
                (m.Disconnect(a.allocation_id, b.allocation_id).encode(), b.address)
            )
        host, joiner = (a, b) if a.is_host else (b, a)
        self._events.append(
            PeerDisconnected(
                host.allocation_id,
                joiner.allocation_id,
                len(host.peers),
                reason,
                joiner_sent=joiner.sent,
                joiner_received=joiner.received,
                host_address=host.address,
                joiner_address=joiner.address,
                connected_for=now - joiner.connected_at,
            )
        )
        joiner.sent = joiner.received = (0, 0)

    def _end(self, alloc: Allocation, reason: str, now: float, *, notify: bool) -> None:
        """Remove ``alloc``; tell its client (timeouts) and its peers."""
        if self.allocations.pop(alloc.allocation_id, None) is None:
            return
        if alloc.admitted:
            alloc.admitted = False
            self.admission.release(alloc.address[0])
        if reason != "closed":
            # Ended by the node, not by its client's CLOSE.
            self.admission.closed(reason)
        self.load -= alloc.weight
        self._ended[alloc.allocation_id] = alloc.bind_deadline
        self.ended_total[reason] = self.ended_total.get(reason, 0) + 1
        if notify:
            # Docs: on a timeout the relay "sends the client a timeout error".
            self._send_error(
                alloc.address, alloc.allocation_id, m.ErrorCode.PLAYER_TIMED_OUT
            )
        peers = [
            self.allocations[p] for p in list(alloc.peers) if p in self.allocations
        ]
        for peer in peers:
            self._unlink(alloc, peer.allocation_id, reason, now, notify=True)
        self._events.append(
            AllocationEnded(
                alloc.allocation_id, alloc.host_allocation_id, alloc.is_host, reason
            )
        )
        if alloc.is_host:
            for peer in peers:
                self._end(peer, "host-ended", now, notify=False)

    def _client_allowed(self, addr: Address) -> bool:
        """Whether the policy lets ``addr`` bind; a refusal is counted (drop
        reason ``client-<verdict>``) and reported as :class:`ClientRefused`."""
        verdict = self.config.policy.judge(addr[0])
        if verdict == Verdict.ALLOWED:
            return True
        self._drop(f"client-{verdict.reason}")
        self._events.append(ClientRefused(addr, verdict))
        return False

    def _drop(self, reason: str) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + 1

    def _error(
        self, addr: Address, allocation_id: bytes, code: m.ErrorCode, now: float
    ) -> None:
        """Answer with ERROR, unless the source is over its error budget."""
        if not self.config.policy.permits(addr[0]):
            return
        if not self._take(
            self._error_buckets,
            addr[0],
            now,
            self.config.error_rate,
            self.config.error_burst,
        ):
            self._drop("error-rate-limited")
            return
        if not self.reflection.allow(addr[0], m.ERROR_SIZE, now):
            self._drop(DROP_REFLECTION)
            return
        self._send_error(addr, allocation_id, code)

    def _send_error(
        self, addr: Address, allocation_id: bytes, code: m.ErrorCode
    ) -> None:
        self.errors_sent[code] = self.errors_sent.get(code, 0) + 1
        self._outbox.append((m.Error(allocation_id, code).encode(), addr))

    def _take(
        self,
        buckets: dict[str, list[float]],
        source: str,
        now: float,
        rate: float,
        burst: float,
    ) -> bool:
        """Token bucket per source IP; True when a token was available."""
        bucket = buckets.get(source)
        if bucket is None:
            if len(buckets) >= self.config.max_tracked_sources:
                del buckets[next(iter(buckets))]
            bucket = buckets[source] = [burst, now]
        return spend_token(bucket, now, rate, burst)
