"""A RakNet 4 server peer (protocol 6), sans-I/O (reference raknet-wire.md §1-2).

Theory of operation
-------------------
One :class:`RakNetServer` owns every RakNet connection of one UDP socket.

1. **Offline messages** carry the 16-byte magic and need no connection:
   an unconnected ping (``01``/``02``) gets a pong of the same size; an
   out-of-band datagram (``0d``) becomes an :class:`OutOfBandReceived` event.
2. **Handshake.** ``OPEN_CONNECTION_REQUEST_1`` is padded by the client to
   the MTU it is trying; a protocol other than 6 gets
   ``INCOMPATIBLE_PROTOCOL_VERSION``, else ``REPLY_1`` with that MTU (capped at
   1492; the reply is smaller than the request). Both requests pass a token
   bucket per source (an IPv4 address or IPv6 /64) *before* the global one, so
   one flooding address takes its own share of the handshake rate, not
   everyone's. ``REQUEST_2`` (MTU, client GUID) proves nothing about its source
   address (RakNet has no cookie without its optional security), so it only
   leaves a :class:`Handshake` record: address, GUID, MTU, time; no
   reliability layer, no buffer. Records live :data:`HANDSHAKE_DEADLINE_MS`
   and are a bounded table that never refuses: a source over its share, or a
   full table, pushes out its (or the) oldest record, and a new ``REQUEST_2``
   with another GUID from the same address replaces the record. A spoofed
   ``REQUEST_2`` can therefore cost the real owner of an address at most a
   retry; it can never lock it out.
3. **Connection.** The client's reliable ``CONNECTION_REQUEST`` (the first
   datagram that comes back from the address that got ``REPLY_2``) turns the
   record into a :class:`Connection` with a :class:`ReliabilityLayer`, admitted
   by the connection table (caps per source and in total; when full, the
   oldest connection still waiting for ``NEW_INCOMING_CONNECTION`` gives way;
   if every one is connected the ``REQUEST_2`` was already answered with
   ``NO_FREE_INCOMING_CONNECTIONS``). It is answered with
   ``CONNECTION_REQUEST_ACCEPTED`` (the client's address as seen, which
   RakNet clients adopt as their external address), and the client's
   ``NEW_INCOMING_CONNECTION`` (which lists its LAN addresses) completes it:
   :class:`Connected`. Until then the connection holds nothing its peer sends
   (no split part, no frame out of order) and must complete within
   :data:`CONNECT_DEADLINE_MS` of its ``REQUEST_2``, whatever it sends.
   Every answer to an address that is not connected is charged to the
   reflection budget (:mod:`crossroads.proto.reflection`).
4. **Connected.** ``CONNECTED_PING`` is answered with a pong stamped from the
   same millisecond clock as every other time this server sends (clients
   derive their clock offset from it, and NAT punchthrough's CONNECT_AT_TIME
   depends on that). ``DISCONNECTION_NOTIFICATION`` ends the connection. Any
   other message is a :class:`MessageReceived` for the plugins; a message no
   plugin knows is ignored, as a stock RakPeer without that plugin does.
5. **Liveness** (RakPeer.cpp:247-249, 5857-5867): a connection that sends
   nothing for 10 s, or leaves a reliable message unacknowledged for 10 s, is
   lost (:class:`Disconnected`); when nothing reliable went out for 5 s the
   server sends a reliable ``CONNECTED_PING`` so that a silent peer is noticed.

What a peer makes the server hold is accounted in two tables
(:class:`~crossroads.proto.admission.Table`;
the process's :class:`crossroads.transport.admission.Admission` in
production): ``handshakes`` (records, :data:`HANDSHAKE_BYTES` each) and
``connections`` (:data:`CONNECTION_BYTES` each, plus the split parts, frames
out of order and reliable numbers ahead that their layers charge with their
overhead, and what they hold to send: queued messages, the resend buffer and
the ACK records of sent datagrams). A peer that does not take what it is sent
(never ACKs) cannot make the server hold more than its layer's
``MAX_SEND_BYTES`` or the table's share: its unreliable messages are dropped
first, and when a reliable one still does not fit the connection is lost
(``send-memory``, counted in the table's closes), as RakNet loses a peer
that stops ACKing (``ID_CONNECTION_LOST``).

The one timer: every 50 ms while reliable messages are in flight (resends),
else every 500 ms while connections exist (liveness sweep).

Malformed datagrams are dropped and counted by reason in :attr:`stats`; a
connection that breaks a bound of the reliability layer is closed.
"""

