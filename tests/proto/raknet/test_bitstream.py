"""RakNet BitStream rules against captured bytes, and fuzzed."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crossroads.errors import DecodeError
from crossroads.proto.raknet.bitstream import BitReader, BitWriter


def test_nat_type_detection_request_from_the_capture() -> None:
    # reference §0: id 96, bool isRequest=1 (one bit), u16 c2Port 32958 unaligned
    writer = BitWriter()
    writer.write_u8(96)
    writer.write_bool(True)
    writer.write_u16(32958)
    assert writer.data() == bytes.fromhex("60c05f00")
    reader = BitReader(bytes.fromhex("60c05f00"))
    assert (reader.read_u8(), reader.read_bool(), reader.read_u16()) == (
        96,
        True,
        32958,
    )


def test_system_address_is_inverted_ip_and_big_endian_port() -> None:
    writer = BitWriter()
    writer.write_address(("203.0.113.1", 61111))
    writer.write_address(("0.0.0.0", 0))
    data = writer.data()
    assert data == bytes.fromhex("0434ff8efeeeb7") + bytes.fromhex("04ffffffff0000")
    reader = BitReader(data)
    assert reader.read_address() == ("203.0.113.1", 61111)
    assert reader.read_address() == ("0.0.0.0", 0)


def test_u24_is_little_endian_and_aligned() -> None:
    writer = BitWriter()
    writer.write_bool(True)
    writer.write_u24le(0x010203)
    assert writer.data() == bytes.fromhex("80030201")
    reader = BitReader(writer.data())
    assert reader.read_bool() and reader.read_u24le() == 0x010203


def test_rakstring_length_then_aligned_bytes() -> None:
    writer = BitWriter()
    writer.write_bool(False)
    writer.write_rakstring(b"203.0.113.3")
    reader = BitReader(writer.data())
    assert not reader.read_bool()
    assert reader.read_rakstring() == b"203.0.113.3"


Op = st.one_of(
    st.tuples(st.just("bool"), st.booleans()),
    st.tuples(st.just("u8"), st.integers(0, 2**8 - 1)),
    st.tuples(st.just("u16"), st.integers(0, 2**16 - 1)),
    st.tuples(st.just("u32"), st.integers(0, 2**32 - 1)),
    st.tuples(st.just("u64"), st.integers(0, 2**64 - 1)),
    st.tuples(st.just("u24le"), st.integers(0, 2**24 - 1)),
    st.tuples(st.just("bytes"), st.binary(max_size=20)),
    st.tuples(
        st.just("address"),
        st.tuples(st.ip_addresses(v=4).map(str), st.integers(0, 65535)),
    ),
)


@given(st.lists(Op, max_size=20))
def test_what_is_written_reads_back(ops: list[tuple[str, object]]) -> None:
    writer = BitWriter()
    for kind, value in ops:
        if kind == "bytes":
            assert isinstance(value, bytes)
            writer.write_bytes(value)
        else:
            getattr(writer, f"write_{kind}")(value)
    reader = BitReader(writer.data())
    for kind, value in ops:
        if kind == "bytes":
            assert isinstance(value, bytes)
            assert reader.read_bytes(len(value)) == value
        else:
            assert getattr(reader, f"read_{kind}")() == value


@given(
    st.binary(max_size=40),
    st.lists(
        st.sampled_from(
            [
                "bool",
                "u8",
                "u16",
                "u32",
                "u64",
                "u24le",
                "address",
                "rakstring",
                "align",
            ]
        ),
        max_size=12,
    ),
)
def test_random_bytes_read_or_raise_decode_error(data: bytes, reads: list[str]) -> None:
    reader = BitReader(data)
    try:
        for kind in reads:
            if kind == "align":
                reader.align()
            else:
                getattr(reader, f"read_{kind}")()
    except DecodeError:
        pass


def test_reading_past_the_end_is_a_decode_error() -> None:
    with pytest.raises(DecodeError):
        BitReader(b"\x01").read_u16()
