"""The reflection budget (proto/reflection.py): bytes out <= bytes in + allowance."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crossroads.proto.reflection import (
    WINDOW,
    ReflectionBudget,
    ReflectionSettings,
)


def budget(**overrides: object) -> ReflectionBudget:
    return ReflectionBudget(ReflectionSettings(**overrides))  # type: ignore[arg-type]


def test_a_legitimate_binding_exchange_fits_the_allowance() -> None:
    b = budget(allowance=4096)
    # A 20-byte Binding request, an 88-byte answer: 68 bytes of allowance each;
    # the first 60 all fit.
    results = [b.answer("192.0.2.1", 20, 88, now=1.0) for _ in range(200)]
    assert all(results[: 4096 // 68])
    # Then refused requests still count as received: out <= in + allowance.
    answered = sum(results)
    assert answered == (200 * 20 + 4096) // 88
    assert b.refused == 200 - answered
    assert b.refused_bytes == 88 * b.refused


def test_replies_no_larger_than_the_requests_are_never_refused() -> None:
    b = budget(allowance=0, global_allowance=0)
    assert all(b.answer("192.0.2.1", 44, 30, now=float(i)) for i in range(1000))
    assert b.refused == 0


def test_what_a_source_sent_pays_for_its_replies() -> None:
    b = budget(allowance=0)
    b.received("192.0.2.1", 100, now=0.0)
    assert b.allow("192.0.2.1", 60, now=1.0)
    assert b.allow("192.0.2.1", 40, now=2.0)
    assert not b.allow("192.0.2.1", 1, now=3.0)
    # Another source has its own ledger.
    assert not b.allow("192.0.2.2", 1, now=3.0)


def test_the_ledger_forgets_after_two_windows() -> None:
    b = budget(allowance=100)
    assert b.allow("192.0.2.1", 100, now=0.0)
    assert not b.allow("192.0.2.1", 1, now=WINDOW - 0.1)
    # Still counted in the next period (it is the previous one there)...
    assert not b.allow("192.0.2.1", 1, now=WINDOW + 1)
    # ...and gone once that period is over too.
    assert b.allow("192.0.2.1", 100, now=2 * WINDOW + 2)


def test_the_table_is_bounded() -> None:
    b = budget(max_sources=100)
    for i in range(10_000):
        b.answer(f"10.0.{i // 256}.{i % 256}", 20, 88, now=0.001 * i)
    assert len(b) <= 2 * 100


def test_the_global_cap_bounds_a_flood_of_spoofed_sources() -> None:
    b = budget(allowance=4096, global_allowance=68 * 1000)
    sent = 0
    for i in range(5000):
        if b.answer(f"10.{i // 65536}.{i // 256 % 256}.{i % 256}", 20, 88, now=1.0):
            sent += 88
    # Each answered source got 68 bytes more than it sent, 1000 of them at most.
    assert sent == 88 * 1000
    # A reply paid for by its request still goes out.
    assert b.answer("192.0.2.9", 100, 88, now=1.0)


def test_disabled_allows_everything() -> None:
    b = budget(enabled=False, allowance=0)
    assert all(b.answer("192.0.2.1", 20, 10_000, now=0.0) for _ in range(100))
    assert len(b) == 0


@pytest.mark.parametrize(
    "bad",
    [{"window": 0.0}, {"allowance": -1}, {"global_allowance": -1}, {"max_sources": 0}],
)
def test_bad_settings_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        budget(**bad)


# Events: (time step, bytes received, bytes asked to send).
_events = st.lists(
    st.tuples(
        st.floats(min_value=0.0, max_value=7.0),
        st.integers(min_value=0, max_value=600),
        st.integers(min_value=0, max_value=600),
    ),
    max_size=200,
)


@settings(max_examples=300, deadline=None)
@given(events=_events, allowance=st.integers(min_value=0, max_value=2000))
def test_over_any_window_sent_is_at_most_received_plus_allowance(
    events: list[tuple[float, int, int]], allowance: int
) -> None:
    """The documented guarantee, checked against an exact replay: at every
    allowed reply, what was sent in the last window is at most the allowance
    plus what was received in the two windows before it; and over the whole
    run, at most what was received plus one allowance per window."""
    b = budget(allowance=allowance)
    now = 0.0
    received: list[tuple[float, int]] = []
    sent: list[tuple[float, int]] = []
    for step, size_in, size_out in events:
        now += step
        b.received("198.51.100.7", size_in, now)
        received.append((now, size_in))
        if b.allow("198.51.100.7", size_out, now):
            sent.append((now, size_out))
            out = sum(n for t, n in sent if t > now - WINDOW)
            got = sum(n for t, n in received if t > now - 2 * WINDOW)
            assert out <= got + allowance
    periods = int(now // WINDOW) + 1
    total_in = sum(n for _, n in received)
    assert sum(n for _, n in sent) <= total_in + allowance * periods


@settings(max_examples=200, deadline=None)
@given(
    events=st.lists(
        st.tuples(
            st.integers(min_value=0, max_value=20),
            st.integers(min_value=0, max_value=300),
            st.integers(min_value=0, max_value=300),
        ),
        max_size=300,
    ),
    cap=st.integers(min_value=0, max_value=5000),
)
def test_the_global_cap_bounds_the_total_overdraft(
    events: list[tuple[int, int, int]], cap: int
) -> None:
    """Within one period, what all sources together were sent beyond what each
    of them sent never exceeds the global allowance, whatever the mix."""
    b = budget(allowance=10**9, global_allowance=cap, max_sources=10**6)
    received: dict[int, int] = {}
    sent: dict[int, int] = {}
    for source, size_in, size_out in events:
        b.received(f"192.0.2.{source}", size_in, now=1.0)
        received[source] = received.get(source, 0) + size_in
        if b.allow(f"192.0.2.{source}", size_out, now=1.0):
            sent[source] = sent.get(source, 0) + size_out
        overdraft = sum(max(0, n - received.get(s, 0)) for s, n in sent.items())
        assert overdraft <= cap
