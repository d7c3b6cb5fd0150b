"""The Unity relay over WebSockets (``ws``, and ``wss`` inside TLS).

Theory of operation
-------------------
Unity Transport's WebSocket client (reference ``unity-secure-transports.md``
§2) opens a TCP connection (TLS first for ``wss``), sends a plain
``GET / HTTP/1.1`` upgrade request with no subprotocol, no extension and no
query string, and then carries exactly one relay message per binary frame: the
allocation is named only by the BIND inside the stream. So a connection is, to
the relay core, one more client address: :meth:`RelayEndpoint.attach_stream`
gives it one, every binary message goes through the same route lookup and
slow path as a datagram (:meth:`RelayEndpoint.receive_stream`), and whatever
the core sends to that address comes back here as one binary frame.

1. **Admission.** On accept (for ``wss``: once the TLS handshake is done, which
   :class:`~crossroads.transport.tls.TlsAcceptor` bounds) the listener's
   :class:`~crossroads.transport.admission.Admission` applies the global and
   per-source caps; a refused connection is closed at once.
2. **Handshake.** The upgrade request must arrive whole within
   :data:`HANDSHAKE_TIMEOUT` (a slow-loris client is cut). The answer is a bare
   ``101`` with ``Upgrade``, ``Connection`` and ``Sec-WebSocket-Accept``: the
   native client aborts on any ``Sec-WebSocket-Protocol`` or
   ``Sec-WebSocket-Extensions`` header (§2.2), so offered subprotocols and
   extensions (a browser's ``permessage-deflate``) are declined, never echoed.
   Any path is accepted: the game may change it (``WithWebSocketParameters``).
3. **Frames.** Binary messages up to :data:`MAX_FRAME` bytes (the native
   client's receive limit, §2.3) go to the core; a larger one closes with 1009
   (message too big), a text frame with 1003 (unsupported data), like the
   client does itself. Pings are answered with pongs; close is echoed.
4. **Bind deadline.** A connection is unauthenticated state until an
   allocation is bound at it (a BIND with a token this node sealed and its
   HMAC, :mod:`crossroads.proto.relay.server`): one that holds none for
   :data:`BIND_TIMEOUT` after the upgrade is closed with 1008 (policy
   violation) and counted (``bind-timeout``), whatever it sends meanwhile --
   junk, PINGs naming nothing and bad BINDs are all relay messages to the idle
   rule. Unity's client BINDs as soon as the WebSocket is up and retries every
   second (reference ``unity-relay-and-raknet.md`` §1.2), so a real client is
   bound within a round trip or two. The deadline starts again when the last
   allocation bound at the connection ends (its CLOSE, a timeout, an
   operator's kick): a connection holding nothing is pre-auth state again.
5. **Idle.** A connection that carries no relay message (binary frame) for the
   relay's idle timeout is closed. WebSocket pings do not count: they are the
   native client's own liveness probe (every 500 ms when it hears nothing,
   §2.3), while relay PINGs flow every few seconds and "the relay's 10 s idle
   rule still applies" (§2.3). So a connection that only pings, bound or not,
   is a dead client or an attacker, and it ends like any silent one.
6. **Sending.** A relay message for the client larger than :data:`MAX_FRAME`
   is dropped (the client would abort on it), and so is one that finds more
   than :data:`MAX_BUFFERED` bytes waiting in the socket: like a full UDP send
   buffer, a slow reader loses frames instead of growing server memory.
7. **One bound for every write.** Pongs and close frames cannot be dropped like
   relay messages (the protocol object answers each ping as it parses it), so
   they count against the same :data:`MAX_BUFFERED` differently: when the
   write buffer goes over it (the transport's high-water mark) the connection
   stops *reading* until the buffer is back under :data:`RESUME_BUFFERED`. A
   client that pings and never reads then fills its own socket, and TCP flow
   control stops it. This is what websockets' own asyncio protocol (and so
   uvicorn) does: the pong is followed by ``drain()``, which holds the reader
   while the transport is over its high-water mark; answering only some pings
   would also be allowed (RFC 6455 §5.5.3), but needs a parser that defers
   them. A connection's buffer is thus at most :data:`MAX_BUFFERED` plus the
   pongs of one read (asyncio reads up to 256 KiB at a time, and a pong is
   never larger than its ping).

Every refusal and drop is counted by reason in :attr:`WebSocketListener.drops`.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import cast

from websockets.exceptions import InvalidState
from websockets.frames import Frame, Opcode
from websockets.http11 import Request
from websockets.protocol import State
from websockets.server import ServerProtocol

from crossroads.transport.admission import Admission
from crossroads.transport.relay import RelayEndpoint
from crossroads.types import Address

#: Largest binary message either way: Unity Transport's receive capacity minus
#: its 14-byte frame header allowance, 1400 - 14 (reference
#: unity-secure-transports.md §2.3, ``WebSocketLayer.cs:526``).
MAX_FRAME = 1386
#: Seconds from accept to a complete upgrade request. The native client gives
#: the server 1 s to answer (``connectTimeoutMS``, §2.2); 5 s leaves room for a
#: slow link and still frees a slot held by a client that sends nothing.
HANDSHAKE_TIMEOUT = 5.0
#: Seconds an upgraded connection may hold no bound allocation. Unity's
#: client sends its BIND as soon as the WebSocket is connected and again every
#: ``connectTimeoutMS`` (1 s) until BIND_RECEIVED (reference
#: unity-relay-and-raknet.md §1.2), so 10 s is ten BINDs lost in a row -- the
#: relay's own 10 s idle rule (same table) would have ended such a client too.
BIND_TIMEOUT = 10.0
#: Bytes allowed to wait in a connection's send buffer before relay messages
#: to it are dropped: about 180 full frames, a fraction of a second of a game's
#: traffic.
MAX_BUFFERED = 256 * 1024
#: Reading resumes once the write buffer is back under this (a quarter of the
#: bound, asyncio's own high/low ratio).
RESUME_BUFFERED = MAX_BUFFERED // 4
#: Bytes one connection may hold at most, measured under the worst client (a
#: ping flood that never reads: RSS growth of a ``crossroads serve`` child per
#: connection, 8 and 32 connections, docs/security.md "WebSocket memory"):
#: the write buffer (MAX_BUFFERED plus the pongs of one 256 KiB read) and the
#: protocol objects; for wss also asyncio's TLS layer (its 256 KiB read buffer
#: and the plaintext and ciphertext waiting on both sides).
WS_CONNECTION_BYTES = 704 * 1024
WSS_CONNECTION_BYTES = 1600 * 1024
#: Close codes (RFC 6455 §7.4.1).
CLOSE_UNSUPPORTED_DATA = 1003
CLOSE_GOING_AWAY = 1001
CLOSE_PROTOCOL_ERROR = 1002
CLOSE_POLICY_VIOLATION = 1008
CLOSE_INVALID_DATA = 1007
CLOSE_MESSAGE_TOO_BIG = 1009

DROP_HANDSHAKE_TIMEOUT = "handshake-timeout"
DROP_BAD_HANDSHAKE = "bad-handshake"
DROP_TEXT_FRAME = "text-frame"
DROP_PROTOCOL_ERROR = "protocol-error"
DROP_IN_TOO_LARGE = "incoming-too-large"
DROP_IDLE = "idle-timeout"
DROP_BIND_TIMEOUT = "bind-timeout"
DROP_OUT_TOO_LARGE = "outgoing-too-large"
DROP_SLOW_READER = "slow-reader"


#: Closes the protocol object sends on its own when the client breaks the
#: rules, counted under these reasons.
FAILURES = {
    CLOSE_PROTOCOL_ERROR: DROP_PROTOCOL_ERROR,
    CLOSE_INVALID_DATA: DROP_PROTOCOL_ERROR,
    CLOSE_MESSAGE_TOO_BIG: DROP_IN_TOO_LARGE,
}


@dataclass(eq=False)
class WebSocketListener:
    """What the connections of one ``ws`` or ``wss`` listener share."""

    endpoint: RelayEndpoint
    admission: Admission
    idle_timeout: float
    handshake_timeout: float = HANDSHAKE_TIMEOUT
    bind_timeout: float = BIND_TIMEOUT
    #: Refusals and drops by reason (exported as metrics).
    drops: dict[str, int] = field(default_factory=dict, init=False)
    #: Connections that completed the WebSocket handshake.
    upgraded: int = field(default=0, init=False)
    #: Times a connection stopped reading because its write buffer was full.
    read_pauses: int = field(default=0, init=False)

    def drop(self, reason: str) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + 1

    def connection(self) -> RelayWebSocket:
        """A protocol for one accepted connection (the server's factory)."""
        return RelayWebSocket(self)


class RelayWebSocket(asyncio.Protocol):
    """One WebSocket connection carrying Unity relay messages."""

    def __init__(self, listener: WebSocketListener) -> None:
        self.listener = listener
        self.ws = ServerProtocol(max_size=MAX_FRAME)
        self.transport: asyncio.Transport | None = None
        self.host = ""
        self.address: Address | None = None
        self._admitted = False
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None
        #: Armed while no allocation is bound at this connection.
        self._bind_timer: asyncio.TimerHandle | None = None
        self._last_received = 0.0
        self._fragments: bytearray | None = None
        self._reading_paused = False

    # ---------------------------------------------------------------- asyncio

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = stream = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        self.host = str(peer[0]) if peer else ""
        if self.listener.admission.admit(self.host) is not None:
            stream.abort()
            return
        self._admitted = True
        # Every write (relay messages, pongs, closes) counts against one bound:
        # over it pause_writing() stops reading (module docstring, point 7).
        stream.set_write_buffer_limits(high=MAX_BUFFERED, low=RESUME_BUFFERED)
        self._timer = self._loop.call_later(
            self.listener.handshake_timeout, self._handshake_expired
        )

    def data_received(self, data: bytes) -> None:
        if self.transport is None or not self._admitted:
            return
        self.ws.receive_data(data)
        for event in self.ws.events_received():
            if isinstance(event, Request):
                self._answer(event)
            elif isinstance(event, Frame):
                self._frame(event)
        if self.ws.handshake_exc is not None and self.ws.state is State.CONNECTING:
            self.listener.drop(DROP_BAD_HANDSHAKE)
        self._write()

    def eof_received(self) -> bool | None:
        if self.transport is not None and self._admitted:
            with contextlib.suppress(EOFError):
                self.ws.receive_eof()
            self._write()
        return None

    def pause_writing(self) -> None:
        """The write buffer went over :data:`MAX_BUFFERED`: read no more (no
        more pings to answer) until it drains."""
        transport = self.transport
        if transport is not None and not self._reading_paused:
            self._reading_paused = True
            self.listener.read_pauses += 1
            with contextlib.suppress(RuntimeError):  # closing already
                transport.pause_reading()

    def resume_writing(self) -> None:
        """The write buffer is back under :data:`RESUME_BUFFERED`."""
        transport = self.transport
        if self._reading_paused and transport is not None:
            self._reading_paused = False
            with contextlib.suppress(RuntimeError):
                transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._bind_timer is not None:
            self._bind_timer.cancel()
            self._bind_timer = None
        if self.address is not None:
            self.listener.endpoint.detach_stream(self.address)
            self.address = None
        if self._admitted:
            self._admitted = False
            self.listener.admission.release(self.host)

    # -------------------------------------------------------------- handshake

    def _answer(self, request: Request) -> None:
        response = self.ws.accept(request)
        # Nothing the client did not need: no Server banner, and (with no
        # extensions or subprotocols configured) no Sec-WebSocket-Extensions
        # or Sec-WebSocket-Protocol header, which the native client refuses.
        if "Server" in response.headers:
            del response.headers["Server"]
        self.ws.send_response(response)
        if response.status_code != 101:
            return  # counted in data_received (handshake_exc is set)
        self.listener.upgraded += 1
        self._last_received = self._loop.time()
        self.address = self.listener.endpoint.attach_stream(
            self.host, self.send, self._binding
        )
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(
            self.listener.idle_timeout, self._check_idle
        )
        self._binding(False)

    def _binding(self, bound: bool) -> None:
        """The endpoint says whether an allocation is bound at this
        connection: the bind deadline stops, or starts (module docstring,
        point 4)."""
        if bound:
            if self._bind_timer is not None:
                self._bind_timer.cancel()
                self._bind_timer = None
        elif self._bind_timer is None and self.transport is not None:
            self._bind_timer = self._loop.call_later(
                self.listener.bind_timeout, self._bind_expired
            )

    def _bind_expired(self) -> None:
        self._bind_timer = None
        if self.transport is None or self.ws.state is not State.OPEN:
            return
        self.listener.drop(DROP_BIND_TIMEOUT)
        self.listener.admission.closed(DROP_BIND_TIMEOUT)
        self._close(CLOSE_POLICY_VIOLATION)
        self._write()
        if self.transport is not None:
            self.transport.abort()

    def _handshake_expired(self) -> None:
        self._timer = None
        if self.ws.state is State.CONNECTING and self.transport is not None:
            self.listener.drop(DROP_HANDSHAKE_TIMEOUT)
            self.listener.admission.closed(DROP_HANDSHAKE_TIMEOUT)
            self.transport.abort()

    def _check_idle(self) -> None:
        self._timer = None
        if self.transport is None:
            return
        idle = self._loop.time() - self._last_received
        if idle >= self.listener.idle_timeout:
            self.listener.drop(DROP_IDLE)
            self.listener.admission.closed(DROP_IDLE)
            self._close(CLOSE_GOING_AWAY)
            self._write()
            if self.transport is not None:
                self.transport.abort()
            return
        self._timer = self._loop.call_later(
            self.listener.idle_timeout - idle, self._check_idle
        )

    # ----------------------------------------------------------------- frames

    def _frame(self, frame: Frame) -> None:
        opcode = frame.opcode
        if opcode is Opcode.BINARY or opcode is Opcode.CONT:
            # Only data counts as life (module docstring, point 5).
            self._last_received = self._loop.time()
        if opcode is Opcode.BINARY:
            if frame.fin:
                self._deliver(bytes(frame.data))
            else:
                self._fragments = bytearray(frame.data)
        elif opcode is Opcode.CONT and self._fragments is not None:
            # The protocol's max_size already bounds the whole message.
            self._fragments += frame.data
            if frame.fin:
                data, self._fragments = bytes(self._fragments), None
                self._deliver(data)
        elif opcode is Opcode.TEXT:
            self.listener.drop(DROP_TEXT_FRAME)
            self._close(CLOSE_UNSUPPORTED_DATA)
        # PING is answered and CLOSE echoed by the protocol object; PONG needs
        # nothing.

    def _deliver(self, data: bytes) -> None:
        # Not after a close this connection decided on, even for frames that
        # came in the same read.
        if self.address is not None and self.ws.state is State.OPEN:
            self.listener.endpoint.receive_stream(data, self.address)

    def _close(self, code: int) -> None:
        """Close with ``code`` without waiting for the client's echo: a client
        that broke the rules gets no more time (RFC 6455 §7.1.7, "fail")."""
        with contextlib.suppress(InvalidState):
            self.ws.fail(code)

    # ---------------------------------------------------------------- sending

    def send(self, data: bytes) -> None:
        """One relay message to the client, as one binary frame."""
        transport = self.transport
        if transport is None or self.ws.state is not State.OPEN:
            return
        if len(data) > MAX_FRAME:
            self.listener.drop(DROP_OUT_TOO_LARGE)
            return
        if transport.get_write_buffer_size() > MAX_BUFFERED:
            self.listener.drop(DROP_SLOW_READER)
            return
        self.ws.send_binary(data)
        self._write()

    def _write(self) -> None:
        transport = self.transport
        if transport is None:
            return
        # One write per batch: a read full of pings makes thousands of small
        # pongs, and a transport that keeps each as an object of its own (uvloop
        # queues them) pays far more than their bytes.
        pending: list[bytes] = []
        for chunk in self.ws.data_to_send():
            if chunk:
                pending.append(chunk)
                continue
            if pending:
                transport.write(b"".join(pending))
                pending = []
            # The protocol is done (closed, failed or refused): the server
            # closes the TCP connection first (RFC 6455 §7.1.1).
            sent = self.ws.close_sent
            reason = FAILURES.get(sent.code) if sent is not None else None
            if reason is not None:
                self.listener.drop(reason)
            transport.close()
            self.transport = None
            return
        if pending:
            transport.write(pending[0] if len(pending) == 1 else b"".join(pending))
