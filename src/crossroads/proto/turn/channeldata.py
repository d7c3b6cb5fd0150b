"""ChannelData framing (RFC 8656 §12.4) and the TURN-over-TCP stream framer.

A ChannelData message is a 4-byte header — channel number (u16), length (u16) —
followed by ``length`` bytes of application data. It shares the client-server
5-tuple with STUN; the two are told apart by the first two bits (RFC 8656 §12,
RFC 7983): ``00`` is STUN, ``01`` (first byte 0x40-0x7F) is ChannelData.

Over UDP the data may be followed by up to 3 padding bytes (optional; coturn's
``uclient -D`` and pjnath pad). Over TCP/TLS the message MUST be padded to a
multiple of 4 bytes, and the length field excludes the padding (§12.5), so a stream
reader needs :class:`StreamFramer` to find message boundaries.

The per-packet relay path does not use :class:`ChannelData` objects; it reads the
header with two index operations (see ``transport/turnrelay.py``). This module is the
reference decoder those fast paths must agree with, and what the TCP framer and the
tests use.
"""

from __future__ import annotations

from crossroads.errors import DecodeError
from crossroads.proto.stun.message import stream_frame_length
from crossroads.proto.turn.constants import (
    CHANNEL_MAX_RFC5766,
    CHANNEL_MIN,
)
from crossroads.types import frozen

#: Channel number and length, 2 bytes each (RFC 8656 §12.4).
HEADER_SIZE = 4
#: The length field is 16 bits, so no ChannelData payload is larger.
MAX_PAYLOAD = 0xFFFF


@frozen
class ChannelData:
    """A decoded ChannelData message."""

    channel: int
    data: bytes


def is_channel_data(first_byte: int) -> bool:
    """True when a message starting with this byte is ChannelData (bits ``01``)."""
    return 0x40 <= first_byte <= 0x7F


def padded_length(length: int) -> int:
    """``length`` rounded up to a multiple of 4 (the TCP padding rule)."""
    return (length + 3) & ~3


def parse_channel_data(data: bytes | memoryview) -> ChannelData:
    """Decode one ChannelData message (as received in one UDP datagram).

    Accepts the optional UDP padding (at most 3 bytes after the data).

    Raises:
        DecodeError: reason ``short`` (no full header), ``not-channel-data``
            (first bits are not ``01``), ``truncated`` (fewer bytes than the
            length field claims), ``trailing`` (more than padding after it).
    """
    size = len(data)
    if size < HEADER_SIZE:
        raise DecodeError("ChannelData shorter than its header", "short")
    channel = (data[0] << 8) | data[1]
    if not CHANNEL_MIN <= channel <= CHANNEL_MAX_RFC5766:
        raise DecodeError(
            f"0x{channel:04x} is not a channel number", "not-channel-data"
        )
    length = (data[2] << 8) | data[3]
    end = HEADER_SIZE + length
    if size < end:
        raise DecodeError(
            f"ChannelData claims {length} bytes, has {size - HEADER_SIZE}", "truncated"
        )
    if size - end > 3:
        raise DecodeError("bytes after ChannelData beyond padding", "trailing")
    return ChannelData(channel, bytes(data[HEADER_SIZE:end]))


def encode_channel_data(channel: int, data: bytes, *, pad: bool = False) -> bytes:
    """Encode a ChannelData message; ``pad`` adds the TCP padding to 4 bytes."""
    if not CHANNEL_MIN <= channel <= CHANNEL_MAX_RFC5766:
        raise ValueError(f"0x{channel:04x} is not a channel number")
    length = len(data)
    if length > MAX_PAYLOAD:
        raise ValueError("ChannelData payload longer than 65535 bytes")
    header = bytes((channel >> 8, channel & 0xFF, length >> 8, length & 0xFF))
    if pad and length & 3:
        return header + data + b"\x00" * (4 - (length & 3))
    return header + data


class StreamFramer:
    """Cuts a TURN-over-TCP byte stream into STUN messages and ChannelData messages.

    Theory of operation: bytes are appended to a buffer; each complete message at
    the front is cut off and returned as ``(is_channel_data, message_bytes)``. The
    first two bits of a message say what it is (RFC 8656 §12): a STUN message is
    ``20 + length`` bytes (its length field counts the attributes); a ChannelData
    message is ``4 + length`` bytes plus padding to a multiple of 4, and the
    returned bytes exclude the padding. Anything else — first bits ``10``/``11``,
    a STUN length that is not a multiple of 4, a message bigger than
    ``max_message`` — cannot be resynchronised on a stream: :meth:`feed` raises
    :class:`DecodeError` and the connection must be closed.

    ``max_message`` bounds the buffer: at most one partial message is held.
    """

    __slots__ = ("_buffer", "max_message")

    def __init__(self, max_message: int = HEADER_SIZE + MAX_PAYLOAD + 3) -> None:
        self._buffer = bytearray()
        self.max_message = max_message

    @property
    def buffered(self) -> int:
        """Bytes held waiting for the rest of a message."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[tuple[bool, bytes]]:
        """Add received bytes; return the complete messages now available."""
        buffer = self._buffer
        buffer += data
        out: list[tuple[bool, bytes]] = []
        start = 0
        size = len(buffer)
        while (total := stream_frame_length(buffer, start)) is not None:
            if total > self.max_message:
                raise DecodeError("message larger than allowed", "too-large")
            if size - start < total:
                break
            is_channel = buffer[start] >= 0x40
            # ChannelData is returned without its TCP padding.
            keep = (
                HEADER_SIZE + ((buffer[start + 2] << 8) | buffer[start + 3])
                if is_channel
                else total
            )
            out.append((is_channel, bytes(buffer[start : start + keep])))
            start += total
        if start:
            del buffer[:start]
        return out
