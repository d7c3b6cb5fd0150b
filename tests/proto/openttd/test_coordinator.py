from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crossroads.errors import DecodeError, LocalProtocolError
from crossroads.proto.openttd.coordinator import (
    COORDINATOR_VERSION,
    LISTING_MAX_PER_PACKET,
    ClientConnect,
    ClientConnected,
    ClientListing,
    ConnectFailed,
    ConnectionType,
    ErrorType,
    GcConnectFailed,
    GcConnecting,
    GcDirectConnect,
    GcError,
    GcListing,
    GcMessage,
    GcNewgrfLookup,
    GcRegisterAck,
    GcStunConnect,
    GcStunRequest,
    GcTurnConnect,
    ListingEntry,
    PacketType,
    PeerMessage,
    ServerRegister,
    ServerUpdate,
    StunResult,
    decode_gc_packet,
    decode_peer_packet,
    encode_gc_packet,
    encode_listing_entry,
    encode_peer_packet,
    error_for_version,
    listing_shape,
    newgrf_lookup_packets,
    pack_listing,
)
from crossroads.proto.openttd.gameinfo import GameInfo, NewGRF, NewGRFSerialization
from crossroads.proto.openttd.wire import COMPAT_MTU, TCP_MTU, PacketSplitter
from tests.proto.openttd.strategies import game_info, text, u8, u16, u32
from tests.proto.openttd.test_gameinfo import GOLDEN_13_0, GOLDEN_INFO


def split(data: bytes) -> tuple[int, bytes]:
    [(packet_type, payload)] = PacketSplitter().feed(data)
    return packet_type, payload


def h(text: str) -> bytes:
    return bytes.fromhex(text.replace(" ", ""))


# Captured from the Debian 13.0 binary (reference section 8).
GOLDEN_REGISTER = h("0900 01 06 01 950f 00 00")
GOLDEN_UPDATE = h("3100 03 06") + GOLDEN_13_0
GOLDEN_CONNECT = h("0c00 06 06") + b"+TestCd\0"
GOLDEN_STUN_RESULT_V6_FAILED = h("0b00 0d 06") + b"Ctok\0" + h("0a 00")
GOLDEN_STUN_RESULT_V4_OK = h("0b00 0d 06") + b"Ctok\0" + h("02 01")

GOLDEN = [
    (GOLDEN_REGISTER, ServerRegister(6, 1, 3989, "", "")),
    (
        GOLDEN_UPDATE,
        ServerUpdate(6, 6, NewGRFSerialization.GRFID_MD5_NAME, GOLDEN_INFO),
    ),
    (GOLDEN_CONNECT, ClientConnect(6, "+TestCd")),
    (GOLDEN_STUN_RESULT_V6_FAILED, StunResult(6, "Ctok", 10, False)),
    (GOLDEN_STUN_RESULT_V4_OK, StunResult(6, "Ctok", 2, True)),
]


@pytest.mark.parametrize(("wire", "message"), GOLDEN)
def test_golden_packets_from_openttd_13(wire: bytes, message: PeerMessage) -> None:
    assert decode_peer_packet(*split(wire)) == message
    assert encode_peer_packet(message) == wire


def test_register_ack_is_shaped_by_the_peer_version() -> None:
    ack = GcRegisterAck(ConnectionType.DIRECT, "+abcdefg", "s" * 64)
    assert encode_gc_packet(ack, 1) == h("0400 02 02")
    v6 = encode_gc_packet(ack, 6)
    assert v6 == h("4e00 02") + b"+abcdefg\0" + b"s" * 64 + b"\0" + h("02")
    assert decode_gc_packet(*split(v6), version=6) == ack
    assert decode_gc_packet(
        *split(encode_gc_packet(ack, 1)), version=1
    ) == GcRegisterAck(ConnectionType.DIRECT)


def test_packets_newer_than_the_peer_cannot_be_sent() -> None:
    with pytest.raises(LocalProtocolError):
        encode_gc_packet(GcTurnConnect("t", 1, "a:b", "h:1"), 4)
    with pytest.raises(LocalProtocolError):
        encode_gc_packet(GcStunRequest("t"), 2)
    with pytest.raises(LocalProtocolError):
        encode_gc_packet(GcConnecting("t", "+c"), 1)


