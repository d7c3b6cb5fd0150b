"""TURN over DTLS (RFC 8656 §3, RFC 7350): the server's sessions on one UDP
socket, and the client's association on the one driver.

What it is
----------
:class:`DtlsListener` is the asyncio protocol of one UDP socket that speaks
DTLS 1.2 (RFC 6347) with the process's certificate. Each client address that
completes a handshake gets a :class:`DtlsSession`: an OpenSSL connection on
memory BIOs (pyOpenSSL), so OpenSSL never touches the socket. Decrypted
datagrams go to ``deliver(data, client, listener)`` exactly as plain UDP
datagrams from that client would; the listener is also the reply path
(``listener.send(data, client)`` encrypts through the client's session), so a
TURN allocation made over DTLS is keyed and relayed like a UDP one whose
"socket" is this listener.

Theory of operation
-------------------
1. A datagram from an address without a session must start with an epoch-0
   ClientHello. Without a valid cookie it is answered with a HelloVerifyRequest
   (:mod:`crossroads.proto.dtls_cookie`: HMAC over the client address, port and
   ClientHello random; a 48-byte reply to a ClientHello of 60+ bytes, also
   charged to the reflection budget) and **nothing is kept**: a ClientHello
   flood, spoofed or not, creates no state.
2. A ClientHello with a valid cookie proves the client receives at its
   address. Only then, within the caps of the listener's own tables in the
   process's resource budget (:class:`DtlsTables`: ``dtls-sessions:NAME``,
   every session from its cookie to its end with its measured memory, and
   ``dtls-handshakes:NAME``, the handshakes in progress; per-source caps an
   eighth of the totals at most, the source an IPv4 address or IPv6 /64),
   a session is made:
   OpenSSL's ``DTLSv1_listen`` re-checks the same cookie (our verify callback)
   and sets the handshake sequence numbers past the cookie exchange, then the
   handshake runs datagram by datagram. OpenSSL's retransmission timer
   (``DTLSv1_get_timeout``) is served by one periodic tick, and a handshake not
   done within the handshake table's pre-auth deadline is cut.
   A session whose handshake is done is still pre-auth state until its first
   valid message (``first_message(data)``; TURN: a well-formed STUN message):
   one that says nothing valid within the session table's pre-auth deadline
   (seconds) is ended, so silent sessions cannot hold the table for the
   idle timeout.
3. A fresh ClientHello with a valid cookie from an address that has a session
   replaces it (RFC 6347 §4.2.8: a client that restarted; the old association
   goes only after the cookie round trip proved the new one). Renegotiation
   inside a session is refused (``OP_NO_RENEGOTIATION``: OpenSSL answers with
   a no_renegotiation warning alert and the session goes on).
4. Records that do not decrypt are discarded by OpenSSL (RFC 6347 §4.1.2.7); a
   fatal error, a close_notify, or ``idle_timeout`` without a datagram ends the
   session. The TURN allocation made over it is not ended with it: like a UDP
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
from dataclasses import KW_ONLY, InitVar, dataclass, field
from typing import Any, Literal, cast

from OpenSSL import SSL
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from crossroads.errors import DecodeError
from crossroads.proto.admission import REFUSED_OVER_IP_LIMIT, REFUSED_OVER_LIMIT
from crossroads.proto.dtls.certificate_client import (
    DTLS_1_2,
    HANDSHAKE_MTU,
    READ_SIZE,
    ClientState,
    Connected,
    DtlsClient,
    Event,
    is_ip,
    pack_datagrams,
    split_records,
)
from crossroads.proto.dtls.handshake import ApplicationData, HandshakeFailed
from crossroads.proto.dtls_cookie import (
    CONTENT_ALERT,
    CONTENT_APPLICATION_DATA,
    RECORD_HEADER_SIZE,
    CookieJar,
    hello_verify_request,
    is_dtls,
    parse_client_hello,
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
#: Seconds between checks of the sessions still waiting for a first message
#: (its deadline is seconds: check every second).
FIRST_MESSAGE_SWEEP = 1.0
#: A session that receives nothing for this long ends. A TURN client must
#: refresh its permissions every 300 s (RFC 8656 §9) or its relay stops, so
#: 600 s of silence means the client is gone.
IDLE_TIMEOUT = 600.0
#: How often the listener serves OpenSSL's retransmission timers (RFC 6347
#: §4.2.4.1: 1 s initial timeout, doubling) and checks deadlines.
TICK = 0.25
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


_SESSION_REFUSALS = {
    REFUSED_OVER_LIMIT: "dtls-session-limit",
    REFUSED_OVER_IP_LIMIT: "dtls-session-ip-limit",
}
_HANDSHAKE_REFUSALS = {
    REFUSED_OVER_LIMIT: "dtls-handshake-limit",
    REFUSED_OVER_IP_LIMIT: "dtls-handshake-ip-limit",
}


class DtlsSession:
    """One client's DTLS association: an OpenSSL connection on memory BIOs."""

    __slots__ = (
        "client",
        "cookie",
        "connection",
        "established",
        "started",
        "seen",
        "proved",
    )

    def __init__(
        self, context: SSL.Context, client: Address, cookie: bytes, now: float
    ) -> None:
        self.client = client
        #: The cookie the client proved (OpenSSL's verify callback checks it).
        self.cookie = cookie
        self.connection = SSL.Connection(context)
        self.connection.set_app_data(self)
        self.connection.set_ciphertext_mtu(HANDSHAKE_MTU)
        self.connection.set_accept_state()
        self.established = False
        self.started = now
        self.seen = now
        #: A valid first message came (until then: pre-auth state); when
        #: established, ``started`` is reset to the moment it was.
        self.proved = False

    def start(self, hello: bytes) -> list[bytes]:
        """Feed the cookie-carrying ClientHello; the datagrams to send."""
        self.connection.bio_write(hello)
        try:
            self.connection.DTLSv1_listen()
        except SSL.WantReadError:
            # OpenSSL did not accept the ClientHello the cookie check passed.
            raise SSL.Error("DTLSv1_listen wants another ClientHello") from None
        return self._advance([])

    def receive(self, datagram: bytes) -> tuple[list[bytes], list[bytes]]:
        """Feed one datagram; the decrypted application datagrams and the
        datagrams to send. Raises :class:`SSL.Error` (fatal) or
        :class:`SSL.ZeroReturnError` (close_notify)."""
        self.connection.bio_write(datagram)
        received: list[bytes] = []
        return received, self._advance(received)

    def _advance(self, received: list[bytes]) -> list[bytes]:
        connection = self.connection
        if not self.established:
            try:
                connection.do_handshake()
                self.established = True
            except SSL.WantReadError:
                return self.pending()
        while True:
            try:
                received.append(connection.recv(READ_SIZE))
            except SSL.WantReadError:
                break
        return self.pending()

    def decrypt(self, record: bytes) -> bytes:
        """The plaintext of one application-data record of an established
        session; b"" if OpenSSL discarded it (a bad MAC, a replay: RFC 6347
        §4.1.2.7). Raises :class:`SSL.Error` on a fatal error."""
        self.connection.bio_write(record)
        try:
            return self.connection.recv(READ_SIZE)
        except SSL.WantReadError:
            return b""

    def pending(self) -> list[bytes]:
        """Datagrams OpenSSL has written (handshake flights, alerts)."""
        try:
            data = self.connection.bio_read(READ_SIZE)
        except SSL.WantReadError:
            return []
        return pack_datagrams(split_records(data))

    def encrypt(self, data: bytes) -> bytes:
        """One record carrying ``data`` (raises :class:`SSL.Error`)."""
        self.connection.send(data)
        return self.connection.bio_read(READ_SIZE)

    def timeout(self) -> list[bytes]:
        """Serve OpenSSL's handshake retransmission timer; the datagrams to send."""
        left = self.connection.DTLSv1_get_timeout()
        if left is None or left > 0:
            return []
        self.connection.DTLSv1_handle_timeout()
        return self.pending()


