"""STUN attributes: one frozen dataclass per attribute type, with its codec.

Every attribute class has a ``TYPE`` (an :class:`AttrType`), ``encode_value(key)``
and ``decode_value(value, key)``, where ``key`` is the 16-byte XOR key of the
message (magic cookie followed by the transaction id, RFC 8489 §14.2) — only the
XOR-address attributes use it. :class:`UnknownAttribute` carries any type this
module does not know, so a decoded message never loses an attribute and a server
can answer 420 with UNKNOWN-ATTRIBUTES (RFC 8489 §6.3.1).

Values are decoded to Python values (``str`` hosts, ``int`` ports, ``str`` text);
``decode_value(encode_value(a)) == a`` for every valid attribute. Padding bytes
are ignored on decode (RFC 8489 §14: "MUST be ignored by the receiver").

Sources for every layout: RFC 8489 §14, RFC 5780 §7, RFC 8656 §18, RFC 6062 §6.2,
RFC 8445 §16.1, RFC 3489 §11.2.
"""

from __future__ import annotations

import ipaddress
import struct
from collections.abc import Callable
from typing import ClassVar, Self

from crossroads.errors import DecodeError
from crossroads.proto.stun.constants import (
    MAGIC_COOKIE_BYTES,
    AttrType,
)
from crossroads.types import frozen

_U16 = struct.Struct("!H")
_U32 = struct.Struct("!I")
_U64 = struct.Struct("!Q")
#: CHANNEL-NUMBER, RESPONSE-PORT: a 16-bit number, then RFFU (RFC 8656 §18.1).
_U16_RESERVED = struct.Struct("!H2x")
#: REQUESTED-TRANSPORT and the address families: one byte, then RFFU (§18.7).
_BYTE_RESERVED = struct.Struct("!B3x")
_FAMILY_PORT = struct.Struct("!xBH")

#: XOR for the port of XOR-address attributes: the top 16 bits of the cookie.
_PORT_XOR = 0x2112


def _bad(name: str, why: str) -> DecodeError:
    return DecodeError(f"{name}: {why}", reason="bad-attribute")


@frozen
class Attribute:
    """Base class of every STUN attribute."""

    TYPE: ClassVar[int] = -1

    def get_type(self) -> int:
        """The attribute type number on the wire."""
        return self.TYPE

    def encode_value(self, key: bytes) -> bytes:
        """The attribute value (without header or padding)."""
        raise NotImplementedError

    @classmethod
    def decode_value(cls, value: bytes, key: bytes) -> Self:
        """Decode a value; raise :class:`DecodeError` if it is malformed."""
        raise NotImplementedError


# ---------------------------------------------------------------- addresses


def pack_address(host: str) -> tuple[int, bytes]:
    """``(family, packed address)`` for a textual IPv4/IPv6 address."""
    ip = ipaddress.ip_address(host)
    return (1 if ip.version == 4 else 2), ip.packed


def _decode_plain_address(name: str, value: bytes) -> tuple[str, int]:
    if len(value) == 8 and value[1] == 1:
        return str(ipaddress.IPv4Address(value[4:8])), _U16.unpack_from(value, 2)[0]
    if len(value) == 20 and value[1] == 2:
        return str(ipaddress.IPv6Address(value[4:20])), _U16.unpack_from(value, 2)[0]
    raise _bad(name, f"bad family/length {value[1:2].hex()}/{len(value)}")


def _encode_plain_address(host: str, port: int) -> bytes:
    family, packed = pack_address(host)
    return _FAMILY_PORT.pack(family, port) + packed


def _xor(data: bytes, key: bytes) -> bytes:
    n = len(data)
    return (int.from_bytes(data, "big") ^ int.from_bytes(key[:n], "big")).to_bytes(
        n, "big"
    )


def _decode_xor_address(name: str, value: bytes, key: bytes) -> tuple[str, int]:
    host, port = _decode_plain_address(name, value)
    if len(value) == 8:
        raw = _xor(value[4:8], MAGIC_COOKIE_BYTES)
        return str(ipaddress.IPv4Address(raw)), port ^ _PORT_XOR
    raw = _xor(value[4:20], key)
    return str(ipaddress.IPv6Address(raw)), port ^ _PORT_XOR


