"""Data-plane helpers for Send and Data indications, without message objects.

Send and Data indications (RFC 8656 §11) carry application data in a STUN
envelope. Decoding each one into a full STUN message object costs more than the
forwarding itself, so the data plane uses these two functions instead:

- :func:`parse_send_indication` walks the attributes of a Send indication in place
  and returns only what forwarding needs (peer address, payload), or None for
  anything it does not fully understand — the caller then hands the bytes to the
  full STUN codec (control path), which decodes, validates and counts the drop;
- :func:`data_indication` writes a Data indication with ``struct``.

Both agree with the full codec (checked by property tests).
"""

from __future__ import annotations

import ipaddress
import struct
import zlib

#: RFC 8489 §5 magic cookie.
MAGIC_COOKIE = 0x2112A442
_COOKIE_BYTES = MAGIC_COOKIE.to_bytes(4, "big")
#: Send indication = method Send (0x006) with class indication (0x0010).
SEND_INDICATION = 0x0016
DATA_INDICATION = 0x0017
ATTR_XOR_PEER_ADDRESS = 0x0012
ATTR_DATA = 0x0013
ATTR_DONT_FRAGMENT = 0x001A
ATTR_FINGERPRINT = 0x8028
#: RFC 8489 §14.7: FINGERPRINT = CRC-32 XOR 0x5354554e.
_FINGERPRINT_XOR = 0x5354554E

_HEADER = struct.Struct("!HHI12s")
_ATTR = struct.Struct("!HH")
_XOR_V4 = struct.Struct("!HHBBH4s")


def _xor_bytes(left: bytes, right: bytes) -> bytes:
    return (int.from_bytes(left, "big") ^ int.from_bytes(right, "big")).to_bytes(
        len(left), "big"
    )


def parse_send_indication(
    data: bytes,
) -> tuple[tuple[str, int], bytes, bool] | None:
    """``(peer address, payload, dont_fragment)`` of a well-formed Send indication.

    Returns None when the bytes are not a Send indication this function fully
    understands: wrong type or cookie, inconsistent lengths, missing or repeated
    XOR-PEER-ADDRESS / DATA, any other attribute besides DONT-FRAGMENT and a
    correct trailing FINGERPRINT. The slow path decides what those are.
    """
    size = len(data)
    if size < 20 or data[0] != 0x00 or data[1] != 0x16:
        return None
    length = (data[2] << 8) | data[3]
    if length + 20 != size or length & 3 or data[4:8] != _COOKIE_BYTES:
        return None
    offset = 20
    peer: tuple[str, int] | None = None
    payload: bytes | None = None
    dont_fragment = False
    while offset < size:
        if size - offset < 4:
            return None
        kind = (data[offset] << 8) | data[offset + 1]
        alen = (data[offset + 2] << 8) | data[offset + 3]
        start = offset + 4
        end = start + alen
        if end > size:
            return None
        if kind == ATTR_DATA:
            if payload is not None:
                return None
            payload = data[start:end]
        elif kind == ATTR_XOR_PEER_ADDRESS:
            if peer is not None:
                return None
            peer = _decode_xor_address(data, start, alen)
            if peer is None:
                return None
        elif kind == ATTR_DONT_FRAGMENT:
            if alen != 0:
                return None
            dont_fragment = True
        elif kind == ATTR_FINGERPRINT:
            if alen != 4 or end != size:
                return None
            expected = (zlib.crc32(data[:offset]) ^ _FINGERPRINT_XOR) & 0xFFFFFFFF
            if int.from_bytes(data[start:end], "big") != expected:
                return None
        else:
            return None
        offset = start + ((alen + 3) & ~3)
    if peer is None or payload is None or offset != size:
        return None
    return peer, payload, dont_fragment


def _decode_xor_address(data: bytes, start: int, alen: int) -> tuple[str, int] | None:
    family = data[start + 1] if alen >= 2 else 0
    if family == 0x01 and alen == 8:
        port = ((data[start + 2] << 8) | data[start + 3]) ^ 0x2112
        raw = _xor_bytes(data[start + 4 : start + 8], _COOKIE_BYTES)
        return f"{raw[0]}.{raw[1]}.{raw[2]}.{raw[3]}", port
    if family == 0x02 and alen == 20:
        port = ((data[start + 2] << 8) | data[start + 3]) ^ 0x2112
        raw = _xor_bytes(data[start + 4 : start + 20], data[4:20])
        return str(ipaddress.IPv6Address(raw)), port
    return None


def xor_peer_address(peer: tuple[str, int], transaction_id: bytes) -> bytes:
    """An encoded XOR-PEER-ADDRESS attribute (header included)."""
    host, port = peer[0], peer[1]
    xport = port ^ 0x2112
    if ":" in host:
        raw = ipaddress.IPv6Address(host).packed
        value = _xor_bytes(raw, _COOKIE_BYTES + transaction_id)
        return (
            _ATTR.pack(ATTR_XOR_PEER_ADDRESS, 20)
            + bytes((0, 2))
            + (xport.to_bytes(2, "big") + value)
        )
    raw = ipaddress.IPv4Address(host).packed
    return _XOR_V4.pack(
        ATTR_XOR_PEER_ADDRESS, 8, 0, 1, xport, _xor_bytes(raw, _COOKIE_BYTES)
    )


def data_indication(
    peer: tuple[str, int],
    payload: bytes,
    transaction_id: bytes,
    peer_attribute: bytes | None = None,
) -> bytes:
    """A Data indication carrying ``payload`` from ``peer``.

    ``peer_attribute`` may be a cached :func:`xor_peer_address` for IPv4 peers
    (which does not depend on the transaction id).
    """
    if peer_attribute is None:
        peer_attribute = xor_peer_address(peer, transaction_id)
    size = len(payload)
    pad = -size & 3
    length = len(peer_attribute) + 4 + size + pad
    return b"".join(
        (
            _HEADER.pack(DATA_INDICATION, length, MAGIC_COOKIE, transaction_id),
            peer_attribute,
            _ATTR.pack(ATTR_DATA, size),
            payload,
            b"\x00" * pad,
        )
    )
