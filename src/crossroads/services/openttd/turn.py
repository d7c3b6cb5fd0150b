"""The OpenTTD TURN service (TCP 3974): pair two sockets by ticket, then relay.

Control plane (reference ``openttd-coordinator.md`` section 6): each side
connects and sends SERCLI_CONNECT with the ticket the coordinator gave both. A
ticket is ``<id>:<secret>``; the coordinator stored ``id -> secret`` in the store
with a 30 s TTL. The first side is checked against the store and waits (at most
:attr:`TurnHandler.wait_timeout`, in the sans-I/O
:class:`~crossroads.proto.openttd.lobby.TurnLobby`, whose one timer holds every
side's deadline); the second must present the same ticket (constant-time
compare). Both then get TURN_CONNECTED with the other's IP, the
ticket is deleted (single use), and the pair switches to relaying.

Data plane: both sockets are handed over (:meth:`PacketConnection.hand_over`)
to a stream route of the relay data plane
(:mod:`crossroads.transport.streamplane`): TURN_CONNECTED and any game bytes
that came with SERCLI_CONNECT go first, then the kernel splices each side's
bytes to the other. No framing, no parsing, no store, no copy to user space;
backpressure, half-close and the idle timeout are the plane's. The two
connections stay admitted by the listener (per-IP and global caps as before)
until the route ends.

An invalid ticket is closed at once, without TURN_ERROR (as the reference
service does: it gives a prober nothing to learn).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from crossroads.errors import StoreError
from crossroads.proto.openttd.codes import split_ticket
from crossroads.proto.openttd.lobby import (
    MISMATCH,
    TicketCheck,
    TicketVerdict,
    TurnLobby,
)
from crossroads.proto.openttd.store import DropTicket, StoreWrite
from crossroads.proto.openttd.turn import (
    TurnConnected,
    decode_turn_connect,
    encode_turn_packet,
)
from crossroads.services.openttd.conn import PacketConnection
from crossroads.services.openttd.metrics import counter, gauge
from crossroads.services.openttd.registry import Registry
from crossroads.services.openttd.runners import run_store_flow, run_store_request
from crossroads.transport.admission import Admission, Pool, ResourceBudget
from crossroads.transport.driver import CoreTimer
from crossroads.transport.streamplane import IDLE, StreamPlane, StreamRoute

#: A lone side waits this long for its peer (reference section 6: 20 s).
WAIT_TIMEOUT = 20.0
#: Sides waiting for a peer, process wide (each is one open socket).
MAX_WAITING = 10000
#: Seconds a relayed pair may stay silent both ways (the service's default
#: ``relay_idle_timeout``).
RELAY_IDLE_TIMEOUT = 300.0
#: The resource budget's table of relayed pairs (docs/security.md).
RELAY_TABLE = "openttd-relays"
#: Descriptors a relayed pair holds beyond the two accepted sockets (which the
#: listener's table counts): their duplicates and two pipes (the stream route).
FDS_PER_RELAY = 6
#: Memory of one relayed pair beyond its two connections: the route, its two
#: pipes' kernel buffers (64 KiB each by default, Linux pipe(7)), the
#: TURN_CONNECTED packets.
BYTES_PER_RELAY = 2 * 64 * 1024 + 4096


def relay_table(resources: ResourceBudget, max_connections: int) -> Admission:
    """Register the relayed pairs with the process's budget: at most half the
    listener's connections (two a pair), capped by the relay pool's
    descriptors (:data:`FDS_PER_RELAY` a pair) and the memory share."""
    pairs = max(1, max_connections // 2)
    return resources.table(
        RELAY_TABLE,
        max_items=pairs,
        max_per_source=pairs,
        pool=Pool.RELAY,
        descriptors_per_item=FDS_PER_RELAY,
        bytes_per_item=BYTES_PER_RELAY,
    )


#: Told the bytes a relay carried, client to server and back, when it ends.
RelayWatcher = Callable[[int, int], None]


class TurnHandler:
    """Handler for the TURN listener."""

    def __init__(
        self,
        registry: Registry,
        metrics: CollectorRegistry,
        wait_timeout: float = WAIT_TIMEOUT,
        relay_idle_timeout: float = RELAY_IDLE_TIMEOUT,
        max_relays: int | None = None,
        table: Admission | None = None,
    ) -> None:
        self.registry = registry
        self.loop = asyncio.get_running_loop()
        self.wait_timeout = wait_timeout
        #: The sides waiting for their peer, under one timer
        #: (proto/openttd/lobby.py).
        self.lobby: TurnLobby[PacketConnection] = TurnLobby(wait_timeout, MAX_WAITING)
        self.timer = CoreTimer(self.loop, self.lobby.get_timer, self._handle_timer)
        self.plane = StreamPlane(
            idle_timeout=relay_idle_timeout,
            max_routes=max_relays if max_relays is not None else 25000,
        )
        #: The budget's table of relayed pairs (None: the plane's cap only),
        #: admitted by the first side's host; the pair's hosts by route.
        self.table = table
        self.admitted: dict[StreamRoute, str] = {}
        #: The two connections of each live route, and each one's route.
        self.pairs: dict[StreamRoute, tuple[PacketConnection, PacketConnection]] = {}
        self.route_of: dict[PacketConnection, StreamRoute] = {}
        #: Each live route's ticket id and back (single use: one route a
        #: ticket), and who waits for the bytes of which (:meth:`watch`).
        self.ticket_of: dict[StreamRoute, str] = {}
        self.route_by_ticket: dict[str, StreamRoute] = {}
        self.watchers: dict[StreamRoute, tuple[str, RelayWatcher]] = {}
        self.sessions = counter(
            metrics, "turn_sessions", "TURN connections, by outcome.", "result"
        )
        self.relays = gauge(metrics, "turn_relays", "Relayed pairs in progress.")
        self.relays_ended = counter(
            metrics,
            "turn_relays_ended",
            "Relays ended, by reason (closed: both sides finished; reset; idle; "
            "shutdown).",
            "reason",
        )
        self.relayed_bytes = counter(
            metrics, "turn_bytes", "Bytes relayed (counted when a relay ends)."
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
        verdict = await run_store_flow(self.registry, TicketCheck(ticket_id, secret))
        if verdict is TicketVerdict.STORE_ERROR:
            self.sessions.labels("store-error").inc()
            conn.close("store-error")
            return
        if verdict is not TicketVerdict.VALID:
            self._invalid(conn)
            return
        if conn.closed or self._pair_with_waiting(conn, ticket_id, secret):
            return
        if not self.lobby.wait(ticket_id, secret, conn, self.loop.time()):
            self.sessions.labels("over-limit").inc()
            conn.close("over-limit")
            return
        self.timer.rearm()

    def _invalid(self, conn: PacketConnection) -> None:
        self.sessions.labels("invalid-ticket").inc()
        conn.close("invalid-ticket")

    def _pair_with_waiting(
        self, conn: PacketConnection, ticket_id: str, secret: str
    ) -> bool:
        waiting = self.lobby.pair(ticket_id, secret)
        if waiting is MISMATCH:
            self._invalid(conn)
            return True
        self.timer.rearm()
        if waiting is None or waiting.closed:
            return False
        self._pair(waiting, conn, ticket_id)
        return True

    def _handle_timer(self, now: float) -> None:
        """The lobby's timer: close the sides whose peer never came."""
        self.lobby.handle_timer(now)
        for conn in self.lobby.pop_events():
            self.sessions.labels("peer-never-came").inc()
            conn.close("peer-never-came")

    def _pair(
        self, first: PacketConnection, second: PacketConnection, ticket_id: str
    ) -> None:
        table = self.table
        if table is not None and table.admit(first.host) is not None:
            self.sessions.labels("over-limit").inc()
            first.close("over-limit")
            second.close("over-limit")
            return
        admitted = first.host if table is not None else None
        route = self._join(first, second)
        if route is None:
            if admitted is not None and table is not None:
                table.release(admitted)
            return
        if admitted is not None:
            if route.closed and table is not None:
                table.release(admitted)
            else:
                self.admitted[route] = admitted
        if not route.closed:
            self.ticket_of[route] = ticket_id
            self.route_by_ticket[ticket_id] = route
        task = asyncio.create_task(self._drop_ticket(ticket_id))
        task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)

    def _join(
        self, first: PacketConnection, second: PacketConnection
    ) -> StreamRoute | None:
        """Hand both sides to the stream plane; the route, or None (both
        closed) when a side went or the plane is full."""
        first_side = first.hand_over()
        second_side = second.hand_over() if first_side is not None else None
        if first_side is None or second_side is None:
            # One side is closing (or asyncio still has bytes for it, which
            # nothing sends before TURN_CONNECTED): nothing to relay.
            if first_side is not None:
                first_side[0].close()
            self.sessions.labels("peer-gone").inc()
            first.close("peer-gone")
            second.close("peer-gone")
            return None
        (first_sock, first_early), (second_sock, second_early) = first_side, second_side
        route = self.plane.join(
            first_sock,
            second_sock,
            to_a=encode_turn_packet(TurnConnected(second.host)) + second_early,
            to_b=encode_turn_packet(TurnConnected(first.host)) + first_early,
            on_closed=self._relay_ended,
        )
        if route is None:
            self.sessions.labels("over-limit").inc()
            first.close("over-limit")
            second.close("over-limit")
            return None
        self.sessions.labels("paired").inc()
        if route.closed:
            # Ended while sending TURN_CONNECTED (a side reset meanwhile):
            # its connections are not in ``pairs`` yet, so close them here.
            first.close(f"relay-{route.reason}")
            second.close(f"relay-{route.reason}")
        else:
            self.pairs[route] = (first, second)
            self.route_of[first] = self.route_of[second] = route
            self.relays.inc()
        return route

    def watch(self, ticket_id: str, client_host: str, watcher: RelayWatcher) -> bool:
        """Call ``watcher(client_to_server, server_to_client)`` with the bytes
        the relay of ``ticket_id`` carried each way when it ends (the join's
        insight record waits for them); False when no live relay here has
        that ticket (another instance relays it, or it already ended).

        The side whose host is ``client_host`` is the client: the pair's two
        sides present the same ticket. Two sides behind one address cannot
        be told apart; the first to connect is taken for the client then."""
        route = self.route_by_ticket.get(ticket_id)
        if route is None or route.closed:
            return False
        self.watchers[route] = (client_host, watcher)
        return True

    def _relay_ended(self, route: StreamRoute) -> None:
        """The data plane ended ``route``: count it, close both connections."""
        self.relayed_bytes.inc(route.octets)
        self.relays_ended.labels(route.reason).inc()
        host = self.admitted.pop(route, None)
        if host is not None and self.table is not None:
            self.table.release(host)
        ticket_id = self.ticket_of.pop(route, None)
        if ticket_id is not None:
            self.route_by_ticket.pop(ticket_id, None)
        pair = self.pairs.pop(route, None)
        watching = self.watchers.pop(route, None)
        if watching is not None and pair is not None:
            client_host, watcher = watching
            forward, back = route.a_to_b.octets, route.b_to_a.octets
            if pair[0].host != client_host and pair[1].host == client_host:
                forward, back = back, forward
            watcher(forward, back)
        if pair is None:
            return
        self.relays.dec()
        for conn in pair:
            self.route_of.pop(conn, None)
            if route.reason == IDLE:
                conn.listener.drop(conn, "relay-idle")
            else:
                conn.close(f"relay-{route.reason}")

    async def _drop_ticket(self, ticket_id: str) -> None:
        with contextlib.suppress(StoreError):
            # Single use, but the ticket's TTL removes it anyway.
            await run_store_request(self.registry, StoreWrite(0, DropTicket(ticket_id)))

    def rejected(self, conn: PacketConnection, reason: str) -> None:
        self.sessions.labels("malformed").inc()

    def closed(self, conn: PacketConnection) -> None:
        ticket_id = conn.state
        if isinstance(ticket_id, str):
            self.lobby.leave(ticket_id, conn)
            self.timer.rearm()
        route = self.route_of.get(conn)
        if route is not None:
            # Closed from outside the plane (shutdown, an operator): the
            # route's own descriptors would keep the socket open.
            route.close()

    def cancel_all(self) -> None:
        self.timer.close()
        self.lobby.clear()
        self.plane.close()
        if self.table is not None:
            self.table.budget.forget(self.table.name)
