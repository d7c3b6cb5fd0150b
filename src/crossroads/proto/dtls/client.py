"""A sans-I/O DTLS 1.2 PSK client: one connection to one server.

Theory of operation
-------------------
:meth:`PskDtlsClient.start` sends a ClientHello (epoch 0, message_seq 0) offering
the AEAD PSK suites, the extended master secret (RFC 7627) and the secure
renegotiation SCSV (RFC 5746). A HelloVerifyRequest is answered with the same
hello plus the cookie (message_seq 1; RFC 6347 §4.2.1), and the Finished hash
starts from that second hello. ServerHello, an optional ServerKeyExchange
(the identity hint, ignored as mbedTLS does) and ServerHelloDone make us send
ClientKeyExchange with the identity as raw bytes (a zero byte is fine: Unity
Transport sends the 16 raw allocation ID bytes), ChangeCipherSpec and Finished
in one datagram. The server's Finished (epoch 1) establishes the session.

Each flight is re-sent when the RFC 6347 §4.2.4.1 timer fires (1 s, doubling);
the handshake fails after ``handshake_timeout`` or on a fatal alert. After it,
:meth:`send` protects one record per datagram and received records come out as
:class:`ApplicationData` events, replay-checked.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from enum import IntEnum
from typing import Final

from crossroads.errors import DecodeError
from crossroads.proto.dtls import crypto
from crossroads.proto.dtls import wire as w
from crossroads.proto.dtls.handshake import (
    ApplicationData,
    Closed,
    DtlsCore,
    Established,
    HandshakeFailed,
    Message,
    Reassembler,
    Retransmitter,
)
from crossroads.types import Address

#: Same reasoning as PskDtlsServerConfig.handshake_timeout: four retransmissions.
DEFAULT_HANDSHAKE_TIMEOUT: Final = 15.0


class ClientState(IntEnum):
    IDLE = 0
    WAIT_SERVER_HELLO = 1
    WAIT_SERVER_FINISHED = 2
    ESTABLISHED = 3
    FAILED = 4
    CLOSED = 5


@dataclass(eq=False)
class PskDtlsClient(DtlsCore):
    """The DTLS 1.2 PSK client core (see the module docstring)."""

    server: Address
    identity: bytes
    psk: bytes = field(repr=False)
    random_bytes: Callable[[int], bytes]
    _: KW_ONLY
    cipher_suites: tuple[int, ...] = tuple(crypto.SUITES)
    offer_extended_master_secret: bool = True
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT
    state: ClientState = field(default=ClientState.IDLE, init=False)
    suite: crypto.CipherSuite | None = field(default=None, init=False)
    _random: bytes = field(init=False)
    _reassembler: Reassembler = field(init=False)
    _transcript: list[bytes] = field(default_factory=list, init=False)
    _message_seq: int = field(default=0, init=False)
    _write_seq: int = field(default=0, init=False)
    _server_random: bytes = field(default=b"", init=False)
    _ems: bool = field(default=False, init=False)
    _master: bytes = field(default=b"", init=False, repr=False)
    _read: crypto.RecordProtection | None = field(default=None, init=False)
    _write: crypto.RecordProtection | None = field(default=None, init=False)
    _app_seq: int = field(default=0, init=False)
    _window: crypto.ReplayWindow = field(
        default_factory=crypto.ReplayWindow, init=False
    )
    _flight: bytes = field(default=b"", init=False)
    _timer: Retransmitter | None = field(default=None, init=False)
    _expires: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        super().__init__()
        self._random = self.random_bytes(w.RANDOM_SIZE)
        self._reassembler = Reassembler(0)

    # ------------------------------------------------------------- public API

    def start(self, now: float) -> None:
        """Send the first ClientHello."""
        self.state = ClientState.WAIT_SERVER_HELLO
        self._expires = now + self.handshake_timeout
        hello = self._hello(b"")
        self._transcript = [hello]
        self._send_flight([(w.ContentType.HANDSHAKE, hello)], now)

    def receive_datagram(self, data: bytes, addr: Address, now: float) -> None:
        if addr != self.server or self.state in (
            ClientState.FAILED,
            ClientState.CLOSED,
        ):
            self._drop("unexpected-source")
            return
        records, bad = w.split_records(data)
        if bad is not None:
            self._drop(bad)
        for record in records:
            if self.state in (ClientState.FAILED, ClientState.CLOSED):
                return
            self._on_record(record, now)

    def send(self, data: bytes, now: float) -> bool:
        """One application record in one datagram; False before the handshake."""
        if self.state != ClientState.ESTABLISHED or self._write is None:
            return False
        self._outbox.append(
            (
                self._write.seal(w.ContentType.APPLICATION_DATA, self._app_seq, data),
                self.server,
            )
        )
        self._app_seq += 1
        return True

    def close(self, now: float) -> None:
        """Send close_notify and stop."""
        if self.state == ClientState.ESTABLISHED and self._write is not None:
            close_notify = self._write.seal_warning(
                self._app_seq, w.AlertDescription.CLOSE_NOTIFY
            )
            self._outbox.append((close_notify, self.server))
            self._app_seq += 1
        self.state = ClientState.CLOSED
        self._timer = None

    def get_timer(self) -> float | None:
        if self._timer is None or self._timer.deadline is None:
            return None
        return min(self._timer.deadline, self._expires)

    def handle_timer(self, now: float) -> None:
        if self._timer is None or self._timer.deadline is None:
            return
        if now >= self._expires:
            self._failed("handshake-timeout")
            return
        if now >= self._timer.deadline:
            self._outbox.append((self._flight, self.server))
            self._timer.back_off(now)

    # ---------------------------------------------------------------- records

    def _on_record(self, record: w.Record, now: float) -> None:
        if record.epoch == 0:
            if record.content_type == w.ContentType.HANDSHAKE:
                fragments = self._fragments(record.fragment)
                if fragments is not None:
                    self._on_fragments(fragments, False, now)
            elif record.content_type == w.ContentType.ALERT and (
                self.state != ClientState.ESTABLISHED
            ):
                self._on_alert(record.fragment)
            elif record.content_type != w.ContentType.CHANGE_CIPHER_SPEC:
                self._drop("plaintext")
            return
        if self._read is None or record.epoch != self._read.epoch:
            self._drop("bad-epoch")
            return
        try:
            plain = crypto.open_fresh(self._read, self._window, record)
        except DecodeError as exc:
            self._drop(exc.reason)
            return
        match record.content_type:
            case w.ContentType.HANDSHAKE:
                fragments = self._fragments(plain)
                if fragments is not None:
                    self._on_fragments(fragments, True, now)
            case w.ContentType.APPLICATION_DATA if (
                self.state == ClientState.ESTABLISHED
            ):
                self._events.append(ApplicationData(self.server, plain))
            case w.ContentType.ALERT:
                self._on_alert(plain)
            case _:
                self._drop("unexpected-record")

    def _on_alert(self, body: bytes) -> None:
        try:
            alert = w.Alert.decode(body)
        except DecodeError:
            self._drop("bad-alert")
            return
        if alert.level == w.AlertLevel.FATAL:
            self._failed(f"alert-{alert.description}")
        elif alert.description == w.AlertDescription.CLOSE_NOTIFY:
            if self.state == ClientState.ESTABLISHED:
                self._events.append(Closed(self.server, "close-notify"))
            self.state = ClientState.CLOSED

    def _on_fragments(
        self, fragments: list[w.HandshakeFragment], encrypted: bool, now: float
    ) -> None:
        for fragment in fragments:
            added = self._reassemble(self._reassembler, fragment)
            if added is None:
                return
            messages, repeated = added
            if repeated:
                if self.state == ClientState.WAIT_SERVER_FINISHED:
                    # The server repeats its flight: ours was lost.
                    self._outbox.append((self._flight, self.server))
                continue
            for message in messages:
                self._on_message(message, encrypted, now)

    def _on_message(self, message: Message, encrypted: bool, now: float) -> None:
        kind = message.msg_type
        if self.state == ClientState.WAIT_SERVER_HELLO:
            if kind == w.HandshakeType.HELLO_VERIFY_REQUEST and self._message_seq == 1:
                self._on_verify_request(message, now)
            elif kind == w.HandshakeType.SERVER_HELLO and self.suite is None:
                self._on_server_hello(message)
            elif kind == w.HandshakeType.SERVER_KEY_EXCHANGE and self.suite is not None:
                self._transcript.append(message.encode())  # identity hint: ignored
            elif kind == w.HandshakeType.SERVER_HELLO_DONE and self.suite is not None:
                self._transcript.append(message.encode())
                self._send_key_exchange(now)
            else:
                self._failed("unexpected-message")
        elif (
            self.state == ClientState.WAIT_SERVER_FINISHED
            and kind == w.HandshakeType.FINISHED
            and encrypted
        ):
            self._on_finished(message)
        else:
            self._drop("unexpected-handshake")

    def _on_verify_request(self, message: Message, now: float) -> None:
        try:
            verify = w.HelloVerifyRequest.decode(message.body)
        except DecodeError:
            self._failed("bad-hello-verify-request")
            return
        hello = self._hello(verify.cookie)
        # RFC 6347 §4.2.6: the first hello and the HVR are not in the hash.
        self._transcript = [hello]
        self._send_flight([(w.ContentType.HANDSHAKE, hello)], now)

    def _on_server_hello(self, message: Message) -> None:
        try:
            hello = w.ServerHello.decode(message.body)
        except DecodeError:
            self._failed("bad-server-hello")
            return
        if hello.version != w.DTLS1_2 or hello.cipher_suite not in self.cipher_suites:
            self._failed("bad-server-hello")
            return
        self.suite = crypto.SUITES[hello.cipher_suite]
        self._server_random = hello.random
        self._ems = (
            self.offer_extended_master_secret
            and hello.extension(w.ExtensionType.EXTENDED_MASTER_SECRET) is not None
        )
        self._transcript.append(message.encode())

    def _send_key_exchange(self, now: float) -> None:
        suite = self.suite
        assert suite is not None
        key_exchange = self._message(
            w.HandshakeType.CLIENT_KEY_EXCHANGE, w.encode_psk_identity(self.identity)
        )
        self._transcript.append(key_exchange)
        session_hash = (
            crypto.transcript_hash(suite, self._transcript) if self._ems else None
        )
        keys = crypto.psk_session_keys(
            suite, self.psk, self._random, self._server_random, session_hash
        )
        self._master = keys.master
        self._write = keys.client_write
        self._read = keys.server_write
        finished = self._message(
            w.HandshakeType.FINISHED,
            crypto.verify_data(suite, self._master, True, self._transcript),
        )
        self._transcript.append(finished)
        flight = self._plain_record(w.ContentType.HANDSHAKE, key_exchange)
        flight += self._plain_record(
            w.ContentType.CHANGE_CIPHER_SPEC, w.CHANGE_CIPHER_SPEC_BODY
        )
        flight += self._write.seal(w.ContentType.HANDSHAKE, 0, finished)
        self._app_seq = 1
        self._flight = flight
        self._outbox.append((flight, self.server))
        if self._timer is not None:
            self._timer.restart(now)
        self.state = ClientState.WAIT_SERVER_FINISHED

    def _on_finished(self, message: Message) -> None:
        suite = self.suite
        assert suite is not None
        expected = crypto.verify_data(suite, self._master, False, self._transcript)
        if not hmac.compare_digest(message.body, expected):
            self._failed("bad-finished")
            return
        self.state = ClientState.ESTABLISHED
        self._timer = None
        self._events.append(
            Established(self.server, self.identity, suite.code, self._ems)
        )

    # ----------------------------------------------------------------- helpers

    def _hello(self, cookie: bytes) -> bytes:
        extensions: tuple[tuple[int, bytes], ...] = (
            ((w.ExtensionType.EXTENDED_MASTER_SECRET, b""),)
            if self.offer_extended_master_secret
            else ()
        )
        hello = w.ClientHello(
            version=w.DTLS1_2,
            random=self._random,
            session_id=b"",
            cookie=cookie,
            cipher_suites=self.cipher_suites + (w.TLS_EMPTY_RENEGOTIATION_INFO_SCSV,),
            compression_methods=b"\x00",
            extensions=extensions,
        )
        return self._message(w.HandshakeType.CLIENT_HELLO, hello.encode())

    def _message(self, msg_type: int, body: bytes) -> bytes:
        message = w.handshake_message(msg_type, self._message_seq, body)
        self._message_seq += 1
        return message

    def _plain_record(self, content_type: int, body: bytes) -> bytes:
        record = w.Record(content_type, w.DTLS1_2, 0, self._write_seq, body).encode()
        self._write_seq += 1
        return record

    def _send_flight(self, messages: list[tuple[int, bytes]], now: float) -> None:
        self._flight = b"".join(self._plain_record(t, body) for t, body in messages)
        self._outbox.append((self._flight, self.server))
        if self._timer is None:
            self._timer = Retransmitter(now)
        else:
            self._timer.restart(now)

    def _failed(self, reason: str) -> None:
        if self.state == ClientState.ESTABLISHED:
            self._events.append(Closed(self.server, reason))
        else:
            self._events.append(HandshakeFailed(self.server, reason))
        self.state = ClientState.FAILED
        self._timer = None
