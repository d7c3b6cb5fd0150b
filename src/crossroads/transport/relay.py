"""The relay node's UDP endpoint: the data-plane fast path around a sans-I/O core.

A RELAY frame between two connected allocations costs one ``recvfrom``, one dict
lookup keyed by (source address, first 36 bytes), one length check, two integer
adds on the route and one ``sendto``: no parse, no object per packet, no store.
Everything else goes to :meth:`RelayServer.receive_slow` (the control plane).

The socket is read directly with ``loop.add_reader`` in batches of up to
:data:`BATCH` datagrams per wake-up, instead of through an asyncio
``DatagramProtocol``, which would add a callback and address normalisation per
packet. Sends are non-blocking ``sendto`` calls; when the kernel buffer is full
the datagram is dropped and counted, which is what a UDP relay should do.

Stream clients (the Unity relay over WebSockets, :mod:`crossroads.transport.relay_ws`)
feed the same core. Each connection gets a client address of its own,
``(its IP, STREAM_PORT_BASE + n)``: a port no datagram can carry, so a route to
it fails in the UDP fast path's ``sendto`` with ``OverflowError`` before any
system call, and the frame goes to the connection instead. The UDP path does no
extra work for that (an unused ``except`` clause costs nothing in Python 3.11).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

from crossroads.proto.relay.server import Event, RelayServer, Route
from crossroads.transport.pktinfo import ReplySource, is_wildcard
from crossroads.types import Address

#: Datagrams read per readiness callback: enough to amortise the event-loop
#: round trip, small enough that timers and the HTTP server keep running.
BATCH = 256
#: Largest UDP payload; a RELAY frame is at most 38 + 65535 bytes, which no
#: IPv4 datagram can carry, so this reads any datagram whole.
MAX_DATAGRAM = 65535
#: First port of the client addresses given to stream connections: one above
#: the largest UDP port, so ``sendto`` refuses it at once (see the module doc).
STREAM_PORT_BASE = 0x10000


class RelayEndpoint:
    """Runs one :class:`RelayServer` on one bound, non-blocking UDP socket."""

    def __init__(
        self,
        core: RelayServer,
        sock: socket.socket,
        on_events: Callable[[list[Event]], None] = lambda events: None,
    ) -> None:
        self.core = core
        self.sock = sock
        self.on_events = on_events
        self.send_failures = 0
        self._loop = asyncio.get_running_loop()
        self._v4 = sock.family == socket.AF_INET
        #: On a wildcard bind, replies and relayed frames leave from the address
        #: each client sent to (:mod:`crossroads.transport.pktinfo`).
        self._replies = (
            ReplySource(sock) if is_wildcard(sock.getsockname()[0]) else None
        )
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._closed = False
        #: Stream connections by their client address: where frames to them go.
        self._streams: dict[Address, Callable[[bytes], None]] = {}
        self._next_stream = 0
        #: Frames for a stream connection that had gone (counted, dropped).
        self.stream_gone = 0

    def start(self) -> None:
        self._loop.add_reader(self.sock.fileno(), self._readable)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self.sock.fileno())
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.sock.close()

    # ------------------------------------------------------------- fast path

    def _readable(self) -> None:
        routes = self.core.routes
        replies = self._replies
        recvfrom = self.sock.recvfrom if replies is None else replies.recvfrom
        sendto = self.sock.sendto if replies is None else replies.sendto
        v4 = self._v4
        slow = False
        now = 0.0
        for _ in range(BATCH):
            try:
                data, raw = recvfrom(MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                # Asynchronous errors (ICMP) surface here on some systems.
                continue
            addr: Address = raw if v4 else (raw[0], raw[1])
            route = routes.get((addr, data[:36]))
            size = len(data)
            if (
                route is not None
                and size >= 38
                and size - 38 == (data[36] << 8 | data[37])
            ):
                route.packets += 1
                route.octets += size
                try:
                    sendto(data, route.dest)
                except OSError:
                    self.send_failures += 1
                except OverflowError:
                    self._to_stream(data, route.dest)
                continue
            if not slow:
                slow = True
                now = self._loop.time()
            self.core.receive_slow(data, addr, now)
        if slow:
            self._flush(now)

    # -------------------------------------------------------- stream clients

    def attach_stream(self, host: str, send: Callable[[bytes], None]) -> Address:
        """A client address for a new stream connection from ``host``; frames
        the core sends to it are given to ``send``. Call :meth:`detach_stream`
        when the connection ends."""
        self._next_stream = (self._next_stream + 1) % STREAM_PORT_BASE
        addr: Address = (host, STREAM_PORT_BASE + self._next_stream)
        while addr in self._streams:
            self._next_stream = (self._next_stream + 1) % STREAM_PORT_BASE
            addr = (host, STREAM_PORT_BASE + self._next_stream)
        self._streams[addr] = send
        return addr

    def detach_stream(self, addr: Address) -> None:
        """The stream connection at ``addr`` ended; frames to it are dropped
        (its allocation ends by the core's idle timer or the client's CLOSE)."""
        self._streams.pop(addr, None)

    def has_stream_from(self, host: str) -> bool:
        """True while a stream connection from ``host`` is attached."""
        return any(addr[0] == host for addr in self._streams)

    def receive_stream(self, data: bytes, addr: Address) -> None:
        """One relay message from the stream connection at ``addr``: the same
        route lookup as a datagram, else the core's slow path."""
        route: Route | None = self.core.routes.get((addr, data[:36]))
        size = len(data)
        if route is not None and size >= 38 and size - 38 == (data[36] << 8 | data[37]):
            route.packets += 1
            route.octets += size
            self._send(data, route.dest)
            return
        now = self._loop.time()
        self.core.receive_slow(data, addr, now)
        self._flush(now)

    def _to_stream(self, data: bytes, addr: Address) -> None:
        send = self._streams.get(addr)
        if send is None:
            self.stream_gone += 1
        else:
            send(data)

    def _send(self, data: bytes, addr: Address) -> None:
        if addr[1] >= STREAM_PORT_BASE:
            self._to_stream(data, addr)
            return
        try:
            if self._replies is None:
                self.sock.sendto(data, addr)
            else:
                self._replies.sendto(data, addr)
        except OSError:
            self.send_failures += 1

    # ----------------------------------------------------------- control plane

    def kick(self, allocation_id: bytes) -> bool:
        """End one allocation now (:meth:`RelayServer.kick`) and send what it says."""
        now = self._loop.time()
        kicked = self.core.kick(allocation_id, now)
        self._flush(now)
        return kicked

    def _flush(self, now: float) -> None:
        for data, addr in self.core.datagrams_to_send(now):
            self._send(data, addr)
        events = self.core.events()
        if events:
            self.on_events(events)
        self._rearm()

    def _rearm(self) -> None:
        deadline = self.core.get_timer()
        if deadline == self._timer_at or self._closed:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = deadline
        if deadline is not None:
            self._timer = self._loop.call_at(deadline, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        now = self._loop.time()
        self.core.handle_timer(now)
        self._flush(now)
