"""DTLS 1.2 wire formats (RFC 6347, RFC 5246, RFC 4279): records, handshake
fragments and the handshake messages a PSK-only handshake needs.

Every decoder takes bytes from the network and returns a frozen dataclass or
raises :class:`~crossroads.errors.DecodeError` (``reason`` is a metric label);
every encoder is its exact inverse. Nothing here keeps state or knows keys.
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import ClassVar, Final

from crossroads.errors import DecodeError
from crossroads.proto.binary import ByteReader, length_prefixed
from crossroads.types import frozen

#: RFC 6347 §4.1: DTLS 1.2 is {254, 253}; DTLS 1.0 is {254, 255}. Versions count
#: *down*, so "at least DTLS 1.2" is ``version <= DTLS1_2``.
DTLS1_0: Final = 0xFEFF
DTLS1_2: Final = 0xFEFD
#: RFC 6347 §4.1: type(1) version(2) epoch(2) sequence_number(6) length(2);
#: the 48-bit sequence number as a 16-bit high and a 32-bit low part.
RECORD_HEADER: Final = struct.Struct("!BHHHIH")
RECORD_HEADER_SIZE: Final = 13
#: RFC 6347 §4.2.2: msg_type(1) length(3) message_seq(2) fragment_offset(3)
#: fragment_length(3).
HANDSHAKE_HEADER_SIZE: Final = 12
#: RFC 6347 §4.1: a record is at most 2^14 bytes of plaintext plus 2048 of
#: expansion; anything longer is malformed.
MAX_RECORD_LENGTH: Final = 2**14 + 2048
#: RFC 5246 §7.4.1.2: the random is 32 bytes; session IDs are at most 32.
RANDOM_SIZE: Final = 32
MAX_SESSION_ID: Final = 32
#: RFC 6347 §4.2.1: the cookie is at most 255 bytes (opaque cookie<0..2^8-1>).
MAX_COOKIE: Final = 255
#: RFC 5246 §7.4.9: verify_data is 12 bytes for every TLS 1.2 suite we offer.
VERIFY_DATA_SIZE: Final = 12
#: RFC 5746 §3.3: the signalling cipher suite value for secure renegotiation.
TLS_EMPTY_RENEGOTIATION_INFO_SCSV: Final = 0x00FF


class ContentType(IntEnum):
    CHANGE_CIPHER_SPEC = 20
    ALERT = 21
    HANDSHAKE = 22
    APPLICATION_DATA = 23


class HandshakeType(IntEnum):
    HELLO_REQUEST = 0
    CLIENT_HELLO = 1
    SERVER_HELLO = 2
    HELLO_VERIFY_REQUEST = 3
    SERVER_KEY_EXCHANGE = 12
    SERVER_HELLO_DONE = 14
    CLIENT_KEY_EXCHANGE = 16
    FINISHED = 20


class ExtensionType(IntEnum):
    SERVER_NAME = 0
    #: RFC 7627: extended master secret.
    EXTENDED_MASTER_SECRET = 0x0017
    #: RFC 5746: renegotiation indication.
    RENEGOTIATION_INFO = 0xFF01


class AlertLevel(IntEnum):
    WARNING = 1
    FATAL = 2


class AlertDescription(IntEnum):
    CLOSE_NOTIFY = 0
    UNEXPECTED_MESSAGE = 10
    BAD_RECORD_MAC = 20
    HANDSHAKE_FAILURE = 40
    ILLEGAL_PARAMETER = 47
    DECODE_ERROR = 50
    DECRYPT_ERROR = 51
    PROTOCOL_VERSION = 70
    INTERNAL_ERROR = 80
    NO_RENEGOTIATION = 100
    #: RFC 4279 §2.
    UNKNOWN_PSK_IDENTITY = 115


VALID_CONTENT_TYPES: Final = frozenset(int(t) for t in ContentType)


# ------------------------------------------------------------------ reading


class Reader(ByteReader):
    """A DTLS message cursor (:class:`crossroads.proto.binary.ByteReader`;
    vectors as RFC 5246 §4.3 defines them)."""

    __slots__ = ()
    PROTOCOL: ClassVar[str] = "DTLS"


# ------------------------------------------------------------------ records


@frozen
class Record:
    """One DTLS record (RFC 6347 §4.1); ``fragment`` is still protected when
    ``epoch`` > 0."""

    content_type: int
    version: int
    epoch: int
    sequence: int
    fragment: bytes

    def header(self, length: int | None = None) -> bytes:
        """The 13-byte header, with ``length`` in place of the fragment's."""
        size = len(self.fragment) if length is None else length
        return (
            bytes((self.content_type,))
            + self.version.to_bytes(2, "big")
            + self.epoch.to_bytes(2, "big")
            + self.sequence.to_bytes(6, "big")
            + size.to_bytes(2, "big")
        )

    def encode(self) -> bytes:
        return self.header() + self.fragment


