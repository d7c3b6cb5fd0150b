"""Stateless DTLS cookies: the HelloVerifyRequest exchange before any state.

Why
---
A DTLS server that sets up a session (and answers with its certificate flight,
kilobytes) for every ClientHello is both a memory sink and an amplifier for
spoofed sources. RFC 6347 §4.2.1 (and RFC 9147 §5.1 for DTLS 1.3) fixes that
with a cookie: the server answers a ClientHello without a valid cookie with a
small HelloVerifyRequest carrying ``Cookie = HMAC(Secret, Client-IP,
Client-Parameters)`` and keeps nothing; the client repeats its ClientHello with
the cookie, which proves it receives at its source address. Only then does the
listener (``crossroads.transport.dtls``) create per-client state.

Theory of operation
-------------------
:func:`parse_client_hello` reads just enough of an epoch-0 handshake record to
find a ClientHello's record sequence number, message sequence, random and cookie
(nothing else is trusted or needed here; OpenSSL parses the rest once a session
exists). :class:`CookieJar` makes and checks cookies: an HMAC-SHA256, cut to
:data:`COOKIE_SIZE` bytes, over the time period, the client's address and port
and its ClientHello random. The period is ``int(now // period)``; a cookie from
the current or the previous period is accepted, so a cookie lives between one
and two periods, and no per-client memory is needed to expire it.
:func:`hello_verify_request` builds the reply: a 60-byte datagram at most,
never larger than the smallest ClientHello that can ask for it, so it cannot
amplify.

Sans-I/O: no sockets, no clock (``now`` comes in), the secret is injected.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import struct
from dataclasses import dataclass

from crossroads.errors import DecodeError

#: RFC 6347 §4.1: content types of DTLS records.
CONTENT_CHANGE_CIPHER_SPEC = 20
CONTENT_ALERT = 21
CONTENT_HANDSHAKE = 22
CONTENT_APPLICATION_DATA = 23
#: RFC 6347 §4.2.2: handshake message types used here.
HANDSHAKE_CLIENT_HELLO = 1
HANDSHAKE_HELLO_VERIFY_REQUEST = 3
#: RFC 6347 §4.1: type(1) version(2) epoch(2) sequence_number(6) length(2).
RECORD_HEADER_SIZE = 13
#: RFC 6347 §4.2.2: msg_type(1) length(3) message_seq(2) fragment_offset(3)
#: fragment_length(3).
HANDSHAKE_HEADER_SIZE = 12
#: RFC 6347 §4.2.1: "DTLS 1.2 server implementations SHOULD use DTLS version
#: 1.0 regardless of the version of TLS that is expected to be negotiated" in
#: the HelloVerifyRequest (its record and its server_version).
DTLS_1_0 = 0xFEFF
#: Cookie bytes: a 160-bit truncated HMAC-SHA256 is beyond guessing within a
#: cookie's lifetime, and keeps the HelloVerifyRequest smaller than any
#: ClientHello (RFC 6347 allows up to 255 bytes, DTLS 1.2 clients copy any).
COOKIE_SIZE = 20
#: Seconds per cookie period; a cookie is accepted in its period and the next
#: (60-120 s). A client answers a HelloVerifyRequest within one round trip;
#: RFC 6347 §4.2.1 only asks that the secret change now and then.
COOKIE_PERIOD = 60.0
#: RFC 6347 §4.2.2: the smallest ClientHello body: client_version(2)
#: random(32) session_id(1) cookie(1) cipher_suites(2+2) compression(1+1).
MIN_CLIENT_HELLO_BODY = 2 + 32 + 1 + 1 + 4 + 2

_RECORD = struct.Struct("!BHH6sH")
_HANDSHAKE = struct.Struct("!B3sH3s3s")


def is_dtls(first_byte: int) -> bool:
    """RFC 7983 §7: a datagram whose first byte is 20-63 is DTLS."""
    return 20 <= first_byte <= 63


@dataclass(frozen=True, slots=True)
class ClientHello:
    """What the cookie exchange needs from an epoch-0 ClientHello record."""

    #: The record's 48-bit sequence number (echoed in the HelloVerifyRequest).
    record_sequence: bytes
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
            raise DecodeError("DTLS handshake record truncated")
        return None
    content, version, epoch, sequence, length = _RECORD.unpack_from(datagram)
    if content != CONTENT_HANDSHAKE or epoch != 0:
        return None
    if version >> 8 != 0xFE:
        raise DecodeError("not a DTLS record version")
    if RECORD_HEADER_SIZE + length > len(datagram):
        raise DecodeError("DTLS record longer than its datagram")
    kind, size, message_seq, offset, fragment = _HANDSHAKE.unpack_from(
        datagram, RECORD_HEADER_SIZE
    )
    if kind != HANDSHAKE_CLIENT_HELLO:
        return None
    body_size = int.from_bytes(size, "big")
    if offset != b"\0\0\0" or int.from_bytes(fragment, "big") != body_size:
        # A fragmented ClientHello: real clients send it whole (it is small),
        # and reassembling for strangers is the state cookies exist to avoid.
        raise DecodeError("fragmented DTLS ClientHello")
    if body_size < MIN_CLIENT_HELLO_BODY or HANDSHAKE_HEADER_SIZE + body_size > length:
        raise DecodeError("DTLS ClientHello truncated")
    body = RECORD_HEADER_SIZE + HANDSHAKE_HEADER_SIZE
    random = datagram[body + 2 : body + 34]
    at = body + 34
    at += 1 + datagram[at]  # session_id
    end = body + body_size
    if at >= end:
        raise DecodeError("DTLS ClientHello truncated")
    cookie_size = datagram[at]
    cookie = datagram[at + 1 : at + 1 + cookie_size]
    if at + 1 + cookie_size > end:
        raise DecodeError("DTLS ClientHello cookie truncated")
    return ClientHello(sequence, message_seq, random, cookie)


def hello_verify_request(hello: ClientHello, cookie: bytes) -> bytes:
    """The HelloVerifyRequest datagram answering ``hello`` (RFC 6347 §4.2.1:
    record sequence number and message_seq copied from the ClientHello)."""
    body = struct.pack("!HB", DTLS_1_0, len(cookie)) + cookie
    handshake = (
        _HANDSHAKE.pack(
            HANDSHAKE_HELLO_VERIFY_REQUEST,
            len(body).to_bytes(3, "big"),
            hello.message_sequence,
            b"\0\0\0",
            len(body).to_bytes(3, "big"),
        )
        + body
    )
    record = _RECORD.pack(
        CONTENT_HANDSHAKE, DTLS_1_0, 0, hello.record_sequence, len(handshake)
    )
    return record + handshake


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
        if len(secret) < 16:
            raise ValueError("cookie secret: at least 16 bytes")
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
