"""OpenTTD TCP packet framing and field primitives (sans-I/O).

Every OpenTTD TCP packet -- game coordinator, STUN, TURN and the game protocol
itself -- is framed the same way (reference ``openttd-coordinator.md`` section 1;
OpenTTD ``src/network/core/packet.cpp``)::

    uint16 size   little-endian, counts the WHOLE packet including these 2 bytes
    uint8  type
    ...    payload

Integers are little-endian; ``bool`` is a uint8 0/1; strings are UTF-8 terminated
by a NUL with no length prefix, and every string field has a maximum length that
counts the NUL (``config.h`` ``NETWORK_*_LENGTH``).

:class:`PacketSplitter` turns a byte stream into ``(type, payload)`` pairs and
rejects impossible sizes; :class:`Reader` and :class:`Writer` read and write the
fields. Nothing here does I/O.
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import ClassVar, Literal, TypeVar

from crossroads.errors import DecodeError, LocalProtocolError
from crossroads.proto.binary import ByteReader

#: Size of the packet header: uint16 size + uint8 type (``packet.h``).
HEADER_SIZE = 3
#: Largest packet OpenTTD accepts on a TCP socket (``config.h`` ``TCP_MTU``).
#: The top bit of the size field is reserved for a future >32 KiB scheme.
TCP_MTU = 32767
#: Default size of packets OpenTTD builds (``config.h`` ``COMPAT_MTU``): every
#: release since 1.0 accepts packets of this size, so we keep small replies under it.
COMPAT_MTU = 1460

# String caps, counting the terminating NUL (OpenTTD ``src/network/core/config.h``).
INVITE_CODE_LENGTH = 64
INVITE_CODE_SECRET_LENGTH = 80
TOKEN_LENGTH = 64
HOSTNAME_LENGTH = 80
HOSTNAME_PORT_LENGTH = 86
ERROR_DETAIL_LENGTH = 100
NAME_LENGTH = 80
REVISION_LENGTH = 33
GRF_NAME_LENGTH = 80

EnumT = TypeVar("EnumT", bound=IntEnum)

_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class Reader(ByteReader):
    """Reads fields from one packet payload (a little-endian
    :class:`crossroads.proto.binary.ByteReader`); every failure is a
    :class:`DecodeError` whose reason labels the OpenTTD drop metrics."""

    __slots__ = ()
    PROTOCOL: ClassVar[str] = "OpenTTD"
    BYTEORDER: ClassVar[Literal["big", "little"]] = "little"
    TRUNCATED: ClassVar[str] = "short"
    TRAILING: ClassVar[str] = "trailing-bytes"

    def u8(self) -> int:
        return self.uint(1)

    def boolean(self) -> bool:
        value = self.u8()
        if value > 1:
            raise DecodeError(f"boolean field holds {value}", "bad-bool")
        return value == 1

    def u8_enum(self, kind: type[EnumT], reason: str) -> EnumT:
        """A uint8 that must be a member of ``kind``; any other value is a
        :class:`DecodeError` labelled ``reason``."""
        raw = self.u8()
        try:
            return kind(raw)
        except ValueError:
            raise DecodeError(f"{kind.__name__} {raw}", reason) from None

    def u16(self) -> int:
        return self.uint(2)

    def u32(self) -> int:
        return self.uint(4)

    def u64(self) -> int:
        return self.uint(8)

    def raw(self, size: int) -> bytes:
        return bytes(self.take(size))

    def string(self, limit: int, *, truncate: bool = False) -> str:
        """A NUL-terminated UTF-8 string of at most ``limit`` bytes with the NUL.

        With ``truncate`` a longer string is cut to ``limit - 1`` bytes, as
        OpenTTD's own ``Packet::Recv_string`` does; without it, it is an error.
        Used with ``truncate`` for free-text fields a real server fills from user
        data (server and NewGRF names), strictly for identifiers (tokens, codes).
        """
        end = self.data.find(b"\0", self.pos)
        if end < 0:
            raise DecodeError("string without NUL terminator", "unterminated")
        raw = self.data[self.pos : end]
        self.pos = end + 1
        if len(raw) >= limit:
            if not truncate:
                raise DecodeError(
                    f"string of {len(raw)} bytes exceeds {limit - 1}", "long-string"
                )
            raw = raw[: limit - 1]
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                if exc.reason != "unexpected end of data":
                    raise DecodeError("string is not UTF-8", "bad-utf8") from None
                # The cut fell inside a multi-byte character: drop that character.
                return raw[: exc.start].decode("utf-8")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise DecodeError("string is not UTF-8", "bad-utf8") from None

    def end(self) -> None:
        """Fail when bytes are left over (the reference GC closes on trailing data)."""
        self.finish()


class Writer:
    """Builds one packet: header first, payload fields, then :meth:`finish`."""

    __slots__ = ("_parts", "_size")

    def __init__(self, packet_type: int) -> None:
        self._parts: list[bytes] = [b"", bytes((packet_type,))]
        self._size = HEADER_SIZE

    def _add(self, data: bytes) -> Writer:
        self._parts.append(data)
        self._size += len(data)
        return self

    def u8(self, value: int) -> Writer:
        if not 0 <= value <= 0xFF:
            raise LocalProtocolError(f"{value} does not fit a uint8")
        return self._add(bytes((value,)))

    def boolean(self, value: bool) -> Writer:
        return self._add(b"\x01" if value else b"\x00")

    def u16(self, value: int) -> Writer:
        if not 0 <= value <= 0xFFFF:
            raise LocalProtocolError(f"{value} does not fit a uint16")
        return self._add(_U16.pack(value))

    def u32(self, value: int) -> Writer:
        if not 0 <= value <= 0xFFFFFFFF:
            raise LocalProtocolError(f"{value} does not fit a uint32")
        return self._add(_U32.pack(value))

    def u64(self, value: int) -> Writer:
        if not 0 <= value <= 0xFFFFFFFFFFFFFFFF:
            raise LocalProtocolError(f"{value} does not fit a uint64")
        return self._add(_U64.pack(value))

    def raw(self, data: bytes) -> Writer:
        return self._add(bytes(data))

    def string(self, value: str, limit: int) -> Writer:
        data = value.encode("utf-8")
        if b"\0" in data:
            raise LocalProtocolError("strings cannot contain NUL")
        if len(data) >= limit:
            raise LocalProtocolError(f"string of {len(data)} bytes exceeds {limit - 1}")
        return self._add(data + b"\0")

    @property
    def size(self) -> int:
        return self._size

    def payload(self) -> bytes:
        """The fields written so far, without the header (to splice into packets)."""
        return b"".join(self._parts[2:])

    def finish(self, limit: int = TCP_MTU) -> bytes:
        if self._size > limit:
            raise LocalProtocolError(f"packet of {self._size} bytes exceeds {limit}")
        self._parts[0] = _U16.pack(self._size)
        return b"".join(self._parts)


def packet(packet_type: int, payload: bytes = b"") -> bytes:
    """Frame ``payload`` as one packet of ``packet_type``."""
    size = HEADER_SIZE + len(payload)
    if size > TCP_MTU:
        raise LocalProtocolError(f"packet of {size} bytes exceeds {TCP_MTU}")
    return _U16.pack(size) + bytes((packet_type,)) + payload


class PacketSplitter:
    """Cuts a TCP byte stream into packets.

    Bytes go in with :meth:`push`; :meth:`next` takes one complete packet out as
    ``(type, payload)`` or returns None when the next one is incomplete. Cutting
    lazily lets a consumer stop taking packets (and stop reading the socket)
    while the backlog is kept as raw bytes, bounded by the caller. :meth:`feed`
    does both at once. A size field below 3 or above ``max_size`` can never
    start a valid packet, so it raises :class:`DecodeError` and the stream is
    unusable from then on (OpenTTD drops such connections, ``ParsePacketSize``).
    """

    __slots__ = ("_buffer", "_pos", "max_size")

    def __init__(self, max_size: int = TCP_MTU) -> None:
        self._buffer = bytearray()
        self._pos = 0
        self.max_size = max_size

    @property
    def pending(self) -> int:
        """Bytes held back: unconsumed packets and any partial packet."""
        return len(self._buffer) - self._pos

    def push(self, data: bytes) -> None:
        if self._pos and self._pos == len(self._buffer):
            self._buffer.clear()
            self._pos = 0
        self._buffer += data

    def next(self) -> tuple[int, bytes] | None:
        buffer, pos = self._buffer, self._pos
        if len(buffer) - pos < 2:
            self._compact()
            return None
        size = buffer[pos] | (buffer[pos + 1] << 8)
        if size < HEADER_SIZE or size > self.max_size:
            raise DecodeError(f"packet size {size} is impossible", "bad-size")
        if len(buffer) - pos < size:
            self._compact()
            return None
        self._pos = pos + size
        return buffer[pos + 2], bytes(buffer[pos + 3 : pos + size])

    def _compact(self) -> None:
        # Drop consumed bytes once they are a large share of the buffer.
        if self._pos > 4096 and self._pos * 2 > len(self._buffer):
            del self._buffer[: self._pos]
            self._pos = 0

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        """Push ``data`` and return every complete packet."""
        self.push(data)
        packets = []
        while (item := self.next()) is not None:
            packets.append(item)
        return packets

    def take_remaining(self) -> bytes:
        """Hand over the buffered bytes (when a socket leaves packet mode)."""
        data = bytes(self._buffer[self._pos :])
        self._buffer.clear()
        self._pos = 0
        return data
