"""Connection-data tokens: sealed, node-bound, and the key derivation."""

from __future__ import annotations

import hashlib
import hmac
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crossroads.errors import DecodeError, LocalProtocolError
from crossroads.proto.relay import messages as m
from crossroads.proto.relay.token import (
    TOKEN_SIZE,
    AllocationClaims,
    Role,
    TokenSealer,
    bind_hmac,
    verify_bind_hmac,
)

SECRET = b"s" * 32
ID = bytes(range(16))
HOST = bytes(range(16, 32))


def sealer() -> TokenSealer:
    return TokenSealer(SECRET, os.urandom)


def claims(**kw: object) -> AllocationClaims:
    values: dict[str, object] = {
        "allocation_id": ID,
        "host_allocation_id": HOST,
        "role": Role.JOINER,
        "max_connections": 7,
        "bind_deadline": 1_700_000_010.5,
    }
    values.update(kw)
    return AllocationClaims(**values)  # type: ignore[arg-type]


def test_seal_open_round_trip_with_padding() -> None:
    token = sealer().seal(claims(), "node-a")
    assert len(token) == TOKEN_SIZE <= m.CONNECTION_DATA_SIZE
    assert sealer().open(m.pad_connection_data(token), "node-a") == claims()


def test_token_for_another_node_or_secret_does_not_open() -> None:
    token = sealer().seal(claims(), "node-a")
    with pytest.raises(DecodeError):
        sealer().open(token, "node-b")
    with pytest.raises(DecodeError):
        TokenSealer(b"t" * 32, os.urandom).open(token, "node-a")


def test_tampered_token_does_not_open() -> None:
    token = bytearray(sealer().seal(claims(), "n"))
    token[20] ^= 1
    with pytest.raises(DecodeError):
        sealer().open(bytes(token), "n")


def test_key_is_64_bytes_and_depends_on_id_and_secret() -> None:
    key = sealer().key_for(ID)
    assert len(key) == m.KEY_SIZE
    assert key != sealer().key_for(HOST)
    assert key != TokenSealer(b"t" * 32, os.urandom).key_for(ID)


def test_bind_hmac_is_hmac_sha256_over_263_bytes() -> None:
    key = sealer().key_for(ID)
    bind = m.Bind(nonce=5, connection_data=b"abc", hmac=bytes(32))
    mac = bind_hmac(key, bind.signed_bytes())
    expected = hmac.new(key, bind.encode()[:263], hashlib.sha256).digest()
    assert mac == expected
    signed = m.Bind(nonce=5, connection_data=b"abc", hmac=mac).encode()
    assert verify_bind_hmac(key, signed)
    assert not verify_bind_hmac(key, signed[:-1] + bytes([signed[-1] ^ 1]))


def test_short_secret_and_bad_claims_are_refused() -> None:
    with pytest.raises(LocalProtocolError):
        TokenSealer(b"short", os.urandom)
    with pytest.raises(LocalProtocolError):
        sealer().seal(claims(max_connections=70000), "n")


def test_host_role() -> None:
    token = sealer().seal(claims(role=Role.HOST, host_allocation_id=ID), "n")
    assert sealer().open(token, "n").is_host


@given(st.binary(max_size=300))
def test_random_bytes_open_or_decode_error(data: bytes) -> None:
    try:
        sealer().open(data, "n")
    except DecodeError:
        pass


def test_a_sealer_that_adopted_a_secret_still_opens_what_the_old_one_sealed() -> None:
    old = sealer()
    old_token = old.seal(claims(), "node-a")
    adopted = TokenSealer(b"n" * 32, os.urandom, previous=[SECRET])
    # Tokens sealed before the adoption open, with the key of the old secret.
    assert adopted.open_with_key(old_token, "node-a") == (claims(), old.key_for(ID))
    # New tokens and keys use the adopted secret only.
    new_token = adopted.seal(claims(), "node-a")
    with pytest.raises(DecodeError):
        old.open(new_token, "node-a")
    fresh = TokenSealer(b"n" * 32, os.urandom)
    assert adopted.open_with_key(new_token, "node-a") == (claims(), fresh.key_for(ID))
    assert adopted.key_for(ID) == fresh.key_for(ID)
