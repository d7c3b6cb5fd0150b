"""Stateless DTLS cookies: the HelloVerifyRequest exchange before any state,
for both DTLS stacks (TURN over DTLS through OpenSSL in
:mod:`crossroads.transport.dtls`, and the Unity relay's PSK core in
:mod:`crossroads.proto.dtls.server`).

Why
---
A DTLS server that sets up a session (and answers with its certificate flight,
kilobytes) for every ClientHello is both a memory sink and an amplifier for
spoofed sources. RFC 6347 §4.2.1 (and RFC 9147 §5.1 for DTLS 1.3) fixes that
with a cookie: the server answers a ClientHello without a valid cookie with a
small HelloVerifyRequest carrying ``Cookie = HMAC(Secret, Client-IP,
Client-Parameters)`` and keeps nothing; the client repeats its ClientHello with
the cookie, which proves it receives at its source address. Only then does a
listener create per-client state.

Theory of operation
-------------------
:func:`parse_client_hello` reads just enough of an epoch-0 handshake record to
find a ClientHello's record sequence number, message sequence, random and cookie
(nothing else is trusted or needed here; OpenSSL parses the rest once a session
exists; the PSK core decodes the whole hello with
:class:`crossroads.proto.dtls.wire.ClientHello` and keeps only these four).
:class:`CookieJar` makes and checks cookies: an HMAC-SHA256, cut to
:data:`COOKIE_SIZE` bytes, over the time period, the client's address and port
and its ClientHello random. The period is ``int(now // period)``; a cookie from
the current or the previous period is accepted, so a cookie lives between one
and two periods, and no per-client memory is needed to expire it.
:func:`hello_verify_request` builds the reply (with the record and handshake
codecs of :mod:`crossroads.proto.dtls.wire`): 48 bytes, never larger than the
smallest ClientHello that can ask for it, so it cannot amplify.

Sans-I/O: no sockets, no clock (``now`` comes in), the secret is injected.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from typing import Final

from crossroads.errors import DecodeError
from crossroads.proto.dtls import wire as w
from crossroads.proto.dtls.wire import HANDSHAKE_HEADER_SIZE, RECORD_HEADER_SIZE
from crossroads.types import frozen

__all__ = [
    "CONTENT_ALERT",
    "CONTENT_APPLICATION_DATA",
    "CONTENT_CHANGE_CIPHER_SPEC",
    "CONTENT_HANDSHAKE",
    "COOKIE_PERIOD",
    "COOKIE_SIZE",
    "HANDSHAKE_HEADER_SIZE",
    "MIN_CLIENT_HELLO_BODY",
    "RECORD_HEADER_SIZE",
    "ClientHello",
    "CookieJar",
    "hello_verify_request",
    "is_dtls",
    "parse_client_hello",
]

#: RFC 6347 §4.1: content types of DTLS records (the listener sorts by them).
CONTENT_CHANGE_CIPHER_SPEC: Final = w.ContentType.CHANGE_CIPHER_SPEC
CONTENT_ALERT: Final = w.ContentType.ALERT
CONTENT_HANDSHAKE: Final = w.ContentType.HANDSHAKE
CONTENT_APPLICATION_DATA: Final = w.ContentType.APPLICATION_DATA
#: Cookie bytes: a 160-bit truncated HMAC-SHA256 is beyond guessing within a
#: cookie's lifetime, and keeps the HelloVerifyRequest smaller than any
#: ClientHello (RFC 6347 allows up to 255 bytes, DTLS 1.2 clients copy any).
COOKIE_SIZE: Final = 20
#: Seconds per cookie period; a cookie is accepted in its period and the next
#: (60-120 s). A client answers a HelloVerifyRequest within one round trip;
#: RFC 6347 §4.2.1 only asks that the secret change now and then.
COOKIE_PERIOD: Final = 60.0
#: The shortest secret :class:`CookieJar` takes: 128 bits (RFC 2104 §3: a key
#: shorter than the hash output weakens the HMAC; below 16 bytes it is guessable).
MIN_SECRET_SIZE: Final = 16
#: RFC 6347 §4.2.2: the smallest ClientHello body: client_version(2)
#: random(32) session_id(1) cookie(1) cipher_suites(2+2) compression(1+1).
MIN_CLIENT_HELLO_BODY: Final = 2 + w.RANDOM_SIZE + 1 + 1 + 4 + 2


def is_dtls(first_byte: int) -> bool:
    """RFC 7983 §7: a datagram whose first byte is 20-63 is DTLS."""
    return 20 <= first_byte <= 63


@frozen
class ClientHello:
    """What the cookie exchange needs from an epoch-0 ClientHello record."""

    #: The record's 48-bit sequence number (echoed in the HelloVerifyRequest).
    record_sequence: int
    #: The handshake message_seq (0 before a cookie, 1 with one: RFC 6347 §4.2.2).
    message_sequence: int
    random: bytes
    cookie: bytes


def parse_client_hello(datagram: bytes) -> ClientHello | None:
    """The ClientHello that starts ``datagram``, or None if the datagram does
    not start with an epoch-0 handshake record holding one.

    Raises:
        DecodeError: a ClientHello record that is truncated or inconsistent.
    """
    if len(datagram) < RECORD_HEADER_SIZE + HANDSHAKE_HEADER_SIZE:
        if datagram[:1] == bytes([CONTENT_HANDSHAKE]):
            raise DecodeError("DTLS handshake record truncated", "truncated")
        return None
    content, version, epoch, high, low, length = w.RECORD_HEADER.unpack_from(datagram)
    if content != CONTENT_HANDSHAKE or epoch != 0:
        return None
    if version >> 8 != 0xFE:
        raise DecodeError("not a DTLS record version", "bad-version")
    if RECORD_HEADER_SIZE + length > len(datagram):
        raise DecodeError("DTLS record longer than its datagram", "truncated")
    header = w.Reader(datagram[RECORD_HEADER_SIZE:])
    if header.uint(1) != w.HandshakeType.CLIENT_HELLO:
        return None
    body_size = header.uint(3)
    message_seq = header.uint(2)
    if header.uint(3) != 0 or header.uint(3) != body_size:
        # A fragmented ClientHello: real clients send it whole (it is small),
        # and reassembling for strangers is the state cookies exist to avoid.
        raise DecodeError("fragmented DTLS ClientHello", "fragmented")
    if body_size < MIN_CLIENT_HELLO_BODY or HANDSHAKE_HEADER_SIZE + body_size > length:
        raise DecodeError("DTLS ClientHello truncated", "truncated")
    start = RECORD_HEADER_SIZE + HANDSHAKE_HEADER_SIZE
    # RFC 6347 §4.2.1: client_version, random, session_id<0..32>, cookie<0..2^8-1>.
    body = w.Reader(datagram[start : start + body_size])
    body.take(2)
    random = body.take(w.RANDOM_SIZE)
    body.vector(1)
    cookie = body.vector(1)
    return ClientHello(high << 32 | low, message_seq, random, cookie)


def hello_verify_request(hello: ClientHello, cookie: bytes) -> bytes:
    """The HelloVerifyRequest datagram answering ``hello`` (RFC 6347 §4.2.1:
    record sequence number and message_seq copied from the ClientHello, and
    "DTLS 1.2 server implementations SHOULD use DTLS version 1.0 regardless of
    the version of TLS that is expected to be negotiated", in the record and in
    server_version)."""
    verify = w.HelloVerifyRequest(w.DTLS1_0, cookie).encode()
    message = w.handshake_message(
        w.HandshakeType.HELLO_VERIFY_REQUEST, hello.message_sequence, verify
    )
    return w.Record(
        w.ContentType.HANDSHAKE, w.DTLS1_0, 0, hello.record_sequence, message
    ).encode()


def _address_bytes(client: tuple[str, int]) -> bytes:
    host, port = client
    try:
        packed = ipaddress.ip_address(host.split("%", 1)[0]).packed
    except ValueError:
        packed = host.encode()
    return packed + port.to_bytes(2, "big")


class CookieJar:
    """Makes and checks stateless cookies with one secret (see module doc)."""

    def __init__(self, secret: bytes, period: float = COOKIE_PERIOD) -> None:
        if len(secret) < MIN_SECRET_SIZE:
            raise ValueError(f"cookie secret: at least {MIN_SECRET_SIZE} bytes")
        self._secret = secret
        self.period = period

    def _mac(self, epoch: int, client: tuple[str, int], random: bytes) -> bytes:
        message = (
            (epoch & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "big")
            + _address_bytes(client)
            + random
        )
        digest = hmac.new(self._secret, message, hashlib.sha256).digest()
        return digest[:COOKIE_SIZE]

    def cookie(self, client: tuple[str, int], random: bytes, now: float) -> bytes:
        """The cookie for ``client``'s ClientHello with ``random`` at ``now``."""
        return self._mac(int(now // self.period), client, random)

    def verify(
        self, cookie: bytes, client: tuple[str, int], random: bytes, now: float
    ) -> bool:
        """True if ``cookie`` was made for this client and random in this period
        or the previous one (constant-time comparisons)."""
        if len(cookie) != COOKIE_SIZE:
            return False
        epoch = int(now // self.period)
        current = hmac.compare_digest(cookie, self._mac(epoch, client, random))
        previous = hmac.compare_digest(cookie, self._mac(epoch - 1, client, random))
        return current | previous
