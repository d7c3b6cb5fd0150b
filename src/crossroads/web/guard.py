"""Connection admission and read deadlines for the HTTP port (uvicorn).

Theory of operation
-------------------
uvicorn accepts every connection and, with its h11 protocol, waits for a
request as long as the client likes: a client that sends half a request line,
or a header a minute, holds its descriptor forever (slowloris). uvicorn's own
knobs do not cover it: ``timeout_keep_alive`` only runs *after* a response, and
``limit_concurrency`` answers 503 to requests but still accepts and keeps the
connections. So the HTTP port runs two small subclasses of uvicorn's protocols:

- :class:`GuardedHttp` (h11): asks the runtime's
  :class:`~crossroads.transport.admission.Admission` for the ``http`` listener
  on accept; a refused connection gets a ``503`` with the JSON error envelope
  and is closed before anything is read. An admitted one is watched by
  :class:`HttpGuard`.
- :class:`GuardedWebSocket`: after a WebSocket upgrade (the p2p signalling
  socket) uvicorn hands the transport to a new protocol object; this one gives
  the admission back when the WebSocket ends, so an upgraded connection counts
  against the same caps until it closes. Its liveness is the WebSocket's
  ping/pong (uvicorn: a ping every 20 s, closed 20 s without a pong).

:class:`HttpGuard` checks every admitted connection once a second. A connection
is *waiting for the client* while h11 has not received a complete request
(``their_state`` IDLE or SEND_BODY); it is stamped whenever that state or its
response count changes, and closed once it has waited ``request_timeout``
seconds in one stamp: headers and body of one request must arrive within that
time of the connection opening or of the previous response. Idle keep-alive
connections are closed sooner, by uvicorn's ``timeout_keep_alive``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
from collections.abc import Sequence

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.websockets.websockets_sansio_impl import (
    WebSocketsSansIOProtocol,
)

from crossroads.proto.policy import parse_networks
from crossroads.transport.admission import Admission
from crossroads.transport.tasks import Sweeper

#: How often deadlines are checked (seconds): one timer for the port, not one
#: per connection; a deadline fires up to this late.
SWEEP_EVERY = 1.0
#: h11 states in which the server waits for the client's bytes.
_WAITING = (h11.IDLE, h11.SEND_BODY)


def _refusal(reason: str) -> bytes:
    body = json.dumps(
        {"code": "too_many_connections", "message": f"connection refused: {reason}"}
    ).encode()
    return (
        b"HTTP/1.1 503 Service Unavailable\r\n"
        b"content-type: application/json\r\n"
        b"connection: close\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


def _peer_host(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if peer else ""


class HttpGuard:
    """The admission and deadlines of one HTTP port (see module docstring)."""

    def __init__(
        self,
        admission: Admission,
        request_timeout: float,
        trusted_proxies: Sequence[str] = (),
    ) -> None:
        self.admission = admission
        self.request_timeout = request_timeout
        #: Reverse proxies (``--trusted-proxy``): one address, many clients,
        #: so the per-IP connection cap does not apply to them.
        self.trusted_proxies = parse_networks(trusted_proxies)
        self.watched: set[GuardedHttp] = set()
        self._sweeper = Sweeper(self.sweep, SWEEP_EVERY)

    def is_trusted_proxy(self, host: str) -> bool:
        """True when ``host`` is in one of the ``--trusted-proxy`` networks."""
        if not self.trusted_proxies:
            return False
        try:
            address = ipaddress.ip_address(host.split("%", 1)[0])
        except ValueError:
            return False
        return any(address in net for net in self.trusted_proxies)

    def protocols(self) -> tuple[type[GuardedHttp], type[GuardedWebSocket]]:
        """uvicorn ``http`` and ``ws`` protocol classes bound to this guard."""
        guard = self

        class Http(GuardedHttp):
            pass

        class WebSocket(GuardedWebSocket):
            pass

        Http.guard = WebSocket.guard = guard
        return Http, WebSocket

    def start(self) -> None:
        self._sweeper.start()

    async def close(self) -> None:
        await self._sweeper.stop()

    def sweep(self, now: float) -> None:
        """Close the connections that waited too long for their request."""
        for proto in list(self.watched):
            key = (proto.conn.their_state, proto.responses)
            if key != proto.deadline_key:
                proto.deadline_key = key
                proto.waiting_since = now
            elif (
                key[0] in _WAITING and now - proto.waiting_since > self.request_timeout
            ):
                self.watched.discard(proto)
                self.admission.closed("request-timeout")
                proto.transport.abort()


class _GuardedPeer(asyncio.Protocol):
    """What both guarded protocols share: the guard, and the peer's host, read
    once when the connection is made (admission is counted per host)."""

    guard: HttpGuard
    peer_host: str

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.peer_host = _peer_host(transport)


class GuardedHttp(_GuardedPeer, H11Protocol):
    """uvicorn's h11 protocol with admission and a request deadline."""

    def connection_made(  # type: ignore[override]
        self, transport: asyncio.Transport
    ) -> None:
        super().connection_made(transport)
        self.responses = 0
        self.deadline_key: tuple[object, int] | None = None
        self.waiting_since = 0.0
        refused = self.guard.admission.admit(
            self.peer_host, per_ip_cap=not self.guard.is_trusted_proxy(self.peer_host)
        )
        self.admitted = refused is None
        if refused is not None:
            transport.write(_refusal(refused))
            transport.close()
            return
        self.guard.watched.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._release()

    def _release(self) -> None:
        if self.admitted:
            self.admitted = False
            self.guard.watched.discard(self)
            self.guard.admission.release(self.peer_host)

    def on_response_complete(self) -> None:
        self.responses += 1
        super().on_response_complete()

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        # The transport moves to a GuardedWebSocket, which releases the
        # admission when the WebSocket ends; this object is done.
        if self.admitted:
            self.admitted = False
            self.guard.watched.discard(self)
        super().handle_websocket_upgrade(event)


class GuardedWebSocket(_GuardedPeer, WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol, giving the HTTP admission back at the end."""

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.guard.admission.release(self.peer_host)
