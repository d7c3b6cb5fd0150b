"""Credentials: static users, coturn time-limited credentials, stateless nonces."""

from __future__ import annotations

import base64
import hashlib
import hmac

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crossroads.proto.turn.auth import (
    NONCE_COOKIE,
    Credentials,
    Lookup,
    NonceCheck,
    NonceMinter,
    merge_users,
    parse_rest_username,
    parse_users_file,
    rest_password,
)


def test_rest_password_matches_coturn_formula() -> None:
    username = "1795396992:bob"
    expected = base64.b64encode(
        hmac.new(b"s3cr3t", username.encode(), hashlib.sha1).digest()
    ).decode()
    assert rest_password("s3cr3t", username) == expected


def test_parse_rest_username() -> None:
    assert parse_rest_username("1795396992:bob") == (1795396992, "bob")
    assert parse_rest_username("1795396992") == (1795396992, "")
    assert parse_rest_username("1795396992|bob", "|") == (1795396992, "bob")
    assert parse_rest_username("bob:1795396992") is None
    assert parse_rest_username("-5:bob") is None


def test_lookup_static_rest_expired_unknown() -> None:
    creds = Credentials("example.org", {"alice": "pw"}, ("old", "new"))
    assert creds.passwords("alice", 0) == (Lookup.FOUND, ["pw"])
    result, passwords = creds.passwords("2000:carl", 1000)
    assert result is Lookup.FOUND
    assert passwords == [
        rest_password("old", "2000:carl"),
        rest_password("new", "2000:carl"),
    ]
    assert creds.passwords("999:carl", 1000) == (Lookup.EXPIRED, [])
    assert creds.passwords("mallory", 0) == (Lookup.UNKNOWN_USER, [])
    assert Credentials("r").enabled is False


def test_users_file_and_merge() -> None:
    users = parse_users_file("# comment\nalice:a:b\n\n bob:pw \n")
    assert users == {"alice": "a:b", "bob": "pw"}
    with pytest.raises(ValueError, match="line 2"):
        parse_users_file("ok:1\nbroken\n")
    assert merge_users(["bob:new", "carol:c"], users) == {
        "alice": "a:b",
        "bob": "new",
        "carol": "c",
    }


def test_nonce_valid_stale_and_bound_to_address() -> None:
    minter = NonceMinter(b"k" * 32, lifetime=600)
    nonce = minter.mint("17/192.0.2.1", 4000, 1_000_000)
    assert nonce.startswith(NONCE_COOKIE + "gAAA")  # password-algorithms bit
    assert minter.check(nonce, "17/192.0.2.1", 4000, 1_000_100) is NonceCheck.VALID
    assert minter.check(nonce, "17/192.0.2.1", 4000, 1_000_601) is NonceCheck.EXPIRED
    assert minter.check(nonce, "17/192.0.2.2", 4000, 1_000_100) is NonceCheck.INVALID
    assert minter.check(nonce, "17/192.0.2.1", 4001, 1_000_100) is NonceCheck.INVALID
    assert minter.check(nonce, "6/192.0.2.1", 4000, 1_000_100) is NonceCheck.INVALID
    # Any port of the same scope (RFC 6062 ConnectionBind).
    assert minter.check(nonce, "17/192.0.2.1", None, 1_000_100) is NonceCheck.VALID
    other = NonceMinter(b"x" * 32)
    assert other.check(nonce, "17/192.0.2.1", 4000, 1_000_100) is NonceCheck.INVALID
    tampered = nonce[:-1] + ("A" if nonce[-1] != "A" else "B")
    assert minter.check(tampered, "17/192.0.2.1", 4000, 1_000_100) is NonceCheck.INVALID
    forged_port = nonce.replace("0fa0", "0fa1")  # 4000 -> 4001 without the key
    assert (
        minter.check(forged_port, "17/192.0.2.1", None, 1_000_100) is NonceCheck.INVALID
    )
    assert minter.mint("17/192.0.2.1", 4000, 1_000_001) > nonce  # monotonic
    plain = NonceMinter(b"k" * 32, password_algorithms=False)
    assert plain.mint("17/192.0.2.1", 1, 0).startswith(NONCE_COOKIE + "AAAA")


@given(st.text(max_size=60))
def test_nonce_check_never_raises(nonce: str) -> None:
    minter = NonceMinter(b"k" * 32)
    assert minter.check(nonce, "17/::1", 5000, 5000) in set(NonceCheck)
    assert minter.check(nonce, "17/::1", None, 5000) in set(NonceCheck)
