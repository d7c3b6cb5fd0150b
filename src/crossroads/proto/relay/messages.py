"""The Unity Relay message codec (UDP; the same bytes run inside DTLS or WSS).

Every message starts with the 4-byte standard header ``DA 72 00 <type>``: the
signature ``0x72DA`` written little-endian, a version byte that is always 0 and a
type byte. Bodies have fixed sizes, except RELAY whose payload length is carried
in a big-endian u16. Facts and sizes: ``reference/unity-relay-and-raknet.md`` §1.1
(UTP ``Runtime/Relay/Messages/RelayMessage*.cs``).

Byte orders are those of Unity Transport, the client that exists in the wild: the
BIND nonce and the PING sequence number are little-endian (UTP writes its structs
raw), the RELAY ``DataLength`` is big-endian (UTP ``SwitchEndianness``).

Two layouts are not documented anywhere and are crossroads' choice, kept as close
to their siblings as possible:

- REJECTED (8): UTP only reads the header; crossroads sends it with the same body
  as ACCEPTED (``FromAllocationId`` = host, ``ToAllocationId`` = joiner), 36 bytes.
- CLOSE (11): the docs say the allocation ID is used in CLOSE; crossroads reads
  the header plus ``AllocationId[16]``, 20 bytes.

:func:`decode` turns bytes into one of the frozen message dataclasses or raises
:class:`~crossroads.errors.DecodeError`; every dataclass has ``encode()``.
The relay's data plane does not use this module for RELAY frames it forwards (see
:mod:`crossroads.proto.relay.server`): it only looks their first 36 bytes up.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import IntEnum
from typing import Final

from crossroads.errors import DecodeError, LocalProtocolError
from crossroads.types import frozen

#: ``0x72DA`` little-endian: the wire bytes ``DA 72`` (UTP ``RelayMessageHeader``).
SIGNATURE: Final = b"\xda\x72"
#: UTP ``IsValid()`` accepts version 0 only.
VERSION: Final = 0
HEADER_SIZE: Final = 4
#: ``RelayAllocationId.k_Length``: the decoded ``allocationIdBytes``.
ALLOCATION_ID_SIZE: Final = 16
#: ``RelayConnectionData.k_Length``: connection data is zero-padded to 255 bytes.
CONNECTION_DATA_SIZE: Final = 255
#: HMAC-SHA256 output.
HMAC_SIZE: Final = 32
#: ``RelayHMACKey.k_Length``: the decoded allocation ``key``.
KEY_SIZE: Final = 64
#: Largest RELAY payload: ``DataLength`` is a u16.
MAX_PAYLOAD: Final = 0xFFFF

# Total sizes (UTP ``k_Length`` of each message struct).
BIND_SIZE: Final = 295
#: The BIND HMAC covers every byte before it (UTP ``ComputeBindHMAC``).
BIND_SIGNED_SIZE: Final = BIND_SIZE - HMAC_SIZE  # 263
BIND_RECEIVED_SIZE: Final = 4
PING_SIZE: Final = 22
CONNECT_REQUEST_SIZE: Final = 276
ACCEPTED_SIZE: Final = 36
REJECTED_SIZE: Final = 36
DISCONNECT_SIZE: Final = 36
RELAY_HEADER_SIZE: Final = 38
#: Bytes of a RELAY frame that name its route: header, from and to allocation IDs.
RELAY_ROUTE_SIZE: Final = 36
CLOSE_SIZE: Final = 20
ERROR_SIZE: Final = 21

ZERO_ID: Final = bytes(ALLOCATION_ID_SIZE)


class MessageType(IntEnum):
    """The header's type byte (reference §1.1; 4, 5 and 7 are reserved)."""

    BIND = 0
    BIND_RECEIVED = 1
    PING = 2
    CONNECT_REQUEST = 3
    ACCEPTED = 6
    REJECTED = 8
    DISCONNECT = 9
    RELAY = 10
    CLOSE = 11
    ERROR = 12


