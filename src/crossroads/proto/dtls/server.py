"""A sans-I/O DTLS 1.2 PSK server: many clients, one UDP port.

Theory of operation
-------------------
Each client is known by its IP:port. Three things may exist for an address: no
state at all, a *handshake* in progress, and an established *session*.

1. **Cookie first, no state before it** (RFC 6347 §4.2.1). A ClientHello
   (epoch 0) without a valid cookie is answered with a HelloVerifyRequest whose
   cookie is an HMAC of the client's address, port and hello random and of the
   ``cookie_rotation``-second period (the current and the previous period are
   accepted; :mod:`crossroads.proto.dtls_cookie`, shared with TURN over DTLS).
   Nothing is stored, and the answer (48 bytes)
   is smaller than any well-formed ClientHello, so spoofed hellos neither fill
   memory nor amplify. Only a hello that echoes a valid cookie (its sender
   received our answer) creates a handshake, within per-IP and global caps.
2. **Handshake** (RFC 5246 §7.3, RFC 4279 §2; PSK only, no certificate, no
   ServerKeyExchange since we send no identity hint): ServerHello +
   ServerHelloDone in one datagram; then ClientKeyExchange (the PSK identity,
   binary-safe: a zero byte is part of it), ChangeCipherSpec and Finished
   (epoch 1). The PSK comes from the injected ``psk_for(identity)`` (candidates:
   the client's Finished picks the one that authenticates); the
   premaster is RFC 4279's, the master secret the extended one (RFC 7627) when
   the client offered it. A wrong key shows as a Finished that does not
   authenticate: the client gets a fatal ``bad_record_mac`` alert. Our
   ChangeCipherSpec + Finished complete it, and the session replaces any
   previous one of that address (Unity's reconnection probe, reference
   unity-secure-transports.md §1.5, is a fresh epoch-0 ClientHello on a live
   address: it gets a HelloVerifyRequest like anyone, never an alert).
3. **Retransmission** (RFC 6347 §4.2.4): a handshake's last flight is re-sent
   when its timer (1 s, doubling) fires or the client repeats its own flight;
   a handshake not done within ``handshake_timeout`` is dropped. After the
   handshake, a repeated client Finished / ClientKeyExchange gets our final
   flight again (at most ``max_final_resends`` times).
4. **Session**: application data records are opened, checked against a 64-record
   replay window and reported as :class:`ApplicationData` events; :meth:`send`
   protects one datagram-sized record per call (one relay message per record
   per datagram). A ClientHello inside the session (renegotiation, RFC 5746)
   gets a ``no_renegotiation`` warning; a close_notify or fatal alert ends the
   session; so does ``idle_timeout`` without a valid record. Plaintext alerts
   never end a session (anyone can forge one).
5. **Pre-auth state and tables.** Handshakes and sessions are admitted by two
   injected tables (:class:`~crossroads.proto.admission.Admitter`: the
   process's resource budget in a service,
   :class:`~crossroads.proto.admission.LocalTable` with the config's caps
   otherwise), which
   count them per source (IPv4 address or IPv6 /64). With
   ``first_message_timeout`` set, a session its owner has not
   :meth:`PskDtlsServer.confirm` ed (the relay: a BIND it accepted) within that
   many seconds of the handshake ends with a close_notify
   (``no-first-message``): the PSK proves the client holds a key, but the
   session is kept for relaying, which needs a bound allocation.

Everything malformed is dropped and counted in :attr:`PskDtlsServer.drops` (one
key per reason); the core does no I/O and reads time only from ``now``.
"""

from __future__ import annotations

import heapq
import hmac
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

from crossroads.errors import DecodeError
from crossroads.proto.admission import Admitter, LocalTable
from crossroads.proto.budget import BudgetConfig, FailureBudget
from crossroads.proto.dtls import wire as w
from crossroads.proto.dtls.crypto import (
    SUITES,
    CipherSuite,
    RecordProtection,
    ReplayWindow,
    SessionKeys,
    open_fresh,
    psk_session_keys,
    transcript_hash,
    verify_data,
)
from crossroads.proto.dtls.handshake import (
    ApplicationData,
    Closed,
    DtlsCore,
    Established,
    HandshakeFailed,
    HelloReceived,
    Message,
    Reassembler,
    Retransmitter,
)
from crossroads.proto.dtls_cookie import ClientHello as CookieHello
from crossroads.proto.dtls_cookie import CookieJar, hello_verify_request
from crossroads.types import Address, frozen

