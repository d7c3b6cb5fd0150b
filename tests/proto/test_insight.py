"""Attempt records: JSON round trip, bounded decoding, pseudonymous sides."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crossroads.errors import DecodeError
from crossroads.proto.insight import (
    Attempt,
    Pseudonymiser,
    Side,
    Step,
    Usage,
    public_prefix,
)


def sample() -> Attempt:
    return Attempt(
        family="natneg",
        session="12345678",
        started=1_700_000_000.5,
        duration=1.25,
        sides=(Side("a" * 16, "198.51.100.0/24", "symmetric"), Side("b" * 16)),
        steps=(
            Step("punch", 0.0, 0.0, "predicted-to-fail"),
            Step("relay", 0.2, 1.0, "ok"),
        ),
        winner="relay",
        outcome="relayed",
        cause="both-symmetric",
        game="gmtest",
        usage=Usage(1, 100, 2, 200, (("throttled", 3),), 12.5),
        instance="host:1",
    )


def test_round_trip() -> None:
    attempt = sample()
    assert Attempt.decode(attempt.encode()) == attempt


def test_decoding_bounds_what_it_keeps() -> None:
    raw = sample().to_json()
    raw["cause"] = "x" * 10_000
    raw["steps"] = raw["steps"] * 100
    decoded = Attempt.from_json(raw)
    assert len(decoded.cause) == 200
    assert len(decoded.steps) == 16


@given(st.binary(max_size=200))
def test_random_bytes_decode_or_raise(data: bytes) -> None:
    try:
        Attempt.decode(data)
    except DecodeError:
        pass


@pytest.mark.parametrize(
    "raw",
    [
        [],
        {"family": 3},
        {"family": "turn", "sides": "x"},
        {"family": "turn", "usage": {"bytes_up": -1}},
        {"family": "turn", "started": True},
    ],
)
def test_bad_records_raise(raw: object) -> None:
    with pytest.raises(DecodeError):
        Attempt.decode(json.dumps(raw).encode())


def test_prefixes() -> None:
    assert public_prefix("198.51.100.7") == "198.51.100.0/24"
    assert public_prefix("2001:db8:1:2::5") == "2001:db8:1::/48"
    assert public_prefix("::ffff:203.0.113.9") == "203.0.113.0/24"
    assert public_prefix("not an ip") == ""


def test_sides_are_keyed_hashes_unless_raw() -> None:
    one = Pseudonymiser(b"k" * 32)
    other = Pseudonymiser(b"j" * 32)
    side = one.side("198.51.100.7", "symmetric")
    assert side.id != "198.51.100.7" and len(side.id) == 16
    assert side == one.side("198.51.100.7", "symmetric")  # stable per key
    assert side.id != other.side("198.51.100.7").id  # keyed
    assert side.id != one.side("198.51.100.8").id
    assert side.prefix == "198.51.100.0/24" and side.nat == "symmetric"
    assert Pseudonymiser(b"k", raw=True).side("198.51.100.7").id == "198.51.100.7"


def test_the_key_is_not_in_the_repr() -> None:
    assert "secret-key" not in repr(Pseudonymiser(b"secret-key"))
