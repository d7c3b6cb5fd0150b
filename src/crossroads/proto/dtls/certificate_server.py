"""The DTLS 1.2 server core with a certificate: TURN over DTLS (RFC 8656 §3,
RFC 7350), every client's session on one socket, sans-I/O.

What it is
----------
:class:`DtlsServer` takes the datagrams of one UDP socket
(:meth:`DtlsServer.receive_datagram`) and gives what to send
(:meth:`DtlsServer.datagrams_to_send`) and each decrypted datagram, as an
:class:`~crossroads.proto.dtls.handshake.ApplicationData` event. Each client
address that completes a handshake gets a :class:`DtlsSession`: an OpenSSL
connection on memory BIOs (pyOpenSSL), so OpenSSL never touches a socket.
:meth:`DtlsServer.send` encrypts a datagram for a client's session, so its
owner (``transport/dtls.py``'s ``DtlsListener``) is a TURN endpoint like a
plain UDP socket.

Theory of operation
-------------------
1. A datagram from an address without a session must start with an epoch-0
   ClientHello. Without a valid cookie it is answered with a HelloVerifyRequest
   (:mod:`crossroads.proto.dtls_cookie`: HMAC over the client address, port and
   ClientHello random; a 48-byte reply to a ClientHello of 60+ bytes, also
   charged to the reflection budget) and **nothing is kept**: a ClientHello
   flood, spoofed or not, creates no state.
2. A ClientHello with a valid cookie proves the client receives at its
   address. Only then, within the caps of the two tables it was given
   (``handshakes`` while the handshake runs, ``sessions`` from the cookie to
   the end; per-source caps an eighth of the totals at most, the source an
   IPv4 address or IPv6 /64), a session is made: OpenSSL's ``DTLSv1_listen``
   re-checks the same cookie (the context's verify callback) and sets the
   handshake sequence numbers past the cookie exchange, then the handshake
   runs datagram by datagram. OpenSSL's retransmission timer
   (``DTLSv1_get_timeout``, its own clock) is served by the core's one timer,
   every :data:`TICK` while a handshake runs, and a handshake not done within
   ``handshake_timeout`` is cut.
   A session whose handshake is done is still pre-auth state until its first
   valid message (``first_message(data)``; TURN: a well-formed STUN message):
   one that says nothing valid within ``first_message_timeout`` (seconds) is
   ended, so silent sessions cannot hold the table for the idle timeout.
3. A fresh ClientHello with a valid cookie from an address that has a session
   replaces it (RFC 6347 §4.2.8: a client that restarted; the old association
   goes only after the cookie round trip proved the new one). Renegotiation
   inside a session is refused (``OP_NO_RENEGOTIATION`` on the context).
4. Records that do not decrypt are discarded by OpenSSL (RFC 6347 §4.1.2.7); a
   fatal error, a close_notify, or ``idle_timeout`` without a datagram ends the
   session; :meth:`DtlsServer.end_session` ends one with a close_notify.

Every refusal is counted through ``drop(reason)`` (the reasons are listed in
``transport/dtls.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Final

from OpenSSL import SSL

from crossroads.errors import DecodeError
from crossroads.proto.admission import (
    REFUSED_OVER_IP_LIMIT,
    REFUSED_OVER_LIMIT,
    Admitter,
)
from crossroads.proto.core import Datagram, EventQueue, Outbox
from crossroads.proto.dtls.certificate_client import (
    HANDSHAKE_MTU,
    READ_SIZE,
    pack_datagrams,
    split_records,
)
from crossroads.proto.dtls.handshake import ApplicationData
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
from crossroads.types import Address

#: How often the timer serves OpenSSL's retransmission timers (RFC 6347
#: §4.2.4.1: 1 s initial timeout, doubling) while handshakes run.
TICK: Final = 0.25
#: Seconds between checks of the sessions still waiting for a first message
#: (its deadline is seconds: check every second).
FIRST_MESSAGE_SWEEP: Final = 1.0
#: Seconds between idle sweeps (the idle timeout is minutes: precision enough).
IDLE_SWEEP_INTERVAL: Final = 5.0
#: A session that receives nothing for this long ends. A TURN client must
#: refresh its permissions every 300 s (RFC 8656 §9) or its relay stops, so
#: 600 s of silence means the client is gone.
IDLE_TIMEOUT: Final = 600.0

_SESSION_REFUSALS = {
    REFUSED_OVER_LIMIT: "dtls-session-limit",
    REFUSED_OVER_IP_LIMIT: "dtls-session-ip-limit",
}
_HANDSHAKE_REFUSALS = {
    REFUSED_OVER_LIMIT: "dtls-handshake-limit",
    REFUSED_OVER_IP_LIMIT: "dtls-handshake-ip-limit",
}


def _anything(data: bytes) -> bool:
    return True


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
class DtlsServer(Outbox[Datagram], EventQueue[ApplicationData]):
    """Every client's DTLS session on one socket (see the module docstring)."""

    #: The OpenSSL context new handshakes use (a certificate reload replaces
    #: it; live sessions keep theirs).
    context: SSL.Context = field(repr=False)
    handshake_table: Admitter
    session_table: Admitter
    drop: Callable[[str], None]
    reflection: ReflectionBudget
    cookies: CookieJar = field(repr=False)
    _: KW_ONLY
    handshake_timeout: float
    first_message_timeout: float
    idle_timeout: float = IDLE_TIMEOUT
    #: Whether a decrypted datagram is a valid first message (it ends the
    #: session's pre-auth state); every datagram is still delivered.
    first_message: Callable[[bytes], bool] = _anything
    sessions: dict[Address, DtlsSession] = field(default_factory=dict, init=False)
    #: Handshakes that completed; HelloVerifyRequests sent.
    handshakes: int = field(default=0, init=False)
    hello_verify_requests: int = field(default=0, init=False)
    _handshaking: set[DtlsSession] = field(default_factory=set, init=False)
    #: Established sessions still waiting for a valid first message.
    _unproved: set[DtlsSession] = field(default_factory=set, init=False)
    _deadline: float | None = field(default=None, init=False)
    _last_sweep: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        super().__init__()

    # -- the core API -------------------------------------------------------------

    def receive_datagram(self, data: bytes, addr: Address, now: float) -> None:
        self._receive(data, addr, now)

    def get_timer(self) -> float | None:
        return self._deadline

    def handle_timer(self, now: float) -> None:
        self._deadline = None
        self.tick(now)
        # Fast while handshakes run (retransmissions), every second while
        # sessions wait for a first message, slow while any session lives
        # (idle sweep), none without sessions.
        if self._handshaking:
            self._deadline = now + TICK
        elif self._unproved:
            self._deadline = now + FIRST_MESSAGE_SWEEP
        elif self.sessions:
            self._deadline = now + IDLE_SWEEP_INTERVAL

    def _hurry(self, now: float) -> None:
        """A handshake started: make sure the next tick is a fast one."""
        if self._deadline is None or self._deadline - now > TICK:
            self._deadline = now + TICK

    # -- sending ----------------------------------------------------------------

    def send(self, data: bytes, addr: Address) -> bool:
        """Encrypt ``data`` for the session of ``addr`` and queue it (dropped
        and counted if there is none); whether it was queued."""
        session = self.sessions.get(addr)
        if session is None or not session.established:
            self.drop("dtls-send-no-session")
            return False
        try:
            record = session.encrypt(data)
        except SSL.Error:
            self.drop("dtls-send-failed")
            return False
        self._outbox.append((record, addr))
        return True

    def close(self) -> None:
        """Forget every session (the socket closes)."""
        for session in list(self.sessions.values()):
            self._end(session)
        self._deadline = None

    # -- receiving ----------------------------------------------------------------

    def _receive(self, data: bytes, client: Address, now: float) -> None:
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
                session.seen = now
                try:
                    message = session.decrypt(data)
                except SSL.Error as exc:
                    self._session_error(session, exc)
                    return
                if message:
                    if not session.proved:
                        self._prove(session, message)
                    self._events.append(ApplicationData(client, message))
            else:
                self._feed(session, data, now)
            return
        if not data or not is_dtls(data[0]):
            self.drop("dtls-not-dtls")
            return
        try:
            hello = parse_client_hello(data)
        except DecodeError:
            self.drop("dtls-bad-client-hello")
            return
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
            self._outbox.append((reply, client))
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
        refused = self.handshake_table.admit(ip)
        if refused is not None:
            self.drop(_HANDSHAKE_REFUSALS[refused])
            return
        if replacing is not None:
            # RFC 6347 §4.2.8: the new association replaces the old one; its
            # session item is given back first, so the client's own session
            # never counts against its replacement.
            self._end(replacing)
        refused = self.session_table.admit(ip)
        if refused is not None:
            self.handshake_table.release(ip)
            self.drop(_SESSION_REFUSALS[refused])
            return
        session = DtlsSession(self.context, client, cookie, now)
        self.sessions[client] = session
        self._handshaking.add(session)
        self._hurry(now)
        try:
            out = session.start(hello)
        except SSL.Error:
            self._send_alerts(session)
            self._fail(session, "dtls-handshake-failed")
            return
        for datagram in out:
            self._outbox.append((datagram, client))
        self._check_established(session, now)

    def _feed(self, session: DtlsSession, data: bytes, now: float) -> None:
        session.seen = now
        try:
            received, out = session.receive(data)
        except SSL.Error as exc:
            self._session_error(session, exc)
            return
        client = session.client
        for datagram in out:
            self._outbox.append((datagram, client))
        self._check_established(session, now)
        events = self._events
        for message in received:
            if message:
                if not session.proved:
                    self._prove(session, message)
                events.append(ApplicationData(client, message))

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
                self._outbox.append((datagram, session.client))

    def _check_established(self, session: DtlsSession, now: float) -> None:
        if session.established and session in self._handshaking:
            self._handshaking.discard(session)
            self.handshake_table.release(session.client[0])
            self.handshakes += 1
            if not session.proved:
                # Its first-message deadline runs from now.
                session.started = now
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
        self.session_table.release(ip)
        self._unproved.discard(session)
        if session in self._handshaking:
            self._handshaking.discard(session)
            self.handshake_table.release(ip)

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
                self._outbox.append((datagram, client))
        self._end(session)

    # -- timers ---------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Retransmit handshake flights whose timer ran out, cut handshakes
        and sessions without a first message past their pre-auth deadlines,
        and (every few seconds) idle sessions."""
        deadline = now - self.handshake_timeout
        for session in list(self._handshaking):
            if session.started < deadline:
                self.handshake_table.closed("handshake-timeout")
                self._fail(session, "dtls-handshake-timeout")
                continue
            try:
                out = session.timeout()
            except SSL.Error:
                self._fail(session, "dtls-handshake-failed")
                continue
            for datagram in out:
                self._outbox.append((datagram, session.client))
        if self._unproved:
            silent = now - self.first_message_timeout
            for session in [s for s in self._unproved if s.started < silent]:
                self.session_table.closed("first-message-timeout")
                self._end_silently(session)
        if now - self._last_sweep < IDLE_SWEEP_INTERVAL:
            return
        self._last_sweep = now
        idle = now - self.idle_timeout
        for session in list(self.sessions.values()):
            if session.established and session.seen < idle:
                self._fail(session, "dtls-idle-timeout")
