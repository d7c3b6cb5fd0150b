"""The shared binary message reader and 16-byte addresses (crossroads.proto.binary):
every read is bounds-checked, random input gives values or DecodeError only."""

from __future__ import annotations

from typing import ClassVar, Literal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crossroads.errors import DecodeError
from crossroads.proto.binary import (
    ByteReader,
    length_prefixed,
    pack_ip16,
    unpack_ip16,
)


class LittleReader(ByteReader):
    __slots__ = ()
    PROTOCOL: ClassVar[str] = "test"
    BYTEORDER: ClassVar[Literal["big", "little"]] = "little"
    TRUNCATED: ClassVar[str] = "short"


def test_fields_in_order_then_finish() -> None:
    reader = ByteReader(b"\x01\x02\x03" + length_prefixed(2, b"abc") + b"\xff")
    assert reader.uint(1) == 1
    assert reader.uint(2) == 0x0203
    assert reader.vector(2, maximum=3) == b"abc"
    assert reader.remaining() == 1 and not reader.done()
    with pytest.raises(DecodeError) as trailing:
        reader.finish()
    assert trailing.value.reason == "trailing"
    assert reader.take(1) == b"\xff" and reader.done()
    reader.finish()


def test_reasons_and_byte_order_are_the_protocols() -> None:
    with pytest.raises(DecodeError) as short:
        LittleReader(b"\x01").uint(2)
    assert short.value.reason == "short" and "test" in str(short.value)
    assert LittleReader(b"\x01\x02").uint(2) == 0x0201
    with pytest.raises(DecodeError) as long:
        ByteReader(length_prefixed(1, b"abcd")).vector(1, maximum=3)
    assert long.value.reason == "too-long"
    assert ByteReader(b"xx\x01", pos=2).uint(1) == 1


@given(
    st.binary(max_size=64),
    st.lists(st.tuples(st.sampled_from("tuvf"), st.integers(0, 4)), max_size=12),
)
def test_random_reads_of_random_bytes_never_over_read(
    data: bytes, reads: list[tuple[str, int]]
) -> None:
    reader = ByteReader(data)
    try:
        for op, size in reads:
            before = reader.pos
            if op == "t":
                assert len(reader.take(size)) == size
            elif op == "u":
                assert 0 <= reader.uint(size) < 256**size
            elif op == "v":
                reader.vector(max(size, 1), maximum=16)
            else:
                reader.finish()
            assert before <= reader.pos <= len(data)
    except DecodeError as exc:
        assert exc.reason in ("truncated", "too-long", "trailing")


@pytest.mark.parametrize(
    ("host", "packed"),
    [
        ("192.0.2.1", bytes(10) + b"\xff\xff\xc0\x00\x02\x01"),
        ("2001:db8::1", bytes.fromhex("20010db8000000000000000000000001")),
    ],
)
def test_16_byte_addresses_map_ipv4(host: str, packed: bytes) -> None:
    assert pack_ip16(host) == packed
    assert unpack_ip16(packed) == host


@given(st.ip_addresses())
def test_16_byte_addresses_round_trip(ip: object) -> None:
    host = str(ip)
    assert len(pack_ip16(host)) == 16
    assert unpack_ip16(pack_ip16(host)) == host or host.startswith("::ffff:")