from __future__ import annotations

import secrets
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from crossroads.errors import DecodeError
from crossroads.proto.admission import LocalTable, Table
from crossroads.proto.budget import BudgetConfig, FailureBudget, source_key
from crossroads.proto.core import Datagram, EventQueue, Outbox
from crossroads.proto.raknet import messages as m
from crossroads.proto.raknet.bitstream import UNASSIGNED_ADDRESS
from crossroads.proto.raknet.messages import MessageId
from crossroads.proto.raknet.reliability import (
    DATAGRAM_HEADER,
    FLAG_ACK,
    FLAG_NAK,
    LimitExceeded,
    Reliability,
    ReliabilityLayer,
    decode_frames,
)
from crossroads.proto.reflection import DROP_REFLECTION, ReflectionBudget
from crossroads.types import Address, frozen

#: Reasons (``crossroads_raknet_dropped{reason}``) of the send side: an
#: unreliable message dropped for want of room, one dropped after RakNet's
#: unreliable timeout, a connection lost because its reliable backlog did not
#: fit (reliability.py: MAX_SEND_BYTES and the connection table's memory).
DROP_UNRELIABLE = "send-unreliable"
DROP_UNRELIABLE_TIMEOUT = "send-unreliable-timeout"
DROP_SEND_MEMORY = "send-memory"
#: ``defaultTimeoutTime`` 10 000 ms in release builds (RakPeer.cpp:247-249).
TIMEOUT_MS = 10_000
#: Resend check interval while reliable data is in flight; RakNet's update
#: thread runs every 10 ms, 50 ms keeps a Python server cheap and is well
#: under the 100 ms minimum RTO.
RESEND_TICK = 0.05
#: Liveness sweep interval: timeouts are 10 s, so 0.5 s is precise enough.
SWEEP_TICK = 0.5
#: A closed connection lingers this long so its DISCONNECTION_NOTIFICATION can
#: be resent if lost.
CLOSE_LINGER_MS = 1000
#: How long a handshake record waits for CONNECTION_REQUEST. The client sends
#: it as soon as REPLY_2 arrives, reliably: before any round trip is measured
#: RakNet resends after 2 s (CCRakNetSlidingWindow::GetRTOForRetransmission,
#: maxThreshold 2000), so 5 s is the first try and two resends. A same-GUID
#: REQUEST_2 retry (every 500 ms: RakPeerInterface.h Connect's
#: timeBetweenSendConnectionAttemptsMS) starts it again.
HANDSHAKE_DEADLINE_MS = 5_000
#: RakNet's own bound for a connection that is not connected yet:
#: UNVERIFIED_SENDER / HANDLING_CONNECTION_REQUEST systems are dropped 10 s
#: after the REQUEST_2 that created them, whatever they send
#: (RakPeer.cpp:5876-5881).
CONNECT_DEADLINE_MS = 10_000
#: Measured fixed memory of one handshake record (the slotted record, its
#: address tuple, its slots in the dicts that index it: ~680 bytes), and of
#: one connection after its handshake (Connection, ReliabilityLayer with its
#: 32-channel tables, the ACK bookkeeping of a few datagrams, its index
#: entries: ~6,700 bytes); CPython 3.11, 64-bit, ``tracemalloc``, checked by
#: tests/proto/raknet/test_peer.py::test_per_item_costs_cover_what_is_held.
HANDSHAKE_BYTES = 768
CONNECTION_BYTES = 8_192
#: A source's default share of the handshake rate: an eighth, as a source's
#: share of any table (PER_SOURCE_FRACTION, transport/admission.py). 125/s of
#: the default 1,000/s is far above the one or two requests per 500 ms a
#: connecting RakNet client sends, and eight sources are needed to take the
#: global rate from everyone else.
SOURCE_RATE_FRACTION = 1 / 8
#: Handshake sources whose token buckets are remembered (least recently used
#: forgotten first: its bucket refills, the global bucket still bounds it):
#: ~250 bytes each, ~4 MB at most.
MAX_RATE_SOURCES = 16_384