def _encode_xor_address(host: str, port: int, key: bytes) -> bytes:
    family, packed = pack_address(host)
    return _FAMILY_PORT.pack(family, port ^ _PORT_XOR) + _xor(packed, key)


@frozen
class _Address(Attribute):
    """An address attribute: a host and a port."""

    host: str
    port: int

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)``."""
        return self.host, self.port


@frozen
class _PlainAddress(_Address):
    """MAPPED-ADDRESS layout (RFC 8489 §14.1)."""

    def encode_value(self, key: bytes) -> bytes:
        return _encode_plain_address(self.host, self.port)

    @classmethod
    def decode_value(cls, value: bytes, key: bytes) -> Self:
        return cls(*_decode_plain_address(cls.__name__, value))


@frozen
class _XorAddress(_Address):
    """XOR-MAPPED-ADDRESS layout (RFC 8489 §14.2)."""

    def encode_value(self, key: bytes) -> bytes:
        return _encode_xor_address(self.host, self.port, key)

    @classmethod
    def decode_value(cls, value: bytes, key: bytes) -> Self:
        return cls(*_decode_xor_address(cls.__name__, value, key))


@frozen
class MappedAddress(_PlainAddress):
    """MAPPED-ADDRESS (RFC 8489 §14.1): the reflexive address, not obfuscated."""

    TYPE: ClassVar[int] = AttrType.MAPPED_ADDRESS


@frozen
class ResponseAddress(_PlainAddress):
    """RESPONSE-ADDRESS (RFC 3489 §11.2.2). Decoded only; servers must not obey it
    (it makes a reflector out of the server)."""

    TYPE: ClassVar[int] = AttrType.RESPONSE_ADDRESS


@frozen
class SourceAddress(_PlainAddress):
    """SOURCE-ADDRESS (RFC 3489 §11.2.5): where an RFC 3489 response came from."""

    TYPE: ClassVar[int] = AttrType.SOURCE_ADDRESS


@frozen
class ChangedAddress(_PlainAddress):
    """CHANGED-ADDRESS (RFC 3489 §11.2.3): the RFC 3489 name of OTHER-ADDRESS."""

    TYPE: ClassVar[int] = AttrType.CHANGED_ADDRESS


@frozen
class XorMappedAddress(_XorAddress):
    """XOR-MAPPED-ADDRESS (RFC 8489 §14.2)."""

    TYPE: ClassVar[int] = AttrType.XOR_MAPPED_ADDRESS


@frozen
class XorPeerAddress(_XorAddress):
    """XOR-PEER-ADDRESS (RFC 8656 §18.3)."""

    TYPE: ClassVar[int] = AttrType.XOR_PEER_ADDRESS


@frozen
class XorRelayedAddress(_XorAddress):
    """XOR-RELAYED-ADDRESS (RFC 8656 §18.5)."""

    TYPE: ClassVar[int] = AttrType.XOR_RELAYED_ADDRESS


@frozen
class AlternateServer(_PlainAddress):
    """ALTERNATE-SERVER (RFC 8489 §14.15), sent with 300 Try Alternate."""

    TYPE: ClassVar[int] = AttrType.ALTERNATE_SERVER


@frozen
class ResponseOrigin(_PlainAddress):
    """RESPONSE-ORIGIN (RFC 5780 §7.3): the address the response was sent from."""

    TYPE: ClassVar[int] = AttrType.RESPONSE_ORIGIN


@frozen
class OtherAddress(_PlainAddress):
    """OTHER-ADDRESS (RFC 5780 §7.4): the server's alternate IP and port."""

    TYPE: ClassVar[int] = AttrType.OTHER_ADDRESS


# ---------------------------------------------------------------- text


@frozen
class _Text(Attribute):
    value: str

    def encode_value(self, key: bytes) -> bytes:
        return self.value.encode("utf-8")

    @classmethod
    def decode_value(cls, value: bytes, key: bytes) -> Self:
        try:
            return cls(value.decode("utf-8"))
        except UnicodeDecodeError:
            raise _bad(cls.__name__, "not UTF-8") from None


@frozen
class Username(_Text):
    """USERNAME (RFC 8489 §14.3), UTF-8, < 509 bytes."""

    TYPE: ClassVar[int] = AttrType.USERNAME


@frozen
class Realm(_Text):
    """REALM (RFC 8489 §14.9)."""

    TYPE: ClassVar[int] = AttrType.REALM


