"""The Multiplay/Unity QoS protocol's two datagrams (docs/qos.md has the
tables and their sources).

Request (client to QoS server)::

    off 0   u8   magic 0x59
    off 1   u8   version (high nibble, 0) | flow control (low nibble, 0)
    off 2   u8   title length, counting this byte (len(title) + 1)
    off 3   ..   title (UTF-8; Unity's services runner sends "QoS request")
    then    u8   sequence
    then    u16  identifier (little-endian)
    then    ..   the rest: the client's timestamp (u64 ms, little-endian),
                 "user data reflected back"

Response (server to client)::

    off 0   u8   magic 0x95
    off 1   u8   version (high nibble, 0) | flow control (low nibble)
    off 2   u8   sequence (echoed)
    off 3   u16  identifier (echoed)
    off 5   ..   the rest of the request, echoed verbatim

So a response is the request without its magic, version and title: always
``title length`` bytes shorter (at least 2: the shortest title is one byte).
The server never interprets the identifier or the timestamp, it copies their
bytes; the client's byte order is its own business.
"""

from __future__ import annotations

from crossroads.errors import DecodeError
from crossroads.types import frozen

REQUEST_MAGIC = 0x59
RESPONSE_MAGIC = 0x95
#: The only version Unity's clients send and accept (QosResponse: "version
#: must be 0").
VERSION = 0
#: Shortest request: magic, version, title length, a 1-byte title, sequence,
#: identifier and an 8-byte timestamp (QosRequest.cs: MinPacketLen 15).
MIN_REQUEST = 15
#: Longest request or response (QosRequest/QosResponse: MaxPacketLen 1500).
MAX_PACKET = 1500
#: Shortest response: magic, version, sequence, identifier, timestamp
#: (QosResponse.cs: MinPacketLen 13).
MIN_RESPONSE = 13
#: The timestamp the client puts after the identifier, in bytes.
TIMESTAMP_BYTES = 8
#: The title Unity's services runner (WebTransportQosRunner) sends.
UNITY_TITLE = b"QoS request"

#: Flow control nibble (Unity's FlowControl): 0 none; bit 3 set asks the
#: client to ban the server for ``units + 1`` units, otherwise to throttle
#: for ``units`` (1..7).
FLOW_NONE = 0
FLOW_BAN = 0x8
MAX_THROTTLE_UNITS = 7


@frozen
class QosRequest:
    """A decoded request: what the response echoes, the title aside."""

    title: bytes
    sequence: int
    #: The identifier's two bytes as sent (echoed as they are).
    identifier: bytes
    #: Everything after the identifier (the timestamp), echoed verbatim.
    rest: bytes

    @property
    def identifier_le(self) -> int:
        """The identifier read little-endian, as Unity's clients write it."""
        return int.from_bytes(self.identifier, "little")

    def encode(self) -> bytes:
        """The request's bytes (for clients and tests)."""
        return (
            bytes((REQUEST_MAGIC, VERSION << 4, len(self.title) + 1))
            + self.title
            + bytes((self.sequence,))
            + self.identifier
            + self.rest
        )


def decode_request(data: bytes) -> QosRequest:
    """Decode a request.

    Raises:
        DecodeError: with ``reason`` ``short``, ``long``, ``bad-magic``,
            ``bad-version`` or ``bad-title``.
    """
    size = len(data)
    if size < MIN_REQUEST:
        raise DecodeError("QoS request shorter than 15 bytes", "short")
    if size > MAX_PACKET:
        raise DecodeError("QoS request longer than 1500 bytes", "long")
    if data[0] != REQUEST_MAGIC:
        raise DecodeError("not a QoS request (magic)", "bad-magic")
    if data[1] >> 4 != VERSION:
        raise DecodeError("QoS request of an unknown version", "bad-version")
    title_length = data[2]
    # The length counts itself: 1 would be an empty title, which no client
    # sends (MIN_REQUEST assumes a 1-byte title); refusing it keeps every
    # answer at least two bytes shorter than its request.
    end = 2 + title_length
    if title_length < 2 or end + 3 + TIMESTAMP_BYTES > size:
        raise DecodeError("QoS request title length out of range", "bad-title")
    return QosRequest(
        title=data[3:end],
        sequence=data[end],
        identifier=data[end + 1 : end + 3],
        rest=data[end + 3 :],
    )


def encode_response(request: QosRequest, flow: int = FLOW_NONE) -> bytes:
    """The answer to ``request`` with flow control ``flow`` (low nibble)."""
    return (
        bytes((RESPONSE_MAGIC, (VERSION << 4) | (flow & 0xF), request.sequence))
        + request.identifier
        + request.rest
    )


def throttle(units: int) -> int:
    """The flow control nibble asking the client to throttle for ``units``
    (clamped to 1..7)."""
    return max(1, min(MAX_THROTTLE_UNITS, units))


@frozen
class QosResponse:
    """A decoded response (for clients and tests)."""

    flow: int
    sequence: int
    identifier: bytes
    rest: bytes


def decode_response(data: bytes) -> QosResponse:
    """Decode a response.

    Raises:
        DecodeError: ``short``, ``long``, ``bad-magic`` or ``bad-version``.
    """
    if len(data) < MIN_RESPONSE:
        raise DecodeError("QoS response shorter than 13 bytes", "short")
    if len(data) > MAX_PACKET:
        raise DecodeError("QoS response longer than 1500 bytes", "long")
    if data[0] != RESPONSE_MAGIC:
        raise DecodeError("not a QoS response (magic)", "bad-magic")
    if data[1] >> 4 != VERSION:
        raise DecodeError("QoS response of an unknown version", "bad-version")
    return QosResponse(data[1] & 0xF, data[2], data[3:5], data[5:])
