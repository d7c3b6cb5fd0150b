"""TCP plumbing shared by the OpenTTD coordinator, STUN and TURN listeners.

A :class:`PacketConnection` cuts its byte stream into OpenTTD packets and hands
them, in order, to the listener's :class:`PacketHandler`, one at a time (a
handler may await the store). It enforces the bounds every listener needs:

- connection count, total and per source address (over the limit: closed at
  once), through the runtime's shared :mod:`~crossroads.transport.admission`
  (the total is also capped by the listener's share of the descriptor limit);
- a deadline for the first packet and for finishing any started packet
  (slowloris), and an idle deadline between packets;
- received bytes are cut into packets only as the handler takes them; past
  :data:`INBOX_PAUSE` buffered bytes reading pauses until the handler catches
  up, so a flood costs the flooder its own TCP window, not our memory;
- a cap on bytes queued for a peer that does not read.

Once the TURN service pairs two connections, :meth:`PacketConnection.hand_over`
gives a duplicate of the socket to the relay data plane's stream routes
(:mod:`crossroads.transport.streamplane`: splice(2), backpressure, half-close,
idle timeout): asyncio stops reading it, and the connection stays admitted (it
still counts against the listener's caps) until the route ends and the owner
closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from dataclasses import InitVar, dataclass, field
from typing import Protocol, cast

from prometheus_client import Counter, Gauge

from crossroads.errors import DecodeError, StoreError
from crossroads.proto.admission import REFUSED_OVER_IP_LIMIT
from crossroads.proto.openttd.wire import TCP_MTU, PacketSplitter
from crossroads.transport.admission import Admission, ResourceBudget
from crossroads.transport.sockets import make_tcp_listener, tcp_round_trip
from crossroads.types import Address, frozen, normalize_address

log = logging.getLogger("crossroads.openttd")

#: Pause reading when this many received bytes wait for the handler (a few
#: typical packets; the largest packet is 32 KiB, so this never blocks one).
INBOX_PAUSE = 64 * 1024
#: Resume reading once the backlog is down to this.
INBOX_RESUME = 16 * 1024
#: How often the sweeper checks deadlines (seconds). Deadlines are coarse on
#: purpose: one timer per listener, not one per connection.
SWEEP_EVERY = 1.0
#: Drop reasons that are read deadlines (also counted by the admission).
_DEADLINES = frozenset({"slow-packet", "no-packet", "idle", "relay-idle"})
#: Write-buffer high-water mark (asyncio pauses us above it) ...
WRITE_HIGH_WATER = 256 * 1024
#: ... and the hard cap: a peer this far behind is not reading; drop it.
WRITE_HARD_CAP = 4 * 1024 * 1024


@frozen
class Limits:
    """Bounds of one listener (see the module docstring)."""

    max_connections: int
    max_per_address: int
    #: Seconds to deliver the first complete packet, and to finish any packet.
    packet_timeout: float
    #: Seconds without a complete packet before the connection is dropped.
    idle_timeout: float


class PacketHandler(Protocol):
    async def handle(
        self, conn: PacketConnection, packet_type: int, payload: bytes
    ) -> None:
        """One packet, in order. Raise DecodeError for bad input."""
        ...

    def rejected(self, conn: PacketConnection, reason: str) -> None:
        """The stream is unusable (bad framing, bad packet): answer and close."""
        ...

    def closed(self, conn: PacketConnection) -> None:
        """The connection is gone (called once)."""
        ...


class PacketConnection(asyncio.Protocol):
    """One accepted TCP connection; see the module docstring."""

    def __init__(self, listener: Listener) -> None:
        self.listener = listener
        self.transport: asyncio.Transport | None = None
        self.peer: Address = ("", 0)
        self.local: Address = ("", 0)
        self.splitter = PacketSplitter(TCP_MTU)
        self.worker: asyncio.Task[None] | None = None
        self.accepted = 0.0
        self.last_packet = 0.0
        self.partial_since: float | None = None
        self.packets = 0
        self.closed = False
        self.close_reason = ""
        self.paused = False
        self._can_write = asyncio.Event()
        self._can_write.set()
        #: Handed over to the data plane (:meth:`hand_over`): no more reads,
        #: packets or deadlines here.
        self.handed_over = False
        #: Free slot for the owning service (its per-connection state).
        self.state: object = None

    # ------------------------------------------------------------ asyncio API

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        transport = cast(asyncio.Transport, transport)
        self.transport = transport
        self.peer = normalize_address(transport.get_extra_info("peername"))
        self.local = normalize_address(transport.get_extra_info("sockname"))
        now = self.listener.loop.time()
        self.accepted = self.last_packet = now
        if not self.listener.admit(self):
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)

    def data_received(self, data: bytes) -> None:
        if self.closed or self.handed_over:
            return
        splitter = self.splitter
        splitter.push(data)
        if self.worker is None:
            self.worker = asyncio.create_task(self._work())
        if splitter.pending >= INBOX_PAUSE and not self.paused and self.transport:
            self.paused = True
            self.transport.pause_reading()

    def eof_received(self) -> bool | None:
        return None  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self._can_write.set()
        if not self.closed:
            self.closed = True
            self.close_reason = self.close_reason or "peer closed"
        self.listener.forget(self)

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    # -------------------------------------------------------------- our API

    @property
    def host(self) -> str:
        return self.peer[0]

    def round_trip(self) -> float | None:
        """The kernel's smoothed round-trip time of this connection (seconds), or
        None where TCP_INFO is not available."""
        transport = self.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is None or self.closed:
            return None
        return tcp_round_trip(sock)

    def send(self, data: bytes) -> None:
        transport = self.transport
        if transport is None or self.closed or transport.is_closing():
            return
        transport.write(data)
        if transport.get_write_buffer_size() > WRITE_HARD_CAP:
            self.listener.drop(self, "slow-reader")

    async def drain(self, timeout: float = 30.0) -> None:
        """Wait until the peer has read what we queued (bounded)."""
        if self._can_write.is_set():
            return
        try:
            await asyncio.wait_for(self._can_write.wait(), timeout)
        except TimeoutError:
            self.listener.drop(self, "slow-reader")

    def close(self, reason: str = "") -> None:
        if self.closed:
            return
        self.closed = True
        self.close_reason = reason
        if self.transport is not None:
            self.transport.close()

    def hand_over(self) -> tuple[socket.socket, bytes] | None:
        """Stop reading and give the data plane this connection's socket: a
        duplicate descriptor (the transport keeps its own, open and idle,
        until :meth:`close`), and the bytes received but not handled yet, which
        belong to the stream. None when the connection cannot be handed over
        (closing, or asyncio still holds bytes to write to it)."""
        transport = self.transport
        if (
            transport is None
            or self.closed
            or transport.is_closing()
            or transport.get_write_buffer_size()
        ):
            return None
        raw = transport.get_extra_info("socket")
        if raw is None:
            return None
        try:
            sock = socket.socket(fileno=os.dup(raw.fileno()))
        except OSError:
            return None
        transport.pause_reading()
        self.handed_over = True
        self.partial_since = None
        return sock, self.splitter.take_remaining()

    async def _work(self) -> None:
        handler = self.listener.handler
        splitter = self.splitter
        loop = self.listener.loop
        try:
            while not self.closed and not self.handed_over:
                try:
                    item = splitter.next()
                    if item is None:
                        break
                    if (
                        self.paused
                        and splitter.pending <= INBOX_RESUME
                        and self.transport
                    ):
                        self.paused = False
                        self.transport.resume_reading()
                    self.last_packet = loop.time()
                    self.packets += 1
                    self.partial_since = None
                    await handler.handle(self, *item)
                except DecodeError as exc:
                    self.listener.reject(self, exc.reason)
                    return
            if splitter.pending and self.partial_since is None:
                self.partial_since = loop.time()
        except StoreError as exc:
            # The store is down (logged once per outage by the store): the
            # client reconnects later, as after any coordinator failure.
            log.debug("openttd %s: store failed: %s", self.listener.name, exc)
            self.listener.drop(self, "store-unavailable")
        except Exception:
            log.exception("openttd %s: handler failed", self.listener.name)
            self.listener.drop(self, "internal-error")
        finally:
            # No await since the last next(): nothing arrived unseen.
            self.worker = None


@dataclass(eq=False)
class Listener:
    """Accepts :class:`PacketConnection` s for one service and polices them."""

    name: str
    handler: PacketHandler
    limits: Limits
    dropped: Counter
    gauges: InitVar[Gauge]
    budget: ResourceBudget
    loop: asyncio.AbstractEventLoop = field(init=False)
    connections: set[PacketConnection] = field(default_factory=set, init=False)
    admission: Admission = field(init=False)
    _gauge: Gauge = field(init=False)
    _server: asyncio.Server | None = field(default=None, init=False)
    _sweeper: asyncio.Task[None] | None = field(default=None, init=False)
    address: Address = field(default=("", 0), init=False)

    def __post_init__(self, gauges: Gauge) -> None:
        self.loop = asyncio.get_running_loop()
        self.admission = self.budget.listener(
            f"openttd-{self.name}",
            self.limits.max_connections,
            self.limits.max_per_address,
        )
        self._gauge = gauges.labels(self.name)

    async def start(self, host: str, port: int) -> Address:
        sock = make_tcp_listener(host, port)
        self._server = await self.loop.create_server(
            lambda: PacketConnection(self), sock=sock
        )
        self.address = normalize_address(sock.getsockname())
        # The registry names the table that admits this port's connections
        # (the adversarial battery attacks it and checks its caps).
        self.budget.listen(
            "openttd",
            f"openttd-{self.name}",
            "tcp",
            self.address,
            self.admission.name,
        )
        self._sweeper = asyncio.create_task(self._sweep_forever())
        return self.address

    def admit(self, conn: PacketConnection) -> bool:
        refused = self.admission.admit(conn.host)
        if refused is not None:
            reason = (
                "over-address-limit" if refused == REFUSED_OVER_IP_LIMIT else refused
            )
            self._count(reason)
            conn.close(reason)
            return False
        self.connections.add(conn)
        self._gauge.inc()
        return True

    def forget(self, conn: PacketConnection) -> None:
        if conn not in self.connections:
            return
        self.connections.discard(conn)
        self.admission.release(conn.host)
        self._gauge.dec()
        if conn.worker is not None:
            conn.worker.cancel()
        try:
            self.handler.closed(conn)
        except Exception:
            log.exception("openttd %s: close handler failed", self.name)

    def _count(self, reason: str) -> None:
        self.dropped.labels(self.name, reason).inc()
        if reason in _DEADLINES:
            self.admission.closed(reason)

    def reject(self, conn: PacketConnection, reason: str) -> None:
        """Bad input: count it, let the handler answer, close."""
        if conn.closed:
            return
        self._count(reason)
        try:
            self.handler.rejected(conn, reason)
        finally:
            conn.close(reason)

    def drop(self, conn: PacketConnection, reason: str) -> None:
        """Close without an answer (timeouts, slow readers, limits)."""
        if conn.closed:
            return
        self._count(reason)
        conn.close(reason)
        if conn.transport is not None:
            conn.transport.abort()

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_EVERY)
            self.sweep(self.loop.time())

    def sweep(self, now: float) -> None:
        limits = self.limits
        for conn in list(self.connections):
            if conn.closed:
                continue
            if conn.handed_over:
                continue  # the data plane times its routes out
            if (
                conn.partial_since is not None
                and now - conn.partial_since > limits.packet_timeout
            ):
                self.drop(conn, "slow-packet")
            elif conn.packets == 0 and now - conn.accepted > limits.packet_timeout:
                self.drop(conn, "no-packet")
            elif now - conn.last_packet > limits.idle_timeout and not self.handler_busy(
                conn
            ):
                self.drop(conn, "idle")

    def handler_busy(self, conn: PacketConnection) -> bool:
        return conn.worker is not None

    def stop_accepting(self) -> None:
        """Close the listening socket; accepted connections go on (a drain:
        new clients are refused and go to another instance)."""
        if self._server is not None:
            self._server.close()

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.close("shutdown")
            if conn.transport is not None:
                conn.transport.abort()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
        await asyncio.sleep(0)
        self.budget.forget(self.admission.name)
