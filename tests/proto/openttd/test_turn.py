from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crossroads.errors import DecodeError
from crossroads.proto.openttd.turn import (
    TurnConnect,
    TurnConnected,
    TurnError,
    decode_turn_connect,
    decode_turn_reply,
    encode_turn_packet,
)
from crossroads.proto.openttd.wire import PacketSplitter
from tests.proto.openttd.strategies import text


def split(data: bytes) -> tuple[int, bytes]:
    [(packet_type, payload)] = PacketSplitter().feed(data)
    return packet_type, payload


def test_layouts() -> None:
    ticket = "0123456789abcdef:fedcba9876543210"
    assert encode_turn_packet(TurnConnect(6, ticket)) == (
        (3 + 1 + len(ticket) + 1).to_bytes(2, "little")
        + b"\x01\x06"
        + ticket.encode()
        + b"\0"
    )
    assert encode_turn_packet(TurnConnected("127.0.0.1")) == b"\x0d\x00\x02127.0.0.1\0"
    assert encode_turn_packet(TurnError()) == b"\x03\x00\x00"


@pytest.mark.parametrize("version", [3, 4, 7])
def test_turn_needs_protocol_5_or_6(version: int) -> None:
    with pytest.raises(DecodeError):
        decode_turn_connect(1, bytes([version]) + b"a:b\0")


@given(st.builds(TurnConnect, st.integers(5, 6), text(63)))
def test_connect_round_trip(message: TurnConnect) -> None:
    assert decode_turn_connect(*split(encode_turn_packet(message))) == message


@given(st.one_of(st.builds(TurnConnected, text(79)), st.just(TurnError())))
def test_reply_round_trip(message: TurnConnected | TurnError) -> None:
    assert decode_turn_reply(*split(encode_turn_packet(message))) == message


@given(st.integers(0, 4), st.binary(max_size=100))
def test_random_bytes(packet_type: int, payload: bytes) -> None:
    for decoder in (decode_turn_connect, decode_turn_reply):
        try:
            decoder(packet_type, payload)
        except DecodeError:
            pass
