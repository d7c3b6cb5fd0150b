"""The Unity Relay codec against bytes written out by hand from the reference tables.

Golden vectors are spelled as hex so a reader can check them against
``reference/unity-relay-and-raknet.md`` §1.1 without running the codec.
"""

from __future__ import annotations

import hashlib
import hmac

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crossroads.errors import DecodeError, LocalProtocolError
from crossroads.proto.relay import messages as m

A = bytes(range(0x10, 0x20))  # allocation ID 10 11 .. 1f
B = bytes(range(0xA0, 0xB0))  # allocation ID a0 a1 .. af


def test_header_bytes_are_da_72_00_type() -> None:
    assert m.BindReceived().encode() == bytes.fromhex("da720001")
    assert m.header(m.MessageType.ERROR) == bytes.fromhex("da72000c")


def test_type_codes_match_reference() -> None:
    assert {t.name: t.value for t in m.MessageType} == {
        "BIND": 0,
        "BIND_RECEIVED": 1,
        "PING": 2,
        "CONNECT_REQUEST": 3,
        "ACCEPTED": 6,
        "REJECTED": 8,
        "DISCONNECT": 9,
        "RELAY": 10,
        "CLOSE": 11,
        "ERROR": 12,
    }
    assert [c.value for c in m.ErrorCode] == [0, 1, 2, 3, 4, 5, 6]


def test_bind_golden() -> None:
    key = bytes(range(64))
    connection_data = b"\x01\x02\x03"
    # DA 72 00 00 | accept mode 00 | nonce 0x0102 little-endian: 02 01 | length FF
    # | connection data zero-padded to 255 | HMAC-SHA256(key, first 263 bytes)
    signed = (
        bytes.fromhex("da720000" + "00" + "0201" + "ff") + connection_data + bytes(252)
    )
    assert len(signed) == 263
    mac = hmac.new(key, signed, hashlib.sha256).digest()
    wire = signed + mac
    assert len(wire) == 295
    decoded = m.decode(wire)
    assert decoded == m.Bind(
        nonce=0x0102, connection_data=connection_data + bytes(252), hmac=mac
    )
    assert decoded.encode() == wire
    assert isinstance(decoded, m.Bind) and decoded.signed_bytes() == signed


def test_bind_with_short_length_byte_keeps_only_that_much_data() -> None:
    wire = bytes.fromhex("da720000" + "00" + "0000" + "03") + b"abc" + bytes(252 + 32)
    decoded = m.decode(wire)
    assert isinstance(decoded, m.Bind)
    assert decoded.connection_data == b"abc"
    assert decoded.encode() == wire


def test_ping_golden() -> None:
    wire = bytes.fromhex("da720002") + A + bytes.fromhex("0100")
    assert len(wire) == 22
    assert m.decode(wire) == m.Ping(A, 1)
    assert m.Ping(A).encode() == wire


def test_connect_request_golden() -> None:
    host_data = b"H" * 72
    wire = bytes.fromhex("da720003") + A + b"\xff" + host_data + bytes(255 - 72)
    assert len(wire) == 276
    decoded = m.decode(wire)
    assert decoded == m.ConnectRequest(A, host_data + bytes(255 - 72))
    assert decoded.encode() == wire


@pytest.mark.parametrize(
    ("cls", "code"),
    [(m.Accepted, "06"), (m.Rejected, "08"), (m.Disconnect, "09")],
)
def test_from_to_messages_golden(cls: type[m.Accepted], code: str) -> None:
    wire = bytes.fromhex("da7200" + code) + A + B
    assert len(wire) == 36
    assert m.decode(wire) == cls(A, B)
    assert cls(A, B).encode() == wire


def test_relay_golden_length_is_big_endian() -> None:
    payload = b"x" * 0x0102
    wire = bytes.fromhex("da72000a") + A + B + bytes.fromhex("0102") + payload
    assert m.decode(wire) == m.Relay(A, B, payload)
    assert m.Relay(A, B, payload).encode() == wire
    assert m.relay_route(A, B) == wire[:36]