@frozen
class Nonce(_Text):
    """NONCE (RFC 8489 §14.10)."""

    TYPE: ClassVar[int] = AttrType.NONCE


@frozen
class Software(_Text):
    """SOFTWARE (RFC 8489 §14.14)."""

    TYPE: ClassVar[int] = AttrType.SOFTWARE


@frozen
class AlternateDomain(_Text):
    """ALTERNATE-DOMAIN (RFC 8489 §14.16): TLS name for ALTERNATE-SERVER."""

    TYPE: ClassVar[int] = AttrType.ALTERNATE_DOMAIN


# ---------------------------------------------------------------- opaque bytes


@frozen
class _Bytes(Attribute):
    value: bytes
    LENGTHS: ClassVar[tuple[int, ...] | None] = None

    def encode_value(self, key: bytes) -> bytes:
        return bytes(self.value)

    @classmethod
    def decode_value(cls, value: bytes, key: bytes) -> Self:
        if cls.LENGTHS is not None and len(value) not in cls.LENGTHS:
            raise _bad(cls.__name__, f"length {len(value)}")
        return cls(bytes(value))


@frozen
class MessageIntegrity(_Bytes):
    """MESSAGE-INTEGRITY (RFC 8489 §14.5): HMAC-SHA1, 20 bytes.

    Build messages with ``encode(..., integrity_key=...)`` rather than by hand;
    check with :func:`crossroads.proto.stun.integrity.check_message_integrity`.
    """

    TYPE: ClassVar[int] = AttrType.MESSAGE_INTEGRITY
    LENGTHS: ClassVar[tuple[int, ...] | None] = (20,)


@frozen
class MessageIntegritySha256(_Bytes):
    """MESSAGE-INTEGRITY-SHA256 (RFC 8489 §14.6): HMAC-SHA256, 16-32 bytes, x4."""

    TYPE: ClassVar[int] = AttrType.MESSAGE_INTEGRITY_SHA256
    LENGTHS: ClassVar[tuple[int, ...] | None] = (16, 20, 24, 28, 32)


@frozen
class Userhash(_Bytes):
    """USERHASH (RFC 8489 §14.4): SHA-256(username ":" realm), 32 bytes."""

    TYPE: ClassVar[int] = AttrType.USERHASH
    LENGTHS: ClassVar[tuple[int, ...] | None] = (32,)


@frozen
class Data(_Bytes):
    """DATA (RFC 8656 §18.4): application data in Send/Data indications."""

    TYPE: ClassVar[int] = AttrType.DATA


@frozen
class ReservationToken(_Bytes):
    """RESERVATION-TOKEN (RFC 8656 §18.9): 8 opaque bytes."""

    TYPE: ClassVar[int] = AttrType.RESERVATION_TOKEN
    LENGTHS: ClassVar[tuple[int, ...] | None] = (8,)


@frozen
class Padding(_Bytes):
    """PADDING (RFC 5780 §7.6): free-form bytes to force IP fragmentation."""

    TYPE: ClassVar[int] = AttrType.PADDING


# ---------------------------------------------------------------- integers


@frozen
class _Number(Attribute):
    """One unsigned number in a fixed layout: ``LAYOUT`` is its struct, whose
    pad bytes are the attribute's reserved bits (zero on encode, ignored on
    decode, RFC 8489 §14: "MUST be ignored by the receiver")."""

    value: int
    LAYOUT: ClassVar[struct.Struct] = _U32

    def encode_value(self, key: bytes) -> bytes:
        return self.LAYOUT.pack(self.value)

    @classmethod
    def decode_value(cls, value: bytes, key: bytes) -> Self:
        if len(value) != cls.LAYOUT.size:
            raise _bad(cls.__name__, f"length {len(value)}")
        return cls(cls.LAYOUT.unpack(value)[0])


@frozen
class Lifetime(_Number):
    """LIFETIME (RFC 8656 §18.2): seconds."""

    TYPE: ClassVar[int] = AttrType.LIFETIME


@frozen
class Priority(_Number):
    """PRIORITY (RFC 8445 §16.1, ICE)."""

    TYPE: ClassVar[int] = AttrType.PRIORITY


@frozen
class ConnectionId(_Number):
    """CONNECTION-ID (RFC 6062 §6.2.1)."""

    TYPE: ClassVar[int] = AttrType.CONNECTION_ID