class ErrorCode(IntEnum):
    """ERROR message codes (UTP ``RelayMessageError.LogError``)."""

    INVALID_PROTOCOL_VERSION = 0
    #: "player timed out due to inactivity"; UTP marks the allocation invalid.
    PLAYER_TIMED_OUT = 1
    UNAUTHORIZED = 2
    #: The allocation is bound to another IP:port; UTP bumps its nonce and re-BINDs.
    ALLOCATION_ID_CLIENT_MISMATCH = 3
    #: UTP marks the allocation invalid.
    ALLOCATION_ID_NOT_FOUND = 4
    NOT_CONNECTED = 5
    SELF_CONNECT_NOT_ALLOWED = 6


#: Accept mode 0 is AUTO, the only one defined ("other accept modes are reserved").
ACCEPT_MODE_AUTO: Final = 0


def header(message_type: MessageType) -> bytes:
    """The 4-byte standard header for ``message_type``."""
    return SIGNATURE + bytes((VERSION, message_type))


def pad_connection_data(data: bytes) -> bytes:
    """Zero-pad connection data to the 255 bytes every message carries."""
    if len(data) > CONNECTION_DATA_SIZE:
        raise LocalProtocolError(
            f"connection data is {len(data)} bytes, at most {CONNECTION_DATA_SIZE}"
        )
    return data + bytes(CONNECTION_DATA_SIZE - len(data))


def _check_id(name: str, value: bytes) -> None:
    if len(value) != ALLOCATION_ID_SIZE:
        raise LocalProtocolError(f"{name} must be {ALLOCATION_ID_SIZE} bytes")


def _check_u16(name: str, value: int) -> None:
    if not 0 <= value <= 0xFFFF:
        raise LocalProtocolError(f"{name} must fit in 16 bits")


def _check_u8(name: str, value: int) -> None:
    if not 0 <= value <= 0xFF:
        raise LocalProtocolError(f"{name} must fit in 8 bits")


@frozen
class Bind:
    """BIND (0), client→relay: attach this UDP address to an allocation.

    ``connection_data`` is the allocation's ``connectionData`` (the length byte on
    the wire is ``len(connection_data)``; UTP pads to 255 and sends 255).
    ``hmac`` is HMAC-SHA256(key, first 263 bytes); see :meth:`signed_bytes`.
    """

    nonce: int
    connection_data: bytes
    hmac: bytes
    accept_mode: int = ACCEPT_MODE_AUTO

    def __post_init__(self) -> None:
        _check_u16("nonce", self.nonce)
        _check_u8("accept_mode", self.accept_mode)
        pad_connection_data(self.connection_data)
        if len(self.hmac) != HMAC_SIZE:
            raise LocalProtocolError(f"hmac must be {HMAC_SIZE} bytes")

    def signed_bytes(self) -> bytes:
        """The 263 bytes the HMAC covers: everything before the HMAC field."""
        return (
            header(MessageType.BIND)
            + bytes((self.accept_mode,))
            + self.nonce.to_bytes(2, "little")
            + bytes((len(self.connection_data),))
            + pad_connection_data(self.connection_data)
        )

    def encode(self) -> bytes:
        return self.signed_bytes() + self.hmac


@frozen
class BindReceived:
    """BIND_RECEIVED (1), relay→client: the BIND was accepted. Header only."""

    def encode(self) -> bytes:
        return header(MessageType.BIND_RECEIVED)


@frozen
class Ping:
    """PING (2), both ways: keep-alive; resets the idle timer."""

    from_allocation_id: bytes
    sequence: int = 1

    def __post_init__(self) -> None:
        _check_id("from_allocation_id", self.from_allocation_id)
        _check_u16("sequence", self.sequence)

    def encode(self) -> bytes:
        return (
            header(MessageType.PING)
            + self.from_allocation_id
            + self.sequence.to_bytes(2, "little")
        )


@frozen
class ConnectRequest:
    """CONNECT_REQUEST (3), joiner→relay: connect to the host named by its data.

    ``allocation_id`` is the sender's own; ``to_connection_data`` is the host's
    ``hostConnectionData`` from the join response.
    """

    allocation_id: bytes
    to_connection_data: bytes

    def __post_init__(self) -> None:
        _check_id("allocation_id", self.allocation_id)
        pad_connection_data(self.to_connection_data)

    def encode(self) -> bytes:
        return (
            header(MessageType.CONNECT_REQUEST)
            + self.allocation_id
            + bytes((len(self.to_connection_data),))
            + pad_connection_data(self.to_connection_data)
        )


