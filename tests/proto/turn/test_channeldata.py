"""ChannelData framing and the TURN-over-TCP stream framer."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crossroads.errors import DecodeError
from crossroads.proto.turn.channeldata import (
    ChannelData,
    StreamFramer,
    encode_channel_data,
    is_channel_data,
    padded_length,
    parse_channel_data,
)

channels = st.integers(0x4000, 0x7FFF)
payloads = st.binary(max_size=300)


@given(st.binary(max_size=80))
def test_random_bytes_decode_or_decode_error(data: bytes) -> None:
    try:
        message = parse_channel_data(data)
    except DecodeError as exc:
        assert exc.reason in {"short", "not-channel-data", "truncated", "trailing"}
    else:
        assert isinstance(message, ChannelData)
        assert 0x4000 <= message.channel <= 0x7FFF


@given(channels, payloads, st.booleans())
def test_round_trip(channel: int, payload: bytes, pad: bool) -> None:
    wire = encode_channel_data(channel, payload, pad=pad)
    assert parse_channel_data(wire) == ChannelData(channel, payload)
    if pad:
        assert len(wire) % 4 == 0
    assert is_channel_data(wire[0])


def test_truncated_and_oversized_claims() -> None:
    wire = encode_channel_data(0x4001, b"hello")
    with pytest.raises(DecodeError) as excinfo:
        parse_channel_data(wire[:-1])
    assert excinfo.value.reason == "truncated"
    with pytest.raises(DecodeError) as excinfo:
        parse_channel_data(wire[:3])
    assert excinfo.value.reason == "short"
    # Length field says 0xFFFF, only 5 bytes follow: truncated, not a crash.
    with pytest.raises(DecodeError):
        parse_channel_data(b"\x40\x01\xff\xff" + b"hello")
    with pytest.raises(DecodeError) as excinfo:
        parse_channel_data(wire + b"\x00" * 4)
    assert excinfo.value.reason == "trailing"
    assert parse_channel_data(wire + b"\x00" * 3).data == b"hello"


def test_encode_refuses_bad_channel() -> None:
    with pytest.raises(ValueError):
        encode_channel_data(0x3FFF, b"")
    with pytest.raises(ValueError):
        encode_channel_data(0x4000, b"x" * 65536)


def test_padded_length() -> None:
    assert [padded_length(n) for n in range(6)] == [0, 4, 4, 4, 4, 8]


def stun_message(body_len: int) -> bytes:
    return (
        b"\x00\x01"
        + body_len.to_bytes(2, "big")
        + b"\x21\x12\xa4\x42"
        + bytes(12)
        + bytes(body_len)
    )


@given(
    st.lists(
        st.one_of(
            st.tuples(st.just(True), channels, payloads),
            st.tuples(
                st.just(False),
                st.just(0),
                st.integers(0, 40).map(lambda n: bytes(n * 4)),
            ),
        ),
        max_size=12,
    ),
    st.data(),
)
def test_framer_reassembles_any_split(
    messages: list[tuple[bool, int, bytes]], data: st.DataObject
) -> None:
    wire = b""
    expected: list[tuple[bool, bytes]] = []
    for is_channel, channel, body in messages:
        if is_channel:
            wire += encode_channel_data(channel, body, pad=True)
            expected.append((True, encode_channel_data(channel, body)))
        else:
            message = stun_message(len(body))
            wire += message
            expected.append((False, message))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=6)))
    framer = StreamFramer()
    got: list[tuple[bool, bytes]] = []
    last = 0
    for cut in [*cuts, len(wire)]:
        got += framer.feed(wire[last:cut])
        last = cut
    assert got == expected
    assert framer.buffered == 0


@given(st.binary(max_size=200))
def test_framer_random_bytes_frames_or_decode_error(data: bytes) -> None:
    framer = StreamFramer(max_message=1024)
    try:
        frames = framer.feed(data)
    except DecodeError as exc:
        assert exc.reason in {"bad-length", "framing", "too-large"}
    else:
        assert sum(len(f) for _, f in frames) <= len(data)
        assert framer.buffered <= len(data)


def test_framer_rejects_garbage_and_bounds_size() -> None:
    with pytest.raises(DecodeError):
        StreamFramer().feed(b"\x80\x00\x00\x00")
    with pytest.raises(DecodeError):
        StreamFramer(max_message=100).feed(b"\x40\x00\x01\x00")
    with pytest.raises(DecodeError):
        StreamFramer().feed(b"\x00\x01\x00\x03" + bytes(16))
