"""Peer-channel encryption: tampering, replay and wrong keys are refused."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from hypothesis import given
from hypothesis import strategies as st

from crossroads.errors import DecodeError
from crossroads.proto.punch.secure import (
    REPLAY_WINDOW,
    Kind,
    ReplayWindow,
    SecureChannel,
    derive_keys,
    receiver_id,
)


def pair(context: bytes = b"") -> tuple[SecureChannel, SecureChannel]:
    a, b = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    ka = derive_keys(a, b.public_key().public_bytes_raw(), context)
    kb = derive_keys(b, a.public_key().public_bytes_raw(), context)
    return SecureChannel(ka), SecureChannel(kb)


def test_both_sides_derive_matching_keys() -> None:
    a, b = pair()
    assert a.keys.send_key == b.keys.recv_key and a.keys.recv_key == b.keys.send_key
    assert a.keys.send_id == b.keys.recv_id and a.keys.send_key != a.keys.recv_key
    assert b.open(a.seal(Kind.DATA, b"hello")) == (Kind.DATA, b"hello")
    assert a.open(b.seal(Kind.PROBE, b"x")) == (Kind.PROBE, b"x")


def test_payload_is_not_visible_on_the_wire() -> None:
    a, _ = pair()
    secret = b"the password is swordfish"
    assert secret not in a.seal(Kind.DATA, secret)


@given(st.integers(0, 60), st.integers(0, 7))
def test_any_flipped_bit_is_refused(index: int, bit: int) -> None:
    a, b = pair()
    packet = bytearray(a.seal(Kind.DATA, b"payload that is long enough"))
    index %= len(packet)
    packet[index] ^= 1 << bit
    with pytest.raises(DecodeError):
        b.open(bytes(packet))


def test_replay_is_refused() -> None:
    a, b = pair()
    packet = a.seal(Kind.DATA, b"once")
    b.open(packet)
    with pytest.raises(DecodeError) as info:
        b.open(packet)
    assert info.value.reason == "replay"


def test_reordering_within_the_window_is_accepted() -> None:
    a, b = pair()
    packets = [a.seal(Kind.DATA, bytes([i])) for i in range(100)]
    for packet in reversed(packets):
        b.open(packet)
    with pytest.raises(DecodeError):
        b.open(packets[50])


def test_too_old_is_refused() -> None:
    a, b = pair()
    old = a.seal(Kind.DATA, b"old")
    for _ in range(REPLAY_WINDOW + 1):
        newest = a.seal(Kind.DATA, b"")
    b.open(newest)
    with pytest.raises(DecodeError) as info:
        b.open(old)
    assert info.value.reason == "replay"


def test_wrong_key_is_refused() -> None:
    a, _ = pair()
    _, other = pair()
    with pytest.raises(DecodeError):
        other.open(a.seal(Kind.DATA, b"x"))


def test_other_attempt_keys_do_not_open() -> None:
    a = X25519PrivateKey.generate()
    b = X25519PrivateKey.generate()
    first = SecureChannel(
        derive_keys(a, b.public_key().public_bytes_raw(), b"\0\0\0\1")
    )
    second = SecureChannel(
        derive_keys(b, a.public_key().public_bytes_raw(), b"\0\0\0\2")
    )
    with pytest.raises(DecodeError):
        second.open(first.seal(Kind.DATA, b"x"))


def test_forged_packet_does_not_move_the_window() -> None:
    a, b = pair()
    good = a.seal(Kind.DATA, b"x")
    forged = bytearray(a.seal(Kind.DATA, b"y"))
    forged[9:17] = (2**40).to_bytes(8, "big")  # a far-future counter
    with pytest.raises(DecodeError):
        b.open(bytes(forged))
    assert b.open(good) == (Kind.DATA, b"x")


def test_low_order_and_own_keys_are_refused() -> None:
    a = X25519PrivateKey.generate()
    with pytest.raises(DecodeError):
        derive_keys(a, bytes(32))
    with pytest.raises(DecodeError):
        derive_keys(a, a.public_key().public_bytes_raw())


@given(st.binary(max_size=80))
def test_random_bytes_are_decode_errors(data: bytes) -> None:
    _, b = pair()
    receiver_id(data)
    with pytest.raises(DecodeError):
        b.open(data)


def test_replay_window_edges() -> None:
    w = ReplayWindow()
    assert w.fresh(0)
    w.accept(0)
    assert not w.fresh(0)
    w.accept(5000)
    assert not w.fresh(5000 - REPLAY_WINDOW)
    assert w.fresh(5000 - REPLAY_WINDOW + 1)