def test_reuse_error_is_registration_failed_below_6() -> None:
    assert (
        error_for_version(ErrorType.REUSE_OF_INVITE_CODE, 6)
        is ErrorType.REUSE_OF_INVITE_CODE
    )
    assert (
        error_for_version(ErrorType.REUSE_OF_INVITE_CODE, 5)
        is ErrorType.REGISTRATION_FAILED
    )
    assert (
        error_for_version(ErrorType.INVALID_INVITE_CODE, 2)
        is ErrorType.INVALID_INVITE_CODE
    )


@pytest.mark.parametrize("version", [0, 7, 255])
def test_unknown_protocol_versions_are_decode_errors(version: int) -> None:
    payload = bytes([version]) + GOLDEN_REGISTER[4:]
    with pytest.raises(DecodeError) as info:
        decode_peer_packet(PacketType.SERVER_REGISTER, payload)
    assert info.value.reason == "version"


def test_packets_need_the_version_that_introduced_them() -> None:
    with pytest.raises(DecodeError):
        decode_peer_packet(PacketType.CLIENT_CONNECT, b"\x01+abc\0")
    with pytest.raises(DecodeError):
        decode_peer_packet(PacketType.SERCLI_STUN_RESULT, b"\x02tok\0\x02\x01")
    assert decode_peer_packet(
        PacketType.CLIENT_CONNECT, b"\x02+abc\0"
    ) == ClientConnect(2, "+abc")


def test_version_1_register_has_no_invite_fields() -> None:
    assert decode_peer_packet(
        PacketType.SERVER_REGISTER, b"\x01\x02\x10\x00"
    ) == ServerRegister(1, 2, 16)
    with pytest.raises(DecodeError):
        decode_peer_packet(PacketType.SERVER_REGISTER, b"\x01\x02\x10\x00\0\0")


def test_listing_cursor_arrived_in_4() -> None:
    assert decode_peer_packet(
        PacketType.CLIENT_LISTING, b"\x03\x06" + b"13.0\0"
    ) == ClientListing(3, 6, "13.0")
    assert decode_peer_packet(
        PacketType.CLIENT_LISTING, b"\x06\x06" + b"13.0\0" + b"\x05\x00\x00\x00"
    ) == ClientListing(6, 6, "13.0", 5)


def test_gc_types_are_not_accepted_from_peers_and_vice_versa() -> None:
    with pytest.raises(DecodeError):
        decode_peer_packet(PacketType.GC_REGISTER_ACK, b"\x06")
    with pytest.raises(DecodeError):
        decode_gc_packet(PacketType.SERVER_REGISTER, b"\x06")
    with pytest.raises(DecodeError):
        decode_peer_packet(17, b"")


def test_server_update_may_not_use_lookup_ids() -> None:
    with pytest.raises(DecodeError):
        decode_peer_packet(PacketType.SERVER_UPDATE, b"\x06\x06\x02" + GOLDEN_13_0[2:])


def test_listing_shape() -> None:
    assert listing_shape(6, 6) == (6, NewGRFSerialization.LOOKUP_ID)
    assert listing_shape(6, 9) == (7, NewGRFSerialization.LOOKUP_ID)
    assert listing_shape(3, 6) == (6, NewGRFSerialization.GRFID_MD5_NAME)


def test_listing_packs_under_the_mtu_and_ends_with_an_empty_packet() -> None:
    infos = [
        GameInfo(server_name=f"server {i}", server_revision="13.0") for i in range(300)
    ]
    entries = [
        encode_listing_entry(
            ListingEntry(f"+code{i}", info), 6, NewGRFSerialization.LOOKUP_ID, {}
        )
        for i, info in enumerate(infos)
    ]
    packets = pack_listing(entries)
    assert len(packets) > 2
    seen: list[ListingEntry] = []
    for data in packets[:-1]:
        assert len(data) <= COMPAT_MTU
        message = decode_gc_packet(*split(data), version=6, lookup={})
        assert isinstance(message, GcListing)
        assert 0 < len(message.entries) <= LISTING_MAX_PER_PACKET
        seen += message.entries
    assert [e.info for e in seen] == infos
    assert decode_gc_packet(*split(packets[-1])) == GcListing(
        0, NewGRFSerialization.GRFID_MD5, ()
    )
    assert pack_listing([]) == [h("0500 05 0000")]


def test_tiny_entries_stop_at_255_per_packet() -> None:
    entries = [b"+\0" + b"\x01"] * 600  # not decodable, only counted
    counts = [int.from_bytes(p[3:5], "little") for p in pack_listing(entries)]
    assert counts == [255, 255, 90, 0]