@frozen
class ServerConfig:
    """Bounds and identity of one server peer."""

    #: ``SetMaximumIncomingConnections``.
    max_connections: int = 4096
    #: Connections (including handshakes) one IP may hold.
    max_connections_per_ip: int = 16
    #: OPEN_CONNECTION_REQUEST_1/2 answered per second, all sources together.
    handshakes_per_second: float = 1000.0
    #: ... and per source (IPv4 address or IPv6 /64), checked first; 0: an
    #: eighth of the global rate (:data:`SOURCE_RATE_FRACTION`).
    handshakes_per_second_per_ip: float = 0.0
    #: Bytes the connections may hold for their peers, all together, when the
    #: core is built without a process budget (unit tests, tools).
    split_budget: int = 64 * 1024 * 1024
    #: Addresses sent in CONNECTION_REQUEST_ACCEPTED as the server's own
    #: (at most 10); empty: the address the client dialled.
    local_addresses: tuple[Address, ...] = ()
    #: ``SetOfflinePingResponse`` data appended to unconnected pongs.
    offline_ping_response: bytes = b""
    #: Silence after which a connection is lost; a reliable keep-alive ping
    #: goes out when nothing reliable was sent for half of it
    #: (RakPeer.cpp:5857-5867).
    timeout_ms: int = TIMEOUT_MS


@frozen
class Connected:
    guid: int
    address: Address
    #: The client's own idea of its addresses (NEW_INCOMING_CONNECTION).
    internal_addresses: tuple[Address, ...]


@frozen
class Disconnected:
    guid: int
    address: Address
    #: ``closed`` (the peer said so), ``timeout``, ``limit`` (it broke a bound),
    #: ``local`` (this server closed it).
    reason: str


@frozen
class MessageReceived:
    guid: int
    address: Address
    payload: bytes


@frozen
class OutOfBandReceived:
    guid: int
    address: Address
    payload: bytes


Event = Connected | Disconnected | MessageReceived | OutOfBandReceived


class State(Enum):
    #: CONNECTION_REQUEST is being handled (only within one datagram).
    HANDSHAKE = "handshake"
    REQUESTED = "requested"
    CONNECTED = "connected"
    CLOSING = "closing"


@dataclass(eq=False, slots=True)
class Handshake:
    """What REQUEST_2 leaves: no layer, no buffer (see the module docstring)."""

    address: Address
    guid: int
    mtu: int
    #: The server address the client dialled (sent back as ours).
    dialled: Address
    created_ms: int


@dataclass(eq=False, slots=True)
class Connection:
    """One remote system (mutable; owned by :class:`RakNetServer`)."""

    address: Address
    guid: int
    mtu: int
    layer: ReliabilityLayer
    #: When its REQUEST_2 arrived (the connect deadline counts from there);
    #: when closing, when it was closed.
    created_ms: int
    system_index: int
    dialled: Address
    state: State = field(default=State.HANDSHAKE, init=False)
    last_receive_ms: int = field(init=False)
    internal_addresses: tuple[Address, ...] = field(default=(), init=False)
    close_reason: str = field(default="", init=False)

    def __post_init__(self) -> None:
        self.last_receive_ms = self.created_ms

    @property
    def rtt_ms(self) -> int | None:
        return self.layer.rtt_ms


@dataclass
class Stats:
    dropped: Counter[str] = field(default_factory=Counter)
    handshakes: int = 0
    connections: int = 0
    messages_in: int = 0
    messages_out: int = 0