@frozen
class _FromTo:
    from_allocation_id: bytes
    to_allocation_id: bytes

    def __post_init__(self) -> None:
        _check_id("from_allocation_id", self.from_allocation_id)
        _check_id("to_allocation_id", self.to_allocation_id)


@frozen
class Accepted(_FromTo):
    """ACCEPTED (6), relay→joiner: from = the host, to = the joiner."""

    def encode(self) -> bytes:
        return (
            header(MessageType.ACCEPTED)
            + self.from_allocation_id
            + self.to_allocation_id
        )


@frozen
class Rejected(_FromTo):
    """REJECTED (8), relay→joiner: the host's ``maxConnections`` is reached.

    Body layout is crossroads' choice (UTP reads the header only): as ACCEPTED.
    """

    def encode(self) -> bytes:
        return (
            header(MessageType.REJECTED)
            + self.from_allocation_id
            + self.to_allocation_id
        )


@frozen
class Disconnect(_FromTo):
    """DISCONNECT (9), both ways: the link between two allocations ends."""

    def encode(self) -> bytes:
        return (
            header(MessageType.DISCONNECT)
            + self.from_allocation_id
            + self.to_allocation_id
        )


@frozen
class Relay:
    """RELAY (10), both ways: ``payload`` from one allocation to another."""

    from_allocation_id: bytes
    to_allocation_id: bytes
    payload: bytes

    def __post_init__(self) -> None:
        _check_id("from_allocation_id", self.from_allocation_id)
        _check_id("to_allocation_id", self.to_allocation_id)
        if len(self.payload) > MAX_PAYLOAD:
            raise LocalProtocolError(f"payload is larger than {MAX_PAYLOAD} bytes")

    def encode(self) -> bytes:
        return relay_frame(self.from_allocation_id, self.to_allocation_id, self.payload)


@frozen
class Close:
    """CLOSE (11), client→relay: unbind and end the allocation (20 bytes)."""

    allocation_id: bytes

    def __post_init__(self) -> None:
        _check_id("allocation_id", self.allocation_id)

    def encode(self) -> bytes:
        return header(MessageType.CLOSE) + self.allocation_id


@frozen
class Error:
    """ERROR (12), relay→client. ``code`` is an :class:`ErrorCode` value (a u8)."""

    allocation_id: bytes
    code: int

    def __post_init__(self) -> None:
        _check_id("allocation_id", self.allocation_id)
        _check_u8("code", self.code)

    def encode(self) -> bytes:
        return header(MessageType.ERROR) + self.allocation_id + bytes((self.code,))


Message = (
    Bind
    | BindReceived
    | Ping
    | ConnectRequest
    | Accepted
    | Rejected
    | Disconnect
    | Relay
    | Close
    | Error
)


def relay_route(from_allocation_id: bytes, to_allocation_id: bytes) -> bytes:
    """The first 36 bytes of every RELAY frame between these two allocations."""
    return header(MessageType.RELAY) + from_allocation_id + to_allocation_id


def relay_frame(
    from_allocation_id: bytes, to_allocation_id: bytes, payload: bytes
) -> bytes:
    """A RELAY frame, built without a dataclass (for senders on a hot path)."""
    return (
        relay_route(from_allocation_id, to_allocation_id)
        + len(payload).to_bytes(2, "big")
        + payload
    )


def encode(message: Message) -> bytes:
    """The wire bytes of ``message``."""
    return message.encode()


# ----------------------------------------------------------------------- decoding


def _need(data: bytes, size: int, name: str) -> None:
    if len(data) != size:
        raise DecodeError(f"{name} is {size} bytes, got {len(data)}", reason="bad-size")


def _connection_data(data: bytes, length_at: int) -> bytes:
    length = data[length_at]
    start = length_at + 1
    return bytes(data[start : start + length])


