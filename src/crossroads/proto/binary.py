"""Bounds-checked reading of binary protocol messages, and the 16-byte address
form several protocols share.

:class:`ByteReader` is a cursor over one message: every read past the end, a
length-prefixed field longer than its limit and bytes left over after the last
field are a :class:`~crossroads.errors.DecodeError` with a stable ``reason``
(a metric label), never an ``IndexError`` or a short slice. A protocol
subclasses it to name itself in error texts, pick its byte order and, where
its metrics already have other labels, its reasons
(:class:`crossroads.proto.dtls.wire.Reader` is the DTLS one).

:func:`pack_ip16` / :func:`unpack_ip16`: an IPv4 or IPv6 address in 16 bytes,
IPv4 as an IPv4-mapped IPv6 address (RFC 4291 §2.5.5.2), as PCP (RFC 6887
§5) and the p2p rendezvous answer carry them.
"""

from __future__ import annotations

import ipaddress
from typing import ClassVar, Literal

from crossroads.errors import DecodeError

#: RFC 4291 §2.5.5.2: ``::ffff:0:0/96`` holds IPv4 addresses in IPv6 form.
_MAPPED_PREFIX = bytes(10) + b"\xff\xff"


class ByteReader:
    """A cursor over one message's bytes that raises DecodeError instead of
    over-reading (see the module docstring)."""

    __slots__ = ("data", "pos")

    #: The protocol's name in error texts ("truncated DTLS field").
    PROTOCOL: ClassVar[str] = "binary"
    #: Byte order of multi-byte integers (network order unless the protocol
    #: says otherwise).
    BYTEORDER: ClassVar[Literal["big", "little"]] = "big"
    #: ``DecodeError.reason`` of a read past the end, of a length-prefixed field
    #: over its limit, and of bytes after the last field.
    TRUNCATED: ClassVar[str] = "truncated"
    TOO_LONG: ClassVar[str] = "too-long"
    TRAILING: ClassVar[str] = "trailing"

    def __init__(self, data: bytes, pos: int = 0) -> None:
        self.data = data
        self.pos = pos

    def take(self, size: int) -> bytes:
        """The next ``size`` bytes."""
        end = self.pos + size
        if end > len(self.data):
            raise DecodeError(f"truncated {self.PROTOCOL} field", self.TRUNCATED)
        chunk = self.data[self.pos : end]
        self.pos = end
        return chunk

    def uint(self, size: int) -> int:
        """An unsigned integer of ``size`` bytes in the protocol's byte order."""
        return int.from_bytes(self.take(size), self.BYTEORDER)

    def vector(self, length_size: int, maximum: int | None = None) -> bytes:
        """Bytes after a ``length_size``-byte length (at most ``maximum``)."""
        length = self.uint(length_size)
        if maximum is not None and length > maximum:
            raise DecodeError(f"{self.PROTOCOL} vector too long", self.TOO_LONG)
        return self.take(length)

    def remaining(self) -> int:
        return len(self.data) - self.pos

    def done(self) -> bool:
        return self.pos == len(self.data)

    def finish(self) -> None:
        """Fail when bytes are left after the last field."""
        if not self.done():
            raise DecodeError(
                f"trailing bytes in a {self.PROTOCOL} message", self.TRAILING
            )


def length_prefixed(length_size: int, data: bytes) -> bytes:
    """``data`` after its length in ``length_size`` big-endian bytes (what
    :meth:`ByteReader.vector` reads)."""
    return len(data).to_bytes(length_size, "big") + data


def pack_ip16(host: str) -> bytes:
    """An IPv4 or IPv6 address as 16 bytes (IPv4 mapped, RFC 4291 §2.5.5.2).

    Raises:
        ValueError: ``host`` is not an IP address.
    """
    ip = ipaddress.ip_address(host)
    if ip.version == 4:
        return _MAPPED_PREFIX + ip.packed
    return ip.packed


def unpack_ip16(packed: bytes) -> str:
    """The text of a 16-byte address: dotted IPv4 when it is IPv4-mapped."""
    ip = ipaddress.IPv6Address(packed)
    mapped = ip.ipv4_mapped
    return str(mapped) if mapped is not None else str(ip)
