"""PCP (RFC 6887) MAP requests and responses.

Common header (RFC 6887 §7.1, §7.2), 24 bytes::

    request:  version 2 | R=0, opcode (7 bits) | reserved u16 | lifetime u32 |
              client IP (16, IPv4-mapped for IPv4)
    response: version 2 | R=1, opcode | reserved u8 | result u8 | lifetime u32 |
              epoch u32 | reserved (12)

MAP opcode payload (§11.1), 36 bytes::

    nonce (12) | protocol u8 | reserved (3) | internal port u16 |
    suggested / assigned external port u16 | suggested / assigned external IP (16)

Options follow the payload (§7.3: code u8, reserved u8, length u16, data padded
to 4 bytes); we send none and skip any we receive. Lifetime 0 deletes a mapping
(§15). The nonce ties a response to its request and must be random (§11.1).
"""

from __future__ import annotations

import struct
from enum import IntEnum

from crossroads.errors import DecodeError
from crossroads.proto.binary import pack_ip16, unpack_ip16
from crossroads.types import frozen

PORT = 5351
VERSION = 2
OPCODE_MAP = 1
PROTOCOL_UDP = 17
PROTOCOL_TCP = 6
#: RFC 6887 §8.1.1: initial retransmission 3 s (IRT); we use the same doubling.
INITIAL_RETRANSMIT = 3.0
#: Largest PCP message (RFC 6887 §7: 1100 bytes).
MAX_MESSAGE = 1100


class Result(IntEnum):
    """RFC 6887 §7.4 result codes."""

    SUCCESS = 0
    UNSUPP_VERSION = 1
    NOT_AUTHORIZED = 2
    MALFORMED_REQUEST = 3
    UNSUPP_OPCODE = 4
    UNSUPP_OPTION = 5
    MALFORMED_OPTION = 6
    NETWORK_FAILURE = 7
    NO_RESOURCES = 8
    UNSUPP_PROTOCOL = 9
    USER_EX_QUOTA = 10
    CANNOT_PROVIDE_EXTERNAL = 11
    ADDRESS_MISMATCH = 12
    EXCESSIVE_REMOTE_PEERS = 13


_REQUEST_HEADER = struct.Struct("!BBHI16s")
_RESPONSE_HEADER = struct.Struct("!BBBBII12x")
_MAP = struct.Struct("!12sB3xHH16s")
_OPTION = struct.Struct("!BBH")


def _encode_map(fields: MapRequest | MapResponse) -> bytes:
    """The MAP opcode data (RFC 6887 §11.1), the same in a request and its
    response."""
    return _MAP.pack(
        fields.nonce,
        fields.protocol,
        fields.internal_port,
        fields.external_port,
        pack_ip16(fields.external_ip),
    )


def _decode_map(data: bytes, offset: int) -> tuple[bytes, int, int, int, str]:
    """``(nonce, protocol, internal port, external port, external IP)`` of the
    MAP opcode data at ``offset`` (the caller checked the size)."""
    nonce, protocol, internal, external, ext_ip = _MAP.unpack_from(data, offset)
    return nonce, protocol, internal, external, unpack_ip16(ext_ip)


@frozen
class MapRequest:
    nonce: bytes
    protocol: int
    internal_port: int
    external_port: int
    external_ip: str
    lifetime: int
    client_ip: str

    def encode(self) -> bytes:
        header = _REQUEST_HEADER.pack(
            VERSION, OPCODE_MAP, 0, self.lifetime, pack_ip16(self.client_ip)
        )
        return header + _encode_map(self)

    @classmethod
    def decode(cls, data: bytes) -> MapRequest:
        """For tests and servers: parse a MAP request."""
        if len(data) < _REQUEST_HEADER.size + _MAP.size or len(data) > MAX_MESSAGE:
            raise DecodeError("PCP request has the wrong size", "size")
        version, opcode, _, lifetime, client = _REQUEST_HEADER.unpack_from(data)
        if version != VERSION or opcode != OPCODE_MAP:
            raise DecodeError("not a PCP MAP request", "bad-header")
        return cls(
            *_decode_map(data, _REQUEST_HEADER.size), lifetime, unpack_ip16(client)
        )


@frozen
class MapResponse:
    result: int
    lifetime: int
    epoch: int
    nonce: bytes
    protocol: int
    internal_port: int
    external_port: int
    external_ip: str

    def encode(self) -> bytes:
        header = _RESPONSE_HEADER.pack(
            VERSION, 0x80 | OPCODE_MAP, 0, self.result, self.lifetime, self.epoch
        )
        return header + _encode_map(self)


@frozen
class ErrorResponse:
    """A response without a usable MAP payload (e.g. UNSUPP_VERSION)."""

    version: int
    opcode: int
    result: int


def decode_response(data: bytes) -> MapResponse | ErrorResponse:
    """Decode a PCP response; raises :class:`DecodeError`."""
    if len(data) < 4:
        raise DecodeError("PCP response too short", "short")
    if len(data) > MAX_MESSAGE:
        raise DecodeError("PCP response too long", "size")
    if data[0] != VERSION:
        # RFC 6887 §9: a NAT-PMP-only gateway answers version 0, result 1.
        raise DecodeError("not a PCP response", "bad-version")
    if len(data) < _RESPONSE_HEADER.size:
        raise DecodeError("PCP response too short", "short")
    version, r_opcode, _, result, lifetime, epoch = _RESPONSE_HEADER.unpack_from(data)
    if not r_opcode & 0x80:
        raise DecodeError("PCP request, not a response", "not-response")
    opcode = r_opcode & 0x7F
    if opcode != OPCODE_MAP or len(data) < _RESPONSE_HEADER.size + _MAP.size:
        if result != Result.SUCCESS:
            return ErrorResponse(version, opcode, result)
        raise DecodeError("PCP response without a MAP payload", "bad-opcode")
    mapping = _decode_map(data, _RESPONSE_HEADER.size)
    offset = _RESPONSE_HEADER.size + _MAP.size
    while offset < len(data):
        if len(data) - offset < _OPTION.size:
            raise DecodeError("truncated PCP option", "bad-option")
        _, _, length = _OPTION.unpack_from(data, offset)
        offset += _OPTION.size + ((length + 3) & ~3)
        if offset > len(data):
            raise DecodeError("truncated PCP option", "bad-option")
    return MapResponse(result, lifetime, epoch, *mapping)