@frozen
class CacheTimeout(_Number):
    """CACHE-TIMEOUT (RFC 5780 §9.1, registered; seconds)."""

    TYPE: ClassVar[int] = AttrType.CACHE_TIMEOUT


@frozen
class Fingerprint(_Number):
    """FINGERPRINT (RFC 8489 §14.7): CRC-32 XOR 0x5354554e. Must be last.

    Build with ``encode(..., fingerprint=True)``; the decoder checks it.
    """

    TYPE: ClassVar[int] = AttrType.FINGERPRINT


@frozen
class IceControlled(_Number):
    """ICE-CONTROLLED (RFC 8445 §16.1): tie-breaker."""

    TYPE: ClassVar[int] = AttrType.ICE_CONTROLLED
    LAYOUT: ClassVar[struct.Struct] = _U64


@frozen
class IceControlling(_Number):
    """ICE-CONTROLLING (RFC 8445 §16.1): tie-breaker."""

    TYPE: ClassVar[int] = AttrType.ICE_CONTROLLING
    LAYOUT: ClassVar[struct.Struct] = _U64


@frozen
class ChannelNumber(_Number):
    """CHANNEL-NUMBER (RFC 8656 §18.1): 0x4000-0x4FFF in RFC 8656."""

    TYPE: ClassVar[int] = AttrType.CHANNEL_NUMBER
    LAYOUT: ClassVar[struct.Struct] = _U16_RESERVED


@frozen
class ResponsePort(_Number):
    """RESPONSE-PORT (RFC 5780 §7.5): send the response to this port."""

    TYPE: ClassVar[int] = AttrType.RESPONSE_PORT
    LAYOUT: ClassVar[struct.Struct] = _U16_RESERVED


@frozen
class RequestedTransport(_Number):
    """REQUESTED-TRANSPORT (RFC 8656 §18.7): IANA protocol number (17 UDP, 6 TCP)."""

    TYPE: ClassVar[int] = AttrType.REQUESTED_TRANSPORT
    LAYOUT: ClassVar[struct.Struct] = _BYTE_RESERVED


@frozen
class RequestedAddressFamily(_Number):
    """REQUESTED-ADDRESS-FAMILY (RFC 8656 §18.8): 1 IPv4, 2 IPv6."""

    TYPE: ClassVar[int] = AttrType.REQUESTED_ADDRESS_FAMILY
    LAYOUT: ClassVar[struct.Struct] = _BYTE_RESERVED


@frozen
class AdditionalAddressFamily(_Number):
    """ADDITIONAL-ADDRESS-FAMILY (RFC 8656 §18.11): only 2 (IPv6) is valid."""

    TYPE: ClassVar[int] = AttrType.ADDITIONAL_ADDRESS_FAMILY
    LAYOUT: ClassVar[struct.Struct] = _BYTE_RESERVED


# ---------------------------------------------------------------- flags


@frozen
class _Empty(Attribute):
    def encode_value(self, key: bytes) -> bytes:
        return b""

    @classmethod
    def decode_value(cls, value: bytes, key: bytes) -> Self:
        if value:
            raise _bad(cls.__name__, f"length {len(value)}")
        return cls()


@frozen
class DontFragment(_Empty):
    """DONT-FRAGMENT (RFC 8656 §18.8): no value."""

    TYPE: ClassVar[int] = AttrType.DONT_FRAGMENT


@frozen
class UseCandidate(_Empty):
    """USE-CANDIDATE (RFC 8445 §16.1): no value."""

    TYPE: ClassVar[int] = AttrType.USE_CANDIDATE


@frozen
class EvenPort(Attribute):
    """EVEN-PORT (RFC 8656 §18.6): one byte, top bit R = reserve the next port."""

    TYPE: ClassVar[int] = AttrType.EVEN_PORT
    reserve: bool = False

    def encode_value(self, key: bytes) -> bytes:
        return b"\x80" if self.reserve else b"\x00"

    @classmethod
    def decode_value(cls, value: bytes, key: bytes) -> Self:
        if len(value) != 1:
            raise _bad(cls.__name__, f"length {len(value)}")
        return cls(bool(value[0] & 0x80))


