"""Runs a :class:`~crossroads.proto.dtls.server.DtlsServer` on one UDP socket.

The same shape as :class:`crossroads.transport.relay.RelayEndpoint`: the socket
is read by the relay data plane's reader (a
:class:`~crossroads.transport.dataplane.RouteTap` with no routes: recvmmsg
batches in C when built, its pure-Python twin otherwise), so every datagram
reaches the core in arrival order through the tap's fallback; the core's one
timer (the driver's :class:`~crossroads.transport.driver.CoreTimer`) is
re-armed after every batch, and what the core emits is sent with non-blocking
``sendto`` (a full kernel buffer drops and counts the datagram, as a UDP server
should). Decrypted records and session changes go to ``on_events``; whoever
owns the endpoint answers through :meth:`DtlsEndpoint.send_to`.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Mapping
from typing import Any

from crossroads.proto.dtls.handshake import Closed, Established, Event
from crossroads.proto.dtls.server import DtlsServer
from crossroads.transport.dataplane import make_tap
from crossroads.transport.driver import CoreTimer
from crossroads.transport.pktinfo import ReplySource, is_wildcard
from crossroads.types import Address


class DtlsEndpoint:
    """One DTLS server core on one bound, non-blocking UDP socket."""

    def __init__(
        self,
        core: DtlsServer,
        sock: socket.socket,
        on_events: Callable[[list[Event]], None] = lambda events: None,
    ) -> None:
        self.core = core
        self.sock = sock
        self.on_events = on_events
        self.send_failures = 0
        self._loop = asyncio.get_running_loop()
        self._replies = (
            ReplySource(sock) if is_wildcard(sock.getsockname()[0]) else None
        )
        #: No routes: every datagram goes to :meth:`_received` (the tap reads
        #: whole datagrams, up to 64 KiB; the core rejects the oversize).
        self.tap = make_tap(
            sock, {}, self._received, ancillary=self._replies is not None
        )
        #: The time of the batch being read (set by its first datagram).
        self._batch_now: float | None = None
        self._timer = CoreTimer(self._loop, core.get_timer, self._on_timer)
        self._closed = False
        #: Addresses that have a session, and those whose session just ended
        #: while ``on_events`` runs: what the owner sends them in that callback
        #: (an ERROR to an ended allocation) is dropped, never sent in clear.
        self._secure: dict[Address, None] = {}

    @property
    def sessions(self) -> Mapping[Address, object]:
        """Addresses only reachable through DTLS (read per packet by the relay)."""
        return self._secure

    def start(self) -> None:
        self._loop.add_reader(self.sock.fileno(), self._readable)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self.sock.fileno())
        self.tap.close()
        self._timer.close()
        self.sock.close()

    def send_to(self, addr: Address, data: bytes) -> None:
        """Protect ``data`` as one record for ``addr``'s session and send it."""
        if self._closed:
            return
        now = self._loop.time()
        if self.core.send(addr, data, now):
            self._transmit(now)

    def _readable(self) -> None:
        self.tap.readable()
        now = self._batch_now
        if now is not None:
            self._batch_now = None
            self._flush(now)

    def _received(self, data: bytes, addr: Address, ancdata: Any = None) -> None:
        """The tap's fallback: one datagram, in arrival order."""
        if self._replies is not None and ancdata:
            self._replies.learn(addr, ancdata)
        now = self._batch_now
        if now is None:
            now = self._batch_now = self._loop.time()
        self.core.receive_datagram(data, addr, now)

    def _transmit(self, now: float) -> None:
        sendto = self.sock.sendto if self._replies is None else self._replies.sendto
        for data, addr in self.core.datagrams_to_send(now):
            try:
                sendto(data, addr)
            except OSError:
                self.send_failures += 1

    def _flush(self, now: float) -> None:
        self._transmit(now)
        events = self.core.pop_events()
        if events:
            for event in events:
                if isinstance(event, Established):
                    self._secure[event.address] = None
            self.on_events(events)
            for event in events:
                if (
                    isinstance(event, Closed)
                    and event.address not in self.core.sessions
                ):
                    self._secure.pop(event.address, None)
            self._transmit(now)
        self._timer.rearm()

    def _on_timer(self, now: float) -> None:
        self.core.handle_timer(now)
        self._flush(now)
