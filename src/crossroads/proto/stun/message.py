"""STUN messages (RFC 8489 §5-§6): decode, encode, and cheap header peeks.

::

     0                   1                   2                   3
    +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
    |0 0|     STUN Message Type     |         Message Length        |
    +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
    |                         Magic Cookie                          |
    +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
    |                     Transaction ID (96 bits)                  |
    +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+

Typical use::

    msg = decode(datagram)                      # DecodeError if not STUN
    if msg.unknown_comprehension_required():    # answer 420
        ...
    reply = success_response(msg, [XorMappedAddress(host, port)])
    wire = encode(reply, fingerprint=True)

:func:`decode` accepts RFC 3489 messages (no magic cookie: ``cookie`` holds the
first four bytes of the 128-bit transaction id) so a server can answer them with
MAPPED-ADDRESS. It checks FINGERPRINT when present and ignores attributes after
MESSAGE-INTEGRITY other than MESSAGE-INTEGRITY-SHA256 and FINGERPRINT (RFC 8489
§14.5). Message integrity is checked on the raw bytes with
:mod:`crossroads.proto.stun.integrity`.

Demultiplexing helpers (:func:`sort_traffic`, :func:`is_stun`,
:func:`is_channel_data`, :func:`peek_header`, :func:`stream_frame_length`) read at most the first 20
bytes and allocate nothing they do not return: they are for per-packet paths.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Iterable
from enum import IntEnum
from typing import NamedTuple, TypeVar

from crossroads.errors import DecodeError, LocalProtocolError
from crossroads.proto.stun.attributes import (
    DECODERS,
    Attribute,
    ErrorCodeAttribute,
    Fingerprint,
    MessageIntegrity,
    MessageIntegritySha256,
    UnknownAttribute,
    UnknownAttributes,
)
from crossroads.proto.stun.constants import (
    COMPREHENSION_OPTIONAL_MIN,
    HEADER_LENGTH,
    MAGIC_COOKIE,
    MAGIC_COOKIE_BYTES,
    AttrType,
    Class,
    ErrorCode,
    Method,
    message_type,
    reason_phrase,
    split_message_type,
)
from crossroads.proto.stun.integrity import fingerprint_value
from crossroads.types import frozen

A = TypeVar("A", bound=Attribute)

_HEADER = struct.Struct("!HHI12s")
_ATTR_HEADER = struct.Struct("!HH")
_U16 = struct.Struct("!H")
_U32 = struct.Struct("!I")

#: Largest value a 16-bit STUN length field can describe.
MAX_MESSAGE_LENGTH = 0xFFFF

_METHODS = {m.value: m for m in Method}
_MI = AttrType.MESSAGE_INTEGRITY
_MI256 = AttrType.MESSAGE_INTEGRITY_SHA256
_FP = AttrType.FINGERPRINT


@frozen
class Message:
    """One STUN message.

    ``method`` is a :class:`Method` when known, else the plain 12-bit number.
    ``transaction_id`` is 12 bytes. ``cookie`` is :data:`MAGIC_COOKIE` except for
    RFC 3489 messages, where it is the first 4 bytes of their 16-byte id.
    ``attributes`` keep wire order and duplicates.
    """

    msg_class: Class
    method: int
    transaction_id: bytes
    attributes: tuple[Attribute, ...] = ()
    cookie: int = MAGIC_COOKIE

    @property
    def message_type(self) -> int:
        """The 14-bit message type on the wire."""
        return message_type(self.method, self.msg_class)

    @property
    def is_rfc3489(self) -> bool:
        """True when the message lacks the magic cookie (a classic STUN client)."""
        return self.cookie != MAGIC_COOKIE

    @property
    def xor_key(self) -> bytes:
        """Magic cookie + transaction id: the key of XOR-address attributes."""
        return MAGIC_COOKIE_BYTES + self.transaction_id

    def get(self, cls: type[A]) -> A | None:
        """The first attribute of class ``cls``, or None (RFC 8489 §14: only the
        first occurrence of a repeated attribute is processed)."""
        for attr in self.attributes:
            if type(attr) is cls:
                return attr
        return None

    def get_all(self, cls: type[A]) -> list[A]:
        """Every attribute of class ``cls``, in order."""
        return [a for a in self.attributes if type(a) is cls]

    def unknown_comprehension_required(self) -> tuple[int, ...]:
        """Types of unknown comprehension-required attributes, for a 420 answer
        with UNKNOWN-ATTRIBUTES (RFC 8489 §6.3.1). Empty when all are known."""
        return tuple(
            a.type_code
            for a in self.attributes
            if type(a) is UnknownAttribute and a.type_code < COMPREHENSION_OPTIONAL_MIN
        )

    @property
    def error(self) -> ErrorCodeAttribute | None:
        """The ERROR-CODE attribute of an error response, if any."""
        return self.get(ErrorCodeAttribute)


# ---------------------------------------------------------------- peeking


class StunHeader(NamedTuple):
    """What :func:`peek_header` reads from the first 20 bytes."""

    msg_class: int
    method: int
    length: int
    magic: bool
    transaction_id: bytes


def is_stun(data: bytes) -> bool:
    """First two bits 00 and room for a header (RFC 8489 §5; RFC 7983 demux)."""
    return len(data) >= HEADER_LENGTH and data[0] < 0x40


def is_channel_data(data: bytes) -> bool:
    """First two bits 01: a TURN ChannelData message (RFC 8656 §12.4)."""
    return len(data) >= 4 and 0x40 <= data[0] < 0x80


class PortTraffic(IntEnum):
    """What a datagram (or TCP frame) on the STUN/TURN port is, by its first
    two bytes (RFC 7983 §7 demultiplexing; RFC 8656 §12)."""

    #: A Binding message of any class: the STUN server's (RFC 8489 §18.1).
    BINDING = 0
    #: Another STUN method (first bits 00): TURN's, or dropped without TURN.
    STUN = 1
    #: First bits 01: TURN ChannelData (RFC 8656 §12.4).
    CHANNEL_DATA = 2
    #: First bits 10 or 11: not STUN (DTLS, RTP, garbage).
    OTHER = 3


def sort_traffic(data: bytes) -> PortTraffic:
    """Sort one datagram or frame of the STUN/TURN port; the one place its
    first bytes are read. ``IndexError`` on an empty datagram (and on a
    one-byte one starting 00), which callers count as ``empty``.

    Binding is method 0x001 in any class: message types 0x0001, 0x0011,
    0x0101 and 0x0111 (RFC 8489 §5: the class bits are 0x0110 of the type).
    """
    first = data[0]
    if first < 0x40:
        if (first & 0x3E) == 0 and (data[1] & 0xEF) == 0x01:
            return PortTraffic.BINDING
        return PortTraffic.STUN
    if first < 0x80:
        return PortTraffic.CHANNEL_DATA
    return PortTraffic.OTHER


def peek_header(data: bytes) -> StunHeader | None:
    """Class, method, length and transaction id without parsing attributes.

    Returns None when ``data`` is not shaped like a STUN message (too short,
    first bits not 00, length not a multiple of 4).
    """
    if len(data) < HEADER_LENGTH or data[0] >= 0x40:
        return None
    mtype, length, cookie, txid = _HEADER.unpack_from(data)
    if length & 3:
        return None
    method, msg_class = split_message_type(mtype)
    return StunHeader(msg_class, method, length, cookie == MAGIC_COOKIE, txid)


def stream_frame_length(
    buffer: bytes | bytearray | memoryview, start: int = 0
) -> int | None:
    """Length of the frame at ``start`` of a TCP byte stream (padding
    included), or None if the buffer does not hold its header yet. The one
    framing rule of STUN/TURN over TCP, for the server's connections and the
    client's :class:`~crossroads.proto.turn.channeldata.StreamFramer`.

    A STUN message is 20 + length bytes (RFC 8489 §6.2.2); a ChannelData message
    is 4 + length rounded up to 4, because over TCP it is padded (RFC 8656 §12.5).

    Raises:
        DecodeError: the stream does not start with STUN or ChannelData (reason
            ``framing``: a stream cannot be resynchronised) or a STUN length is
            not a multiple of 4 (``bad-length``).
    """
    if len(buffer) - start < 4:
        return None
    first = buffer[start]
    length = (buffer[start + 2] << 8) | buffer[start + 3]
    if first < 0x40:
        if length & 3:
            raise DecodeError("STUN length not a multiple of 4", reason="bad-length")
        return HEADER_LENGTH + length
    if first < 0x80:
        return 4 + ((length + 3) & ~3)
    raise DecodeError("neither STUN nor ChannelData on a stream", reason="framing")


# ---------------------------------------------------------------- decoding


def decode(data: bytes, *, check_fingerprint: bool = True) -> Message:
    """Decode one STUN message that fills ``data`` exactly.

    Raises:
        DecodeError: with ``reason`` one of ``short``, ``not-stun``,
            ``bad-length``, ``truncated``, ``bad-attribute``, ``bad-fingerprint``,
            ``fingerprint-not-last``.
    """
    data = bytes(data)
    size = len(data)
    if size < HEADER_LENGTH:
        raise DecodeError(f"{size} bytes is shorter than a header", reason="short")
    mtype, length, cookie, txid = _HEADER.unpack_from(data)
    if mtype & 0xC000:
        raise DecodeError("first two bits are not 00", reason="not-stun")
    if length & 3 or HEADER_LENGTH + length != size:
        raise DecodeError(
            f"length field {length} does not match {size - HEADER_LENGTH}",
            reason="bad-length",
        )
    method, msg_class = split_message_type(mtype)
    key = MAGIC_COOKIE_BYTES + txid
    attributes: list[Attribute] = []
    offset = HEADER_LENGTH
    # RFC 8489 §14.5/§14.6: after MESSAGE-INTEGRITY only MESSAGE-INTEGRITY-SHA256
    # and FINGERPRINT count; after MESSAGE-INTEGRITY-SHA256 only FINGERPRINT.
    after_mi = False
    after_mi256 = False
    while offset < size:
        if offset + 4 > size:
            raise DecodeError("truncated attribute header", reason="truncated")
        atype, alen = _ATTR_HEADER.unpack_from(data, offset)
        start = offset + 4
        end = start + alen
        if end > size:
            raise DecodeError(f"attribute {atype:#06x} overruns", reason="truncated")
        value = data[start:end]
        offset = end + (-alen & 3)
        if offset > size:
            raise DecodeError("attribute padding overruns", reason="truncated")
        if atype == _FP:
            if offset != size:
                raise DecodeError(
                    "FINGERPRINT is not last", reason="fingerprint-not-last"
                )
            if alen != 4:
                raise DecodeError("FINGERPRINT length", reason="bad-attribute")
            expected = fingerprint_value(data, start - 4)
            (got,) = _U32.unpack(value)
            if check_fingerprint and got != expected:
                raise DecodeError("FINGERPRINT mismatch", reason="bad-fingerprint")
            attributes.append(Fingerprint(got))
            continue
        if after_mi256 or (after_mi and atype != _MI256):
            continue
        if atype == _MI:
            after_mi = True
        elif atype == _MI256:
            after_mi256 = True
        decoder = DECODERS.get(atype)
        if decoder is None:
            attributes.append(UnknownAttribute(atype, value))
            continue
        try:
            attributes.append(decoder(value, key))
        except DecodeError:
            raise
        except (ValueError, struct.error, IndexError) as exc:
            raise DecodeError(
                f"attribute {atype:#06x}: {exc}", reason="bad-attribute"
            ) from None
    return Message(
        Class(msg_class),
        _METHODS.get(method, method),
        txid,
        tuple(attributes),
        cookie,
    )


# ---------------------------------------------------------------- encoding


def _append_attribute(out: bytearray, atype: int, value: bytes, pad: bytes) -> None:
    if len(value) > MAX_MESSAGE_LENGTH:
        raise LocalProtocolError(f"attribute {atype:#06x} value too long")
    out += _ATTR_HEADER.pack(atype, len(value))
    out += value
    out += pad * (-len(value) & 3)


def _set_length(out: bytearray, length: int) -> None:
    if length > MAX_MESSAGE_LENGTH:
        raise LocalProtocolError(f"message length {length} exceeds 65535")
    _U16.pack_into(out, 2, length)


def encode(
    msg: Message,
    *,
    integrity_key: bytes | None = None,
    integrity_sha256_key: bytes | None = None,
    sha256_length: int = 32,
    fingerprint: bool = False,
    pad: bytes = b"\0",
) -> bytes:
    """Encode ``msg``.

    Without keys and ``fingerprint``, attributes are written exactly as given
    (so ``decode(encode(m)) == m``). With ``integrity_key`` (MESSAGE-INTEGRITY,
    HMAC-SHA1), ``integrity_sha256_key`` (MESSAGE-INTEGRITY-SHA256, truncated to
    ``sha256_length`` bytes) or ``fingerprint``, any such attributes already in
    ``msg`` are dropped and fresh ones are appended in the RFC 8489 §14 order.
    ``pad`` is the padding byte (RFC 5769's vectors use spaces).

    Raises:
        LocalProtocolError: a value does not fit its field.
    """
    if len(msg.transaction_id) != 12:
        raise LocalProtocolError("transaction id must be 12 bytes")
    if len(pad) != 1:
        raise LocalProtocolError("pad must be one byte")
    computed = integrity_key is not None or integrity_sha256_key is not None
    attributes = msg.attributes
    if computed or fingerprint:
        attributes = tuple(
            a
            for a in attributes
            if not isinstance(
                a, MessageIntegrity | MessageIntegritySha256 | Fingerprint
            )
        )
    key = msg.xor_key
    out = bytearray(
        _HEADER.pack(msg.message_type, 0, msg.cookie & 0xFFFFFFFF, msg.transaction_id)
    )
    try:
        for attr in attributes:
            _append_attribute(out, attr.get_type(), attr.encode_value(key), pad)
    except (struct.error, ValueError, OverflowError) as exc:
        raise LocalProtocolError(f"cannot encode attribute: {exc}") from None
    if integrity_key is not None:
        # RFC 8489 §14.5: HMAC over the message so far, with the length field
        # already counting the 24-byte MESSAGE-INTEGRITY attribute.
        _set_length(out, len(out) + 24 - HEADER_LENGTH)
        digest = hmac.new(integrity_key, out, hashlib.sha1).digest()
        _append_attribute(out, _MI, digest, pad)
    if integrity_sha256_key is not None:
        if sha256_length not in (16, 20, 24, 28, 32):
            raise LocalProtocolError("MESSAGE-INTEGRITY-SHA256 is 16-32 bytes, x4")
        _set_length(out, len(out) + 4 + sha256_length - HEADER_LENGTH)
        digest = hmac.new(integrity_sha256_key, out, hashlib.sha256).digest()
        _append_attribute(out, _MI256, digest[:sha256_length], pad)
    if fingerprint:
        fp_offset = len(out)
        _set_length(out, fp_offset + 8 - HEADER_LENGTH)
        _append_attribute(out, _FP, _U32.pack(fingerprint_value(out, fp_offset)), pad)
    _set_length(out, len(out) - HEADER_LENGTH)
    return bytes(out)


# ---------------------------------------------------------------- building


def request(
    method: int,
    transaction_id: bytes,
    attributes: Iterable[Attribute] = (),
) -> Message:
    """A request message."""
    return Message(Class.REQUEST, method, transaction_id, tuple(attributes))


def indication(
    method: int,
    transaction_id: bytes,
    attributes: Iterable[Attribute] = (),
) -> Message:
    """An indication message."""
    return Message(Class.INDICATION, method, transaction_id, tuple(attributes))


def success_response(req: Message, attributes: Iterable[Attribute] = ()) -> Message:
    """A success response to ``req`` (same method, transaction id and cookie)."""
    return Message(
        Class.SUCCESS, req.method, req.transaction_id, tuple(attributes), req.cookie
    )


def error_response(
    req: Message,
    code: int,
    reason: str | None = None,
    attributes: Iterable[Attribute] = (),
) -> Message:
    """An error response to ``req`` with ERROR-CODE first (RFC 8489 §6.3.1.1)."""
    error = ErrorCodeAttribute(code, reason_phrase(code) if reason is None else reason)
    return Message(
        Class.ERROR,
        req.method,
        req.transaction_id,
        (error, *attributes),
        req.cookie,
    )


def unknown_attributes_response(req: Message, types: Iterable[int]) -> Message:
    """420 Unknown Attribute listing ``types`` in UNKNOWN-ATTRIBUTES."""
    return error_response(
        req, ErrorCode.UNKNOWN_ATTRIBUTE, None, [UnknownAttributes(tuple(types))]
    )