#: The PSKs an identity may use, most likely first (a relay node that adopted a
#: new secret still knows allocations keyed under the previous ones); empty
#: when the identity is unknown. The client's Finished tells which one it used.
PskLookup = Callable[[bytes], Sequence[bytes]]
#: Candidate keys tried per handshake, at most (each costs a key derivation).
MAX_PSK_CANDIDATES: Final = 8

#: Bytes of the cookie secret drawn at start: a full HMAC-SHA256 key (RFC 2104
#: §3: the hash output size).
COOKIE_SECRET_SIZE: Final = 32
#: RFC 6347 §4.1: sequence numbers are 48 bits; a session that would wrap ends.
MAX_SEQUENCE: Final = 2**48 - 1


@frozen
class PskDtlsServerConfig:
    """Limits and timers of a DTLS server."""

    #: Offered suites, in server preference order (all AEAD; crypto.SUITES).
    cipher_suites: tuple[int, ...] = tuple(SUITES)
    #: A legitimate handshake takes one round trip after the cookie; 15 s covers
    #: four retransmissions of the RFC 6347 §4.2.4.1 timer (1 + 2 + 4 + 8 s).
    handshake_timeout: float = 15.0
    #: Seconds without a valid record before a session ends. The relay drops an
    #: allocation after 10 s of silence (reference §1.2) and Unity clients
    #: ping every 3 s at most; 30 s only frees sessions nobody uses.
    idle_timeout: float = 30.0
    #: Handshakes past the cookie, in all and per source IP (a slow-handshake
    #: flood needs real addresses, and each one holds at most this many).
    max_handshakes: int = 1024
    max_handshakes_per_ip: int = 8
    #: Established sessions, in all and per source IP (players behind one NAT).
    max_sessions: int = 20_000
    max_sessions_per_ip: int = 256
    #: Seconds of one cookie period (proto/dtls_cookie.py); a cookie stays
    #: valid in its period and the next.
    cookie_rotation: float = 30.0
    #: Unity Transport's DTLS MTU is 1400 bytes (reference §1.4): no datagram
    #: we send may be larger.
    max_datagram: int = 1400
    #: Re-sends of the final flight when the client repeats its last flight.
    max_final_resends: int = 8
    #: ClientHellos per second per source (IPv4 address or IPv6 /64,
    #: proto/budget.py) and the burst: a client sends one per retransmission
    #: (1 s, doubling), so even a NAT with hundreds of players starting at once
    #: stays under it; a flood from one source costs one HMAC per hello only
    #: up to it. 0 turns it off.
    hello_rate: float = 50.0
    hello_burst: float = 200.0
    #: Seconds an established session may live before its owner confirms it
    #: (:meth:`PskDtlsServer.confirm`); None: no such deadline (the core alone
    #: cannot tell a valid message).
    first_message_timeout: float | None = None


@dataclass(slots=True, eq=False)
class _Handshake:
    address: Address
    hello_seq: int
    client_random: bytes
    server_random: bytes
    suite: CipherSuite
    ems: bool
    transcript: list[bytes]
    reassembler: Reassembler
    next_server_seq: int
    write_seq: int
    flight: bytes
    timer: Retransmitter
    expires: float
    token: int = 0
    master: bytes = field(default=b"", repr=False)
    identity: bytes = b""
    read: RecordProtection | None = None
    write: RecordProtection | None = None
    #: The keys of each candidate PSK until the client's Finished shows which
    #: one it holds.
    candidates: list[SessionKeys] = field(default_factory=list)

    def choose(self, keys: SessionKeys) -> None:
        """Go on with ``keys`` (we read what the client writes)."""
        self.master = keys.master
        self.read = keys.client_write
        self.write = keys.server_write


@dataclass(slots=True, eq=False)
class _Session:
    address: Address
    identity: bytes
    suite: CipherSuite
    read: RecordProtection
    write: RecordProtection
    last_rx: float
    final_flight: bytes | None
    write_seq: int = 1
    resends: int = 0
    #: The datagram (by :attr:`PskDtlsServer._datagrams` count) that last made us
    #: resend: a repeated flight of two records gets one answer, not two.
    resent_for: int = -1
    token: int = 0
    window: ReplayWindow = field(default_factory=ReplayWindow)
    #: When the handshake completed; whether the owner confirmed the session
    #: (its first valid message came).
    established: float = 0.0
    confirmed: bool = False


