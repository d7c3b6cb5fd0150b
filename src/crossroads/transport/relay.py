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
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Mapping
from typing import Protocol

from crossroads.proto.relay.server import Event, RelayServer, Route
from crossroads.transport.pktinfo import ReplySource, is_wildcard
from crossroads.types import Address

#: Datagrams read per readiness callback: enough to amortise the event-loop
#: round trip, small enough that timers and the HTTP server keep running.
BATCH = 256
#: Largest UDP payload; a RELAY frame is at most 38 + 65535 bytes, which no
#: IPv4 datagram can carry, so this reads any datagram whole.
MAX_DATAGRAM = 65535


class SecureSide(Protocol):
    """A transport whose clients the relay reaches through it (DTLS): the
    addresses it has sessions for, and how to send one relay message to one."""

    @property
    def sessions(self) -> Mapping[Address, object]: ...

    def send_to(self, addr: Address, data: bytes) -> None: ...


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
        #: Plaintext datagrams from an address that has a DTLS session (a
        #: spoofed source must not speak for an encrypted client).
        self.plaintext_refused = 0
        self._secure: SecureSide | None = None
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

    def start(self) -> None:
        self._loop.add_reader(self.sock.fileno(), self._readable)

    def attach_secure(self, side: SecureSide) -> None:
        """Reach ``side``'s session addresses through it, and refuse their
        plaintext datagrams here. While ``side`` has no session the fast path
        pays one truth test per packet."""
        self._secure = side

    def receive(self, data: bytes, addr: Address) -> None:
        """One relay message that arrived (decrypted) through the secure side."""
        now = self._loop.time()
        self.core.receive_datagram(data, addr, now)
        self._flush(now)

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
        secured = self._secure.sessions if self._secure is not None else None
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
                if secured and (addr in secured or route.dest in secured):
                    self._forward_secure(data, addr, route.dest, route)
                    continue
                route.packets += 1
                route.octets += size
                try:
                    sendto(data, route.dest)
                except OSError:
                    self.send_failures += 1
                continue
            if secured and addr in secured:
                self.plaintext_refused += 1
                continue
            if not slow:
                slow = True
                now = self._loop.time()
            self.core.receive_slow(data, addr, now)
        if slow:
            self._flush(now)

    # ----------------------------------------------------------- control plane

    def kick(self, allocation_id: bytes) -> bool:
        """End one allocation now (:meth:`RelayServer.kick`) and send what it says."""
        now = self._loop.time()
        kicked = self.core.kick(allocation_id, now)
        self._flush(now)
        return kicked

    def _forward_secure(
        self, data: bytes, addr: Address, dest: Address, route: Route
    ) -> None:
        if self._secure is None or addr in self._secure.sessions:
            self.plaintext_refused += 1
            return
        route.packets += 1
        route.octets += len(data)
        self._secure.send_to(dest, data)

    def _flush(self, now: float) -> None:
        sendto = self.sock.sendto if self._replies is None else self._replies.sendto
        secure = self._secure
        secured = secure.sessions if secure is not None else None
        for data, addr in self.core.datagrams_to_send(now):
            if secured and addr in secured and secure is not None:
                secure.send_to(addr, data)
                continue
            try:
                sendto(data, addr)
            except OSError:
                self.send_failures += 1
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
