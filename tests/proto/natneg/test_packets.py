"""natneg codec: golden bytes for every packet type, error reasons, properties.

Golden vectors are the byte captures and SDK examples quoted in
``shared/reference/gamespy-natneg.md`` (§3.x), not bytes this codec produced.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crossroads.errors import DecodeError
from crossroads.proto.natneg.packets import (
    INIT_SIZE,
    MAGIC,
    REPORT_SIZE,
    AddressCheck,
    AddressReply,
    BackupAck,
    BackupTest,
    Connect,
    ConnectAck,
    ConnectPing,
    ErtAck,
    ErtTest,
    Init,
    InitAck,
    NatifyRequest,
    NatType,
    Packet,
    PacketType,
    Preinit,
    PreinitAck,
    Report,
    ReportAck,
    StateUpdate,
    decode,
    encode,
)


def h(text: str) -> bytes:
    return bytes.fromhex(text.replace(" ", ""))


MAGIC_HEX = "fd fc 1e 66 6a b2"

# ------------------------------------------------------------------ golden bytes


def test_init_v4_from_sdk_simpletest() -> None:
    # ref §3.1: the SDK test program's GP INIT, 28 bytes (gmtest, cookie 666).
    wire = h(
        MAGIC_HEX + "04 00 00 00 02 9a 00 00 01 00 00 00 00 00 00 67 6d 74 65 73 74 00"
    )
    packet = decode(wire)
    assert packet == Init(
        version=4,
        cookie=666,
        port_type=0,
        client_index=0,
        use_game_port=1,
        local_ip="0.0.0.0",
        local_port=0,
        game_name="gmtest",
    )
    assert len(wire) == 28
    assert encode(packet) == wire


def test_init_nn2_carries_game_socket_port() -> None:
    # ref §3.1: the pt2/pt3 INITs carry the game socket port (9f 21).
    packet = Init(4, 666, 2, 0, 1, "0.0.0.0", 0x9F21, "gmtest")
    assert encode(packet)[12:21] == h("02 00 01 00 00 00 00 9f 21")


def test_init_v2_without_name_and_v1() -> None:
    v2 = h(MAGIC_HEX + "02 00 00 00 00 07 01 01 00 c0 a8 01 0a 1f 90")
    assert len(v2) == INIT_SIZE
    assert decode(v2) == Init(2, 7, 1, 1, 0, "192.168.1.10", 8080, None)
    assert encode(decode(v2)) == v2
    # v1 INIT stops after usegameport: 15 bytes (ref §1).
    v1 = h(MAGIC_HEX + "01 00 00 00 00 07 02 00 01")
    assert decode(v1) == Init(1, 7, 2, 0, 1)
    assert encode(Init(1, 7, 2, 0, 1)) == v1


def test_init_ack_real_gamespy_reply() -> None:
    # ref §3.2: real GameSpy INIT_ACK = echo of bytes 0-13 + constant filler.
    wire = h(MAGIC_HEX + "03 01 00 00 02 9a 00 00 ff ff 6d 16 b5 7d ea")
    packet = decode(wire)
    assert isinstance(packet, InitAck)
    assert (packet.port_type, packet.client_index, packet.cookie) == (0, 0, 666)
    assert encode(packet) == wire


def test_ert_test_is_natify_request_echo() -> None:
    # ref §3.2: the real server echoed the 73-byte NATIFY_REQUEST with type 2.
    request = h(MAGIC_HEX + "03 0c 00 00 03 09 02") + bytes(73 - 13)
    natify = decode(request)
    assert natify == NatifyRequest(3, 777, 2, extra=bytes(52))
    ert = ErtTest(3, 777, 2, extra=bytes(52))
    assert encode(ert) == request[:7] + b"\x02" + request[8:]


def test_ert_ack_is_first_21_bytes_of_ert_with_type_3() -> None:
    ert = h(MAGIC_HEX + "03 02 12 34 56 78 01 00 00 0a 00 00 01 30 39")
    ack = ert[:7] + b"\x03" + ert[8:21]
    assert decode(ack) == ErtAck(3, 0x12345678, 1, 0, 0, "10.0.0.1", 12345)


def test_state_update_is_opaque() -> None:
    wire = h(MAGIC_HEX + "03 04 00 00 00 01 aa bb")
    assert decode(wire) == StateUpdate(3, 1, b"\xaa\xbb")
    assert encode(StateUpdate(3, 1, b"\xaa\xbb")) == wire


def test_connect_real_capture() -> None:
    # ref §3.3 (DWC capture): remote 24.171.237.122:55808, gotyourdata 0x42.
    wire = h(MAGIC_HEX + "03 05 3d f1 00 71 18 ab ed 7a da 00 42 00")
    assert len(wire) == 20
    packet = decode(wire)
    assert packet == Connect(3, 0x3DF10071, "24.171.237.122", 0xDA00, 0x42, 0)
    assert encode(packet) == wire


def test_connect_ack_with_stack_garbage() -> None:
    # ref §3.2: a v3 client's CONNECT_ACK, bytes 12 and 14-20 uninitialised.
    wire = h(MAGIC_HEX + "03 06 00 00 02 9a fc 00 00 00 b0 4b 69 e0 fc")
    packet = decode(wire)
    assert isinstance(packet, ConnectAck)
    assert packet.client_index == 0 and packet.cookie == 666
    assert encode(packet) == wire


def test_connect_ping() -> None:
    wire = h(MAGIC_HEX + "04 07 00 00 02 9a 7f 00 00 01 9f 21 01 00")
    assert decode(wire) == ConnectPing(4, 666, "127.0.0.1", 0x9F21, 1, 0)
    assert encode(ConnectPing(4, 666, "127.0.0.1", 0x9F21, 1, 0)) == wire


def test_backup_test_and_ack() -> None:
    test = h(MAGIC_HEX + "03 08 00 00 00 05 01 00 00 00 00 00 00 00 00")
    assert decode(test) == BackupTest(3, 5, 1)
    ack = test[:7] + b"\x09" + test[8:]
    assert decode(ack) == BackupAck(3, 5, 1)


def test_address_check_and_real_reply() -> None:
    check = h(MAGIC_HEX + "03 0a 00 00 00 03 01") + bytes(73 - 13)
    assert decode(check) == AddressCheck(3, 3, 1, extra=bytes(52))
    # ref §3.2 real ADDRESS_REPLY: mapping 3 (map1b), 37.201.226.138:37348.
    reply = h(MAGIC_HEX + "03 0b 00 00 00 03 01 00 00 25 c9 e2 8a 91 e4")
    assert decode(reply) == AddressReply(3, 3, 1, 0, 0, "37.201.226.138", 0x91E4)
    assert encode(decode(reply)) == reply


def test_natify_request_cookie_777() -> None:
    wire = h(MAGIC_HEX + "04 0c 00 00 03 09 03") + bytes(60)
    assert len(wire) == 73
    assert decode(wire) == NatifyRequest(4, 777, 3, extra=bytes(52))


REPORT_V4 = (
    h(MAGIC_HEX + "04 0d 00 00 02 9a 7f 00 01 02 00 00 00 01 00 00 00")
    + b"gmtest"
    + bytes(50 - 6)
)


def test_report_v4_from_sdk_simpletest() -> None:
    # ref §3.4: 73 bytes, porttype garbage 0x7f, natType/scheme host-order int32.
    assert len(REPORT_V4) == REPORT_SIZE
    packet = decode(REPORT_V4)
    assert isinstance(packet, Report)
    assert packet.cookie == 666
    assert packet.port_type == 0x7F
    assert packet.client_index == 0
    assert packet.neg_result == 1
    assert packet.nat_type == NatType.FULL_CONE
    assert packet.mapping_scheme == 1
    assert packet.game_name == "gmtest"
    assert encode(packet) == REPORT_V4
    built = Report.build(
        version=4,
        cookie=666,
        port_type=0x7F,
        client_index=0,
        success=True,
        nat_type=2,
        mapping_scheme=1,
        game_name="gmtest",
    )
    assert encode(built) == REPORT_V4


def test_report_big_endian_wii() -> None:
    # ref §3.4: a Wii sends natType as 00 00 00 06.
    wire = bytearray(REPORT_V4)
    wire[15:19] = b"\x00\x00\x00\x06"
    wire[19:23] = b"\x00\x00\x00\x00"
    packet = decode(bytes(wire))
    assert isinstance(packet, Report)
    assert packet.nat_type == NatType.UNKNOWN
    assert packet.mapping_scheme == 0


def test_report_ack_like_gamespy() -> None:
    # ref §3.2: first 21 bytes of the REPORT, type 0x0E, byte 14 cleared.
    wire = bytearray(REPORT_V4[:21])
    wire[7] = 0x0E
    wire[14] = 0
    packet = decode(bytes(wire))
    assert packet == ReportAck(4, 666, 0x7F, 0, 0, "2.0.0.0", 0x0100)


def test_preinit_captures() -> None:
    # ref §3.6 (DWC docstring, Pokemon BW).
    pre = h(MAGIC_HEX + "04 0f b5 e0 95 2a 00 24 38 b2 b3 5e")
    assert decode(pre) == Preinit(4, 0xB5E0952A, 0, 0x24, 0x38B2B35E)
    assert encode(decode(pre)) == pre
    first = h(MAGIC_HEX + "04 10 b5 e0 95 2a 00 00 00 00 00 00")
    assert decode(first) == PreinitAck(4, 0xB5E0952A, 0, 0, 0)
    ready = h(MAGIC_HEX + "04 10 b5 e0 95 2a 01 02 00 00 00 00")
    assert decode(ready) == PreinitAck(4, 0xB5E0952A, 1, 2, 0)
    assert len(pre) == 18


def test_every_type_has_a_golden_test() -> None:
    covered = {
        Init,
        InitAck,
        ErtTest,
        ErtAck,
        StateUpdate,
        Connect,
        ConnectAck,
        ConnectPing,
        BackupTest,
        BackupAck,
        AddressCheck,
        AddressReply,
        NatifyRequest,
        Report,
        ReportAck,
        Preinit,
        PreinitAck,
    }
    assert {cls.TYPE for cls in covered} == set(PacketType)


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("wire", "reason"),
    [
        (b"", "short"),
        (MAGIC + b"\x03\x00\x00\x00", "short"),
        (b"\xfd\xfc\x1e\x66\x6a\xb3" + bytes(15), "bad-magic"),
        (MAGIC + b"\x00\x00" + bytes(13), "bad-version"),
        (MAGIC + b"\x05\x00" + bytes(13), "bad-version"),
        (MAGIC + b"\x03\x11" + bytes(13), "bad-type"),
        (MAGIC + b"\x03\x00" + bytes(8), "short"),  # INIT of 20 bytes
        (MAGIC + b"\x01\x00" + bytes(6), "short"),  # v1 INIT of 14 bytes
        (MAGIC + b"\x03\x05" + bytes(7), "short"),  # CONNECT of 19 bytes
        (MAGIC + b"\x03\x0d" + bytes(60), "short"),  # REPORT of 72 bytes
        (MAGIC + b"\x04\x0f" + bytes(5), "short"),  # PREINIT of 17 bytes
        (MAGIC + b"\x03\x01" + bytes(6), "short"),  # 14-byte INIT_ACK (seed)
        (MAGIC + b"\x03\x00" + bytes(13) + b"x" * 64, "bad-gamename"),
        (MAGIC + b"\x03\x00" + bytes(600), "too-long"),
    ],
)
def test_decode_errors(wire: bytes, reason: str) -> None:
    with pytest.raises(DecodeError) as info:
        decode(wire)
    assert info.value.reason == reason


# ------------------------------------------------------------------ properties


@given(st.binary(max_size=600))
def test_random_bytes_decode_or_decode_error(data: bytes) -> None:
    try:
        packet = decode(data)
    except DecodeError:
        return
    assert packet.TYPE == data[7]


@given(
    st.integers(0, 5),
    st.integers(0, 0x12),
    st.binary(min_size=4, max_size=120),
)
def test_random_body_after_valid_magic(version: int, ptype: int, rest: bytes) -> None:
    data = MAGIC + bytes((version, ptype)) + rest
    try:
        packet = decode(data)
    except DecodeError:
        return
    # Whatever decodes re-encodes to a packet that decodes to the same value.
    assert decode(encode(packet)) == packet


versions = st.integers(1, 4)
cookies = st.integers(0, 0xFFFFFFFF)
u8 = st.integers(0, 255)
ports = st.integers(0, 0xFFFF)
ips = st.ip_addresses(v=4).map(str)
extra = st.binary(max_size=60)
names = st.text(alphabet=st.characters(min_codepoint=1, max_codepoint=255), max_size=63)


def body_packets(cls: type) -> st.SearchStrategy[Packet]:
    return st.builds(cls, versions, cookies, u8, u8, u8, ips, ports, extra)


def connect_packets(cls: type) -> st.SearchStrategy[Packet]:
    return st.builds(cls, versions, cookies, ips, ports, u8, u8, extra)


def preinit_packets(cls: type) -> st.SearchStrategy[Packet]:
    return st.builds(cls, versions, cookies, u8, u8, cookies, extra)


inits = st.one_of(
    st.builds(Init, st.just(1), cookies, u8, u8, u8),
    st.builds(
        Init, st.integers(2, 4), cookies, u8, u8, u8, ips, ports, st.none() | names
    ),
)
reports = st.builds(
    Report,
    versions,
    cookies,
    u8,
    u8,
    u8,
    st.binary(min_size=4, max_size=4),
    st.binary(min_size=4, max_size=4),
    st.binary(min_size=50, max_size=50),
    extra,
)
packets = st.one_of(
    inits,
    reports,
    st.builds(StateUpdate, versions, cookies, st.binary(max_size=80)),
    *(
        body_packets(cls)
        for cls in (
            InitAck,
            ErtTest,
            ErtAck,
            ConnectAck,
            BackupTest,
            BackupAck,
            AddressCheck,
            AddressReply,
            NatifyRequest,
            ReportAck,
        )
    ),
    connect_packets(Connect),
    connect_packets(ConnectPing),
    preinit_packets(Preinit),
    preinit_packets(PreinitAck),
)


@given(packets)
def test_round_trip(packet: Packet) -> None:
    assert decode(encode(packet)) == packet
