"""The relay node's UDP endpoint: the data-plane fast path around a sans-I/O core.

The socket is a :class:`~crossroads.transport.dataplane.RouteTap` over the
endpoint's forwarding table (:attr:`RelayEndpoint.routes`, keyed by source
address and the frame's first 36 bytes: header, from and to allocation IDs),
with the RELAY length check (``DataLength`` at offset 36 must be the rest of the
frame). A frame between two connected allocations is forwarded unchanged by
the tap -- in C with ``recvmmsg``/``sendmmsg`` when built -- and counted on its
route: no parse, no Python per frame, no store. Everything else reaches the
core (the control plane), whose replies are sent once per readiness callback.

The endpoint is the core's :class:`~crossroads.proto.relay.server.Forwarding`
port: a route the core announces is written by the runtime's route table
(:mod:`crossroads.transport.routes`), the table's only writer, into the tap
and, with ``--dataplane kernel``, into the eBPF program's map as a ``RELAY``
route (the frame goes out as is, so the kernel can forward it: keyed by the
client's address and the frame's first 36 bytes, DataLength checked), which
then forwards it before the socket. Removing a route (a revoked, closed or
timed-out allocation, a disconnect, a rebind) takes it out of both at once.
Each entry is made by :meth:`RelayEndpoint.make_forward`: a data-plane route
from this socket. On a wildcard bind each route carries the
``IP_PKTINFO`` source its destination client last sent to
(:mod:`crossroads.transport.pktinfo`), learned from that client's slow-path
frames (BIND, CONNECT_REQUEST, a rebind) before any route to it exists. When the
kernel buffer is full a datagram is dropped and counted, which is what a UDP
relay should do.

Two kinds of clients share the core without being on this socket:

- DTLS clients (:mod:`crossroads.services.relay_dtls`): their decrypted frames
  arrive through :meth:`RelayEndpoint.receive`, and what goes to them is
  encrypted by the secure side, never sent here in clear. A plaintext frame on
  this port from an address that holds a DTLS session is refused (a spoofed
  source must not speak for an encrypted client).
- Stream clients (the Unity relay over WebSockets,
  :mod:`crossroads.transport.relay_ws`): each connection gets a client address
  of its own, ``(its IP, STREAM_PORT_BASE + n)``, a port no datagram can carry,
  so it never collides with a UDP client; its frames arrive through
  :meth:`RelayEndpoint.receive` too. The endpoint follows which allocations
  are bound at each stream address (the core's :class:`AllocationBound` and
  :class:`AllocationEnded` events) and tells the connection when it first
  holds one and when it holds none any more: a connection with no allocation
  is unauthenticated state, which its transport gives a deadline.

A pair with such an end gets an :class:`OffPlaneForward` instead of a C route:
the C tap does not forward it (not its route type) and hands the frame to the
fallback, which gives it to the core; the core's outbox is sent by
:meth:`_send`, which knows each kind of client. The pure-Python tap calls the
entry's ``send``, which makes the same decisions. Frames between UDP clients
take the data plane exactly as before.
"""

from __future__ import annotations

import asyncio
import random
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from crossroads.proto.relay.messages import RELAY_ROUTE_SIZE, MessageType, header
from crossroads.proto.relay.server import (
    AllocationBound,
    AllocationEnded,
    Event,
    ForwardEntry,
    RelayServer,
    RouteHandle,
    RouteKey,
)
from crossroads.service_types import Impairment as Impairment  # re-exported
from crossroads.transport.dataplane import RouteLike, make_route
from crossroads.transport.driver import TapDriver
from crossroads.transport.routes import RouteTable
from crossroads.types import Address

#: First port of the client addresses given to stream connections: one above
#: the largest UDP port (see the module doc).
STREAM_PORT_BASE = 0x10000
#: Frames held back by QA impairments at once, all sessions together: at most
#: ~6 MB of 1500-byte frames (an operator's test tool, not a data path);
#: beyond, a frame is dropped and counted.
MAX_IMPAIRED_PENDING = 4096
_RELAY = header(MessageType.RELAY)


class SecureSide(Protocol):
    """A transport whose clients the relay reaches through it (DTLS): the
    addresses it has sessions for, and how to send one relay message to one."""

    @property
    def sessions(self) -> Mapping[Address, object]: ...

    def send_to(self, addr: Address, data: bytes) -> None: ...


