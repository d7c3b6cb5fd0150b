"""NAT-PMP (RFC 6886) messages.

Every message goes to UDP port 5351 of the default gateway. Requests::

    external address:  version 0 | opcode 0                                  (2 bytes)
    mapping:           version 0 | opcode 1 (UDP) or 2 (TCP) | reserved u16 |
                       internal port u16 | suggested external port u16 |
                       requested lifetime u32                                (12 bytes)

Responses set opcode 128 + request opcode and carry a result code and the
gateway's "seconds since start of epoch" (RFC 6886 §3.2, §3.3). A mapping with
lifetime 0 (and external port 0) deletes the mapping (§3.4).
"""

from __future__ import annotations

import ipaddress
import struct
from enum import IntEnum

from crossroads.errors import DecodeError
from crossroads.types import frozen

PORT = 5351
VERSION = 0
#: RFC 6886 §3.1: the first retransmission after 250 ms, doubling each time.
INITIAL_RETRANSMIT = 0.25
#: RFC 6886 §3.3: the recommended lifetime of a mapping is 7200 s.
RECOMMENDED_LIFETIME = 7200


class Opcode(IntEnum):
    EXTERNAL_ADDRESS = 0
    MAP_UDP = 1
    MAP_TCP = 2


class Result(IntEnum):
    """RFC 6886 §3.5 result codes."""

    SUCCESS = 0
    UNSUPPORTED_VERSION = 1
    NOT_AUTHORIZED = 2
    NETWORK_FAILURE = 3
    OUT_OF_RESOURCES = 4
    UNSUPPORTED_OPCODE = 5


#: RFC 6886 §3.2, §3.3: every message opens with version and opcode; a
#: response adds its result code and the gateway's epoch.
_REQUEST_HEADER = struct.Struct("!BB")
_HEADER = struct.Struct("!BBHI")
#: RFC 6886 §3.1: a response's opcode is its request's + 128.
RESPONSE_BIT = 128
#: §3.3 bodies after the header: reserved, internal port, suggested external
#: port, lifetime (request); internal port, mapped external port, lifetime
#: (response).
_MAP_REQUEST_BODY = struct.Struct("!HHHI")
_MAP_RESPONSE_BODY = struct.Struct("!HHI")
#: §3.2: the external IPv4 address.
_ADDRESS_SIZE = 4
_EXT_RESPONSE_SIZE = _HEADER.size + _ADDRESS_SIZE
_MAP_RESPONSE_SIZE = _HEADER.size + _MAP_RESPONSE_BODY.size


def _response_header(opcode: int, result: int, epoch: int) -> bytes:
    return _HEADER.pack(VERSION, RESPONSE_BIT + opcode, result, epoch)


@frozen
class ExternalAddressRequest:
    def encode(self) -> bytes:
        return _REQUEST_HEADER.pack(VERSION, Opcode.EXTERNAL_ADDRESS)


@frozen
class MapRequest:
    opcode: Opcode
    internal_port: int
    external_port: int
    lifetime: int

    def encode(self) -> bytes:
        body = _MAP_REQUEST_BODY.pack(
            0, self.internal_port, self.external_port, self.lifetime
        )
        return _REQUEST_HEADER.pack(VERSION, self.opcode) + body


@frozen
class ExternalAddressResponse:
    result: int
    epoch: int
    address: str

    def encode(self) -> bytes:
        header = _response_header(Opcode.EXTERNAL_ADDRESS, self.result, self.epoch)
        return header + ipaddress.IPv4Address(self.address).packed


@frozen
class MapResponse:
    opcode: Opcode
    result: int
    epoch: int
    internal_port: int
    external_port: int
    lifetime: int

    def encode(self) -> bytes:
        body = _MAP_RESPONSE_BODY.pack(
            self.internal_port, self.external_port, self.lifetime
        )
        return _response_header(self.opcode, self.result, self.epoch) + body


@frozen
class ErrorResponse:
    """A short response that carries only a failure (e.g. the answer a NAT-PMP
    gateway gives to a PCP request: version 0, UNSUPPORTED_VERSION)."""

    opcode: int
    result: int
    epoch: int


Response = ExternalAddressResponse | MapResponse | ErrorResponse


def decode_response(data: bytes) -> Response:
    """Decode a gateway's answer; raises :class:`DecodeError`."""
    if len(data) < _HEADER.size:
        raise DecodeError("NAT-PMP response too short", "short")
    version, opcode, result, epoch = _HEADER.unpack_from(data)
    if version != VERSION:
        raise DecodeError("not a NAT-PMP response", "bad-version")
    if opcode < RESPONSE_BIT:
        raise DecodeError("NAT-PMP request, not a response", "not-response")
    op = opcode - RESPONSE_BIT
    if result != Result.SUCCESS and len(data) not in (
        _EXT_RESPONSE_SIZE,
        _MAP_RESPONSE_SIZE,
    ):
        return ErrorResponse(op, result, epoch)
    if op == Opcode.EXTERNAL_ADDRESS:
        if len(data) != _EXT_RESPONSE_SIZE:
            raise DecodeError("bad external address response size", "size")
        address = ipaddress.IPv4Address(data[_HEADER.size :])
        return ExternalAddressResponse(result, epoch, str(address))
    if op in (Opcode.MAP_UDP, Opcode.MAP_TCP):
        if len(data) != _MAP_RESPONSE_SIZE:
            raise DecodeError("bad mapping response size", "size")
        internal, external, lifetime = _MAP_RESPONSE_BODY.unpack_from(
            data, _HEADER.size
        )
        return MapResponse(Opcode(op), result, epoch, internal, external, lifetime)
    if result != Result.SUCCESS:
        return ErrorResponse(op, result, epoch)
    raise DecodeError(f"unknown NAT-PMP opcode {op}", "bad-opcode")