def test_empty_relay_is_38_bytes() -> None:
    assert len(m.Relay(A, B, b"").encode()) == 38


def test_close_and_error_golden() -> None:
    assert m.decode(bytes.fromhex("da72000b") + A) == m.Close(A)
    wire = bytes.fromhex("da72000c") + A + b"\x03"
    assert len(wire) == 21
    assert m.decode(wire) == m.Error(A, m.ErrorCode.ALLOCATION_ID_CLIENT_MISMATCH)


@pytest.mark.parametrize(
    ("wire", "reason"),
    [
        (b"", "short"),
        (b"\xda\x72\x00", "short"),
        (b"\x72\xda\x00\x01", "bad-signature"),
        (b"\xda\x72\x01\x01", "bad-version"),
        (b"\xda\x72\x00\x04", "unknown-type"),
        (b"\xda\x72\x00\x07", "unknown-type"),
        (b"\xda\x72\x00\x0d", "unknown-type"),
        (b"\xda\x72\x00\x01\x00", "bad-size"),
        (b"\xda\x72\x00\x00" + bytes(290), "bad-size"),
        (b"\xda\x72\x00\x02" + bytes(17), "bad-size"),
        (b"\xda\x72\x00\x0a" + bytes(33), "bad-size"),
        (b"\xda\x72\x00\x0a" + bytes(32) + b"\x00\x05" + b"1234", "bad-length"),
        (b"\xda\x72\x00\x0a" + bytes(32) + b"\x00\x01" + b"12", "bad-length"),
        (b"\xda\x72\x00\x0c" + bytes(16), "bad-size"),
    ],
)
def test_bad_input_raises_decode_error_with_reason(wire: bytes, reason: str) -> None:
    with pytest.raises(DecodeError) as info:
        m.decode(wire)
    assert info.value.reason == reason


def test_constructors_refuse_what_cannot_be_sent() -> None:
    with pytest.raises(LocalProtocolError):
        m.Ping(b"short")
    with pytest.raises(LocalProtocolError):
        m.Bind(nonce=70000, connection_data=b"", hmac=bytes(32))
    with pytest.raises(LocalProtocolError):
        m.ConnectRequest(A, bytes(256))
    with pytest.raises(LocalProtocolError):
        m.Relay(A, B, bytes(70000))
    with pytest.raises(LocalProtocolError):
        m.Error(A, 300)


@given(st.binary(max_size=400))
def test_random_bytes_decode_or_raise_decode_error(data: bytes) -> None:
    try:
        message = m.decode(data)
    except DecodeError:
        return
    assert message.encode() == data or isinstance(message, m.Bind | m.ConnectRequest)


@given(st.binary(max_size=40))
def test_random_bytes_after_a_valid_header(data: bytes) -> None:
    for code in range(14):
        try:
            m.decode(b"\xda\x72\x00" + bytes((code,)) + data)
        except DecodeError:
            pass


ids = st.binary(min_size=16, max_size=16)
cdata = st.binary(max_size=255)

messages = st.one_of(
    st.builds(
        m.Bind,
        nonce=st.integers(0, 0xFFFF),
        connection_data=cdata,
        hmac=st.binary(min_size=32, max_size=32),
        accept_mode=st.integers(0, 255),
    ),
    st.just(m.BindReceived()),
    st.builds(m.Ping, ids, st.integers(0, 0xFFFF)),
    st.builds(m.ConnectRequest, ids, cdata),
    st.builds(m.Accepted, ids, ids),
    st.builds(m.Rejected, ids, ids),
    st.builds(m.Disconnect, ids, ids),
    st.builds(m.Relay, ids, ids, st.binary(max_size=2000)),
    st.builds(m.Close, ids),
    st.builds(m.Error, ids, st.integers(0, 255)),
)


@given(messages)
def test_round_trip(message: m.Message) -> None:
    assert m.decode(message.encode()) == message
