"""The registration rate limiter counts sources as the admission does."""

from __future__ import annotations

from crossroads.services.openttd.limits import AddressRateLimiter


def test_one_ipv6_64_shares_one_bucket() -> None:
    # Each registration from a new address of the same /64 used to get a fresh
    # bucket: a /64 registered without limit (and each registration reserves an
    # invite code for 30 days).
    limiter = AddressRateLimiter(per_minute=3)
    assert all(limiter.allow(f"2001:db8:0:1::{i}", 0.0) for i in range(1, 4))
    assert not limiter.allow("2001:db8:0:1::4", 0.0)
    assert not limiter.allow("2001:db8:0:1:ffff::1", 0.0)
    # Another /64 and an IPv4 source have their own buckets.
    assert limiter.allow("2001:db8:0:2::1", 0.0)
    assert limiter.allow("192.0.2.1", 0.0)
    assert len(limiter) == 3


def test_ipv4_mapped_is_the_ipv4_source() -> None:
    limiter = AddressRateLimiter(per_minute=1)
    assert limiter.allow("192.0.2.7", 0.0)
    assert not limiter.allow("::ffff:192.0.2.7", 0.0)
    # A bucket refills at per_minute / 60 per second.
    assert limiter.allow("::ffff:192.0.2.7", 60.0)