@frozen
class ChangeRequest(Attribute):
    """CHANGE-REQUEST (RFC 5780 §7.2): flags A (change IP, 0x4) and B (port, 0x2)."""

    TYPE: ClassVar[int] = AttrType.CHANGE_REQUEST
    change_ip: bool = False
    change_port: bool = False

    def encode_value(self, key: bytes) -> bytes:
        return _U32.pack((4 if self.change_ip else 0) | (2 if self.change_port else 0))

    @classmethod
    def decode_value(cls, value: bytes, key: bytes) -> Self:
        if len(value) != 4:
            raise _bad(cls.__name__, f"length {len(value)}")
        flags = _U32.unpack(value)[0]
        return cls(bool(flags & 4), bool(flags & 2))


# ---------------------------------------------------------------- errors


def _encode_error(head: int, code: int, reason: str) -> bytes:
    """The value ERROR-CODE and ADDRESS-ERROR-CODE share: a first byte
    (reserved 0 / the address family), a reserved byte, the class (the hundreds)
    and the number (the rest) of ``code``, then the UTF-8 reason phrase."""
    if not 300 <= code <= 699:
        raise ValueError(f"error code {code} outside 300-699")
    return bytes((head, 0, code // 100, code % 100)) + reason.encode("utf-8")


def _decode_error(name: str, value: bytes) -> tuple[int, int, str]:
    """``(first byte, code, reason)`` of an :func:`_encode_error` value."""
    if len(value) < 4:
        raise _bad(name, f"length {len(value)}")
    # RFC 8489 §14.8: class 3-6 (the low 3 bits of its byte), number 0-99.
    klass, number = value[2] & 0x07, value[3]
    if not 3 <= klass <= 6 or number > 99:
        raise _bad(name, f"bad error code {klass}/{number}")
    try:
        return value[0], klass * 100 + number, value[4:].decode("utf-8")
    except UnicodeDecodeError:
        raise _bad(name, "reason not UTF-8") from None


@frozen
class ErrorCodeAttribute(Attribute):
    """ERROR-CODE (RFC 8489 §14.8): code 300-699 and a UTF-8 reason phrase."""

    TYPE: ClassVar[int] = AttrType.ERROR_CODE
    code: int
    reason: str = ""

    def encode_value(self, key: bytes) -> bytes:
        return _encode_error(0, self.code, self.reason)

    @classmethod
    def decode_value(cls, value: bytes, key: bytes) -> Self:
        _, code, reason = _decode_error(cls.__name__, value)
        return cls(code, reason)


@frozen
class AddressErrorCode(Attribute):
    """ADDRESS-ERROR-CODE (RFC 8656 §18.12): family, error code, reason."""

    TYPE: ClassVar[int] = AttrType.ADDRESS_ERROR_CODE
    family: int
    code: int
    reason: str = ""

    def encode_value(self, key: bytes) -> bytes:
        return _encode_error(self.family, self.code, self.reason)

    @classmethod
    def decode_value(cls, value: bytes, key: bytes) -> Self:
        return cls(*_decode_error(cls.__name__, value))


@frozen
class UnknownAttributes(Attribute):
    """UNKNOWN-ATTRIBUTES (RFC 8489 §14.13): the types a 420 refers to."""

    TYPE: ClassVar[int] = AttrType.UNKNOWN_ATTRIBUTES
    types: tuple[int, ...]

    def encode_value(self, key: bytes) -> bytes:
        return b"".join(_U16.pack(t) for t in self.types)

    @classmethod
    def decode_value(cls, value: bytes, key: bytes) -> Self:
        if len(value) % 2:
            raise _bad(cls.__name__, f"odd length {len(value)}")
        return cls(tuple(t for (t,) in _U16.iter_unpack(value)))


@frozen
class Icmp(Attribute):
    """ICMP (RFC 8656 §18.13): 16 reserved bits, type (7 bits), code (9 bits),
    4 bytes of error data (the MTU for "packet too big", else zero)."""

    TYPE: ClassVar[int] = AttrType.ICMP
    icmp_type: int
    icmp_code: int
    error_data: int = 0

    def encode_value(self, key: bytes) -> bytes:
        if not (0 <= self.icmp_type < 128 and 0 <= self.icmp_code < 512):
            raise ValueError("ICMP type is 7 bits and code 9 bits")
        return (
            b"\0\0"
            + _U16.pack((self.icmp_type << 9) | self.icmp_code)
            + _U32.pack(self.error_data)
        )

    @classmethod
    def decode_value(cls, value: bytes, key: bytes) -> Self:
        if len(value) != 8:
            raise _bad(cls.__name__, f"length {len(value)}")
        both = _U16.unpack_from(value, 2)[0]
        return cls(both >> 9, both & 0x1FF, _U32.unpack_from(value, 4)[0])


# ---------------------------------------------------------------- passwords


@frozen
class PasswordAlgorithm(Attribute):
    """PASSWORD-ALGORITHM (RFC 8489 §14.12): algorithm and its parameters."""

    TYPE: ClassVar[int] = AttrType.PASSWORD_ALGORITHM
    algorithm: int
    parameters: bytes = b""

    def encode_value(self, key: bytes) -> bytes:
        return (
            _U16.pack(self.algorithm)
            + _U16.pack(len(self.parameters))
            + (self.parameters)
        )

    @classmethod
    def decode_value(cls, value: bytes, key: bytes) -> Self:
        if len(value) < 4:
            raise _bad(cls.__name__, f"length {len(value)}")
        algorithm, length = struct.unpack_from("!HH", value)
        if 4 + length != len(value):
            raise _bad(cls.__name__, "parameter length")
        return cls(algorithm, bytes(value[4:]))


@frozen
class PasswordAlgorithms(Attribute):
    """PASSWORD-ALGORITHMS (RFC 8489 §14.11): list of (algorithm, parameters),
    each parameter block padded to 4 bytes."""

    TYPE: ClassVar[int] = AttrType.PASSWORD_ALGORITHMS
    algorithms: tuple[tuple[int, bytes], ...]

    def encode_value(self, key: bytes) -> bytes:
        out = bytearray()
        for algorithm, params in self.algorithms:
            out += struct.pack("!HH", algorithm, len(params)) + params
            out += b"\0" * (-len(params) % 4)
        return bytes(out)

    @classmethod
    def decode_value(cls, value: bytes, key: bytes) -> Self:
        items: list[tuple[int, bytes]] = []
        offset = 0
        while offset < len(value):
            if offset + 4 > len(value):
                raise _bad(cls.__name__, "truncated")
            algorithm, length = struct.unpack_from("!HH", value, offset)
            end = offset + 4 + length
            if end > len(value):
                raise _bad(cls.__name__, "truncated parameters")
            items.append((algorithm, bytes(value[offset + 4 : end])))
            offset = end + (-length % 4)
        return cls(tuple(items))


# ---------------------------------------------------------------- unknown


@frozen
class UnknownAttribute(Attribute):
    """An attribute whose type this codec does not know; kept as raw bytes."""

    type_code: int
    value: bytes

    def get_type(self) -> int:
        return self.type_code

    def encode_value(self, key: bytes) -> bytes:
        return bytes(self.value)

    @classmethod
    def decode_value(cls, value: bytes, key: bytes) -> Self:
        raise TypeError("UnknownAttribute is built by the message decoder")


# ---------------------------------------------------------------- registry

#: Attribute type -> class, for the decoder.
ATTRIBUTE_CLASSES: dict[int, type[Attribute]] = {
    cls.TYPE: cls
    for cls in (
        MappedAddress,
        ResponseAddress,
        ChangeRequest,
        SourceAddress,
        ChangedAddress,
        Username,
        MessageIntegrity,
        ErrorCodeAttribute,
        UnknownAttributes,
        ChannelNumber,
        Lifetime,
        XorPeerAddress,
        Data,
        Realm,
        Nonce,
        XorRelayedAddress,
        RequestedAddressFamily,
        EvenPort,
        RequestedTransport,
        DontFragment,
        MessageIntegritySha256,
        PasswordAlgorithm,
        Userhash,
        XorMappedAddress,
        ReservationToken,
        Priority,
        UseCandidate,
        Padding,
        ResponsePort,
        ConnectionId,
        AdditionalAddressFamily,
        AddressErrorCode,
        PasswordAlgorithms,
        AlternateDomain,
        Icmp,
        Software,
        AlternateServer,
        CacheTimeout,
        Fingerprint,
        IceControlled,
        IceControlling,
        ResponseOrigin,
        OtherAddress,
    )
}

#: Per-type decoders, looked up once per attribute.
DECODERS: dict[int, Callable[[bytes, bytes], Attribute]] = {
    t: cls.decode_value for t, cls in ATTRIBUTE_CLASSES.items()
}
