from __future__ import annotations

from enum import IntEnum

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crossroads.errors import DecodeError, LocalProtocolError
from crossroads.proto.openttd.wire import (
    TCP_MTU,
    PacketSplitter,
    Reader,
    Writer,
    packet,
)


def test_splitter_cuts_packets_fed_byte_by_byte() -> None:
    stream = packet(1, b"abc") + packet(2) + packet(3, b"\x00" * 10)
    splitter = PacketSplitter()
    got = []
    for byte in stream:
        got += splitter.feed(bytes([byte]))
    assert got == [(1, b"abc"), (2, b""), (3, b"\x00" * 10)]
    assert splitter.pending == 0


def test_splitter_keeps_a_partial_packet() -> None:
    splitter = PacketSplitter()
    assert splitter.feed(packet(5, b"hello")[:4]) == []
    assert splitter.pending == 4
    assert splitter.feed(b"ello") == [(5, b"hello")]
    assert splitter.take_remaining() == b""


@pytest.mark.parametrize("size", [0, 1, 2, TCP_MTU + 1, 0xFFFF])
def test_impossible_sizes_are_decode_errors(size: int) -> None:
    with pytest.raises(DecodeError) as info:
        PacketSplitter().feed(size.to_bytes(2, "little") + b"\x00" * 8)
    assert info.value.reason == "bad-size"


def test_a_lower_limit_applies() -> None:
    with pytest.raises(DecodeError):
        PacketSplitter(max_size=100).feed(packet(1, b"x" * 100))


@given(st.lists(st.binary(max_size=64), max_size=20))
def test_random_streams_give_packets_or_decode_error(chunks: list[bytes]) -> None:
    splitter = PacketSplitter()
    try:
        for chunk in chunks:
            for packet_type, payload in splitter.feed(chunk):
                assert 0 <= packet_type <= 255
                assert len(payload) <= TCP_MTU - 3
    except DecodeError:
        pass


@given(st.lists(st.tuples(st.integers(0, 255), st.binary(max_size=300)), max_size=10))
def test_packets_survive_any_chunking(packets: list[tuple[int, bytes]]) -> None:
    stream = b"".join(packet(t, p) for t, p in packets)
    splitter = PacketSplitter()
    got = []
    for i in range(0, len(stream), 7):
        got += splitter.feed(stream[i : i + 7])
    assert got == packets


def test_reader_fields_and_end() -> None:
    data = (
        Writer(0)
        .u8(7)
        .u16(0x1234)
        .u32(0xDEADBEEF)
        .u64(2**63)
        .boolean(True)
        .string("héllo", 10)
        .raw(b"\x01\x02")
        .payload()
    )
    r = Reader(data)
    assert (r.u8(), r.u16(), r.u32(), r.u64(), r.boolean()) == (
        7,
        0x1234,
        0xDEADBEEF,
        2**63,
        True,
    )
    assert r.string(10) == "héllo"
    assert r.raw(2) == b"\x01\x02"
    r.end()


def test_reader_errors() -> None:
    with pytest.raises(DecodeError, match="truncated") as short:
        Reader(b"\x01").u16()
    assert short.value.reason == "short"
    with pytest.raises(DecodeError, match="NUL"):
        Reader(b"abc").string(10)
    with pytest.raises(DecodeError, match="exceeds"):
        Reader(b"abcdef\0").string(6)
    with pytest.raises(DecodeError, match="UTF-8"):
        Reader(b"\xff\0").string(10)
    with pytest.raises(DecodeError, match="boolean"):
        Reader(b"\x02").boolean()
    r = Reader(b"\0x")
    assert r.string(5) == ""
    with pytest.raises(DecodeError, match="trailing") as trailing:
        r.end()
    assert trailing.value.reason == "trailing-bytes"


def test_free_text_is_truncated_like_openttd() -> None:
    assert Reader(b"abcdef\0").string(4, truncate=True) == "abc"
    # A cut inside a multi-byte character drops that character.
    assert Reader("aé".encode() + b"\0").string(3, truncate=True) == "a"


def test_writer_refuses_what_the_peer_would_refuse() -> None:
    with pytest.raises(LocalProtocolError):
        Writer(0).string("x" * 10, 10)
    with pytest.raises(LocalProtocolError):
        Writer(0).string("a\0b", 10)
    with pytest.raises(LocalProtocolError):
        Writer(0).u8(256)
    with pytest.raises(LocalProtocolError):
        Writer(0).raw(b"x" * TCP_MTU).finish()


def test_writer_header_counts_the_whole_packet() -> None:
    assert Writer(3).u8(1).finish() == b"\x04\x00\x03\x01"
    assert packet(7) == b"\x03\x00\x07"


def test_reader_u8_enum() -> None:
    class Colour(IntEnum):
        RED = 0
        BLUE = 3

    assert Reader(b"\x03").u8_enum(Colour, "bad-colour") is Colour.BLUE
    with pytest.raises(DecodeError, match="Colour 2") as bad:
        Reader(b"\x02").u8_enum(Colour, "bad-colour")
    assert bad.value.reason == "bad-colour"
