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
   1492; the reply is smaller than the request). ``REQUEST_2`` (MTU, client
   GUID) creates the connection, subject to the caps (connections in total and
   per IP: ``NO_FREE_INCOMING_CONNECTIONS``; a GUID already connected from
   elsewhere: ``ALREADY_CONNECTED``) and to a global handshake rate (excess is
   dropped and counted). From then on datagrams from that address go through
   the connection's :class:`ReliabilityLayer`: the client's reliable
   ``CONNECTION_REQUEST`` is answered with ``CONNECTION_REQUEST_ACCEPTED``
   (the client's address as seen, which RakNet clients adopt as their external
   address), and the client's ``NEW_INCOMING_CONNECTION`` (which lists its LAN
   addresses) completes it: :class:`Connected`.
3. **Connected.** ``CONNECTED_PING`` is answered with a pong stamped from the
   same millisecond clock as every other time this server sends (clients
   derive their clock offset from it, and NAT punchthrough's CONNECT_AT_TIME
   depends on that). ``DISCONNECTION_NOTIFICATION`` ends the connection. Any
   other message is a :class:`MessageReceived` for the plugins; a message no
   plugin knows is ignored, as a stock RakPeer without that plugin does.
4. **Liveness** (RakPeer.cpp:247-249, 5857-5867): a connection that sends
   nothing for 10 s, or leaves a reliable message unacknowledged for 10 s, is
   lost (:class:`Disconnected`); when nothing reliable went out for 5 s the
   server sends a reliable ``CONNECTED_PING`` so that a silent peer is noticed.
   Handshakes that do not complete within 10 s are forgotten.

The one timer: every 50 ms while reliable messages are in flight (resends),
else every 500 ms while connections exist (liveness sweep).