@dataclass(eq=False)
class DtlsListener(asyncio.DatagramProtocol):
    """A UDP socket serving DTLS sessions (an ``Endpoint`` of the STUN/TURN
    service: ``transport`` is ``"udp"``; see the module docstring)."""

    certificates: Certificates
    deliver: Deliver
    tables: DtlsTables
    drop: Callable[[str], None]
    reflection: ReflectionBudget
    _: KW_ONLY
    idle_timeout: float = IDLE_TIMEOUT
    #: Whether a decrypted datagram is a valid first message (it ends the
    #: session's pre-auth state); every datagram is still delivered.
    first_message: Callable[[bytes], bool] = _anything
    cookie_secret: InitVar[bytes | None] = None
    cookies: CookieJar = field(init=False, repr=False)
    transport: Literal["udp"] = field(default="udp", init=False)
    local: Address = field(default=("", 0), init=False)
    sessions: dict[Address, DtlsSession] = field(default_factory=dict, init=False)
    #: Handshakes that completed; HelloVerifyRequests sent.
    handshakes: int = field(default=0, init=False)
    hello_verify_requests: int = field(default=0, init=False)
    _handshaking: set[DtlsSession] = field(default_factory=set, init=False)
    #: Established sessions still waiting for a valid first message.
    _unproved: set[DtlsSession] = field(default_factory=set, init=False)
    _context: SSL.Context = field(init=False, repr=False)
    _udp: asyncio.DatagramTransport | None = field(default=None, init=False)
    _loop: asyncio.AbstractEventLoop = field(init=False, repr=False)
    _tick: asyncio.TimerHandle | None = field(default=None, init=False)
    _last_sweep: float = field(init=False)

    def __post_init__(self, cookie_secret: bytes | None) -> None:
        self.cookies = CookieJar(cookie_secret or os.urandom(32))
        self._context = server_context(self.certificates)
        self.certificates.on_reload.append(self._reload)
        self._loop = asyncio.get_running_loop()
        self._last_sweep = self._loop.time()

    # -- asyncio ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._udp = cast(asyncio.DatagramTransport, transport)
        sockname = transport.get_extra_info("sockname")
        self.local = (sockname[0], sockname[1])
        self._tick = self._loop.call_later(TICK, self._on_tick)

    def connection_lost(self, exc: Exception | None) -> None:
        self.close()

    def error_received(self, exc: Exception) -> None:
        # ICMP errors for earlier sends: the session's own timers deal with it.
        pass

    def close(self) -> None:
        """Stop the timer, forget every session and close the socket."""
        with contextlib.suppress(ValueError):
            self.certificates.on_reload.remove(self._reload)
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None
        for session in list(self.sessions.values()):
            self._end(session)
        if self._udp is not None:
            self._udp.close()
            self._udp = None

    def _sendto(self, data: bytes, client: Address) -> None:
        if self._udp is not None:
            self._udp.sendto(data, client)

    # -- the Endpoint interface --------------------------------------------------

    def send(self, data: bytes, addr: Address) -> None:
        """Encrypt ``data`` for the session of ``addr`` and send it (dropped and
        counted if there is none)."""
        session = self.sessions.get(addr)
        if session is None or not session.established:
            self.drop("dtls-send-no-session")
            return
        try:
            record = session.encrypt(data)
        except SSL.Error:
            self.drop("dtls-send-failed")
            return
        self._sendto(record, addr)

    # -- receiving -----------------------------------------------------------------

    def datagram_received(self, data: bytes, addr: Any) -> None:
        client: Address = addr if len(addr) == 2 else (addr[0], addr[1])
        try:
            self._receive(data, client)
        except Exception:  # never let one datagram kill the socket
            log.exception("DTLS datagram handler failed")
            self.drop("internal-error")

    def _receive(self, data: bytes, client: Address) -> None:
        if data and data[0] == CONTENT_APPLICATION_DATA:
            # The common case (relayed data): straight to the session.
            session = self.sessions.get(client)
            if session is None:
                self.drop("dtls-no-session")
            elif session.established and len(data) == RECORD_HEADER_SIZE + (
                (data[11] << 8) | data[12]
            ):
                # One application-data record: one decryption, and nothing
                # for OpenSSL to answer (no flight, no alert to flush).
                session.seen = self._loop.time()
                try:
                    message = session.decrypt(data)
                except SSL.Error as exc:
                    self._session_error(session, exc)
                    return
                if message:
                    if not session.proved:
                        self._prove(session, message)
                    self.deliver(message, client, self)
            else:
                self._feed(session, data, self._loop.time())
            return
        if not data or not is_dtls(data[0]):
            self.drop("dtls-not-dtls")
            return
        try:
            hello = parse_client_hello(data)
        except DecodeError:
            self.drop("dtls-bad-client-hello")
            return
        now = self._loop.time()
        session = self.sessions.get(client)
        if hello is None:
            if session is None:
                self.drop("dtls-no-session")
                return
            self._feed(session, data, now)
            return
        if session is not None and not session.established:
            # A retransmitted ClientHello of the handshake in progress.
            self._feed(session, data, now)
            return
        if not hello.cookie or not self.cookies.verify(
            hello.cookie, client, hello.random, now
        ):
            if hello.cookie:
                self.drop("dtls-cookie-invalid")
            reply = hello_verify_request(
                hello, self.cookies.cookie(client, hello.random, now)
            )
            if not self.reflection.answer(client[0], len(data), len(reply), now):
                self.drop("dtls-reflection-budget")
                return
            self.hello_verify_requests += 1
            self._sendto(reply, client)
            return
        self._open(client, data, hello.cookie, now, replacing=session)

    def _open(
        self,
        client: Address,
        hello: bytes,
        cookie: bytes,
        now: float,
        replacing: DtlsSession | None,
    ) -> None:
        ip = client[0]
        tables = self.tables
        refused = tables.handshakes.admit(ip)
        if refused is not None:
            self.drop(_HANDSHAKE_REFUSALS[refused])
            return
        if replacing is not None:
            # RFC 6347 §4.2.8: the new association replaces the old one; its
            # session item is given back first, so the client's own session
            # never counts against its replacement.
            self._end(replacing)
        refused = tables.sessions.admit(ip)
        if refused is not None:
            tables.handshakes.release(ip)
            self.drop(_SESSION_REFUSALS[refused])
            return
        session = DtlsSession(self._context, client, cookie, now)
        self.sessions[client] = session
        self._handshaking.add(session)
        self._hurry()
        try:
            out = session.start(hello)
        except SSL.Error as exc:
            log.debug("DTLS handshake from %s failed: %r", client, exc)
            self._send_alerts(session)
            self._fail(session, "dtls-handshake-failed")
            return
        for datagram in out:
            self._sendto(datagram, client)
        self._check_established(session)

    def _feed(self, session: DtlsSession, data: bytes, now: float) -> None:
        session.seen = now
        try:
            received, out = session.receive(data)
        except SSL.Error as exc:
            self._session_error(session, exc)
            return
        client = session.client
        for datagram in out:
            self._sendto(datagram, client)
        self._check_established(session)
        deliver = self.deliver
        for message in received:
            if message:
                if not session.proved:
                    self._prove(session, message)
                deliver(message, client, self)

    def _prove(self, session: DtlsSession, message: bytes) -> None:
        """``message`` came over ``session``: if it is a valid first message,
        the session's pre-auth deadline no longer applies."""
        if session.established and self.first_message(message):
            session.proved = True
            self._unproved.discard(session)

    def _session_error(self, session: DtlsSession, exc: SSL.Error) -> None:
        if isinstance(exc, SSL.ZeroReturnError):
            # close_notify: answer it (RFC 5246 §7.2.1) and forget the session.
            self.end_session(session.client)
            return
        log.debug("DTLS session %s failed: %r", session.client, exc)
        self._send_alerts(session)
        self._fail(
            session,
            "dtls-session-error" if session.established else "dtls-handshake-failed",
        )

    def _send_alerts(self, session: DtlsSession) -> None:
        """Send the alert OpenSSL wrote on a fatal error (a client told
        protocol_version tries again: coturn's uclient then picks DTLS 1.2)."""
        for datagram in session.pending():
            if datagram[0] == CONTENT_ALERT:
                self._sendto(datagram, session.client)

    def _check_established(self, session: DtlsSession) -> None:
        if session.established and session in self._handshaking:
            self._handshaking.discard(session)
            self.tables.handshakes.release(session.client[0])
            self.handshakes += 1
            if not session.proved:
                # Its first-message deadline runs from now.
                session.started = self._loop.time()
                self._unproved.add(session)

    # -- ending ------------------------------------------------------------------

    def _fail(self, session: DtlsSession, reason: str) -> None:
        self.drop(reason)
        self._end(session)

    def _end(self, session: DtlsSession) -> None:
        client = session.client
        if self.sessions.get(client) is not session:
            return
        del self.sessions[client]
        # Break the session <-> connection cycle: the ~80 KB go now, not at
        # the next garbage collection.
        session.connection.set_app_data(None)
        ip = client[0]
        self.tables.sessions.release(ip)
        self._unproved.discard(session)
        if session in self._handshaking:
            self._handshaking.discard(session)
            self.tables.handshakes.release(ip)

    def _end_silently(self, session: DtlsSession) -> None:
        """End a session that never said anything valid: a close_notify, so
        a real client that was only slow knows to start again."""
        self.drop("dtls-first-message-timeout")
        self.end_session(session.client)

    def end_session(self, client: Address) -> None:
        """Close ``client``'s session with a close_notify (its TURN allocation
        ended: the association is not kept for nothing, as coturn does)."""
        session = self.sessions.get(client)
        if session is None:
            return
        if session.established:
            with contextlib.suppress(SSL.Error):
                session.connection.shutdown()
            for datagram in session.pending():
                self._sendto(datagram, client)
        self._end(session)

    def _reload(self) -> None:
        """A new OpenSSL context for new handshakes, at the moment the
        certificate files were reloaded and checked (see module doc)."""
        try:
            self._context = server_context(self.certificates)
        except (SSL.Error, OSError) as exc:
            log.error("DTLS certificate not reloaded, keeping the old one: %s", exc)

    # -- timers ----------------------------------------------------------------

    def _on_tick(self) -> None:
        now = self._loop.time()
        try:
            self.tick(now)
        except Exception:
            log.exception("DTLS timer failed")
        # Fast while handshakes run (retransmissions), every second while
        # sessions wait for a first message, slow otherwise (idle sweep).
        if self._handshaking:
            delay = TICK
        elif self._unproved:
            delay = FIRST_MESSAGE_SWEEP
        else:
            delay = IDLE_SWEEP_INTERVAL
        self._tick = self._loop.call_later(delay, self._on_tick)

    def _hurry(self) -> None:
        """A handshake started: make sure the next tick is a fast one."""
        tick = self._tick
        if tick is not None and tick.when() - self._loop.time() > TICK:
            tick.cancel()
            self._tick = self._loop.call_later(TICK, self._on_tick)

    def tick(self, now: float) -> None:
        """Retransmit handshake flights whose timer ran out, cut handshakes
        and sessions without a first message past their pre-auth deadlines,
        and (every few seconds) idle sessions."""
        tables = self.tables
        deadline = now - tables.handshake_timeout
        for session in list(self._handshaking):
            if session.started < deadline:
                tables.handshakes.closed("handshake-timeout")
                self._fail(session, "dtls-handshake-timeout")
                continue
            try:
                out = session.timeout()
            except SSL.Error:
                self._fail(session, "dtls-handshake-failed")
                continue
            for datagram in out:
                self._sendto(datagram, session.client)
        if self._unproved:
            silent = now - tables.first_message_timeout
            for session in [s for s in self._unproved if s.started < silent]:
                tables.sessions.closed("first-message-timeout")
                self._end_silently(session)
        if now - self._last_sweep < IDLE_SWEEP_INTERVAL:
            return
        self._last_sweep = now
        idle = now - self.idle_timeout
        for session in list(self.sessions.values()):
            if session.established and session.seen < idle:
                self._fail(session, "dtls-idle-timeout")


#: Seconds between idle sweeps (the idle timeout is minutes: precision enough).
IDLE_SWEEP_INTERVAL = 5.0


async def open_dtls_listener(
    host: str, port: int, v6only: bool, listener: DtlsListener
) -> DtlsListener:
    """Bind UDP ``host``:``port`` and serve ``listener`` on it."""
    sock = bind_socket(host, port, socket.SOCK_DGRAM, v6only=v6only)
    try:
        await asyncio.get_running_loop().create_datagram_endpoint(
            lambda: listener, sock=sock
        )
    except BaseException:
        sock.close()
        raise
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
