"""The OpenTTD STUN service (TCP 3975).

A peer connects, sends one SERCLI_STUN packet (token, address family) and keeps
the socket open: it will later connect to its peer *from the same local
address*, which is what makes the public address we saw useful
(reference ``openttd-coordinator.md`` section 6). We never answer. We tell the
coordinator instance named inside the token which address we saw, and hold the
connection until the peer closes it or :attr:`Limits.idle_timeout` passes.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from crossroads.proto.openttd.routing import Ignore, route_stun_request
from crossroads.proto.openttd.stun import decode_stun_packet
from crossroads.services.openttd.bus import Bus
from crossroads.services.openttd.conn import PacketConnection
from crossroads.services.openttd.metrics import counter


class StunHandler:
    """Handler for the STUN listener."""

    def __init__(self, bus: Bus, metrics: CollectorRegistry) -> None:
        self.bus = bus
        self.requests = counter(
            metrics, "stun_requests", "SERCLI_STUN packets, by result.", "result"
        )

    async def handle(
        self, conn: PacketConnection, packet_type: int, payload: bytes
    ) -> None:
        if conn.state is not None:
            # One packet per connection; more is not OpenTTD.
            self.requests.labels("extra-packet").inc()
            conn.close("extra-packet")
            return
        request = decode_stun_packet(packet_type, payload)
        conn.state = request
        host, port = conn.peer
        route = route_stun_request(request.token, request.family, host, port)
        if isinstance(route, Ignore):
            self.requests.labels(route.reason).inc()
            conn.close(route.reason)
            return
        await self.bus.publish(route)
        self.requests.labels("ok").inc()

    def rejected(self, conn: PacketConnection, reason: str) -> None:
        self.requests.labels("malformed").inc()

    def closed(self, conn: PacketConnection) -> None:
        pass
