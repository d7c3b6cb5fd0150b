"""One TLS port for TURN over TLS and HTTPS (``--turn-tls-port 443`` with
``--https-port 443``): each connection goes to the service it speaks to.

Theory of operation
-------------------
Firewalls that pass only outbound TLS to port 443 are why TURN over TLS is
offered on 443 at all (RFC 8656 §3), and HTTPS wants the same port. After the
TLS handshake (bounded by :class:`~crossroads.transport.tls.TlsAcceptor`) a
:class:`TlsSorter` is the connection's protocol until it knows which service
the client wants:

1. **ALPN** (RFC 7301): the shared port's context offers ``stun.turn``
   (RFC 7443) and ``http/1.1``; a client that named one of them is handed over
   at once. ``h2`` is not offered: the HTTP server speaks HTTP/1.1, and a
   browser offering both gets ``http/1.1``.
2. **First byte** otherwise (coturn's uclient and most TURN clients send no
   ALPN): the first message of a TURN connection is a STUN request, whose
   first byte is 0-3 (RFC 7983 §7's range for STUN: the two top bits are
   zero, RFC 8489 §5, and every registered method is below 0x400;
   ChannelData, 0x40-0x4F, needs an allocation on this connection first,
   RFC 8656 §12); an HTTP request starts with a method
   (RFC 9110 §9: ``GET``, ``POST``, ``PUT``, ``HEAD``, ``DELETE``,
   ``OPTIONS``, ``PATCH``, ``CONNECT``, ``TRACE``). Anything else is closed and
   counted (``tls-sort-unknown``), and so is a client that sends nothing for
   :data:`FIRST_BYTES_TIMEOUT` seconds (``tls-sort-timeout``).

The chosen protocol gets the TLS transport (``connection_made``) and the bytes
read so far (``data_received``): from there it is exactly the connection it
would have been on its own port, with its own caps and deadlines. While it is
sorted, the connection is held in the port's connection table (its descriptor
share), as it was during the handshake.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import cast

from crossroads.transport.admission import Admission

#: Seconds a client has, after the handshake, to send its first byte. A TURN
#: client sends its Allocate and a browser its request at once; as long as the
#: TLS handshake's own bound (tls.HANDSHAKE_TIMEOUT).
FIRST_BYTES_TIMEOUT = 10.0


class Application(enum.Enum):
    """The services a shared TLS port can lead to."""

    TURN = "turn"
    HTTP = "http"


#: ALPN protocol IDs offered on the shared port, in the server's preference.
ALPN = {"stun.turn": Application.TURN, "http/1.1": Application.HTTP}
#: RFC 7983 §7: a first byte of 0-3 is STUN.
_STUN_LAST_FIRST_BYTE = 3
#: First bytes of the HTTP methods (RFC 9110 §9.3, RFC 5789).
_HTTP_FIRST = frozenset(b"GPHDOCT")


def classify(first: int) -> Application | None:
    """The service a connection whose first application byte is ``first``
    speaks to, or None when neither could start that way."""
    if first <= _STUN_LAST_FIRST_BYTE:
        return Application.TURN
    if first in _HTTP_FIRST:
        return Application.HTTP
    return None


@dataclass(eq=False)
class TlsSorter(asyncio.Protocol):
    """A shared TLS port's connection until its service is known."""

    factories: Mapping[Application, Callable[[], asyncio.Protocol]]
    drop: Callable[[str], None]
    timeout: float = FIRST_BYTES_TIMEOUT
    #: The port's connection table (its descriptor share): a connection is
    #: held in it while it is sorted, then the chosen protocol admits it to
    #: its own. None: not counted here.
    admission: Admission | None = None
    transport: asyncio.Transport | None = field(default=None, init=False)
    _timer: asyncio.TimerHandle | None = field(default=None, init=False)
    _host: str | None = field(default=None, init=False)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self.admission is not None:
            peer = transport.get_extra_info("peername")
            host = str(peer[0]) if peer else ""
            if self.admission.admit(host) is not None:
                self.drop("tls-sort-limit")
                cast(asyncio.Transport, transport).abort()
                return
            self._host = host
        self.transport = transport  # type: ignore[assignment]
        ssl_object = transport.get_extra_info("ssl_object")
        chosen = ssl_object.selected_alpn_protocol() if ssl_object else None
        if chosen in ALPN:
            self._hand_over(ALPN[chosen], b"")
            return
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.timeout, self._expired)

    def data_received(self, data: bytes) -> None:
        if self.transport is None or not data:
            return
        application = classify(data[0])
        if application is None:
            self.drop("tls-sort-unknown")
            self._abort()
            return
        self._hand_over(application, data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        self._release()
        self.transport = None

    def _release(self) -> None:
        host, self._host = self._host, None
        if host is not None and self.admission is not None:
            self.admission.release(host)

    def _hand_over(self, application: Application, data: bytes) -> None:
        self._cancel()
        # The chosen protocol admits the connection to its own table.
        self._release()
        transport = self.transport
        assert transport is not None
        self.transport = None
        protocol = self.factories[application]()
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        if data and not transport.is_closing():
            protocol.data_received(data)

    def _expired(self) -> None:
        self._timer = None
        if self.transport is not None:
            self.drop("tls-sort-timeout")
            self._abort()

    def _abort(self) -> None:
        self._cancel()
        self._release()
        if self.transport is not None:
            self.transport.abort()
            self.transport = None

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