class RakNetServer(Outbox[Datagram], EventQueue[Event]):
    """See the module docstring. Time (``now``) is in seconds of a monotonic
    clock; RakNet times on the wire are its milliseconds.

    ``handshakes`` and ``connections`` are the tables that admit and account
    handshake records and connections (default: :class:`LocalTable` s sized
    by ``config``); ``reflection`` charges every answer to an address that is
    not connected (default: none)."""

    def __init__(
        self,
        config: ServerConfig | None = None,
        *,
        guid: int | None = None,
        random_guid: Callable[[], int] = lambda: secrets.randbits(64),
        handshakes: Table | None = None,
        connections: Table | None = None,
        reflection: ReflectionBudget | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg = config or ServerConfig()
        self.guid = guid if guid is not None else random_guid()
        self.stats = Stats()
        self.handshake_table: Table = handshakes or LocalTable(
            cfg.max_connections, cfg.max_connections_per_ip
        )
        self.connection_table: Table = connections or LocalTable(
            cfg.max_connections, cfg.max_connections_per_ip, cfg.split_budget
        )
        self.reflection = ReflectionBudget.or_unlimited(reflection)
        #: Handshake records, oldest first (see the module docstring).
        self.handshakes: OrderedDict[Address, Handshake] = OrderedDict()
        self._handshakes_of: dict[str, dict[Address, None]] = {}
        self.connections: dict[Address, Connection] = {}
        self._connections_of: dict[str, dict[Address, None]] = {}
        #: Connections not connected yet, oldest first: the ones that give way.
        self._unverified: OrderedDict[Address, None] = OrderedDict()
        self._by_guid: dict[int, Address] = {}
        per_source = (
            cfg.handshakes_per_second_per_ip
            or cfg.handshakes_per_second * SOURCE_RATE_FRACTION
        )
        self._rates = FailureBudget(
            BudgetConfig(
                per_source_rate=per_source,
                per_source_burst=max(1.0, per_source),
                global_rate=cfg.handshakes_per_second,
                global_burst=max(1.0, cfg.handshakes_per_second),
            ),
            MAX_RATE_SOURCES,
        )
        self._dirty: set[Address] = set()
        self._tick: float | None = None
        self._next_sweep = 0.0
        self._next_index = 0
        #: Whether some connection had reliable data in flight when last seen.
        self._busy = False
        #: The time of the latest input (for answers plugins send).
        self._now = 0.0

    # ------------------------------------------------------------ core API

    def receive_datagram(self, data: bytes, addr: Address, now: float) -> None:
        self._now = now
        if not data:
            self.stats.dropped["empty"] += 1
            return
        now_ms = int(now * 1000)
        try:
            conn = self.connections.get(addr)
            if conn is None or conn.state is not State.CONNECTED:
                self.reflection.received(addr[0], len(data), now)
            if m.is_offline(data):
                self._offline(data, addr, conn, now)
            elif conn is not None:
                if data[0] & 0x80:
                    self._connected(conn, data, now_ms)
                else:
                    self.stats.dropped["not-raknet"] += 1
            else:
                record = self.handshakes.get(addr)
                if record is None:
                    self.stats.dropped["unknown-source"] += 1
                elif data[0] & 0x80:
                    self._promote(record, data, now_ms)
                else:
                    self.stats.dropped["not-raknet"] += 1
        except LimitExceeded as exc:
            conn = self.connections.get(addr)
            if conn is not None:
                self._over_limit(conn, exc)
            else:
                self.stats.dropped[exc.reason] += 1
        except DecodeError as exc:
            self.stats.dropped[exc.reason] += 1
        self._schedule(now)

    def datagrams_to_send(self, now: float) -> list[tuple[bytes, Address]]:
        now_ms = int(now * 1000)
        out = super().datagrams_to_send(now)
        reflection = self.reflection
        for addr in self._dirty:
            conn = self.connections.get(addr)
            if conn is None:
                continue
            unverified = conn.state in (State.HANDSHAKE, State.REQUESTED)
            for data in conn.layer.datagrams(now_ms):
                if unverified and not reflection.allow(addr[0], len(data), now):
                    # Lost like any datagram: what is reliable goes again.
                    self.stats.dropped[DROP_REFLECTION] += 1
                    continue
                out.append((data, addr))
            if conn.layer.in_flight:
                self._busy = True
        self._dirty.clear()
        self._schedule(now)
        return out

    def get_timer(self) -> float | None:
        return self._tick

    def handle_timer(self, now: float) -> None:
        if self._tick is None or now < self._tick:
            return
        self._tick = None
        self._now = now
        now_ms = int(now * 1000)
        self._busy = False
        for addr, conn in self.connections.items():
            due = conn.layer.next_resend_ms()
            if due is not None:
                self._busy = True
                if due <= now_ms:
                    self._dirty.add(addr)
        if now >= self._next_sweep:
            self._next_sweep = now + SWEEP_TICK
            self._sweep(now_ms)
        self._schedule(now)

    # ------------------------------------------------------------ for plugins

    def send(
        self,
        addr: Address,
        payload: bytes,
        reliability: Reliability = Reliability.RELIABLE_ORDERED,
        channel: int = 0,
        *,
        now: float,
    ) -> bool:
        """Queue a message to a connected system; False if it is not connected
        (or its send queue is full, which closes it)."""
        conn = self.connections.get(addr)
        if conn is None or conn.state is not State.CONNECTED:
            return False
        try:
            queued = conn.layer.send(payload, reliability, channel, int(now * 1000))
        except LimitExceeded as exc:
            self._over_limit(conn, exc)
            return False
        if not queued:
            self.stats.dropped[DROP_UNRELIABLE] += 1
            return False
        self.stats.messages_out += 1
        self._dirty.add(addr)
        self._schedule(now)
        return True

    def send_out_of_band(self, addr: Address, payload: bytes) -> None:
        """An ``0d`` datagram with this server's GUID (no connection needed;
        charged to the reflection budget unless ``addr`` is connected)."""
        data = m.OutOfBand(self.guid, payload).encode()
        if self.connection(addr) is not None:
            self._outbox.append((data, addr))
        else:
            self._reply(data, addr)

    def send_raw(self, addr: Address, data: bytes) -> None:
        self._outbox.append((data, addr))

    def close(self, addr: Address, now: float) -> None:
        """Send DISCONNECTION_NOTIFICATION and forget the connection."""
        conn = self.connections.get(addr)
        if conn is None:
            return
        if conn.state is State.CONNECTED:
            try:
                conn.layer.send(
                    bytes([MessageId.DISCONNECTION_NOTIFICATION]),
                    Reliability.RELIABLE_ORDERED,
                    0,
                    int(now * 1000),
                )
            except LimitExceeded:
                # No room for the notification behind its backlog: closed
                # without one, as RakNet closes a lost connection.
                self._drop(conn, "local")
                self._forget(conn)
                self._schedule(now)
                return
            self._dirty.add(addr)
        self._drop(conn, "local")
        if addr in self.connections:
            conn.state = State.CLOSING
            conn.created_ms = int(now * 1000)
        self._schedule(now)

    def address_of(self, guid: int) -> Address | None:
        """The address of the connected system with this GUID."""
        addr = self._by_guid.get(guid)
        if addr is None:
            return None
        conn = self.connections.get(addr)
        return addr if conn is not None and conn.state is State.CONNECTED else None

    def connection(self, addr: Address) -> Connection | None:
        conn = self.connections.get(addr)
        return conn if conn is not None and conn.state is State.CONNECTED else None

    @property
    def connected_count(self) -> int:
        return sum(1 for c in self.connections.values() if c.state is State.CONNECTED)

    @property
    def buffered_bytes(self) -> int:
        """Bytes the connections' layers hold for their peers (charged with
        their overhead)."""
        return sum(c.layer.charged for c in self.connections.values())

    #: The older name (split reassembly was all that was counted).
    split_bytes = buffered_bytes

    # --------------------------------------------------------------- offline

    def _reply(self, data: bytes, addr: Address) -> None:
        """Answer an address that has proved nothing: within its reflection
        budget, else dropped and counted."""
        if self.reflection.allow(addr[0], len(data), self._now):
            self._outbox.append((data, addr))
        else:
            self.stats.dropped[DROP_REFLECTION] += 1

    def _offline(
        self, data: bytes, addr: Address, conn: Connection | None, now: float
    ) -> None:
        kind = data[0]
        if kind == MessageId.OUT_OF_BAND_INTERNAL:
            oob = m.OutOfBand.decode(data)
            self._events.append(OutOfBandReceived(oob.guid, addr, oob.payload))
            return
        if kind in (
            MessageId.UNCONNECTED_PING,
            MessageId.UNCONNECTED_PING_OPEN_CONNECTIONS,
        ):
            ping = m.UnconnectedPing.decode(data)
            if ping.open_connections_only and self._slot_for(addr[0]) is not None:
                self.stats.dropped["ping-no-free-slot"] += 1
                return
            # The pong must not be larger than the ping: cap the user data.
            response = self.config.offline_ping_response[: max(0, len(data) - 33)]
            self._reply(m.unconnected_pong(ping.time, self.guid, response), addr)
            return
        if not self._take_token(addr, now):
            return
        if kind == MessageId.OPEN_CONNECTION_REQUEST_1:
            request1 = m.OpenConnectionRequest1.decode(data)
            if request1.protocol != m.PROTOCOL_VERSION:
                self.stats.dropped["protocol-version"] += 1
                self._reply(m.incompatible_protocol(self.guid), addr)
                return
            mtu = min(request1.mtu, m.MAXIMUM_MTU)
            self._reply(m.open_connection_reply_1(self.guid, mtu), addr)
            return
        request2 = m.OpenConnectionRequest2.decode(data)
        self._open(request2, addr, conn, int(now * 1000))

    def _take_token(self, addr: Address, now: float) -> bool:
        """One handshake request's token: the source's bucket first, then the
        global one (each refusal counted by which bucket was empty)."""
        rates = self._rates
        before = rates.refused_source
        if rates.try_spend(addr[0], now):
            return True
        if rates.refused_source > before:
            self.stats.dropped["handshake-ip-rate"] += 1
        else:
            self.stats.dropped["handshake-rate"] += 1
        return False

    def _open(
        self,
        request: m.OpenConnectionRequest2,
        addr: Address,
        conn: Connection | None,
        now_ms: int,
    ) -> None:
        mtu = min(request.mtu, m.MAXIMUM_MTU)
        if mtu < m.MINIMUM_MTU:
            raise DecodeError("MTU below RakNet's smallest", "bad-mtu")
        if conn is not None:
            # RakNet answers ALREADY_CONNECTED to a REQUEST_2 from an address
            # past its handshake (RakPeer.cpp:5254-5290).
            self._refuse(MessageId.ALREADY_CONNECTED, addr, "already-connected")
            return
        if request.guid in self._by_guid:
            self._refuse(MessageId.ALREADY_CONNECTED, addr, "guid-in-use")
            return
        host = addr[0]
        record = self.handshakes.get(addr)
        if record is not None:
            # The client's retry after a lost REPLY_2, or a new REQUEST_2 on
            # this address: the newest one wins (a forged one cannot keep the
            # address's owner out), and its deadline starts again.
            record.guid = request.guid
            record.mtu = mtu
            record.dialled = request.server_address
            record.created_ms = now_ms
            self.handshakes.move_to_end(addr)
            mine = self._handshakes_of[source_key(host)]
            del mine[addr]
            mine[addr] = None
            self._reply(m.open_connection_reply_2(self.guid, addr, mtu), addr)
            return
        full = self._slot_for(host)
        if full is not None:
            self._refuse(MessageId.NO_FREE_INCOMING_CONNECTIONS, addr, full)
            return
        self._make_room_for_handshake(host)
        refused = self.handshake_table.admit(host)
        if refused is not None:
            self._refuse(
                MessageId.NO_FREE_INCOMING_CONNECTIONS, addr, f"handshake-{refused}"
            )
            return
        record = Handshake(addr, request.guid, mtu, request.server_address, now_ms)
        self.handshakes[addr] = record
        self._handshakes_of.setdefault(source_key(host), {})[addr] = None
        self.stats.handshakes += 1
        self._reply(m.open_connection_reply_2(self.guid, addr, mtu), addr)

    def _refuse(self, kind: MessageId, addr: Address, reason: str) -> None:
        self.stats.dropped[reason] += 1
        self._reply(m.handshake_refusal(kind, self.guid), addr)

    # ------------------------------------------------------------ the tables

    def _slot_for(self, host: str) -> str | None:
        """Why a connection from ``host`` could not be admitted now (None: it
        could, if need be in place of one that is not connected yet)."""
        table = self.connection_table
        mine = self._connections_of.get(source_key(host))
        if (
            mine is not None
            and len(mine) >= table.max_per_source
            and not any(a in self._unverified for a in mine)
        ):
            return "ip-full"
        if len(self.connections) >= table.max_items and not self._unverified:
            return "server-full"
        return None

    def _make_room_for_handshake(self, host: str) -> None:
        """A source over its share of records, or a full table, loses its (or
        the) oldest record: records never refuse a new handshake."""
        table = self.handshake_table
        mine = self._handshakes_of.get(source_key(host))
        if mine is not None and len(mine) >= table.max_per_source:
            self._forget_handshake(self.handshakes[next(iter(mine))], "evicted")
        if len(self.handshakes) >= table.max_items:
            self._forget_handshake(next(iter(self.handshakes.values())), "evicted")

    def _make_room_for_connection(self, host: str) -> str | None:
        """Free a slot for a connection from ``host`` by ending the oldest
        connection not connected yet (of the source, or of all) when a cap is
        reached; the reason when there is none to end."""
        table = self.connection_table
        mine = self._connections_of.get(source_key(host))
        if mine is not None and len(mine) >= table.max_per_source:
            victim = next((a for a in mine if a in self._unverified), None)
            if victim is None:
                return "ip-full"
            self._evict(self.connections[victim])
        if len(self.connections) >= table.max_items:
            if not self._unverified:
                return "server-full"
            self._evict(self.connections[next(iter(self._unverified))])
        return None

    def _evict(self, conn: Connection) -> None:
        self.stats.dropped["connect-evicted"] += 1
        self.connection_table.closed("evicted")
        self._forget(conn)

    def _forget_handshake(self, record: Handshake, reason: str) -> None:
        """Remove a record: promoted (``reason`` empty), or ended for ``reason``."""
        addr = record.address
        if self.handshakes.pop(addr, None) is None:
            return
        key = source_key(addr[0])
        mine = self._handshakes_of.get(key)
        if mine is not None:
            mine.pop(addr, None)
            if not mine:
                del self._handshakes_of[key]
        self.handshake_table.release(addr[0])
        if reason:
            self.stats.dropped[f"handshake-{reason}"] += 1
            self.handshake_table.closed(reason)

    def _promote(self, record: Handshake, data: bytes, now_ms: int) -> None:
        """The first connected datagram from a handshake record's address:
        a connection if it carries CONNECTION_REQUEST, else dropped (nothing
        is kept for it)."""
        if data[0] & (FLAG_ACK | FLAG_NAK) or len(data) < DATAGRAM_HEADER:
            self.stats.dropped["before-connection-request"] += 1
            return
        request: m.ConnectionRequest | None = None
        for frame in decode_frames(data, DATAGRAM_HEADER):
            if (
                not frame.split_count
                and frame.payload[0] == MessageId.CONNECTION_REQUEST
            ):
                request = m.ConnectionRequest.decode(frame.payload)
                break
        if request is None:
            self.stats.dropped["before-connection-request"] += 1
            return
        addr = record.address
        if request.secure:
            # RakNet's optional security is not offered (REPLY_2 says so).
            self.stats.dropped["bad-connection-request"] += 1
            self._forget_handshake(record, "refused")
            return
        # RakNet reads the client's GUID here without comparing it with the
        # REQUEST_2's (RakPeer.cpp ParseConnectionRequestPacket): a REQUEST_2
        # forged onto this address cannot make the real client's fail.
        if request.guid in self._by_guid:
            self.stats.dropped["guid-in-use"] += 1
            self._forget_handshake(record, "refused")
            return
        host = addr[0]
        full = self._make_room_for_connection(host)
        if full is None:
            full = self.connection_table.admit(host)
        if full is not None:
            self.stats.dropped[full] += 1
            self._forget_handshake(record, "refused")
            return
        self._forget_handshake(record, "")
        index = self._next_index
        self._next_index = (index + 1) % 65536
        conn = Connection(
            addr,
            request.guid,
            record.mtu,
            ReliabilityLayer(record.mtu, self.connection_table, buffering=False),
            record.created_ms,
            index,
            record.dialled,
        )
        self.connections[addr] = conn
        self._connections_of.setdefault(source_key(host), {})[addr] = None
        self._unverified[addr] = None
        self._by_guid[request.guid] = addr
        self._connected(conn, data, now_ms)

    # ------------------------------------------------------------- connected

    def _connected(self, conn: Connection, data: bytes, now_ms: int) -> None:
        if conn.state is State.CLOSING:
            conn.layer.receive(data, now_ms)  # ACKs for the notification
            self._dirty.add(conn.address)
            return
        layer = conn.layer
        held_back = layer.held_back
        messages = layer.receive(data, now_ms)
        if layer.held_back != held_back:
            self.stats.dropped["held-back-before-connected"] += 1
        conn.last_receive_ms = now_ms
        self._dirty.add(conn.address)
        for payload in messages:
            self._message(conn, payload, now_ms)
            if self.connections.get(conn.address) is not conn:
                return

    def _message(self, conn: Connection, payload: bytes, now_ms: int) -> None:
        kind = payload[0]
        if kind == MessageId.CONNECTED_PING:
            if len(payload) >= 9:
                ping_time = int.from_bytes(payload[1:9], "big")
                if not conn.layer.send(
                    m.connected_pong(ping_time, now_ms),
                    Reliability.UNRELIABLE,
                    0,
                    now_ms,
                ):
                    self.stats.dropped[DROP_UNRELIABLE] += 1
            return
        if kind in (MessageId.CONNECTED_PONG, MessageId.DETECT_LOST_CONNECTIONS):
            return
        if kind == MessageId.DISCONNECTION_NOTIFICATION:
            self._drop(conn, "closed")
            return
        if conn.state is State.HANDSHAKE:
            if kind != MessageId.CONNECTION_REQUEST:
                self.stats.dropped["before-connection-request"] += 1
                return
            request = m.ConnectionRequest.decode(payload)
            if request.guid != conn.guid or request.secure:
                self.stats.dropped["bad-connection-request"] += 1
                self._drop(conn, "limit")
                return
            local = list(self.config.local_addresses) or [conn.dialled]
            conn.layer.send(
                m.connection_request_accepted(
                    conn.address, conn.system_index, local, request.time, now_ms
                ),
                Reliability.RELIABLE_ORDERED,
                0,
                now_ms,
            )
            conn.state = State.REQUESTED
            return
        if conn.state is State.REQUESTED:
            if kind == MessageId.CONNECTION_REQUEST:
                return  # a duplicate under a new reliable number: already answered
            if kind != MessageId.NEW_INCOMING_CONNECTION:
                self.stats.dropped["before-new-incoming-connection"] += 1
                return
            incoming = m.NewIncomingConnection.decode(payload)
            conn.internal_addresses = tuple(
                a for a in incoming.internal_addresses if a != UNASSIGNED_ADDRESS
            )
            conn.state = State.CONNECTED
            conn.layer.buffering = True
            self._unverified.pop(conn.address, None)
            self.stats.connections += 1
            self._events.append(
                Connected(conn.guid, conn.address, conn.internal_addresses)
            )
            return
        if kind in (MessageId.CONNECTION_REQUEST, MessageId.NEW_INCOMING_CONNECTION):
            return  # duplicates of the handshake
        self.stats.messages_in += 1
        self._events.append(MessageReceived(conn.guid, conn.address, payload))

    # ---------------------------------------------------------------- timers

    def _sweep(self, now_ms: int) -> None:
        # Records are in the order of their deadlines (a refreshed one moves
        # to the end): only the expired ones are looked at.
        while self.handshakes:
            record = next(iter(self.handshakes.values()))
            if now_ms - record.created_ms <= HANDSHAKE_DEADLINE_MS:
                break
            self._forget_handshake(record, "deadline")
        timeout = self.config.timeout_ms
        for conn in list(self.connections.values()):
            if conn.state is State.CLOSING:
                if (
                    conn.layer.in_flight == 0
                    or now_ms - conn.created_ms > CLOSE_LINGER_MS
                ):
                    self._forget(conn)
                continue
            if conn.state is not State.CONNECTED:
                # Whatever it sends: a deadline, not a silence timeout.
                if now_ms - conn.created_ms > CONNECT_DEADLINE_MS:
                    self.stats.dropped["connect-deadline"] += 1
                    self.connection_table.closed("deadline")
                    self._forget(conn)
                continue
            oldest = conn.layer.oldest_unacked_ms()
            if now_ms - conn.last_receive_ms > timeout or (
                oldest is not None and now_ms - oldest > timeout
            ):
                self.stats.dropped["timeout"] += 1
                self._drop(conn, "timeout")
                continue
            culled = conn.layer.cull_unreliable(now_ms)
            if culled:
                self.stats.dropped[DROP_UNRELIABLE_TIMEOUT] += culled
            if now_ms - conn.layer.last_reliable_send_ms > timeout // 2:
                try:
                    conn.layer.send(
                        m.connected_ping(now_ms), Reliability.RELIABLE, 0, now_ms
                    )
                except LimitExceeded as exc:
                    self._over_limit(conn, exc)
                    continue
                self._dirty.add(conn.address)

    def _schedule(self, now: float) -> None:
        if not self.connections and not self.handshakes:
            self._tick = None
            return
        step = RESEND_TICK if self._busy else SWEEP_TICK
        desired = now + step
        if self._tick is None or desired < self._tick:
            self._tick = desired

    # ------------------------------------------------------------- teardown

    def _over_limit(self, conn: Connection, exc: LimitExceeded) -> None:
        """``conn`` broke a bound (``exc.reason``): counted and closed. A
        reliable backlog that cannot be held (``send-memory``) is also counted
        as a close of the connection table: RakNet's ID_CONNECTION_LOST
        (RakPeer.cpp:5874-5901), without a DISCONNECTION_NOTIFICATION, which
        could only wait behind that backlog."""
        self.stats.dropped[exc.reason] += 1
        if exc.reason == DROP_SEND_MEMORY:
            self.connection_table.closed(DROP_SEND_MEMORY)
        self._drop(conn, "limit")

    def _drop(self, conn: Connection, reason: str) -> None:
        """End a connection: event if it was connected; linger if closing."""
        if conn.state is State.CONNECTED:
            self._events.append(Disconnected(conn.guid, conn.address, reason))
        if reason == "local" and conn.state is State.CONNECTED:
            return  # close() keeps it for the notification's ACK
        self._forget(conn)

    def _forget(self, conn: Connection) -> None:
        addr = conn.address
        if self.connections.pop(addr, None) is None:
            return
        if self._by_guid.get(conn.guid) == addr:
            del self._by_guid[conn.guid]
        key = source_key(addr[0])
        mine = self._connections_of.get(key)
        if mine is not None:
            mine.pop(addr, None)
            if not mine:
                del self._connections_of[key]
        self._unverified.pop(addr, None)
        self.connection_table.release(addr[0])
        conn.layer.release()
        self._dirty.discard(addr)
