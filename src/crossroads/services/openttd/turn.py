"""The OpenTTD TURN service (TCP 3974): pair two sockets by ticket, then relay.

Control plane (reference ``openttd-coordinator.md`` section 6): each side
connects and sends SERCLI_CONNECT with the ticket the coordinator gave both. A
ticket is ``<id>:<secret>``; the coordinator stored ``id -> secret`` in the store
with a 30 s TTL. The first side is checked against the store and waits (at most
:attr:`TurnService.wait_timeout`); the second must present the same ticket
(constant-time compare). Both then get TURN_CONNECTED with the other's IP, the
ticket is deleted (single use), and the pair switches to relaying.

Data plane: :meth:`PacketConnection.relay_to` -- from then on a chunk read on
one socket is written to the other as is. No framing, no parsing, no store.
An invalid ticket is closed at once, without TURN_ERROR (as the reference
service does: it gives a prober nothing to learn).
"""

from __future__ import annotations

import asyncio
import hmac
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from crossroads.errors import StoreError
from crossroads.proto.openttd.codes import split_ticket
from crossroads.proto.openttd.turn import (
    TurnConnected,
    decode_turn_connect,
    encode_turn_packet,
)
from crossroads.services.openttd.conn import PacketConnection
from crossroads.services.openttd.registry import Registry

#: A lone side waits this long for its peer (reference section 6: 20 s).
WAIT_TIMEOUT = 20.0
#: Sides waiting for a peer, process wide (each is one open socket).
MAX_WAITING = 10000


@dataclass(slots=True)
class _Waiting:
    conn: PacketConnection
    secret: str
    timer: asyncio.TimerHandle


class TurnService:
    """Handler for the TURN listener."""

    def __init__(
        self,
        registry: Registry,
        metrics: CollectorRegistry,
        wait_timeout: float = WAIT_TIMEOUT,
    ) -> None:
        self.registry = registry
        self.loop = asyncio.get_running_loop()
        self.wait_timeout = wait_timeout
        self.waiting: dict[str, _Waiting] = {}
        self.sessions = Counter(
            "crossroads_openttd_turn_sessions",
            "TURN connections, by outcome.",
            ["result"],
            registry=metrics,
        )
        self.relays = Gauge(
            "crossroads_openttd_turn_relays",
            "Relayed pairs in progress.",
            registry=metrics,
        )
        self.relayed_bytes = Counter(
            "crossroads_openttd_turn_bytes",
            "Bytes relayed (counted when a relayed connection closes).",
            registry=metrics,
        )

    async def handle(
        self, conn: PacketConnection, packet_type: int, payload: bytes
    ) -> None:
        if conn.state is not None:
            # Nothing may follow SERCLI_CONNECT before TURN_CONNECTED.
            self.sessions.labels("early-data").inc()
            conn.close("early-data")
            return
        message = decode_turn_connect(packet_type, payload)
        parts = split_ticket(message.ticket)
        if parts is None:
            self._invalid(conn)
            return
        ticket_id, secret = parts
        conn.state = ticket_id
        if self._pair_with_waiting(conn, ticket_id, secret):
            return
        try:
            stored = await self.registry.get_ticket(ticket_id)
        except StoreError:
            self.sessions.labels("store-error").inc()
            conn.close("store-error")
            return
        if stored is None or not hmac.compare_digest(stored, secret):
            self._invalid(conn)
            return
        if conn.closed or self._pair_with_waiting(conn, ticket_id, secret):
            return
        if len(self.waiting) >= MAX_WAITING:
            self.sessions.labels("over-limit").inc()
            conn.close("over-limit")
            return
        timer = self.loop.call_later(self.wait_timeout, self._expire, ticket_id, conn)
        self.waiting[ticket_id] = _Waiting(conn, secret, timer)

    def _invalid(self, conn: PacketConnection) -> None:
        self.sessions.labels("invalid-ticket").inc()
        conn.close("invalid-ticket")

    def _pair_with_waiting(
        self, conn: PacketConnection, ticket_id: str, secret: str
    ) -> bool:
        waiting = self.waiting.get(ticket_id)
        if waiting is None:
            return False
        if waiting.conn.closed:
            self._forget(ticket_id, waiting)
            return False
        if not hmac.compare_digest(waiting.secret, secret):
            self._invalid(conn)
            return True
        self._forget(ticket_id, waiting)
        self._pair(waiting.conn, conn, ticket_id)
        return True

    def _forget(self, ticket_id: str, waiting: _Waiting) -> None:
        waiting.timer.cancel()
        if self.waiting.get(ticket_id) is waiting:
            del self.waiting[ticket_id]

    def _expire(self, ticket_id: str, conn: PacketConnection) -> None:
        waiting = self.waiting.get(ticket_id)
        if waiting is not None and waiting.conn is conn:
            del self.waiting[ticket_id]
            self.sessions.labels("peer-never-came").inc()
            conn.close("peer-never-came")

    def _pair(
        self, first: PacketConnection, second: PacketConnection, ticket_id: str
    ) -> None:
        assert first.transport is not None and second.transport is not None
        first.send(encode_turn_packet(TurnConnected(second.host)))
        second.send(encode_turn_packet(TurnConnected(first.host)))
        early_first = first.relay_to(second)
        early_second = second.relay_to(first)
        if early_first:
            second.transport.write(early_first)
        if early_second:
            first.transport.write(early_second)
        self.sessions.labels("paired").inc()
        self.relays.inc()
        task = asyncio.create_task(self._drop_ticket(ticket_id))
        task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)

    async def _drop_ticket(self, ticket_id: str) -> None:
        try:
            await self.registry.drop_ticket(ticket_id)
        except StoreError:
            pass

    def rejected(self, conn: PacketConnection, reason: str) -> None:
        self.sessions.labels("malformed").inc()

    def closed(self, conn: PacketConnection) -> None:
        ticket_id = conn.state
        if isinstance(ticket_id, str):
            waiting = self.waiting.get(ticket_id)
            if waiting is not None and waiting.conn is conn:
                self._forget(ticket_id, waiting)
        if conn.relay_peer is not None:
            self.relayed_bytes.inc(conn.relay_bytes)
            partner = conn.relay_partner
            # Count the pair once: when its first side is forgotten.
            if partner is not None and not partner.relay_done:
                self.relays.dec()
            conn.relay_done = True

    def cancel_all(self) -> None:
        for waiting in list(self.waiting.values()):
            waiting.timer.cancel()
        self.waiting.clear()