Malformed datagrams are dropped and counted by reason in :attr:`stats`; a
connection that breaks a bound of the reliability layer is closed.
"""

from __future__ import annotations

import secrets
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from crossroads.errors import DecodeError
from crossroads.proto.core import Datagram, EventQueue, Outbox
from crossroads.proto.raknet import messages as m
from crossroads.proto.raknet.bitstream import UNASSIGNED_ADDRESS
from crossroads.proto.raknet.messages import MessageId
from crossroads.proto.raknet.reliability import (
    LimitExceeded,
    Reliability,
    ReliabilityLayer,
    SplitBudget,
)
from crossroads.types import Address, frozen

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


@frozen
class ServerConfig:
    """Bounds and identity of one server peer."""

    #: ``SetMaximumIncomingConnections``.
    max_connections: int = 4096
    #: Connections (including handshakes) one IP may hold.
    max_connections_per_ip: int = 16
    #: OPEN_CONNECTION_REQUEST_1/2 answered per second, all sources together.
    handshakes_per_second: float = 1000.0
    #: Split-message reassembly bytes held by all connections together.
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
    HANDSHAKE = "handshake"
    REQUESTED = "requested"
    CONNECTED = "connected"
    CLOSING = "closing"


@dataclass(eq=False, slots=True)
class Connection:
    """One remote system (mutable; owned by :class:`RakNetServer`)."""

    address: Address
    guid: int
    mtu: int
    layer: ReliabilityLayer
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
    clock; RakNet times on the wire are its milliseconds."""

    def __init__(
        self,
        config: ServerConfig | None = None,
        *,
        guid: int | None = None,
        random_guid: Callable[[], int] = lambda: secrets.randbits(64),
    ) -> None:
        super().__init__()
        self.config = config or ServerConfig()
        self.guid = guid if guid is not None else random_guid()
        self.stats = Stats()
        self.connections: dict[Address, Connection] = {}
        self._by_guid: dict[int, Address] = {}
        self._per_ip: Counter[str] = Counter()
        self._budget = SplitBudget(self.config.split_budget)
        self._dirty: set[Address] = set()
        self._tokens = self.config.handshakes_per_second
        self._tokens_at = 0.0
        self._tick: float | None = None
        self._next_sweep = 0.0
        self._next_index = 0
        #: Whether some connection had reliable data in flight when last seen.
        self._busy = False

    # ------------------------------------------------------------ core API

    def receive_datagram(self, data: bytes, addr: Address, now: float) -> None:
        if not data:
            self.stats.dropped["empty"] += 1
            return
        now_ms = int(now * 1000)
        try:
            conn = self.connections.get(addr)
            if m.is_offline(data):
                self._offline(data, addr, conn, now, now_ms)
            elif conn is None:
                self.stats.dropped["unknown-source"] += 1
            elif data[0] & 0x80:
                self._connected(conn, data, now_ms)
            else:
                self.stats.dropped["not-raknet"] += 1
        except LimitExceeded as exc:
            self.stats.dropped[exc.reason] += 1
            conn = self.connections.get(addr)
            if conn is not None:
                self._drop(conn, "limit")
        except DecodeError as exc:
            self.stats.dropped[exc.reason] += 1
        self._schedule(now)

    def datagrams_to_send(self, now: float) -> list[tuple[bytes, Address]]:
        now_ms = int(now * 1000)
        out = super().datagrams_to_send(now)
        for addr in self._dirty:
            conn = self.connections.get(addr)
            if conn is None:
                continue
            for data in conn.layer.datagrams(now_ms):
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
            conn.layer.send(payload, reliability, channel, int(now * 1000))
        except LimitExceeded as exc:
            self.stats.dropped[exc.reason] += 1
            self._drop(conn, "limit")
            return False
        self.stats.messages_out += 1
        self._dirty.add(addr)
        self._schedule(now)
        return True

    def send_out_of_band(self, addr: Address, payload: bytes) -> None:
        """An ``0d`` datagram with this server's GUID (no connection needed)."""
        self._outbox.append((m.OutOfBand(self.guid, payload).encode(), addr))

    def send_raw(self, addr: Address, data: bytes) -> None:
        self._outbox.append((data, addr))

    def close(self, addr: Address, now: float) -> None:
        """Send DISCONNECTION_NOTIFICATION and forget the connection."""
        conn = self.connections.get(addr)
        if conn is None:
            return
        if conn.state is State.CONNECTED:
            conn.layer.send(
                bytes([MessageId.DISCONNECTION_NOTIFICATION]),
                Reliability.RELIABLE_ORDERED,
                0,
                int(now * 1000),
            )
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
    def split_bytes(self) -> int:
        return self._budget.used

    # --------------------------------------------------------------- offline

    def _offline(
        self,
        data: bytes,
        addr: Address,
        conn: Connection | None,
        now: float,
        now_ms: int,
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
            full = len(self.connections) >= self.config.max_connections
            if ping.open_connections_only and full:
                self.stats.dropped["ping-no-free-slot"] += 1
                return
            # The pong must not be larger than the ping: cap the user data.
            response = self.config.offline_ping_response[: max(0, len(data) - 33)]
            self._outbox.append(
                (m.unconnected_pong(ping.time, self.guid, response), addr)
            )
            return
        if not self._take_token(now):
            self.stats.dropped["handshake-rate"] += 1
            return
        if kind == MessageId.OPEN_CONNECTION_REQUEST_1:
            request1 = m.OpenConnectionRequest1.decode(data)
            if request1.protocol != m.PROTOCOL_VERSION:
                self.stats.dropped["protocol-version"] += 1
                self._outbox.append((m.incompatible_protocol(self.guid), addr))
                return
            mtu = min(request1.mtu, m.MAXIMUM_MTU)
            self._outbox.append((m.open_connection_reply_1(self.guid, mtu), addr))
            return
        request2 = m.OpenConnectionRequest2.decode(data)
        self._open(request2, addr, conn, now_ms)

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
            if conn.guid == request.guid and conn.state is State.HANDSHAKE:
                # The client's retry after a lost REPLY_2.
                self._outbox.append(
                    (m.open_connection_reply_2(self.guid, addr, conn.mtu), addr)
                )
                return
            self._refuse(MessageId.ALREADY_CONNECTED, addr, "already-connected")
            return
        if request.guid in self._by_guid:
            self._refuse(MessageId.ALREADY_CONNECTED, addr, "guid-in-use")
            return
        if len(self.connections) >= self.config.max_connections:
            self._refuse(MessageId.NO_FREE_INCOMING_CONNECTIONS, addr, "server-full")
            return
        if self._per_ip[addr[0]] >= self.config.max_connections_per_ip:
            self._refuse(MessageId.NO_FREE_INCOMING_CONNECTIONS, addr, "ip-full")
            return
        index = self._next_index
        self._next_index = (index + 1) % 65536
        conn = Connection(
            addr,
            request.guid,
            mtu,
            ReliabilityLayer(mtu, self._budget),
            now_ms,
            index,
            request.server_address,
        )
        self.connections[addr] = conn
        self._by_guid[request.guid] = addr
        self._per_ip[addr[0]] += 1
        self.stats.handshakes += 1
        self._outbox.append((m.open_connection_reply_2(self.guid, addr, mtu), addr))

    def _refuse(self, kind: MessageId, addr: Address, reason: str) -> None:
        self.stats.dropped[reason] += 1
        self._outbox.append((m.handshake_refusal(kind, self.guid), addr))

    def _take_token(self, now: float) -> bool:
        rate = self.config.handshakes_per_second
        self._tokens = min(rate, self._tokens + (now - self._tokens_at) * rate)
        self._tokens_at = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True

    # ------------------------------------------------------------- connected

    def _connected(self, conn: Connection, data: bytes, now_ms: int) -> None:
        if conn.state is State.CLOSING:
            conn.layer.receive(data, now_ms)  # ACKs for the notification
            self._dirty.add(conn.address)
            return
        messages = conn.layer.receive(data, now_ms)
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
                conn.layer.send(
                    m.connected_pong(ping_time, now_ms),
                    Reliability.UNRELIABLE,
                    0,
                    now_ms,
                )
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
        timeout = self.config.timeout_ms
        for conn in list(self.connections.values()):
            if conn.state is State.CLOSING:
                if (
                    conn.layer.in_flight == 0
                    or now_ms - conn.created_ms > CLOSE_LINGER_MS
                ):
                    self._forget(conn)
                continue
            oldest = conn.layer.oldest_unacked_ms()
            if now_ms - conn.last_receive_ms > timeout or (
                oldest is not None and now_ms - oldest > timeout
            ):
                self.stats.dropped["timeout"] += 1
                self._drop(conn, "timeout")
                continue
            if (
                conn.state is State.CONNECTED
                and now_ms - conn.layer.last_reliable_send_ms > timeout // 2
            ):
                conn.layer.send(
                    m.connected_ping(now_ms), Reliability.RELIABLE, 0, now_ms
                )
                self._dirty.add(conn.address)

    def _schedule(self, now: float) -> None:
        if not self.connections:
            self._tick = None
            return
        step = RESEND_TICK if self._busy else SWEEP_TICK
        desired = now + step
        if self._tick is None or desired < self._tick:
            self._tick = desired

    # ------------------------------------------------------------- teardown

    def _drop(self, conn: Connection, reason: str) -> None:
        """End a connection: event if it was connected; linger if closing."""
        if conn.state is State.CONNECTED:
            self._events.append(Disconnected(conn.guid, conn.address, reason))
        if reason == "local" and conn.state is State.CONNECTED:
            return  # close() keeps it for the notification's ACK
        self._forget(conn)

    def _forget(self, conn: Connection) -> None:
        if self.connections.pop(conn.address, None) is None:
            return
        if self._by_guid.get(conn.guid) == conn.address:
            del self._by_guid[conn.guid]
        self._per_ip[conn.address[0]] -= 1
        if self._per_ip[conn.address[0]] <= 0:
            del self._per_ip[conn.address[0]]
        conn.layer.release()
        self._dirty.discard(conn.address)
