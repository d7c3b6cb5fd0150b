"""TURN over DTLS (RFC 8656 §3, RFC 7350): the server's sessions on one UDP
socket and the client's association, each a sans-I/O core on the one driver.

What it is
----------
:class:`DtlsListener` runs the
:class:`~crossroads.proto.dtls.certificate_server.DtlsServer` core (every
client's OpenSSL session on memory BIOs; its module docstring has the theory
of operation: cookies before state, the two tables, pre-auth deadlines) on
one UDP socket with a :class:`~crossroads.transport.driver.DatagramDriver`.
Decrypted datagrams go to ``deliver(data, client, listener)`` exactly as plain
UDP datagrams from that client would; the listener is also the reply path
(``listener.send(data, client)`` encrypts through the client's session), so a
TURN allocation made over DTLS is keyed and relayed like a UDP one whose
"socket" is this listener. The session tables are the listener's own in the
process's resource budget (:class:`DtlsTables`: ``dtls-sessions:NAME``, every
session from its cookie to its end with its measured memory, and
``dtls-handshakes:NAME``, the handshakes in progress); their pre-auth
deadlines are the handshake timeout and the first-message timeout.

A session's end does not end the TURN allocation made over it: like a UDP
one, it lives until its lifetime runs out (or the client's new session, from
the same address, refreshes it). The other way round, the TURN service ends
the session (close_notify) when the allocation made over it ends
(:meth:`DtlsListener.end_session`), so clients that leave without a
close_notify do not hold sessions until the idle timeout.

Every refusal is counted through ``drop(reason)``: ``dtls-not-dtls``,
``dtls-no-session``, ``dtls-bad-client-hello``, ``dtls-cookie-invalid`` (then
answered with a new HelloVerifyRequest), ``dtls-reflection-budget``,
``dtls-handshake-limit``, ``dtls-handshake-ip-limit``, ``dtls-session-limit``,
``dtls-session-ip-limit``, ``dtls-handshake-timeout``,
``dtls-first-message-timeout``,
``dtls-handshake-failed``, ``dtls-session-error``, ``dtls-idle-timeout``,
``dtls-send-no-session``, ``dtls-send-failed``.

Certificates are those of :class:`~crossroads.transport.tls.Certificates`: a
SIGHUP reload that loaded (and checked) the files calls back
(``Certificates.on_reload``) and the listener builds a new OpenSSL context
from them at once; new handshakes use it, live sessions keep theirs.

The client side is the sans-I/O
:class:`~crossroads.proto.dtls.certificate_client.DtlsClient` core (OpenSSL
on memory BIOs as well), run on a connected UDP socket by
:class:`DtlsConnection`, a :class:`~crossroads.transport.driver.DatagramDriver`;
:func:`dtls_connect` opens one and waits for its handshake.

Speed: DTLS records are encrypted and decrypted in Python-called OpenSSL, one
call per datagram; TURN's C data plane handles plaintext UDP only, so DTLS
clients' relayed data goes through Python (docs/benchmarks.md has figures).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, cast

from OpenSSL import SSL
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from crossroads.proto.dtls.certificate_client import (
    DTLS_1_2,
    ClientState,
    Connected,
    DtlsClient,
    Event,
    is_ip,
)
from crossroads.proto.dtls.certificate_server import (
    IDLE_TIMEOUT,
    DtlsServer,
    DtlsSession,
)
from crossroads.proto.dtls.handshake import ApplicationData, HandshakeFailed
from crossroads.proto.dtls_cookie import (
    CookieJar,
)
from crossroads.proto.reflection import ReflectionBudget
from crossroads.transport.admission import (
    Admission,
    Pool,
    ResourceBudget,
)
from crossroads.transport.driver import DatagramDriver
from crossroads.transport.sockets import bind_socket
from crossroads.transport.tls import (
    HANDSHAKE_TIMEOUT,
    MAX_HANDSHAKES,
    MAX_HANDSHAKES_PER_SOURCE,
    Certificates,
)

log = logging.getLogger("crossroads.dtls")

Address = tuple[str, int]
Deliver = Callable[[bytes, Address, "DtlsListener"], None]

#: Live sessions at once on one listener, at most (the memory share of its
#: table may allow fewer): 4096 x SESSION_BYTES is ~400 MB.
MAX_SESSIONS = 4096
#: Live sessions from one IPv4 address or IPv6 /64: the TURN service passes
#: its TCP listener's per-IP cap (``--stun-tcp-max-connections-per-ip``, 128),
#: as a DTLS session is what a TCP connection is to TURN over TLS (the budget
#: caps it at an eighth of the table's total anyway).
MAX_SESSIONS_PER_IP = 128
#: Resident memory of one established DTLS session (OpenSSL connection on
#: memory BIOs, its buffers, the session object), with a margin: measured as
#: RSS growth of a ``crossroads serve`` child over 240 sessions, 81 KB each
#: (pyOpenSSL 26 / OpenSSL 3.0, P-256 certificate). A session whose
#: handshake stalled after the cookie measured 66 KB.
SESSION_BYTES = 96 * 1024
#: A handshake in progress is counted on top of its session (which it is
#: already): a nominal amount, so the handshake table has a memory share too.
HANDSHAKE_BYTES = 16 * 1024
#: Seconds an established session has to send its first valid message. A
#: TURN client sends its Allocate (or a Binding) right after the handshake;
#: the same 10 s a TCP or TLS client has for its first message
#: (``--stun-tcp-message-timeout``).
FIRST_MESSAGE_TIMEOUT = 10.0
#: Largest plaintext sent in one record (OpenSSL refuses more: "dtls message
#: too big"); TURN messages over DTLS are one per record (RFC 8656 §3.1).
MAX_PLAINTEXT = 16384


def server_context(certificates: Certificates) -> SSL.Context:
    """A DTLS 1.2 server context holding the certificate chain and key."""
    context = SSL.Context(SSL.DTLS_SERVER_METHOD)
    context.set_min_proto_version(DTLS_1_2)
    # OP_NO_QUERY_MTU: memory BIOs have no MTU to query, we set it per
    # connection. OP_NO_RENEGOTIATION: a renegotiation repeats the expensive
    # part of a handshake on demand (CVE-2011-1473 class).
    context.set_options(SSL.OP_NO_QUERY_MTU | SSL.OP_NO_RENEGOTIATION)
    context.use_certificate_chain_file(str(certificates.cert))
    context.use_privatekey_file(str(certificates.key))
    context.check_privatekey()

    def generate(connection: SSL.Connection) -> bytes:
        return cast(DtlsSession, connection.get_app_data()).cookie

    def verify(connection: SSL.Connection, cookie: bytes) -> bool:
        return cookie == cast(DtlsSession, connection.get_app_data()).cookie

    context.set_cookie_generate_callback(generate)
    context.set_cookie_verify_callback(verify)
    return context


def _anything(data: bytes) -> bool:
    return True


@dataclass(eq=False)
class DtlsTables:
    """The tables of the process's resource budget a DTLS listener admits its
    sessions to (module docstring): ``sessions`` from the cookie to the end
    (memory, and the first-message deadline as its pre-auth deadline),
    ``handshakes`` while the handshake runs (count and deadline)."""

    handshakes: Admission
    sessions: Admission

    @property
    def handshake_timeout(self) -> float:
        return self.handshakes.preauth_deadline or HANDSHAKE_TIMEOUT

    @property
    def first_message_timeout(self) -> float:
        return self.sessions.preauth_deadline or FIRST_MESSAGE_TIMEOUT

    def forget(self) -> None:
        """The listener stopped: its tables leave the budget."""
        budget = self.handshakes.budget
        budget.forget(self.handshakes.name)
        budget.forget(self.sessions.name)


def dtls_tables(
    budget: ResourceBudget,
    name: str,
    *,
    max_sessions: int = MAX_SESSIONS,
    max_sessions_per_source: int = MAX_SESSIONS_PER_IP,
    max_handshakes: int = MAX_HANDSHAKES,
    max_handshakes_per_source: int = MAX_HANDSHAKES_PER_SOURCE,
    handshake_timeout: float = HANDSHAKE_TIMEOUT,
    first_message_timeout: float = FIRST_MESSAGE_TIMEOUT,
) -> DtlsTables:
    """Register ``dtls-handshakes:NAME`` and ``dtls-sessions:NAME`` with
    ``budget`` (no descriptor: every session shares the listener's socket)."""
    handshakes = budget.table(
        f"dtls-handshakes:{name}",
        max_items=max_handshakes,
        max_per_source=max_handshakes_per_source,
        pool=Pool.NONE,
        bytes_per_item=HANDSHAKE_BYTES,
        preauth_deadline=handshake_timeout,
    )
    try:
        sessions = budget.table(
            f"dtls-sessions:{name}",
            max_items=max_sessions,
            max_per_source=max_sessions_per_source,
            pool=Pool.NONE,
            bytes_per_item=SESSION_BYTES,
            preauth_deadline=first_message_timeout,
        )
    except BaseException:
        budget.forget(handshakes.name)
        raise
    return DtlsTables(handshakes, sessions)


class _ListenerDriver(DatagramDriver):
    """The one driver, with the listener's guard: no datagram and no timer
    may kill the socket (asyncio closes a transport whose
    ``datagram_received`` raises, and a timer that raises is not re-armed)."""

    core: DtlsServer

    def datagram_received(self, data: bytes, addr: tuple[str | object, ...]) -> None:
        try:
            super().datagram_received(data, addr)
        except Exception:
            log.exception("DTLS datagram handler failed")
            self.core.drop("internal-error")

    def _on_timer(self, now: float) -> None:
        try:
            super()._on_timer(now)
        except Exception:
            log.exception("DTLS timer failed")
            self.core.drop("internal-error")


class DtlsListener:
    """A UDP socket serving DTLS sessions (an ``Endpoint`` of the STUN/TURN
    service: ``transport`` is ``"udp"``; see the module docstring): the
    :class:`~crossroads.proto.dtls.certificate_server.DtlsServer` core on the
    one driver."""

    transport: Literal["udp"] = "udp"

    def __init__(
        self,
        certificates: Certificates,
        deliver: Deliver,
        tables: DtlsTables,
        drop: Callable[[str], None],
        reflection: ReflectionBudget,
        *,
        idle_timeout: float = IDLE_TIMEOUT,
        first_message: Callable[[bytes], bool] = _anything,
        cookie_secret: bytes | None = None,
    ) -> None:
        self.certificates = certificates
        self.deliver = deliver
        self.tables = tables
        self.drop = drop
        self.core = DtlsServer(
            server_context(certificates),
            tables.handshakes,
            tables.sessions,
            drop,
            reflection,
            CookieJar(cookie_secret or os.urandom(32)),
            handshake_timeout=tables.handshake_timeout,
            first_message_timeout=tables.first_message_timeout,
            idle_timeout=idle_timeout,
            first_message=first_message,
        )
        self.driver = _ListenerDriver(self.core, self._deliver)
        self.local: Address = ("", 0)
        certificates.on_reload.append(self._reload)

    @property
    def sessions(self) -> dict[Address, DtlsSession]:
        return self.core.sessions

    @property
    def handshakes(self) -> int:
        """Handshakes that completed."""
        return self.core.handshakes

    @property
    def hello_verify_requests(self) -> int:
        """HelloVerifyRequests sent."""
        return self.core.hello_verify_requests

    def _deliver(self, events: list[ApplicationData]) -> None:
        deliver = self.deliver
        for event in events:
            deliver(event.data, event.address, self)

    def send(self, data: bytes, addr: Address) -> None:
        """Encrypt ``data`` for the session of ``addr`` and send it (dropped and
        counted if there is none)."""
        core = self.core
        if core.send(data, addr):
            # Relayed data's path: the record and nothing else (a send starts
            # no timer and reports no event), without the driver's full step.
            transport = self.driver.transport
            if transport is not None:
                for record, client in core.datagrams_to_send(0.0):
                    transport.sendto(record, client)

    def end_session(self, client: Address) -> None:
        """Close ``client``'s session with a close_notify (its TURN allocation
        ended: the association is not kept for nothing, as coturn does)."""
        self.core.end_session(client)
        self.driver.transmit()

    def close(self) -> None:
        """Forget every session and close the socket."""
        with contextlib.suppress(ValueError):
            self.certificates.on_reload.remove(self._reload)
        self.core.close()
        self.driver.timer.close()
        transport = self.driver.transport
        if transport is not None:
            transport.close()
            self.driver.transport = None

    def _reload(self) -> None:
        """A new OpenSSL context for new handshakes, at the moment the
        certificate files were reloaded and checked (see module doc)."""
        try:
            self.core.context = server_context(self.certificates)
        except (SSL.Error, OSError) as exc:
            log.error("DTLS certificate not reloaded, keeping the old one: %s", exc)


async def open_dtls_listener(
    host: str, port: int, v6only: bool, listener: DtlsListener
) -> DtlsListener:
    """Bind UDP ``host``:``port`` and serve ``listener`` on it."""
    sock = bind_socket(host, port, socket.SOCK_DGRAM, v6only=v6only)
    try:
        await asyncio.get_running_loop().create_datagram_endpoint(
            lambda: listener.driver, sock=sock
        )
    except BaseException:
        sock.close()
        raise
    sockname = sock.getsockname()
    listener.local = (sockname[0], sockname[1])
    return listener


class DtlsCollector(Collector):
    """Prometheus view of the DTLS listeners (counted in plain ints)."""

    def __init__(self, listeners: list[DtlsListener]) -> None:
        self.listeners = listeners

    def collect(self) -> Iterator[Any]:
        listeners = self.listeners
        sessions = GaugeMetricFamily(
            "crossroads_turn_dtls_sessions", "Live TURN-over-DTLS sessions."
        )
        sessions.add_metric([], sum(len(x.sessions) for x in listeners))
        yield sessions
        handshakes = CounterMetricFamily(
            "crossroads_turn_dtls_handshakes",
            "TURN-over-DTLS handshakes completed.",
        )
        handshakes.add_metric([], sum(x.handshakes for x in listeners))
        yield handshakes
        verify = CounterMetricFamily(
            "crossroads_turn_dtls_hello_verify_requests",
            "HelloVerifyRequests sent (ClientHellos without a valid cookie).",
        )
        verify.add_metric([], sum(x.hello_verify_requests for x in listeners))
        yield verify


# ------------------------------------------------------------------ client side


class DtlsHandshakeError(ConnectionError):
    """The DTLS handshake failed (refused, certificate not trusted, timed out)."""


def client_context(cafile: str | None = None, *, verify: bool = True) -> SSL.Context:
    """A DTLS 1.2 client context trusting ``cafile`` (else the system store);
    ``verify=False`` accepts any certificate (like coturn's uclient)."""
    context = SSL.Context(SSL.DTLS_CLIENT_METHOD)
    context.set_min_proto_version(DTLS_1_2)
    context.set_options(SSL.OP_NO_QUERY_MTU)
    if verify:
        if cafile:
            context.load_verify_locations(cafile)
        else:
            context.set_default_verify_paths()
        context.set_verify(SSL.VERIFY_PEER, lambda *args: bool(args[-1]))
    return context


class DtlsConnection(DatagramDriver):
    """A :class:`~crossroads.proto.dtls.certificate_client.DtlsClient` core
    on a connected UDP socket, on the one driver.

    ``deliver(data)`` gets each decrypted datagram; ``lost()`` is called when
    the socket closes. Await :attr:`handshake` before :meth:`send`.
    """

    core: DtlsClient

    def __init__(
        self,
        core: DtlsClient,
        deliver: Callable[[bytes], None],
        lost: Callable[[], None],
    ) -> None:
        super().__init__(core)
        self.deliver = deliver
        self.lost = lost
        self.handshake: asyncio.Future[None] = self._loop.create_future()

    @property
    def udp(self) -> asyncio.DatagramTransport | None:
        """The connected UDP socket's transport (None once closed)."""
        return self.transport

    @property
    def connection(self) -> SSL.Connection:
        """The OpenSSL connection (its peer certificate, its cipher)."""
        return self.core.connection

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        now = self._loop.time()
        self.core.start(now)
        self.transmit(now)

    def error_received(self, exc: Exception) -> None:
        if not self.handshake.done():
            self.handshake.set_exception(DtlsHandshakeError(str(exc)))

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.transport = None
        if not self.handshake.done():
            self.handshake.set_exception(DtlsHandshakeError("socket closed"))
        self.lost()

    def transmit(self, now: float | None = None) -> None:
        """Send what the core has to send on the connected socket (no
        destination: asyncio refuses one on a connected socket), dispatch its
        events, re-arm its timer."""
        transport = self.transport
        if transport is None:
            return
        now = self._loop.time() if now is None else now
        events = self.core.pop_events()
        if events:
            self._dispatch(events)
        for data, _ in self.core.datagrams_to_send(now):
            transport.sendto(data)
        self.timer.rearm()
        if self.core.state in (ClientState.FAILED, ClientState.CLOSED):
            self._close_socket()

    def _dispatch(self, events: list[Event]) -> None:
        for event in events:
            match event:
                case Connected():
                    if not self.handshake.done():
                        self.handshake.set_result(None)
                case ApplicationData(_, data):
                    self.deliver(data)
                case HandshakeFailed(_, reason):
                    if not self.handshake.done():
                        self.handshake.set_exception(DtlsHandshakeError(reason))

    def send(self, data: bytes) -> None:
        """Encrypt and send one datagram (after the handshake)."""
        now = self._loop.time()
        if self.core.send(data, now):
            self.transmit(now)

    def close(self) -> None:
        """Send close_notify (if up) and close the socket."""
        now = self._loop.time()
        self.core.close(now)
        self.transmit(now)
        self._close_socket()

    def _close_socket(self) -> None:
        # The datagrams just queued leave first: asyncio closes a datagram
        # transport after its buffer is flushed.
        self.timer.close()
        if self.transport is not None:
            self.transport.close()


async def dtls_connect(
    server: Address,
    context: SSL.Context,
    deliver: Callable[[bytes], None],
    lost: Callable[[], None],
    *,
    server_hostname: str | None = None,
    local: Address | None = None,
    timeout: float = 10.0,
    check_hostname: bool = True,
) -> DtlsConnection:
    """Open a UDP socket to ``server`` and complete a DTLS handshake on it
    (``server_hostname``, default the server's address, is checked against the
    certificate unless ``check_hostname`` is False)."""
    loop = asyncio.get_running_loop()
    name = server_hostname or server[0]
    core = DtlsClient(context, server, server_hostname=name if check_hostname else None)
    if not check_hostname and not is_ip(name):
        # SNI all the same: a server with several certificates picks by it.
        core.connection.set_tlsext_host_name(name.encode("idna"))
    _, protocol = await loop.create_datagram_endpoint(
        lambda: DtlsConnection(core, deliver, lost),
        local_addr=local,
        remote_addr=server,
    )
    try:
        await asyncio.wait_for(asyncio.shield(protocol.handshake), timeout)
    except TimeoutError:
        protocol.close()
        raise DtlsHandshakeError("DTLS handshake timed out") from None
    except BaseException:
        protocol.close()
        raise
    return protocol