def _bind(data: bytes) -> Bind:
    _need(data, BIND_SIZE, "BIND")
    return Bind(
        accept_mode=data[4],
        nonce=int.from_bytes(data[5:7], "little"),
        connection_data=_connection_data(data, 7),
        hmac=bytes(data[BIND_SIGNED_SIZE:BIND_SIZE]),
    )


def _bind_received(data: bytes) -> BindReceived:
    _need(data, BIND_RECEIVED_SIZE, "BIND_RECEIVED")
    return BindReceived()


def _ping(data: bytes) -> Ping:
    _need(data, PING_SIZE, "PING")
    return Ping(bytes(data[4:20]), int.from_bytes(data[20:22], "little"))


def _connect_request(data: bytes) -> ConnectRequest:
    _need(data, CONNECT_REQUEST_SIZE, "CONNECT_REQUEST")
    return ConnectRequest(bytes(data[4:20]), _connection_data(data, 20))


def _accepted(data: bytes) -> Accepted:
    _need(data, ACCEPTED_SIZE, "ACCEPTED")
    return Accepted(bytes(data[4:20]), bytes(data[20:36]))


def _rejected(data: bytes) -> Rejected:
    _need(data, REJECTED_SIZE, "REJECTED")
    return Rejected(bytes(data[4:20]), bytes(data[20:36]))


def _disconnect(data: bytes) -> Disconnect:
    _need(data, DISCONNECT_SIZE, "DISCONNECT")
    return Disconnect(bytes(data[4:20]), bytes(data[20:36]))


def _relay(data: bytes) -> Relay:
    if len(data) < RELAY_HEADER_SIZE:
        raise DecodeError(
            f"RELAY needs {RELAY_HEADER_SIZE} bytes, got {len(data)}", reason="bad-size"
        )
    length = int.from_bytes(data[36:38], "big")
    if len(data) != RELAY_HEADER_SIZE + length:
        raise DecodeError(
            f"RELAY DataLength {length} does not match {len(data) - RELAY_HEADER_SIZE}"
            " payload bytes",
            reason="bad-length",
        )
    return Relay(bytes(data[4:20]), bytes(data[20:36]), bytes(data[38:]))


def _close(data: bytes) -> Close:
    _need(data, CLOSE_SIZE, "CLOSE")
    return Close(bytes(data[4:20]))


def _error(data: bytes) -> Error:
    _need(data, ERROR_SIZE, "ERROR")
    return Error(bytes(data[4:20]), data[20])


_DECODERS: dict[MessageType, Callable[[bytes], Message]] = {
    MessageType.BIND: _bind,
    MessageType.BIND_RECEIVED: _bind_received,
    MessageType.PING: _ping,
    MessageType.CONNECT_REQUEST: _connect_request,
    MessageType.ACCEPTED: _accepted,
    MessageType.REJECTED: _rejected,
    MessageType.DISCONNECT: _disconnect,
    MessageType.RELAY: _relay,
    MessageType.CLOSE: _close,
    MessageType.ERROR: _error,
}


def check_header(data: bytes) -> MessageType:
    """Validate the standard header and return the message type.

    Raises:
        DecodeError: ``reason`` is ``short``, ``bad-signature``, ``bad-version``
            or ``unknown-type``.
    """
    if len(data) < HEADER_SIZE:
        raise DecodeError(f"{len(data)} bytes is shorter than a header", reason="short")
    if data[0:2] != SIGNATURE:
        raise DecodeError("not a Unity Relay message", reason="bad-signature")
    if data[2] != VERSION:
        raise DecodeError(f"protocol version {data[2]}", reason="bad-version")
    try:
        return MessageType(data[3])
    except ValueError:
        raise DecodeError(
            f"unknown message type {data[3]}", reason="unknown-type"
        ) from None


def decode(data: bytes) -> Message:
    """Decode one datagram.

    Raises:
        DecodeError: the bytes are not exactly one valid message; ``reason`` names
            why (``short``, ``bad-signature``, ``bad-version``, ``unknown-type``,
            ``bad-size``, ``bad-length``).
    """
    return _DECODERS[check_header(data)](data)
