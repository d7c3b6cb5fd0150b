"""Rendezvous datagrams and mapping classification."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crossroads.errors import DecodeError
from crossroads.proto.punch import rendezvous as rv


@given(
    st.binary(min_size=16, max_size=16),
    st.integers(0, 2**32 - 1),
    st.integers(0, 65535),
)
def test_probe_round_trip(token: bytes, attempt: int, seq: int) -> None:
    probe = rv.Probe(token, attempt, seq)
    assert rv.Probe.decode(probe.encode()) == probe


@given(
    st.integers(0, 2**32 - 1),
    st.integers(0, 65535),
    st.integers(0, 2),
    st.ip_addresses().map(str),
    st.integers(1, 65535),
)
def test_observed_round_trip(
    attempt: int, seq: int, index: int, host: str, port: int
) -> None:
    observed = rv.Observed(attempt, seq, index, host, port)
    assert rv.Observed.decode(observed.encode()) == observed


@given(st.binary(max_size=64))
def test_random_bytes_decode_or_raise(data: bytes) -> None:
    for decode in (rv.Probe.decode, rv.Observed.decode):
        try:
            decode(data)
        except DecodeError:
            pass


def test_answer_is_never_larger_than_the_question() -> None:
    assert rv.OBSERVED_SIZE <= rv.PROBE_SIZE


@pytest.mark.parametrize(
    ("ports", "expected"),
    [
        ((40000, 40000, 40000), ("independent", 0)),
        ((40000, 40001, 40002), ("sequential", 1)),
        ((40000, 40002, 40004), ("sequential", 2)),
        ((40010, 40009, 40008), ("sequential", -1)),
        ((40000, 51234, 1999), ("random", 0)),
        ((40000, 41000, 42000), ("random", 0)),
        ((40000, 40000), ("independent", 0)),
        ((40000,), ("unknown", 0)),
    ],
)
def test_classify_mapping(ports: tuple[int, ...], expected: tuple[str, int]) -> None:
    assert rv.classify_mapping(ports) == expected
