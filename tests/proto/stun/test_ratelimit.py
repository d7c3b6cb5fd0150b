from __future__ import annotations

from crossroads.proto.stun.ratelimit import SourceRateLimiter


def test_limit_per_source_and_window() -> None:
    limiter = SourceRateLimiter(3)
    assert [limiter.allow("a", 0.0) for _ in range(4)] == [True, True, True, False]
    assert limiter.allow("b", 0.5)
    assert limiter.limited == 1
    assert limiter.allow("a", 1.0)  # new window


def test_unlimited() -> None:
    limiter = SourceRateLimiter(0)
    assert all(limiter.allow("a", 0.0) for _ in range(1000))
    assert len(limiter) == 0


def test_table_is_bounded_and_overflow_shares_one_budget() -> None:
    limiter = SourceRateLimiter(2, max_sources=3)
    for source in "abc":
        assert limiter.allow(source, 0.0)
    # Sources beyond the table share the overflow budget (2 per window).
    assert limiter.allow("d", 0.0)
    assert limiter.allow("e", 0.0)
    assert not limiter.allow("f", 0.0)
    assert len(limiter) == 4  # three sources + the overflow counter
    assert limiter.allow("f", 2.0)
