"""Runs a :class:`~crossroads.proto.dtls.server.PskDtlsServer` on one UDP socket.

The same driver as :class:`crossroads.transport.relay.RelayEndpoint`
(:class:`~crossroads.transport.driver.TapDriver`): the socket is read by the
relay data plane's reader (a :class:`~crossroads.transport.dataplane.RouteTap`
with no routes: recvmmsg batches in C when built, its pure-Python twin
otherwise), so every datagram reaches the core in arrival order through the
tap's fallback; the core's one timer is re-armed after every batch, and what
the core emits is sent with non-blocking ``sendto`` (a full kernel buffer drops
and counts the datagram, as a UDP server should). Decrypted records and session changes go to ``on_events``; whoever
owns the endpoint answers through :meth:`PskDtlsEndpoint.send_to`.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping

from crossroads.proto.dtls.handshake import Closed, Established, Event
from crossroads.proto.dtls.server import PskDtlsServer
from crossroads.transport.driver import TapDriver
from crossroads.types import Address


class PskDtlsEndpoint(TapDriver[PskDtlsServer]):
    """One DTLS server core on one bound, non-blocking UDP socket."""

    def __init__(
        self,
        core: PskDtlsServer,
        sock: socket.socket,
        on_events: Callable[[list[Event]], None] = lambda events: None,
    ) -> None:
        #: No routes: every datagram goes to the core (the tap reads whole
        #: datagrams, up to 64 KiB; the core rejects the oversize).
        super().__init__(core, sock, {})
        self.on_events = on_events
        self.send_failures = 0
        #: Addresses that have a session, and those whose session just ended
        #: while ``on_events`` runs: what the owner sends them in that callback
        #: (an ERROR to an ended allocation) is dropped, never sent in clear.
        self._secure: dict[Address, None] = {}

    @property
    def sessions(self) -> Mapping[Address, object]:
        """Addresses only reachable through DTLS (read per packet by the relay)."""
        return self._secure

    def send_to(self, addr: Address, data: bytes) -> None:
        """Protect ``data`` as one record for ``addr``'s session and send it."""
        if self._closed:
            return
        now = self._loop.time()
        if self.core.send(addr, data, now):
            self._transmit(now)

    def _transmit(self, now: float) -> None:
        for data, addr in self.core.datagrams_to_send(now):
            try:
                self._sendto(data, addr)
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