def split_records(data: bytes) -> tuple[list[Record], str | None]:
    """The records of one datagram, and why the rest was unusable (None: all used).

    RFC 6347 §4.1.2.7: invalid records are discarded, not fatal; a datagram may
    carry several records, so the good ones before a bad tail are kept.
    """
    records: list[Record] = []
    pos = 0
    size = len(data)
    unpack = RECORD_HEADER.unpack_from
    while pos < size:
        if size - pos < RECORD_HEADER_SIZE:
            return records, "truncated"
        content_type, version, epoch, high, low, length = unpack(data, pos)
        if content_type not in VALID_CONTENT_TYPES:
            return records, "bad-content-type"
        if version >> 8 != 0xFE:
            return records, "bad-version"
        if length > MAX_RECORD_LENGTH:
            return records, "too-long"
        end = pos + RECORD_HEADER_SIZE + length
        if end > size:
            return records, "truncated"
        records.append(
            Record(
                content_type,
                version,
                epoch,
                high << 32 | low,
                data[pos + RECORD_HEADER_SIZE : end],
            )
        )
        pos = end
    return records, None


# ---------------------------------------------------------------- handshake


@frozen
class HandshakeFragment:
    """One handshake message fragment (RFC 6347 §4.2.2)."""

    msg_type: int
    length: int
    message_seq: int
    fragment_offset: int
    body: bytes

    @property
    def whole(self) -> bool:
        return self.fragment_offset == 0 and len(self.body) == self.length

    def encode(self) -> bytes:
        return (
            bytes((self.msg_type,))
            + self.length.to_bytes(3, "big")
            + self.message_seq.to_bytes(2, "big")
            + self.fragment_offset.to_bytes(3, "big")
            + len(self.body).to_bytes(3, "big")
            + self.body
        )


def decode_fragments(data: bytes) -> list[HandshakeFragment]:
    """Every handshake fragment in one record's plaintext (RFC 6347 §4.2.3
    lets a record carry several)."""
    reader = Reader(data)
    fragments = []
    while not reader.done():
        msg_type = reader.uint(1)
        length = reader.uint(3)
        message_seq = reader.uint(2)
        offset = reader.uint(3)
        body = reader.vector(3)
        if offset + len(body) > length:
            raise DecodeError("handshake fragment beyond its message", "bad-fragment")
        fragments.append(HandshakeFragment(msg_type, length, message_seq, offset, body))
    if not fragments:
        raise DecodeError("empty handshake record", "empty")
    return fragments


def handshake_message(msg_type: int, message_seq: int, body: bytes) -> bytes:
    """A whole handshake message in one fragment: what goes on the wire and,
    RFC 6347 §4.2.6, what the Finished hash covers."""
    return HandshakeFragment(msg_type, len(body), message_seq, 0, body).encode()


def _decode_hello_head(reader: Reader) -> tuple[int, bytes, bytes]:
    """``(version, random, session_id)``: how both hellos start (RFC 5246
    §7.4.1.2-3)."""
    version = reader.uint(2)
    random = reader.take(RANDOM_SIZE)
    return version, random, reader.vector(1, MAX_SESSION_ID)


def _encode_hello_head(version: int, random: bytes, session_id: bytes) -> bytes:
    return version.to_bytes(2, "big") + random + length_prefixed(1, session_id)