def test_newgrf_lookup_packets_carry_the_final_cursor() -> None:
    grfs = [(i, NewGRF(i, bytes(16), "n" * 70)) for i in range(1, 60)]
    packets = newgrf_lookup_packets(grfs, 59)
    table: dict[int, NewGRF] = {}
    for data in packets:
        assert len(data) <= COMPAT_MTU
        message = decode_gc_packet(*split(data))
        assert isinstance(message, GcNewgrfLookup) and message.cursor == 59
        table.update(message.entries)
    assert table == dict(grfs)


# ------------------------------------------------------------------ properties

tokens = text(63)
hosts = text(79)


def peer_messages() -> st.SearchStrategy[PeerMessage]:
    versions = st.integers(1, COORDINATOR_VERSION)
    return st.one_of(
        st.builds(
            lambda v, t, p, c, s: ServerRegister(
                v, t, p, c if v >= 2 else "", s if v >= 2 else ""
            ),
            versions,
            u8,
            u16,
            text(63),
            text(79),
        ),
        st.integers(1, 7).flatmap(
            lambda gv: st.builds(
                lambda v, info: ServerUpdate(
                    v, gv, NewGRFSerialization.GRFID_MD5, info
                ),
                versions,
                game_info(gv, with_names=False),
            )
        ),
        st.builds(
            lambda v, gv, r, c: ClientListing(v, gv, r, c if v >= 4 else 0),
            versions,
            st.integers(1, 255),
            text(32),
            u32,
        ),
        st.builds(ClientConnect, st.integers(2, 6), text(63)),
        st.builds(ConnectFailed, st.integers(2, 6), tokens, u8),
        st.builds(ClientConnected, st.integers(2, 6), tokens),
        st.builds(StunResult, st.integers(3, 6), tokens, u8, st.booleans()),
    )


@settings(max_examples=150, deadline=None)
@given(peer_messages())
def test_peer_messages_round_trip(message: PeerMessage) -> None:
    assert decode_peer_packet(*split(encode_peer_packet(message))) == message


def gc_messages() -> st.SearchStrategy[GcMessage]:
    return st.one_of(
        st.builds(GcError, st.sampled_from(ErrorType), text(99)),
        st.builds(GcRegisterAck, st.sampled_from(ConnectionType), text(63), text(79)),
        st.builds(GcConnecting, tokens, text(63)),
        st.builds(GcConnectFailed, tokens),
        st.builds(GcDirectConnect, tokens, u8, hosts, u16),
        st.builds(GcStunRequest, tokens),
        st.builds(GcStunConnect, tokens, u8, u8, text(85), u16),
        st.builds(
            GcNewgrfLookup,
            u32,
            st.lists(
                st.tuples(
                    u32,
                    st.builds(
                        NewGRF, u32, st.binary(min_size=16, max_size=16), text(79)
                    ),
                ),
                max_size=4,
            ).map(tuple),
        ),
        st.builds(GcTurnConnect, tokens, u8, tokens, text(85)),
        st.integers(1, 7).flatmap(
            lambda gv: st.builds(
                lambda entries: GcListing(
                    gv if entries else 0, NewGRFSerialization.GRFID_MD5, tuple(entries)
                ),
                st.lists(
                    st.builds(ListingEntry, text(85), game_info(gv, with_names=False)),
                    max_size=3,
                ),
            )
        ),
    )


@settings(max_examples=150, deadline=None)
@given(gc_messages())
def test_gc_messages_round_trip(message: GcMessage) -> None:
    assert decode_gc_packet(*split(encode_gc_packet(message, 6)), version=6) == message


@given(st.integers(0, 20), st.binary(max_size=200))
def test_random_peer_payloads_decode_or_raise_decode_error(
    packet_type: int, payload: bytes
) -> None:
    try:
        decode_peer_packet(packet_type, payload)
    except DecodeError:
        pass


@given(st.integers(0, 20), st.binary(max_size=200), st.integers(1, 6))
def test_random_gc_payloads_decode_or_raise_decode_error(
    packet_type: int, payload: bytes, version: int
) -> None:
    try:
        decode_gc_packet(packet_type, payload, version, {})
    except DecodeError:
        pass


def test_nothing_we_send_exceeds_the_tcp_mtu() -> None:
    info = GameInfo(
        server_name="x" * 79,
        server_revision="y" * 32,
        newgrfs=tuple(NewGRF(i, bytes(16), "z" * 79) for i in range(255)),
    )
    data = encode_gc_packet(
        GcListing(
            6, NewGRFSerialization.GRFID_MD5_NAME, (ListingEntry("+" + "a" * 84, info),)
        )
    )
    assert len(data) <= TCP_MTU
