"""The TCP admission helper: per-source keys, caps, release and shares."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from crossroads.transport.admission import (
    MIN_RESERVE,
    REFUSED_OVER_IP_LIMIT,
    REFUSED_OVER_LIMIT,
    ResourceBudget,
    source_key,
)


def test_source_key_is_the_ipv4_address_or_the_ipv6_slash_64() -> None:
    assert source_key("192.0.2.7") == "192.0.2.7"
    assert source_key("::ffff:192.0.2.7") == "192.0.2.7"
    assert source_key("2001:db8:1:2:aaaa::1") == "2001:db8:1:2::/64"
    assert source_key("2001:db8:1:2:bbbb::9") == "2001:db8:1:2::/64"
    assert source_key("2001:db8:1:3::1") == "2001:db8:1:3::/64"
    assert source_key("fe80::1%eth0") == "fe80::/64"
    assert source_key("not an address") == "not an address"


def test_an_ipv6_host_cannot_dodge_the_cap_by_changing_its_interface_id() -> None:
    admission = ResourceBudget(100_000).listener("http", 1000, 2)
    assert admission.admit("2001:db8::1") is None
    assert admission.admit("2001:db8::2") is None
    assert admission.admit("2001:db8::3") == REFUSED_OVER_IP_LIMIT
    assert admission.admit("2001:db8:0:1::3") is None


def test_release_frees_the_slot_and_forgets_the_source() -> None:
    admission = ResourceBudget(100_000).listener("stun", 2, 5)
    assert admission.admit("192.0.2.1") is None
    assert admission.admit("192.0.2.2") is None
    assert admission.admit("192.0.2.3") == REFUSED_OVER_LIMIT
    admission.release("192.0.2.1")
    admission.release("192.0.2.1")  # a second release changes nothing
    assert admission.live == 1 and admission.per_source == {"192.0.2.2": 1}
    assert admission.admit("192.0.2.3") is None
    assert admission.refused == {REFUSED_OVER_LIMIT: 1}


def test_a_stopped_listener_gives_its_share_back() -> None:
    budget = ResourceBudget(1000)
    first = budget.listener("a", 10_000, 10_000)
    budget.listener("b", 10_000, 10_000)
    assert first.max_items == 250
    assert budget.reserved() == 500
    budget.forget("b")
    assert first.max_items == 500


@given(st.integers(1, 1 << 22), st.integers(1, 12))
def test_shares_never_exceed_the_limit_less_the_reserve(limit: int, count: int) -> None:
    budget = ResourceBudget(limit)
    for i in range(count):
        budget.listener(str(i), 1 << 30, 1 << 30)
    assert budget.share() >= 1
    pool = min(limit // 2, limit - MIN_RESERVE)
    if pool >= count:
        assert budget.share() * count <= pool