@dataclass(eq=False, slots=True)
class OffPlaneForward:
    """The forwarding entry of a pair with a DTLS or stream end: not a
    data-plane route, so the C tap leaves its frames to the slow path; the
    pure-Python tap calls :meth:`send`, which decides as the slow path would."""

    endpoint: RelayEndpoint
    dest: Address
    source: Address
    packets: int = field(default=0, init=False)
    octets: int = field(default=0, init=False)

    def send(self, data: bytes) -> None:
        """One plaintext datagram of this socket routed along this entry."""
        self.endpoint.forward_plaintext(data, self.source, self.dest)


@dataclass(eq=False, slots=True)
class StreamClient:
    """One attached stream connection: where frames to it go, whom to tell
    when it starts or stops holding an allocation, and the allocations bound
    at its address."""

    send: Callable[[bytes], None]
    on_binding: Callable[[bool], None]
    allocations: set[bytes] = field(default_factory=set)


def _no_binding(bound: bool) -> None:
    """The default :attr:`StreamClient.on_binding`: nobody to tell."""


class RelayEndpoint(TapDriver[RelayServer]):
    """Runs one :class:`RelayServer` on one bound, non-blocking UDP socket."""

    def __init__(
        self,
        core: RelayServer,
        sock: socket.socket,
        on_events: Callable[[list[Event]], None] = lambda events: None,
        table: RouteTable | None = None,
    ) -> None:
        #: The forwarding table the tap reads, written by ``table`` only.
        self.routes: dict[RouteKey, ForwardEntry] = {}
        #: The runtime's route table (kernel routes with --dataplane kernel).
        self.table = RouteTable() if table is None else table
        # The tap forwards along these routes (prefix: the RELAY header and
        # both allocation IDs; DataLength checked at that offset).
        super().__init__(
            core,
            sock,
            self.routes,
            prefix=RELAY_ROUTE_SIZE,
            length_at=RELAY_ROUTE_SIZE,
        )
        self.on_events = on_events
        self._flush_failures = 0
        #: Plaintext datagrams from an address that has a DTLS session.
        self.plaintext_refused = 0
        self._secure: SecureSide | None = None
        core.set_forwarding(self)
        #: Stream connections by their client address.
        self._streams: dict[Address, StreamClient] = {}
        #: The stream address each allocation bound at a stream is bound at.
        self._stream_of: dict[bytes, Address] = {}
        self._next_stream = 0
        #: Frames for a stream connection that had gone (counted, dropped).
        self.stream_gone = 0
        #: QA impairments by allocation ID, and the client addresses they
        #: held when set (their links are off the data plane).
        self.impaired: dict[bytes, Impairment] = {}
        self._impaired_at: dict[bytes, Address] = {}
        self._impaired_pending = 0
        #: Frames an impairment dropped: as asked ("lost"), or because
        #: :data:`MAX_IMPAIRED_PENDING` were held back already ("overflow").
        self.impaired_lost = 0
        #: Frames an impairment lost, by (from, to) allocation ID: the link's
        #: insight record reports them as drops (popped when it ends).
        self.impaired_lost_by: dict[tuple[bytes, bytes], int] = {}
        self.impaired_overflow = 0
        self.impaired_delayed = 0
        self._random = random.Random()

    @property
    def send_failures(self) -> int:
        """Datagrams the kernel refused (relayed frames and replies)."""
        return self.tap.send_errors + self._flush_failures

    def attach_secure(self, side: SecureSide) -> None:
        """Reach ``side``'s session addresses through it, and refuse their
        plaintext datagrams here."""
        self._secure = side

    def install(self, key: RouteKey, dest: Address, source: Address) -> RouteHandle:
        """The core's route, written by the route table: an off-plane entry
        in the tap's table only; a data-plane route there and in the kernel."""
        entry = self.make_forward(dest, source)
        # A stream client's frames (WebSocket, TCP) never reach this socket,
        # so no kernel route can carry them: its entry is in the tap's table
        # only, even toward a UDP client.
        on_plane = (
            not isinstance(entry, OffPlaneForward) and key[0][1] < STREAM_PORT_BASE
        )
        return self.table.install(
            self.routes,
            key[0],
            entry,
            via=self.sock if on_plane else None,
            header=key[1],
        )

    def close(self) -> None:
        """Take every route out of every plane, then close (idempotent)."""
        self.table.clear(self.routes)
        super().close()

    def make_forward(self, dest: Address, source: Address) -> ForwardEntry:
        """A data-plane route from this socket to ``dest`` (the core's factory),
        or an :class:`OffPlaneForward` when either end is not a UDP client of
        this socket."""
        secure = self._secure
        impaired = self._impaired_at.values()
        if (
            dest[1] >= STREAM_PORT_BASE
            or (
                secure is not None
                and (dest in secure.sessions or source in secure.sessions)
            )
            or (impaired and (dest in impaired or source in impaired))
        ):
            return OffPlaneForward(self, dest, source)
        control = None if self._replies is None else self._replies.control_for(dest)
        route: RouteLike = make_route(self.sock, dest, control)
        return route

    # ------------------------------------------------------------- fast path

    def forward_plaintext(self, data: bytes, source: Address, dest: Address) -> None:
        """A plaintext frame of this socket routed to or from a client that is
        not on it (the pure-Python tap's path; the C tap's is :meth:`_received`)."""
        secure = self._secure
        if secure is not None and source in secure.sessions:
            self.plaintext_refused += 1
        else:
            self._send(data, dest)

    def _received(self, data: bytes, addr: Address, ancdata: Any = None) -> None:
        """The tap's fallback (the slow path): to the core, unless ``addr``
        holds a DTLS session. A routed frame of a pair with an off-plane end
        reaches here too (the C tap forwards only its own routes); the core's
        ``receive_datagram`` takes it."""
        secure = self._secure
        if secure is not None and addr in secure.sessions:
            self.plaintext_refused += 1
            return
        super()._received(data, addr, ancdata)

    # ------------------------------------------------- DTLS and stream clients

    def receive(self, data: bytes, addr: Address) -> None:
        """One relay message from a client that is not on this socket (a DTLS
        session, decrypted, or a stream connection)."""
        now = self._loop.time()
        self.core.receive_datagram(data, addr, now)
        self._flush(now)

    receive_stream = receive

    def attach_stream(
        self,
        host: str,
        send: Callable[[bytes], None],
        on_binding: Callable[[bool], None] = _no_binding,
    ) -> Address:
        """A client address for a new stream connection from ``host``; frames
        the core sends to it are given to ``send``, and ``on_binding(True)``
        is called when the first allocation is bound at it,
        ``on_binding(False)`` when the last one bound there has ended or moved
        away. Call :meth:`detach_stream` when the connection ends."""
        self._next_stream = (self._next_stream + 1) % STREAM_PORT_BASE
        addr: Address = (host, STREAM_PORT_BASE + self._next_stream)
        while addr in self._streams:
            self._next_stream = (self._next_stream + 1) % STREAM_PORT_BASE
            addr = (host, STREAM_PORT_BASE + self._next_stream)
        self._streams[addr] = StreamClient(send, on_binding)
        return addr

    def detach_stream(self, addr: Address) -> None:
        """The stream connection at ``addr`` ended; frames to it are dropped
        (its allocation ends by the core's idle timer or the client's CLOSE)."""
        stream = self._streams.pop(addr, None)
        if stream is not None:
            for allocation_id in stream.allocations:
                self._stream_of.pop(allocation_id, None)

    def has_stream_from(self, host: str) -> bool:
        """True while a stream connection from ``host`` is attached."""
        return any(addr[0] == host for addr in self._streams)

    def stream_bound(self, addr: Address) -> bool:
        """True while an allocation is bound at the stream address ``addr``."""
        stream = self._streams.get(addr)
        return stream is not None and bool(stream.allocations)

    def to_stream(self, data: bytes, addr: Address) -> None:
        """Give ``data`` to the stream connection at ``addr`` (dropped and
        counted when it has gone)."""
        stream = self._streams.get(addr)
        if stream is None:
            self.stream_gone += 1
        else:
            stream.send(data)

    def _follow_streams(self, events: list[Event]) -> None:
        """Keep each stream's bound allocations from the core's events, and
        tell a stream when it starts or stops holding one."""
        for event in events:
            if isinstance(event, AllocationBound):
                aid = event.allocation_id
                if self._stream_of.get(aid) != event.address:
                    self._unbind_stream(aid)
                    stream = self._streams.get(event.address)
                    if stream is not None:
                        self._stream_of[aid] = event.address
                        stream.allocations.add(aid)
                        if len(stream.allocations) == 1:
                            stream.on_binding(True)
            elif isinstance(event, AllocationEnded):
                self._unbind_stream(event.allocation_id)

    def _unbind_stream(self, allocation_id: bytes) -> None:
        """``allocation_id`` is no longer bound at the stream it was bound at."""
        addr = self._stream_of.pop(allocation_id, None)
        stream = None if addr is None else self._streams.get(addr)
        if stream is None:
            return
        stream.allocations.discard(allocation_id)
        if not stream.allocations:
            stream.on_binding(False)

    # ------------------------------------------------------- QA impairment

    def impair(self, allocation_id: bytes, impairment: Impairment | None) -> bool:
        """Impair one allocation's relayed frames both ways (None or an
        inactive one: stop); its links leave the data plane while impaired
        (their frames go through the core, counted as before). False when no
        such allocation."""
        allocation = self.core.allocations.get(allocation_id)
        if allocation is None:
            return False
        if impairment is None or not impairment.active:
            self.impaired.pop(allocation_id, None)
            self._impaired_at.pop(allocation_id, None)
        else:
            self.impaired[allocation_id] = impairment
            self._impaired_at[allocation_id] = allocation.address
        self.core.reroute(allocation_id)
        return True

    def _impairment_of(self, data: bytes) -> Impairment | None:
        if len(data) < RELAY_ROUTE_SIZE or data[:4] != _RELAY:
            return None
        impaired = self.impaired
        return impaired.get(bytes(data[4:20])) or impaired.get(bytes(data[20:36]))

    def pop_lost(self, from_id: bytes, to_id: bytes) -> int:
        """Frames from ``from_id`` to ``to_id`` an impairment lost (forgotten
        once read: the link's record takes them)."""
        return self.impaired_lost_by.pop((from_id, to_id), 0)

    def _send_later(self, data: bytes, addr: Address) -> None:
        self._impaired_pending -= 1
        self._deliver(data, addr)

    def _send(self, data: bytes, addr: Address) -> None:
        if self.impaired:
            impairment = self._impairment_of(data)
            if impairment is not None:
                if self._random.random() < impairment.loss:
                    self.impaired_lost += 1
                    key = (bytes(data[4:20]), bytes(data[20:36]))
                    lost = self.impaired_lost_by
                    lost[key] = lost.get(key, 0) + 1
                    return
                if self._impaired_pending >= MAX_IMPAIRED_PENDING:
                    self.impaired_overflow += 1
                    return
                spread = self._random.uniform(-impairment.jitter, impairment.jitter)
                self._impaired_pending += 1
                self.impaired_delayed += 1
                asyncio.get_running_loop().call_later(
                    max(0.0, impairment.delay + spread), self._send_later, data, addr
                )
                return
        self._deliver(data, addr)

    def _deliver(self, data: bytes, addr: Address) -> None:
        if addr[1] >= STREAM_PORT_BASE:
            self.to_stream(data, addr)
            return
        secure = self._secure
        if secure is not None and addr in secure.sessions:
            secure.send_to(addr, data)
            return
        try:
            self._sendto(data, addr)
        except OSError:
            self._flush_failures += 1

    # ----------------------------------------------------------- control plane

    def kick(self, allocation_id: bytes, *, notify: bool = True) -> bool:
        """End one allocation now (:meth:`RelayServer.kick`) and send what it says."""
        now = self._loop.time()
        kicked = self.core.kick(allocation_id, now, notify=notify)
        self._flush(now)
        return kicked

    def _flush(self, now: float) -> None:
        for data, addr in self.core.datagrams_to_send(now):
            self._send(data, addr)
        events = self.core.pop_events()
        if events:
            if self.impaired:
                for event in events:
                    if isinstance(event, AllocationEnded):
                        self.impaired.pop(event.allocation_id, None)
                        self._impaired_at.pop(event.allocation_id, None)
            if self._streams:
                self._follow_streams(events)
            self.on_events(events)
        self._timer.rearm()
