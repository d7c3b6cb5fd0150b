"""RakNet's BitStream serialization (reference raknet-wire.md §0).

A BitStream is bit-packed, most significant bit first. A ``bool`` takes one
bit (BitStream.h:1130), so whatever follows a bool is unaligned unless the
writer aligns: the plugin messages this server reads and writes do *not* align
(the NAT type detection request is ``60`` · bit · u16 shifted by one bit).
Multi-byte integers are big-endian; RakNet's ``uint24_t`` is little-endian and
always byte-aligned (BitStream.h:1165-1184). A ``RakNetGUID`` is a u64 and a
``RakNet::Time`` a u64 of milliseconds. An IPv4 ``SystemAddress`` is
``u8 4 · ~ip · port`` (7 bytes; IPv6 is compiled out of stock RakNet,
``RAKNET_SUPPORT_IPV6 0``). A ``RakString`` is a u16 length, then the bytes
from the next byte boundary (RakString.cpp:1218-1223).

Reading past the end raises :class:`DecodeError`; nothing else escapes.
"""

from __future__ import annotations

import ipaddress

from crossroads.errors import DecodeError
from crossroads.types import Address

#: ``UNASSIGNED_SYSTEM_ADDRESS`` as RakNet writes it: ``04 ffffffff 0000``.
UNASSIGNED_ADDRESS: Address = ("0.0.0.0", 0)
#: A RakString longer than this is refused when reading: the only strings on
#: this server's wire are dotted IPv4 addresses and short passwords.
MAX_RAKSTRING = 512


class BitWriter:
    """Appends values MSB-first; :meth:`data` pads the last byte with zeros."""

    __slots__ = ("_buf", "_bits")

    def __init__(self) -> None:
        self._buf = bytearray()
        self._bits = 0

    @property
    def bits(self) -> int:
        return self._bits

    def align(self) -> None:
        self._bits = len(self._buf) * 8

    def write_bits(self, value: int, count: int) -> None:
        """The low ``count`` bits of ``value``, most significant first."""
        if count <= 0:
            return
        if self._bits % 8 == 0:
            if count % 8 == 0:
                self._buf += (value & ((1 << count) - 1)).to_bytes(count // 8, "big")
                self._bits += count
                return
        for shift in range(count - 1, -1, -1):
            bit = (value >> shift) & 1
            index, offset = divmod(self._bits, 8)
            if index == len(self._buf):
                self._buf.append(0)
            if bit:
                self._buf[index] |= 0x80 >> offset
            self._bits += 1

    def write_bool(self, value: bool) -> None:
        self.write_bits(1 if value else 0, 1)

    def write_u8(self, value: int) -> None:
        self.write_bits(value, 8)

    def write_u16(self, value: int) -> None:
        self.write_bits(value, 16)

    def write_u32(self, value: int) -> None:
        self.write_bits(value, 32)

    def write_u64(self, value: int) -> None:
        self.write_bits(value, 64)

    def write_bytes(self, data: bytes) -> None:
        """Raw bytes at the current bit position (RakNet's ``Write(char*, n)``)."""
        if self._bits % 8 == 0:
            self._buf += data
            self._bits += 8 * len(data)
        else:
            self.write_bits(int.from_bytes(data, "big"), 8 * len(data))

    def write_u24le(self, value: int) -> None:
        self.align()
        self.write_bytes((value & 0xFFFFFF).to_bytes(3, "little"))

    def write_address(self, addr: Address) -> None:
        host, port = addr
        try:
            packed = ipaddress.IPv4Address(host).packed
        except ValueError:
            packed = bytes(4)  # not IPv4: written as unassigned, as RakNet would
            port = 0
        self.write_u8(4)
        self.write_bytes(bytes(b ^ 0xFF for b in packed))
        self.write_u16(port)

    def write_rakstring(self, text: bytes) -> None:
        self.write_u16(len(text))
        self.align()
        self.write_bytes(text)

    def data(self) -> bytes:
        return bytes(self._buf)


class BitReader:
    """Reads what :class:`BitWriter` writes; :class:`DecodeError` past the end."""

    __slots__ = ("_data", "_pos", "_end")

    def __init__(self, data: bytes, *, start_bits: int = 0) -> None:
        self._data = data
        self._pos = start_bits
        self._end = len(data) * 8

    @property
    def remaining_bits(self) -> int:
        return self._end - self._pos

    def align(self) -> None:
        self._pos = (self._pos + 7) // 8 * 8

    def read_bits(self, count: int) -> int:
        if count > self._end - self._pos:
            raise DecodeError("read past the end of the message", "short")
        if self._pos % 8 == 0 and count % 8 == 0:
            start = self._pos // 8
            self._pos += count
            return int.from_bytes(self._data[start : start + count // 8], "big")
        first = self._pos // 8
        last = (self._pos + count - 1) // 8
        chunk = int.from_bytes(self._data[first : last + 1], "big")
        tail = (last + 1) * 8 - (self._pos + count)
        self._pos += count
        return (chunk >> tail) & ((1 << count) - 1)

    def read_bool(self) -> bool:
        return self.read_bits(1) == 1

    def read_u8(self) -> int:
        return self.read_bits(8)

    def read_u16(self) -> int:
        return self.read_bits(16)

    def read_u32(self) -> int:
        return self.read_bits(32)

    def read_u64(self) -> int:
        return self.read_bits(64)

    def read_bytes(self, count: int) -> bytes:
        if count == 0:
            return b""
        return self.read_bits(8 * count).to_bytes(count, "big")

    def read_u24le(self) -> int:
        self.align()
        return int.from_bytes(self.read_bytes(3), "little")

    def read_address(self) -> Address:
        version = self.read_u8()
        if version != 4:
            raise DecodeError("only IPv4 SystemAddresses are used", "bad-address")
        packed = bytes(b ^ 0xFF for b in self.read_bytes(4))
        port = self.read_u16()
        return str(ipaddress.IPv4Address(packed)), port

    def read_rakstring(self) -> bytes:
        length = self.read_u16()
        if length > MAX_RAKSTRING:
            raise DecodeError("RakString too long", "too-long")
        self.align()
        return self.read_bytes(length)

    def rest(self) -> bytes:
        """The bytes from the next byte boundary to the end."""
        self.align()
        start = self._pos // 8
        self._pos = self._end
        return self._data[start:]
