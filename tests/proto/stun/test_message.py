"""Codec properties: random bytes decode or raise DecodeError; round trips."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crossroads.errors import DecodeError, LocalProtocolError
from crossroads.proto.stun import (
    BINDING_REQUEST,
    MAGIC_COOKIE,
    AddressErrorCode,
    AttrType,
    ChangeRequest,
    Class,
    ErrorCode,
    ErrorCodeAttribute,
    Fingerprint,
    Message,
    MessageIntegrity,
    Method,
    Software,
    UnknownAttribute,
    UnknownAttributes,
    XorMappedAddress,
    check_fingerprint,
    check_message_integrity,
    decode,
    encode,
    error_response,
    is_channel_data,
    is_stun,
    message_type,
    peek_header,
    request,
    split_message_type,
    stream_frame_length,
    success_response,
    unknown_attributes_response,
)
from crossroads.proto.stun.message import PortTraffic, sort_traffic
from tests.proto.stun.strategies import attributes, messages

TXID = bytes(range(12))


def _message(parts: tuple[Class, int, bytes, tuple[object, ...]]) -> Message:
    cls, method, txid, attrs = parts
    return Message(cls, method, txid, attrs)  # type: ignore[arg-type]


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_decode_or_decode_error(data: bytes) -> None:
    try:
        msg = decode(data)
    except DecodeError as exc:
        assert exc.reason
    else:
        assert isinstance(msg, Message)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=120), st.sampled_from([0x0001, 0x0101, 0x0017]))
def test_random_attribute_area_decode_or_decode_error(body: bytes, mtype: int) -> None:
    # Random attribute bytes behind a valid header reach the attribute decoders.
    body = body[: len(body) & ~3]
    data = struct.pack("!HHI", mtype, len(body), MAGIC_COOKIE) + TXID + body
    try:
        decode(data)
    except DecodeError:
        pass


@settings(max_examples=300, deadline=None)
@given(messages)
def test_round_trip(parts: tuple[Class, int, bytes, tuple[object, ...]]) -> None:
    msg = _message(parts)
    assert decode(encode(msg)) == msg


@settings(max_examples=200, deadline=None)
@given(messages, st.binary(min_size=1, max_size=20), st.booleans())
def test_round_trip_with_integrity_and_fingerprint(
    parts: tuple[Class, int, bytes, tuple[object, ...]], key: bytes, fp: bool
) -> None:
    msg = _message(parts)
    wire = encode(msg, integrity_key=key, fingerprint=fp)
    assert check_message_integrity(wire, key)
    assert check_fingerprint(wire) is fp
    back = decode(wire)
    assert back.attributes[: len(msg.attributes)] == msg.attributes
    assert isinstance(back.attributes[len(msg.attributes)], MessageIntegrity)


@settings(deadline=None)
@given(attributes)
def test_attribute_value_round_trip(attr: object) -> None:
    from crossroads.proto.stun.attributes import Attribute

    assert isinstance(attr, Attribute)
    if isinstance(attr, UnknownAttribute):
        return
    key = b"\x21\x12\xa4\x42" + TXID
    assert type(attr).decode_value(attr.encode_value(key), key) == attr


def test_message_type_interleaving() -> None:
    # RFC 8489 §5 and reference §3.2.
    assert message_type(Method.BINDING, Class.REQUEST) == 0x0001
    assert message_type(Method.BINDING, Class.INDICATION) == 0x0011
    assert message_type(Method.BINDING, Class.SUCCESS) == 0x0101
    assert message_type(Method.BINDING, Class.ERROR) == 0x0111
    assert message_type(Method.SEND, Class.INDICATION) == 0x0016
    assert message_type(Method.DATA, Class.INDICATION) == 0x0017
    assert message_type(Method.ALLOCATE, Class.ERROR) == 0x0113
    for mtype in range(0x4000):
        method, cls = split_message_type(mtype)
        assert message_type(method, cls) == mtype


def test_peek_and_demux_helpers() -> None:
    wire = encode(request(Method.ALLOCATE, TXID))
    header = peek_header(wire)
    assert header is not None
    assert header.method == Method.ALLOCATE and header.msg_class == Class.REQUEST
    assert header.transaction_id == TXID and header.magic and header.length == 0
    assert is_stun(wire) and not is_channel_data(wire)
    assert is_channel_data(b"\x40\x00\x00\x00") and not is_stun(b"\x40" * 20)
    assert peek_header(b"\x40" + wire[1:]) is None
    assert peek_header(wire[:19]) is None
    assert int.from_bytes(wire[:2], "big") != BINDING_REQUEST


def test_stream_frame_length() -> None:
    wire = encode(request(Method.BINDING, TXID, [Software("x")]))
    assert stream_frame_length(wire[:3]) is None
    assert stream_frame_length(wire[:4]) == len(wire)
    assert stream_frame_length(b"\x40\x00\x00\x05") == 12  # ChannelData padded
    assert stream_frame_length(b"\x40\x00\x00\x08") == 12
    with pytest.raises(DecodeError):
        stream_frame_length(b"\x80\x00\x00\x00")
    with pytest.raises(DecodeError):
        stream_frame_length(b"\x00\x01\x00\x03")


def test_decode_errors_have_reasons() -> None:
    good = encode(request(Method.BINDING, TXID, [Software("abc")]), fingerprint=True)
    cases = {
        "short": good[:19],
        "not-stun": b"\x80" + good[1:],
        "bad-length": good + b"\0\0\0\0",
        "bad-fingerprint": good[:-1] + bytes([good[-1] ^ 1]),
    }
    for reason, data in cases.items():
        with pytest.raises(DecodeError) as info:
            decode(data)
        assert info.value.reason == reason
    # Attribute overrunning the message.
    bad = struct.pack("!HHI", 1, 8, MAGIC_COOKIE) + TXID + struct.pack("!HH", 0x8022, 8)
    with pytest.raises(DecodeError) as info:
        decode(bad + b"abcd")
    assert info.value.reason == "truncated"
    # Malformed known attribute (XOR-MAPPED-ADDRESS with family 7).
    bad = struct.pack("!HHI", 1, 12, MAGIC_COOKIE) + TXID
    bad += struct.pack("!HHBBH", 0x0020, 8, 0, 7, 1) + b"\0\0\0\0"
    with pytest.raises(DecodeError) as info:
        decode(bad)
    assert info.value.reason == "bad-attribute"


def test_fingerprint_must_be_last() -> None:
    wire = encode(request(Method.BINDING, TXID), fingerprint=True)
    tail = struct.pack("!HH", 0x8022, 0)
    bad = bytearray(wire + tail)
    struct.pack_into("!H", bad, 2, len(bad) - 20)
    with pytest.raises(DecodeError) as info:
        decode(bytes(bad))
    assert info.value.reason == "fingerprint-not-last"


def test_attributes_after_integrity_are_ignored() -> None:
    wire = encode(request(Method.BINDING, TXID, [Software("a")]), integrity_key=b"k")
    extra = struct.pack("!HH", 0x8022, 4) + b"evil"
    bad = bytearray(wire + extra)
    struct.pack_into("!H", bad, 2, len(bad) - 20)
    msg = decode(bytes(bad))
    assert msg.get_all(Software) == [Software("a")]
    assert check_message_integrity(bytes(bad), b"k")


def test_unknown_comprehension_required_and_420() -> None:
    req = request(
        Method.BINDING,
        TXID,
        [UnknownAttribute(0x7777, b"ab"), UnknownAttribute(0xC001, b""), Software("s")],
    )
    msg = decode(encode(req))
    assert msg.unknown_comprehension_required() == (0x7777,)
    answer = decode(encode(unknown_attributes_response(msg, [0x7777])))
    assert answer.msg_class is Class.ERROR
    assert answer.error == ErrorCodeAttribute(420, "Unknown Attribute")
    assert answer.get(UnknownAttributes) == UnknownAttributes((0x7777,))


def test_rfc3489_message_keeps_its_cookie() -> None:
    raw = struct.pack("!HHI", 0x0001, 0, 0xDEADBEEF) + TXID
    msg = decode(raw)
    assert msg.is_rfc3489 and msg.cookie == 0xDEADBEEF
    reply = success_response(msg, [XorMappedAddress("192.0.2.1", 5)])
    assert encode(reply)[4:20] == raw[4:20]


def test_error_response_and_encode_errors() -> None:
    req = request(Method.REFRESH, TXID)
    err = error_response(req, ErrorCode.ALLOCATION_MISMATCH)
    assert decode(encode(err)).error == ErrorCodeAttribute(437, "Allocation Mismatch")
    with pytest.raises(LocalProtocolError):
        encode(Message(Class.REQUEST, 1, b"short"))
    with pytest.raises(LocalProtocolError):
        encode(request(Method.BINDING, TXID, [ErrorCodeAttribute(200, "")]))
    with pytest.raises(LocalProtocolError):
        encode(
            request(
                Method.BINDING,
                TXID,
                [ChangeRequest(), Fingerprint(1)] * 0
                + [XorMappedAddress("not-an-ip", 1)],
            )
        )


def test_encode_replaces_stale_integrity_and_fingerprint() -> None:
    msg = request(Method.BINDING, TXID, [MessageIntegrity(b"\0" * 20), Fingerprint(0)])
    wire = encode(msg, integrity_key=b"key", fingerprint=True)
    assert check_message_integrity(wire, b"key") and check_fingerprint(wire)
    types = [a.get_type() for a in decode(wire).attributes]
    assert types == [AttrType.MESSAGE_INTEGRITY, AttrType.FINGERPRINT]


@pytest.mark.parametrize("msg_class", list(Class))
def test_sort_traffic_sends_every_binding_class_to_the_stun_server(
    msg_class: Class,
) -> None:
    wire = encode(Message(msg_class, Method.BINDING, TXID, ()))
    assert sort_traffic(wire) is PortTraffic.BINDING
    other = encode(Message(msg_class, Method.ALLOCATE, TXID, ()))
    assert sort_traffic(other) is PortTraffic.STUN


@given(st.binary(min_size=2, max_size=40))
def test_sort_traffic_agrees_with_the_demux_helpers(data: bytes) -> None:
    kind = sort_traffic(data)
    first_bits = data[0] >> 6
    assert (kind in (PortTraffic.BINDING, PortTraffic.STUN)) == (first_bits == 0)
    assert (kind is PortTraffic.CHANNEL_DATA) == (first_bits == 1)
    assert (kind is PortTraffic.OTHER) == (first_bits >= 2)
    method, _ = split_message_type(int.from_bytes(data[:2], "big") & 0x3FFF)
    assert (kind is PortTraffic.BINDING) == (
        first_bits == 0 and method == Method.BINDING
    )


def test_sort_traffic_of_an_empty_datagram_raises_index_error() -> None:
    with pytest.raises(IndexError):
        sort_traffic(b"")


def test_error_code_values_byte_for_byte() -> None:
    # RFC 8489 §14.8: reserved (21 bits), class (3 bits), number (8 bits), reason;
    # RFC 8656 §18.12: the same with the family in the first byte.
    error = ErrorCodeAttribute(438, "Stale Nonce")
    assert error.encode_value(b"") == b"\x00\x00\x04\x26Stale Nonce"
    address_error = AddressErrorCode(2, 440, "no v6")
    assert address_error.encode_value(b"") == b"\x02\x00\x04\x28no v6"
    # The class is the low 3 bits of its byte: set reserved bits are ignored.
    assert ErrorCodeAttribute.decode_value(b"\xff\xff\xfc\x26x", b"") == (
        ErrorCodeAttribute(438, "x")
    )
    assert AddressErrorCode.decode_value(b"\x01\x00\x04\x28", b"") == (
        AddressErrorCode(1, 440, "")
    )
    for bad in (
        b"\x00\x00\x04",
        b"\x00\x00\x02\x00",
        b"\x00\x00\x04\x64",
        b"\0\0\4\0\xff",
    ):
        with pytest.raises(DecodeError):
            ErrorCodeAttribute.decode_value(bad, b"")
        with pytest.raises(DecodeError):
            AddressErrorCode.decode_value(bad, b"")
