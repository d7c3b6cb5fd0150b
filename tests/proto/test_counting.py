"""The counting helpers the cores share (per-key counts, token buckets)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from crossroads.proto.counting import decrement, spend_token


def test_a_count_that_reaches_zero_leaves_the_table() -> None:
    counts = {"192.0.2.1": 2, "192.0.2.2": 1}
    decrement(counts, "192.0.2.1")
    decrement(counts, "192.0.2.2")
    assert counts == {"192.0.2.1": 1}
    decrement(counts, "192.0.2.9")  # unknown key: nothing to forget
    assert counts == {"192.0.2.1": 1}


def test_a_bucket_spends_its_burst_then_refills_at_the_rate() -> None:
    bucket = [3.0, 0.0]
    assert [spend_token(bucket, 0.0, 2.0, 3.0) for _ in range(4)] == [
        True,
        True,
        True,
        False,
    ]
    # Half a second at 2 tokens/s: one token back, spent at once.
    assert spend_token(bucket, 0.5, 2.0, 3.0)
    assert not spend_token(bucket, 0.5, 2.0, 3.0)
    # A long silence refills up to the burst, never beyond.
    assert [spend_token(bucket, 100.0, 2.0, 3.0) for _ in range(4)] == [
        True,
        True,
        True,
        False,
    ]


@given(
    st.lists(st.floats(min_value=0.0, max_value=10.0), max_size=50),
    st.floats(min_value=0.01, max_value=100.0),
    st.floats(min_value=1.0, max_value=50.0),
)
def test_a_bucket_never_spends_more_than_burst_plus_refill(
    gaps: list[float], rate: float, burst: float
) -> None:
    bucket, now, spent = [burst, 0.0], 0.0, 0
    for gap in gaps:
        now += gap
        spent += spend_token(bucket, now, rate, burst)
        assert 0.0 <= bucket[0] <= burst
    assert spent <= burst + now * rate + 1e-9
