"""The shared replay window, for each protocol's size, against a set model."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crossroads.proto.dtls import crypto
from crossroads.proto.punch import secure
from crossroads.proto.replay import ReplayWindow


@pytest.mark.parametrize("window_class", [crypto.ReplayWindow, secure.ReplayWindow])
@given(sequences=st.lists(st.integers(0, 5000), max_size=200))
def test_fresh_is_unseen_and_within_the_window(
    window_class: type[ReplayWindow], sequences: list[int]
) -> None:
    window = window_class()
    seen: set[int] = set()
    for counter in sequences:
        expected = counter not in seen and (
            not seen or counter > max(seen) - window_class.SIZE
        )
        assert window.fresh(counter) == expected
        if expected:
            window.accept(counter)
            seen.add(counter)


def test_sizes_are_the_protocols() -> None:
    # RFC 6347 §4.1.2.6 for DTLS; WireGuard's 2048 for the p2p channel.
    assert (crypto.ReplayWindow.SIZE, secure.ReplayWindow.SIZE) == (64, 2048)
