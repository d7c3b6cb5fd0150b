"""Join codes: alphabet, length, uniformity, normalisation."""

from __future__ import annotations

import os
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crossroads.errors import DecodeError, LocalProtocolError
from crossroads.proto.relay import joincode


def test_alphabet_is_the_references() -> None:
    assert joincode.ALPHABET == "6789BCDFGHJKLMNPQRTW"
    assert len(set(joincode.ALPHABET)) == 20


def test_generate_uses_only_the_alphabet_and_the_length() -> None:
    for length in (6, 9, 12):
        code = joincode.generate(length, os.urandom)
        assert len(code) == length
        assert set(code) <= set(joincode.ALPHABET)
    with pytest.raises(LocalProtocolError):
        joincode.generate(5, os.urandom)


def test_bytes_above_the_unbiased_limit_are_redrawn() -> None:
    stream = iter([bytes([255, 250, 240] * 4), bytes([0, 19, 20, 239] * 3)])
    code = joincode.generate(6, lambda n: next(stream))
    # 0 -> '6', 19 -> 'W', 20 -> '6', 239 -> 'W' (239 % 20 == 19)
    assert code == "6W6W6W"


def test_symbols_are_roughly_uniform() -> None:
    counts = Counter("".join(joincode.generate(12, os.urandom) for _ in range(2000)))
    assert len(counts) == 20
    assert min(counts.values()) > 0.7 * max(counts.values())


def test_normalize_is_case_insensitive_and_strict() -> None:
    assert joincode.normalize(" bcdf67 ") == "BCDF67"
    for bad in ("BCDF6", "BCDFGHJKLMNPQ", "BCDFGA", "BCD 67", "BCDF60"):
        with pytest.raises(DecodeError):
            joincode.normalize(bad)


@given(st.text(max_size=20))
def test_normalize_random_text(text: str) -> None:
    try:
        code = joincode.normalize(text)
    except DecodeError:
        return
    assert joincode.normalize(code) == code
