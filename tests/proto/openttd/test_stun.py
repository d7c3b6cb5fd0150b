from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crossroads.errors import DecodeError
from crossroads.proto.openttd.stun import (
    StunRequest,
    decode_stun_packet,
    encode_stun_packet,
)
from crossroads.proto.openttd.wire import PacketSplitter
from tests.proto.openttd.strategies import text

# SERCLI_STUN for IPv4 from the 13.0 binary (reference section 8).
GOLDEN = bytes.fromhex("0a000006") + b"Ctok\0" + b"\x02"


def test_golden_stun_packet() -> None:
    [(packet_type, payload)] = PacketSplitter().feed(GOLDEN)
    assert decode_stun_packet(packet_type, payload) == StunRequest(6, "Ctok", 2)
    assert encode_stun_packet(StunRequest(6, "Ctok", 2)) == GOLDEN


@pytest.mark.parametrize("version", [1, 2, 7])
def test_stun_needs_protocol_3_to_6(version: int) -> None:
    with pytest.raises(DecodeError):
        decode_stun_packet(0, bytes([version]) + b"tok\0\x02")


def test_other_types_are_rejected() -> None:
    with pytest.raises(DecodeError):
        decode_stun_packet(1, b"\x06tok\0\x02")


@given(st.builds(StunRequest, st.integers(3, 6), text(63), st.integers(0, 255)))
def test_round_trip(request: StunRequest) -> None:
    [(packet_type, payload)] = PacketSplitter().feed(encode_stun_packet(request))
    assert decode_stun_packet(packet_type, payload) == request


@given(st.integers(0, 3), st.binary(max_size=100))
def test_random_bytes(packet_type: int, payload: bytes) -> None:
    try:
        decode_stun_packet(packet_type, payload)
    except DecodeError:
        pass