@dataclass(eq=False)
class PskDtlsServer(DtlsCore):
    """The DTLS 1.2 PSK server core (see the module docstring).

    Args:
        config: limits and timers.
        psk_for: the candidate PSKs of an identity, none when unknown.
        random_bytes: the randomness source (server randoms, cookie secrets).
    """

    config: PskDtlsServerConfig
    psk_for: PskLookup
    random_bytes: Callable[[int], bytes]
    #: Where handshakes and established sessions are admitted; None: a
    #: :class:`~crossroads.proto.admission.LocalTable` with the config's caps.
    handshake_table: Admitter | None = None
    session_table: Admitter | None = None
    handshakes: dict[Address, _Handshake] = field(
        default_factory=dict, init=False, repr=False
    )
    sessions: dict[Address, _Session] = field(default_factory=dict, init=False)
    #: Handshake failures by reason, and counters for metrics and tests.
    failures: dict[str, int] = field(default_factory=dict, init=False)
    hello_verify_sent: int = field(default=0, init=False)
    established_total: int = field(default=0, init=False)
    _timers: list[tuple[float, int, Address]] = field(default_factory=list, init=False)
    _next_token: int = field(default=0, init=False)
    _datagrams: int = field(default=0, init=False)
    _hello_budget: FailureBudget = field(init=False)
    _cookies: CookieJar = field(init=False)

    def __post_init__(self) -> None:
        super().__init__()
        cfg = self.config
        if self.handshake_table is None:
            self.handshake_table = LocalTable(
                cfg.max_handshakes, cfg.max_handshakes_per_ip
            )
        if self.session_table is None:
            self.session_table = LocalTable(cfg.max_sessions, cfg.max_sessions_per_ip)
        self._hello_budget = FailureBudget(
            BudgetConfig(
                per_source_rate=self.config.hello_rate,
                per_source_burst=self.config.hello_burst,
                global_rate=0.0,
                global_burst=0.0,
            )
        )
        self._cookies = CookieJar(
            self.random_bytes(COOKIE_SECRET_SIZE), self.config.cookie_rotation
        )

    # ------------------------------------------------------------- public API

    def receive_datagram(self, data: bytes, addr: Address, now: float) -> None:
        """Handle one datagram from ``addr``. Never raises on bad input."""
        self._datagrams += 1
        records, bad = w.split_records(data)
        if bad is not None:
            self._drop(bad)
        for record in records:
            self._on_record(record, addr, now)

    def send(self, addr: Address, data: bytes, now: float) -> bool:
        """Protect ``data`` as one record in one datagram to ``addr``'s session.
        False (and counted) when there is no session or it would not fit."""
        session = self.sessions.get(addr)
        if session is None:
            self._drop("send-no-session")
            return False
        record = session.write.seal(
            w.ContentType.APPLICATION_DATA, session.write_seq, data
        )
        if len(record) > self.config.max_datagram:
            self._drop("oversize")
            return False
        session.write_seq += 1
        if session.write_seq > MAX_SEQUENCE:
            self._end_session(session, "sequence-exhausted")
        self._outbox.append((record, addr))
        return True

    def close(self, addr: Address, now: float, reason: str = "closed") -> None:
        """End ``addr``'s session with a close_notify alert."""
        session = self.sessions.get(addr)
        if session is None:
            return
        close_notify = session.write.seal_warning(
            session.write_seq, w.AlertDescription.CLOSE_NOTIFY
        )
        self._outbox.append((close_notify, addr))
        self._end_session(session, reason)

    def confirm(self, addr: Address) -> None:
        """``addr``'s session said something valid (the relay: a BIND it
        accepted): its first-message deadline no longer applies."""
        session = self.sessions.get(addr)
        if session is not None:
            session.confirmed = True

    def get_timer(self) -> float | None:
        return self._timers[0][0] if self._timers else None

    def handle_timer(self, now: float) -> None:
        while self._timers and self._timers[0][0] <= now:
            _, token, addr = heapq.heappop(self._timers)
            handshake = self.handshakes.get(addr)
            if handshake is not None and handshake.token == token:
                if now >= handshake.expires:
                    self._fail(handshake, None, "handshake-timeout")
                    continue
                self._outbox.append((handshake.flight, addr))
                handshake.timer.back_off(now)
                self._schedule_handshake(handshake)
                continue
            session = self.sessions.get(addr)
            if session is not None and session.token == token:
                first = self.config.first_message_timeout
                if now - session.last_rx >= self.config.idle_timeout:
                    self._end_session(session, "idle")
                elif (
                    first is not None
                    and not session.confirmed
                    and now - session.established >= first
                ):
                    assert self.session_table is not None
                    self.session_table.closed("first-message-timeout")
                    self.close(addr, now, "no-first-message")
                else:
                    self._schedule_session(session)

    # ---------------------------------------------------------------- records

    def _on_record(self, record: w.Record, addr: Address, now: float) -> None:
        if record.epoch == 0:
            self._on_plaintext(record, addr, now)
            return
        handshake = self.handshakes.get(addr)
        session = self.sessions.get(addr)
        if (
            handshake is not None
            and handshake.read is not None
            and record.epoch == handshake.read.epoch
        ):
            plain = self._open_handshake_record(handshake, record)
            if plain is None:
                if session is None:
                    # The client derived other keys: a wrong PSK (RFC 4279 §2
                    # lets the Finished check reveal it).
                    self._fail(handshake, w.AlertDescription.BAD_RECORD_MAC, "bad-psk")
                    return
            else:
                self._on_handshake_record(handshake, record.content_type, plain, now)
                return
        if session is not None and record.epoch == session.read.epoch:
            try:
                plain = open_fresh(session.read, session.window, record)
            except DecodeError as exc:
                self._drop(exc.reason)
                return
            session.last_rx = now
            self._on_session_record(session, record.content_type, plain, now)
            return
        self._drop("no-session")

    def _on_plaintext(self, record: w.Record, addr: Address, now: float) -> None:
        handshake = self.handshakes.get(addr)
        match record.content_type:
            case w.ContentType.HANDSHAKE:
                fragments = self._fragments(record.fragment)
                if fragments is None:
                    return
                if fragments[0].msg_type == w.HandshakeType.CLIENT_HELLO:
                    self._on_client_hello(record, fragments[0], addr, now)
                elif handshake is not None:
                    self._on_fragments(handshake, fragments, False, now)
                elif (session := self.sessions.get(addr)) is not None:
                    # The client repeats its last flight: ours was lost.
                    self._resend_final(session)
                else:
                    self._drop("no-handshake")
            case w.ContentType.CHANGE_CIPHER_SPEC:
                if handshake is None and addr not in self.sessions:
                    self._drop("no-handshake")
            case w.ContentType.ALERT:
                if handshake is not None and handshake.read is None:
                    try:
                        alert = w.Alert.decode(record.fragment)
                    except DecodeError:
                        self._drop("bad-alert")
                        return
                    if alert.level == w.AlertLevel.FATAL:
                        self._fail(handshake, None, f"client-alert-{alert.description}")
                else:
                    self._drop("plaintext-alert")
            case _:
                self._drop("plaintext-data")

    # ------------------------------------------------------------ ClientHello

    def _on_client_hello(
        self,
        record: w.Record,
        fragment: w.HandshakeFragment,
        addr: Address,
        now: float,
    ) -> None:
        if not fragment.whole:
            # Reassembling would mean state before the cookie round trip.
            self._drop("fragmented-hello")
            return
        if not self._hello_budget.try_spend(addr[0], now):
            self._drop("hello-rate")
            return
        try:
            hello = w.ClientHello.decode(fragment.body)
        except DecodeError as exc:
            self._drop(f"hello-{exc.reason}")
            return
        if not self._cookies.verify(hello.cookie, addr, hello.random, now):
            challenge = CookieHello(
                record.sequence, fragment.message_seq, hello.random, hello.cookie
            )
            cookie = self._cookies.cookie(addr, hello.random, now)
            self._outbox.append((hello_verify_request(challenge, cookie), addr))
            self.hello_verify_sent += 1
            return
        current = self.handshakes.get(addr)
        if current is not None:
            if current.hello_seq == fragment.message_seq and (
                current.client_random == hello.random
            ):
                # A repeated ClientHello: our ServerHello flight was lost.
                self._outbox.append((current.flight, addr))
                return
            self._forget_handshake(current)
        if not self._admit(addr):
            return
        self._start_handshake(record, fragment, hello, addr, now)

    def _admit(self, addr: Address) -> bool:
        """A handshake item for ``addr`` (its session item is taken when the
        handshake completes)."""
        assert self.handshake_table is not None
        if self.handshake_table.admit(addr[0]) is not None:
            self._drop("handshake-cap")
            return False
        return True

    def _start_handshake(
        self,
        record: w.Record,
        fragment: w.HandshakeFragment,
        hello: w.ClientHello,
        addr: Address,
        now: float,
    ) -> None:
        offered = set(hello.cipher_suites)
        chosen = next((s for s in self.config.cipher_suites if s in offered), None)
        self._events.append(
            HelloReceived(
                address=addr,
                version=hello.version,
                cipher_suites=hello.cipher_suites,
                extensions=tuple(t for t, _ in hello.extensions),
                chosen=chosen,
            )
        )
        failure: tuple[w.AlertDescription, str] | None = None
        renegotiation = hello.extension(w.ExtensionType.RENEGOTIATION_INFO)
        if hello.version > w.DTLS1_2:  # versions count down: this is older
            failure = (w.AlertDescription.PROTOCOL_VERSION, "old-version")
        elif chosen is None:
            failure = (w.AlertDescription.HANDSHAKE_FAILURE, "no-shared-suite")
        elif 0 not in hello.compression_methods:
            failure = (w.AlertDescription.ILLEGAL_PARAMETER, "no-null-compression")
        elif renegotiation not in (None, b"\x00"):
            # RFC 5746 §3.6: an initial handshake carries an empty
            # renegotiated_connection.
            failure = (w.AlertDescription.HANDSHAKE_FAILURE, "bad-renegotiation-info")
        if failure is not None or chosen is None:
            assert self.handshake_table is not None
            self.handshake_table.release(addr[0])
            description, reason = failure or (w.AlertDescription.INTERNAL_ERROR, "")
            alert = w.Alert(w.AlertLevel.FATAL, description).encode()
            self._plain(addr, w.ContentType.ALERT, record.sequence, alert)
            self.failures[reason] = self.failures.get(reason, 0) + 1
            self._events.append(HandshakeFailed(addr, reason))
            return
        suite = SUITES[chosen]
        ems = hello.extension(w.ExtensionType.EXTENDED_MASTER_SECRET) is not None
        extensions: list[tuple[int, bytes]] = []
        if ems:
            extensions.append((w.ExtensionType.EXTENDED_MASTER_SECRET, b""))
        if (
            renegotiation is not None
            or w.TLS_EMPTY_RENEGOTIATION_INFO_SCSV in hello.cipher_suites
        ):
            # RFC 5746 §3.6: answer with an empty renegotiation_info.
            extensions.append((w.ExtensionType.RENEGOTIATION_INFO, b"\x00"))
        server_random = self.random_bytes(w.RANDOM_SIZE)
        server_hello = w.ServerHello(
            version=w.DTLS1_2,
            random=server_random,
            session_id=b"",
            cipher_suite=chosen,
            compression_method=0,
            extensions=tuple(extensions),
        )
        # RFC 6347 §4.2.2 / what OpenSSL's DTLSv1_listen does: after a
        # stateless cookie exchange our message_seq continues from the
        # client's, and so does our epoch-0 record sequence.
        seq = fragment.message_seq
        hello_message = w.handshake_message(
            w.HandshakeType.CLIENT_HELLO, seq, fragment.body
        )
        sh = w.handshake_message(
            w.HandshakeType.SERVER_HELLO, seq, server_hello.encode()
        )
        done = w.handshake_message(w.HandshakeType.SERVER_HELLO_DONE, seq + 1, b"")
        write_seq = record.sequence
        flight = self._plain_record(w.ContentType.HANDSHAKE, write_seq, sh)
        flight += self._plain_record(w.ContentType.HANDSHAKE, write_seq + 1, done)
        handshake = _Handshake(
            address=addr,
            hello_seq=seq,
            client_random=hello.random,
            server_random=server_random,
            suite=suite,
            ems=ems,
            transcript=[hello_message, sh, done],
            reassembler=Reassembler(seq + 1),
            next_server_seq=seq + 2,
            write_seq=write_seq + 2,
            flight=flight,
            timer=Retransmitter(now),
            expires=now + self.config.handshake_timeout,
        )
        self.handshakes[addr] = handshake
        self._outbox.append((flight, addr))
        self._schedule_handshake(handshake)

    # ------------------------------------------------------------- handshake

    def _on_handshake_record(
        self, handshake: _Handshake, content_type: int, plain: bytes, now: float
    ) -> None:
        if content_type == w.ContentType.HANDSHAKE:
            fragments = self._fragments(plain)
            if fragments is not None:
                self._on_fragments(handshake, fragments, True, now)
        elif content_type == w.ContentType.ALERT:
            self._fail(handshake, None, "client-alert")
        else:
            self._drop("early-data")

    def _on_fragments(
        self,
        handshake: _Handshake,
        fragments: list[w.HandshakeFragment],
        encrypted: bool,
        now: float,
    ) -> None:
        for fragment in fragments:
            added = self._reassemble(handshake.reassembler, fragment)
            if added is None:
                return
            messages, repeated = added
            if repeated:
                self._outbox.append((handshake.flight, handshake.address))
                return
            for message in messages:
                if not self._on_message(handshake, message, encrypted, now):
                    return

    def _on_message(
        self, handshake: _Handshake, message: Message, encrypted: bool, now: float
    ) -> bool:
        """Handle one client handshake message; False when the handshake ended."""
        if (
            message.msg_type == w.HandshakeType.CLIENT_KEY_EXCHANGE
            and not handshake.master
        ):
            return self._on_key_exchange(handshake, message)
        if message.msg_type == w.HandshakeType.FINISHED and encrypted:
            self._on_finished(handshake, message, now)
            return False
        self._fail(
            handshake, w.AlertDescription.UNEXPECTED_MESSAGE, "unexpected-message"
        )
        return False

    def _on_key_exchange(self, handshake: _Handshake, message: Message) -> bool:
        try:
            identity = w.decode_psk_identity(message.body)
        except DecodeError:
            self._fail(handshake, w.AlertDescription.DECODE_ERROR, "bad-key-exchange")
            return False
        psks = list(self.psk_for(identity))[:MAX_PSK_CANDIDATES]
        if not psks:
            self._fail(
                handshake, w.AlertDescription.UNKNOWN_PSK_IDENTITY, "unknown-identity"
            )
            return False
        suite = handshake.suite
        handshake.transcript.append(message.encode())
        session_hash = (
            transcript_hash(suite, handshake.transcript) if handshake.ems else None
        )
        handshake.candidates = [
            psk_session_keys(
                suite,
                psk,
                handshake.client_random,
                handshake.server_random,
                session_hash,
            )
            for psk in psks
        ]
        handshake.choose(handshake.candidates[0])
        handshake.identity = identity
        return True

    @staticmethod
    def _open_handshake_record(handshake: _Handshake, record: w.Record) -> bytes | None:
        """The plaintext of an epoch-1 handshake record under the candidate key
        that authenticates it (which then becomes the only one), else None."""
        for candidate in handshake.candidates:
            try:
                plain = candidate.client_write.open(record)
            except DecodeError:
                continue
            handshake.choose(candidate)
            handshake.candidates = [candidate]
            return plain
        return None

    def _on_finished(self, handshake: _Handshake, message: Message, now: float) -> None:
        suite = handshake.suite
        expected = verify_data(suite, handshake.master, True, handshake.transcript)
        if handshake.write is None or handshake.read is None:
            self._fail(
                handshake, w.AlertDescription.UNEXPECTED_MESSAGE, "early-finished"
            )
            return
        if not hmac.compare_digest(message.body, expected):
            self._fail(handshake, w.AlertDescription.DECRYPT_ERROR, "bad-finished")
            return
        handshake.transcript.append(message.encode())
        ours = verify_data(suite, handshake.master, False, handshake.transcript)
        finished = w.handshake_message(
            w.HandshakeType.FINISHED, handshake.next_server_seq, ours
        )
        final = self._plain_record(
            w.ContentType.CHANGE_CIPHER_SPEC,
            handshake.write_seq,
            w.CHANGE_CIPHER_SPEC_BODY,
        ) + handshake.write.seal(w.ContentType.HANDSHAKE, 0, finished)
        addr = handshake.address
        previous = self.sessions.get(addr)
        if previous is not None:
            # Its item goes back first: a client's own old session never
            # counts against its new one.
            self._end_session(previous, "replaced")
        assert self.session_table is not None
        if self.session_table.admit(addr[0]) is not None:
            self._drop("session-cap")
            self._fail(handshake, w.AlertDescription.INTERNAL_ERROR, "session-cap")
            return
        self._forget_handshake(handshake)
        session = _Session(
            address=addr,
            identity=handshake.identity,
            suite=suite,
            read=handshake.read,
            write=handshake.write,
            last_rx=now,
            final_flight=final,
            established=now,
        )
        self.sessions[addr] = session
        self.established_total += 1
        self._outbox.append((final, addr))
        self._events.append(
            Established(addr, handshake.identity, suite.code, handshake.ems)
        )
        self._schedule_session(session)

    # --------------------------------------------------------------- session

    def _on_session_record(
        self, session: _Session, content_type: int, plain: bytes, now: float
    ) -> None:
        match content_type:
            case w.ContentType.APPLICATION_DATA:
                session.final_flight = None  # the client has our Finished
                self._events.append(ApplicationData(session.address, plain))
            case w.ContentType.HANDSHAKE:
                try:
                    fragments = w.decode_fragments(plain)
                except DecodeError:
                    self._drop("handshake-malformed")
                    return
                kind = fragments[0].msg_type
                if kind == w.HandshakeType.FINISHED:
                    self._resend_final(session)
                elif kind == w.HandshakeType.CLIENT_HELLO:
                    # RFC 5746 §4.4 / RFC 5246 §7.2.2: refuse renegotiation
                    # with a warning; the session goes on.
                    self._drop("renegotiation")
                    refusal = session.write.seal_warning(
                        session.write_seq, w.AlertDescription.NO_RENEGOTIATION
                    )
                    self._outbox.append((refusal, session.address))
                    session.write_seq += 1
                else:
                    self._drop("unexpected-handshake")
            case w.ContentType.ALERT:
                try:
                    alert = w.Alert.decode(plain)
                except DecodeError:
                    self._drop("bad-alert")
                    return
                if (
                    alert.level == w.AlertLevel.FATAL
                    or alert.description == w.AlertDescription.CLOSE_NOTIFY
                ):
                    self._end_session(session, f"alert-{alert.description}")
            case _:
                self._drop("unexpected-record")

    def _resend_final(self, session: _Session) -> None:
        if (
            session.final_flight is None
            or session.resends >= self.config.max_final_resends
        ):
            self._drop("repeated-flight")
            return
        if session.resent_for == self._datagrams:
            return
        session.resent_for = self._datagrams
        session.resends += 1
        self._outbox.append((session.final_flight, session.address))

    def _end_session(self, session: _Session, reason: str) -> None:
        if self.sessions.get(session.address) is not session:
            return
        del self.sessions[session.address]
        assert self.session_table is not None
        self.session_table.release(session.address[0])
        self._events.append(Closed(session.address, reason))

    # ----------------------------------------------------------------- helpers

    def _fail(
        self,
        handshake: _Handshake,
        description: w.AlertDescription | None,
        reason: str,
    ) -> None:
        if description is not None:
            alert = w.Alert(w.AlertLevel.FATAL, description).encode()
            self._plain(
                handshake.address, w.ContentType.ALERT, handshake.write_seq, alert
            )
        self._forget_handshake(handshake)
        self.failures[reason] = self.failures.get(reason, 0) + 1
        self._events.append(HandshakeFailed(handshake.address, reason))

    def _forget_handshake(self, handshake: _Handshake) -> None:
        if self.handshakes.get(handshake.address) is handshake:
            del self.handshakes[handshake.address]
            assert self.handshake_table is not None
            self.handshake_table.release(handshake.address[0])

    def _schedule_handshake(self, handshake: _Handshake) -> None:
        deadline = handshake.timer.deadline
        at = handshake.expires if deadline is None else min(deadline, handshake.expires)
        handshake.token = self._push(at, handshake.address)

    def _schedule_session(self, session: _Session) -> None:
        at = session.last_rx + self.config.idle_timeout
        first = self.config.first_message_timeout
        if first is not None and not session.confirmed:
            at = min(at, session.established + first)
        session.token = self._push(at, session.address)

    def _push(self, at: float, addr: Address) -> int:
        self._next_token += 1
        heapq.heappush(self._timers, (at, self._next_token, addr))
        return self._next_token

    @staticmethod
    def _plain_record(content_type: int, sequence: int, body: bytes) -> bytes:
        return w.Record(content_type, w.DTLS1_2, 0, sequence, body).encode()

    def _plain(
        self, addr: Address, content_type: int, sequence: int, body: bytes
    ) -> None:
        self._outbox.append((self._plain_record(content_type, sequence, body), addr))
