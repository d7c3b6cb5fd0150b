from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crossroads.client.openttd import server_game_info_packet
from crossroads.errors import DecodeError
from crossroads.proto.openttd.game import CLIENT_GAME_INFO, decode_server_game_info
from crossroads.proto.openttd.gameinfo import GameInfo
from crossroads.proto.openttd.wire import PacketSplitter


def test_probe_request_is_an_empty_type_7_packet() -> None:
    assert CLIENT_GAME_INFO == b"\x03\x00\x07"


def test_server_game_info_decodes() -> None:
    info = GameInfo(server_name="probe me", server_revision="13.0", dedicated=True)
    [(packet_type, payload)] = PacketSplitter().feed(server_game_info_packet(info))
    assert packet_type == 6
    assert decode_server_game_info(packet_type, payload).info == info


def test_other_packets_are_not_game_info() -> None:
    with pytest.raises(DecodeError):
        decode_server_game_info(3, b"")


@given(st.binary(max_size=200))
def test_random_bytes(payload: bytes) -> None:
    try:
        decode_server_game_info(6, payload)
    except DecodeError:
        pass
