from __future__ import annotations

import os

from hypothesis import given
from hypothesis import strategies as st

from crossroads.proto.openttd.codes import (
    ALPHABET,
    TokenSide,
    check_invite_code_secret,
    invite_code_secret,
    looks_like_invite_code,
    make_attempt_id,
    make_invite_code,
    make_ticket,
    parse_token,
    split_ticket,
    token_for,
)


def test_alphabet_has_53_unambiguous_symbols() -> None:
    assert len(ALPHABET) == len(set(ALPHABET)) == 53
    assert not set("01ILOPilo") & set(ALPHABET)


@given(st.binary(min_size=8, max_size=8))
def test_invite_codes_have_the_openttd_shape(random_bytes: bytes) -> None:
    code = make_invite_code(random_bytes)
    assert code.startswith("+") and len(code) == 8
    assert looks_like_invite_code(code)


def test_codes_from_openttd_org_are_accepted_shapes() -> None:
    assert looks_like_invite_code("+GndZfBW")
    assert not looks_like_invite_code("GndZfBW")
    assert not looks_like_invite_code("+0bad")
    assert not looks_like_invite_code("+")


def test_secrets_bind_code_and_key() -> None:
    secret = invite_code_secret(b"key", "+abcdefg")
    assert len(secret) == 64 and len(secret) < 80
    assert check_invite_code_secret(b"key", "+abcdefg", secret)
    assert not check_invite_code_secret(b"other", "+abcdefg", secret)
    assert not check_invite_code_secret(b"key", "+abcdefh", secret)


def test_tokens_name_side_instance_and_attempt() -> None:
    key = make_attempt_id("0a1b2c3d", os.urandom(12))
    for side in TokenSide:
        parsed = parse_token(token_for(side, key))
        assert parsed is not None
        assert (parsed.side, parsed.instance, parsed.attempt_key) == (
            side,
            "0a1b2c3d",
            key,
        )
    assert parse_token("Ctok") is None
    assert parse_token("X" + key) is None
    assert parse_token("C" + key.upper()) is None


@given(st.text(max_size=80))
def test_parse_token_never_raises(token: str) -> None:
    parse_token(token)
    split_ticket(token)


def test_tickets() -> None:
    ticket = make_ticket(bytes(range(16)))
    assert ticket == "0001020304050607:08090a0b0c0d0e0f"
    assert split_ticket(ticket) == ("0001020304050607", "08090a0b0c0d0e0f")
    assert split_ticket("abc:def") is None
