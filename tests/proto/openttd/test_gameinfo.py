from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crossroads.errors import DecodeError, LocalProtocolError
from crossroads.proto.openttd.gameinfo import (
    DAYS_TILL_1920,
    GameInfo,
    NewGRF,
    NewGRFSerialization,
    decode_game_info,
    encode_game_info,
    game_info_from_json,
    game_info_to_json,
)
from crossroads.proto.openttd.wire import Reader, Writer
from tests.proto.openttd.strategies import game_info

# Game info from the SERVER_UPDATE the Debian 13.0 binary sent
# (reference openttd-coordinator.md section 8), without the packet header
# and protocol byte.
GOLDEN_13_0 = (
    bytes.fromhex("06 01 ffffffff 00 00 1fde0a00 1fde0a00 0f 00 19".replace(" ", ""))
    + b"CaptureSrv\0"
    + b"13.0\0"
    + bytes.fromhex("00 19 00 00 0001 0001 00 01".replace(" ", ""))
)

GOLDEN_INFO = GameInfo(
    server_name="CaptureSrv",
    server_revision="13.0",
    use_password=False,
    clients_max=25,
    clients_on=0,
    spectators_on=0,
    map_width=256,
    map_height=256,
    landscape=0,
    dedicated=True,
    companies_max=15,
    companies_on=0,
    spectators_max=25,
    game_date=712223,
    start_date=712223,
)


def encode(
    info: GameInfo,
    version: int,
    nst: NewGRFSerialization = NewGRFSerialization.GRFID_MD5,
    lookup: dict[tuple[int, bytes], int] | None = None,
) -> bytes:
    w = Writer(0)
    encode_game_info(w, info, version, nst, lookup)
    return w.payload()


def decode(data: bytes, lookup: dict[int, NewGRF] | None = None):  # type: ignore[no-untyped-def]
    r = Reader(data)
    decoded = decode_game_info(r, lookup)
    r.end()
    return decoded


def test_golden_13_0_decodes() -> None:
    decoded = decode(GOLDEN_13_0)
    assert decoded.version == 6
    assert decoded.serialization is NewGRFSerialization.GRFID_MD5_NAME
    assert decoded.info == GOLDEN_INFO
    assert decoded.info.estimated_ticks_playing == 0


def test_golden_13_0_encodes_byte_for_byte() -> None:
    assert encode(GOLDEN_INFO, 6, NewGRFSerialization.GRFID_MD5_NAME) == GOLDEN_13_0


def test_version_7_prepends_ticks() -> None:
    info = GameInfo(server_name="x", ticks_playing=1234)
    data = encode(info, 7)
    assert data[0] == 7 and int.from_bytes(data[1:9], "little") == 1234
    assert decode(data).info == info


def test_versions_below_7_estimate_ticks_from_dates() -> None:
    info = decode(encode(GameInfo(game_date=1010, start_date=1000), 6)).info
    assert info.ticks_playing is None
    assert info.estimated_ticks_playing == 10 * 74


def test_old_versions_carry_16_bit_dates_since_1920() -> None:
    info = GameInfo(game_date=DAYS_TILL_1920 + 500, start_date=DAYS_TILL_1920)
    data = encode(info, 2)
    assert decode(data).info.game_date == DAYS_TILL_1920 + 500
    # Dates before 1920 or past the uint16 range are clamped, not wrapped.
    clamped = decode(encode(GameInfo(game_date=10, start_date=10**7), 1)).info
    assert clamped.game_date == DAYS_TILL_1920
    assert clamped.start_date == DAYS_TILL_1920 + 0xFFFF


def test_lookup_ids_need_the_table() -> None:
    grf = NewGRF(0x12345678, bytes(range(16)), "Some set")
    data = encode(
        GameInfo(newgrfs=(grf,)), 6, NewGRFSerialization.LOOKUP_ID, {grf.key: 42}
    )
    with pytest.raises(DecodeError):
        decode(data)
    with pytest.raises(DecodeError):
        decode(data, {41: grf})
    assert decode(data, {42: grf}).info.newgrfs == (grf,)
    with pytest.raises(LocalProtocolError):
        encode(GameInfo(newgrfs=(grf,)), 6, NewGRFSerialization.LOOKUP_ID, {})


def test_unknown_version_and_nst_are_decode_errors() -> None:
    with pytest.raises(DecodeError):
        decode(b"\x08" + GOLDEN_13_0[1:])
    with pytest.raises(DecodeError):
        decode(b"\x06\x03" + GOLDEN_13_0[2:])


@pytest.mark.parametrize("version", range(1, 8))
def test_every_version_round_trips(version: int) -> None:
    @settings(max_examples=40, deadline=None)
    @given(game_info(version, with_names=False))
    def check(info: GameInfo) -> None:
        decoded = decode(encode(info, version))
        assert decoded.version == version
        assert decoded.info == info

    check()


@pytest.mark.parametrize("version", [6, 7])
def test_names_and_lookup_ids_round_trip(version: int) -> None:
    @settings(max_examples=40, deadline=None)
    @given(game_info(version, with_names=True))
    def check(info: GameInfo) -> None:
        named = decode(encode(info, version, NewGRFSerialization.GRFID_MD5_NAME))
        assert named.info == info
        ids = {g.key: i for i, g in enumerate(info.newgrfs)}
        table = {i: g for i, g in enumerate(info.newgrfs)}
        looked_up = decode(
            encode(info, version, NewGRFSerialization.LOOKUP_ID, ids), table
        )
        assert looked_up.info.newgrfs == tuple(table[ids[g.key]] for g in info.newgrfs)

    check()


@given(st.binary(max_size=400))
def test_random_bytes_decode_or_raise_decode_error(data: bytes) -> None:
    try:
        decode(data, {})
    except DecodeError:
        pass


@settings(max_examples=40, deadline=None)
@given(game_info(7))
def test_json_round_trip(info: GameInfo) -> None:
    assert game_info_from_json(game_info_to_json(info)) == info


def test_json_form_names_every_field() -> None:
    # Store records of other instances (and older releases) carry this form:
    # every GameInfo field under its own name, NewGRFs as hex strings.
    grf = NewGRF(0x4D470102, bytes(range(16)), "OpenGFX+")
    expected: dict[str, object] = {
        "server_name": "s",
        "server_revision": "14.1",
        "use_password": True,
        "clients_max": 1,
        "clients_on": 2,
        "spectators_on": 3,
        "map_width": 4,
        "map_height": 5,
        "landscape": 2,
        "dedicated": True,
        "companies_max": 6,
        "companies_on": 7,
        "spectators_max": 8,
        "game_date": 9,
        "start_date": 10,
        "newgrfs": [
            {"grfid": "4d470102", "md5": bytes(range(16)).hex(), "name": "OpenGFX+"}
        ],
        "gamescript_version": 11,
        "gamescript_name": "gs",
        "ticks_playing": 12,
    }
    # Each value differs from its field's default, so a field missing from
    # either direction shows.
    scalars = {key: value for key, value in expected.items() if key != "newgrfs"}
    info = GameInfo(newgrfs=(grf,), **scalars)  # type: ignore[arg-type]
    assert game_info_to_json(info) == expected
    assert game_info_from_json(expected) == info
    with pytest.raises(ValueError, match="map_width"):
        game_info_from_json({**expected, "map_width": True})