@frozen
class ClientHello:
    """RFC 6347 §4.2.1 / RFC 5246 §7.4.1.2."""

    version: int
    random: bytes
    session_id: bytes
    cookie: bytes
    cipher_suites: tuple[int, ...]
    compression_methods: bytes
    extensions: tuple[tuple[int, bytes], ...]

    @classmethod
    def decode(cls, body: bytes) -> ClientHello:
        reader = Reader(body)
        version, random, session_id = _decode_hello_head(reader)
        cookie = reader.vector(1, MAX_COOKIE)
        suites_raw = reader.vector(2)
        if not suites_raw or len(suites_raw) % 2:
            raise DecodeError("bad cipher_suites length", "bad-suites")
        suites = tuple(
            int.from_bytes(suites_raw[i : i + 2], "big")
            for i in range(0, len(suites_raw), 2)
        )
        compression = reader.vector(1)
        if not compression:
            raise DecodeError("no compression methods", "bad-compression")
        extensions = _decode_extensions(reader) if not reader.done() else ()
        reader.finish()
        return cls(version, random, session_id, cookie, suites, compression, extensions)

    def encode(self) -> bytes:
        return (
            _encode_hello_head(self.version, self.random, self.session_id)
            + length_prefixed(1, self.cookie)
            + length_prefixed(
                2, b"".join(s.to_bytes(2, "big") for s in self.cipher_suites)
            )
            + length_prefixed(1, self.compression_methods)
            + _encode_extensions(self.extensions)
        )

    def extension(self, kind: int) -> bytes | None:
        return find_extension(self.extensions, kind)


def find_extension(
    extensions: tuple[tuple[int, bytes], ...], kind: int
) -> bytes | None:
    """The data of extension ``kind``, None when absent."""
    for ext_type, data in extensions:
        if ext_type == kind:
            return data
    return None


def _decode_extensions(reader: Reader) -> tuple[tuple[int, bytes], ...]:
    inner = Reader(reader.vector(2))
    found = []
    seen = set()
    while not inner.done():
        ext_type = inner.uint(2)
        data = inner.vector(2)
        if ext_type in seen:
            # RFC 5246 §7.4.1.4: at most one extension of each type.
            raise DecodeError("duplicate extension", "duplicate-extension")
        seen.add(ext_type)
        found.append((ext_type, data))
    return tuple(found)


def _encode_extensions(extensions: tuple[tuple[int, bytes], ...]) -> bytes:
    if not extensions:
        return b""
    return length_prefixed(
        2, b"".join(t.to_bytes(2, "big") + length_prefixed(2, d) for t, d in extensions)
    )


@frozen
class ServerHello:
    """RFC 5246 §7.4.1.3."""

    version: int
    random: bytes
    session_id: bytes
    cipher_suite: int
    compression_method: int
    extensions: tuple[tuple[int, bytes], ...]

    @classmethod
    def decode(cls, body: bytes) -> ServerHello:
        reader = Reader(body)
        version, random, session_id = _decode_hello_head(reader)
        suite = reader.uint(2)
        compression = reader.uint(1)
        extensions = _decode_extensions(reader) if not reader.done() else ()
        reader.finish()
        return cls(version, random, session_id, suite, compression, extensions)

    def encode(self) -> bytes:
        return (
            _encode_hello_head(self.version, self.random, self.session_id)
            + self.cipher_suite.to_bytes(2, "big")
            + bytes((self.compression_method,))
            + _encode_extensions(self.extensions)
        )

    def extension(self, kind: int) -> bytes | None:
        return find_extension(self.extensions, kind)


@frozen
class HelloVerifyRequest:
    """RFC 6347 §4.2.1."""

    server_version: int
    cookie: bytes

    @classmethod
    def decode(cls, body: bytes) -> HelloVerifyRequest:
        reader = Reader(body)
        version = reader.uint(2)
        cookie = reader.vector(1)
        reader.finish()
        return cls(version, cookie)

    def encode(self) -> bytes:
        return self.server_version.to_bytes(2, "big") + length_prefixed(1, self.cookie)


def decode_psk_identity(body: bytes) -> bytes:
    """The PSK identity of a ClientKeyExchange, or the identity hint of a
    ServerKeyExchange (RFC 4279 §2: ``opaque psk_identity<0..2^16-1>``).
    Binary-safe: a zero byte is part of the identity."""
    reader = Reader(body)
    identity = reader.vector(2)
    reader.finish()
    return identity


def encode_psk_identity(identity: bytes) -> bytes:
    return length_prefixed(2, identity)


@frozen
class Alert:
    """RFC 5246 §7.2."""

    level: int
    description: int

    @classmethod
    def decode(cls, body: bytes) -> Alert:
        if len(body) != 2:
            raise DecodeError("an alert is two bytes", "bad-alert")
        return cls(body[0], body[1])

    def encode(self) -> bytes:
        return bytes((self.level, self.description))


#: RFC 5246 §7.1: the ChangeCipherSpec body is the single byte 1.
CHANGE_CIPHER_SPEC_BODY: Final = b"\x01"
