"""The one resource budget: per-source keys, caps, release, descriptor and
memory shares, the registry snapshot."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crossroads.proto.admission import (
    REFUSED_OVER_IP_LIMIT,
    REFUSED_OVER_LIMIT,
    REFUSED_OVER_MEMORY,
)
from crossroads.proto.budget import source_key
from crossroads.transport.admission import (
    MIN_RESERVE,
    PER_SOURCE_FRACTION,
    Pool,
    ResourceBudget,
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


def test_a_source_holds_at_most_an_eighth_of_a_table() -> None:
    # Configured 128 per source, but the descriptor share is 73 at 1,024: a
    # source may hold 9, eight sources are needed to fill the table.
    budget = ResourceBudget(1024)
    tables = [budget.listener(f"l{i}", 10_000, 128) for i in range(7)]
    http = tables[0]
    assert http.max_items == 73
    assert http.max_per_source == int(73 * PER_SOURCE_FRACTION) == 9
    admitted = sum(http.admit("192.0.2.1") is None for _ in range(100))
    assert admitted == 9
    assert http.refused == {REFUSED_OVER_IP_LIMIT: 91}


def test_per_client_socket_tables_share_the_rest_by_weight() -> None:
    budget = ResourceBudget(1024, memory=1 << 30)
    budget.listener("http", 10_000, 128)
    turn = budget.table(
        "turn", max_items=100_000, max_per_source=256, descriptors_per_item=2, weight=2
    )
    forwarders = budget.table(
        "forwarders", max_items=100_000, max_per_source=64, descriptors_per_item=1
    )
    # 1,024 - 64 reserved - 512 for TCP connections = 448 per-client sockets,
    # two thirds to TURN (2 each), a third to the forwarders (1 each).
    assert budget.relay_pool() == 448
    assert turn.max_items == 448 * 2 // 3 // 2
    assert forwarders.max_items == 448 // 3
    held = turn.max_items * 2 + forwarders.max_items
    assert held <= budget.relay_pool()
    budget.forget("turn")
    assert forwarders.max_items == 448


def test_memory_shares_cap_the_items_and_the_buffered_bytes() -> None:
    budget = ResourceBudget(100_000, memory=1 << 20)
    sessions = budget.table(
        "sessions", max_items=1 << 20, max_per_source=1 << 20,
        pool=Pool.NONE, bytes_per_item=1024,
    )  # fmt: skip
    budget.table(
        "other", max_items=1 << 20, max_per_source=1 << 20,
        pool=Pool.NONE, bytes_per_item=1024, weight=3,
    )  # fmt: skip
    # A quarter of 1 MiB at 1 KiB an item.
    assert sessions.max_items == 256
    for i in range(200):
        assert sessions.admit(f"192.0.2.{i % 250}") is None
    # What the items do not take is left for their buffered data.
    assert sessions.max_bytes == (1 << 18) - 200 * 1024
    assert sessions.charge(sessions.max_bytes)
    assert not sessions.charge(1)
    assert sessions.refused == {REFUSED_OVER_MEMORY: 1}
    sessions.uncharge(10)
    assert sessions.charge(10)


def test_a_table_is_registered_once_and_holds_descriptors_from_a_pool() -> None:
    budget = ResourceBudget(1024)
    budget.table("t", max_items=1, max_per_source=1)
    with pytest.raises(ValueError, match="registered twice"):
        budget.table("t", max_items=1, max_per_source=1)
    with pytest.raises(ValueError, match="names no pool"):
        budget.table("u", max_items=1, max_per_source=1, pool=Pool.NONE,
                     descriptors_per_item=1)  # fmt: skip


def test_the_snapshot_names_every_listener_and_table() -> None:
    budget = ResourceBudget(1024, memory=64 << 20)
    budget.listener("http", 10_000, 128).admit("192.0.2.1")
    budget.listen("http", "http", "tcp", ("127.0.0.1", 8080), "http")
    budget.listen("stun", "stun", "udp", ("127.0.0.1", 3478))
    snap = budget.snapshot()
    assert snap["fd_limit"] == 1024 and snap["memory_budget"] == 64 << 20
    assert [t["table"] for t in snap["tables"]] == ["http"]
    assert snap["tables"][0]["live"] == 1
    assert {(e["transport"], e["port"], e["table"]) for e in snap["listeners"]} == {
        ("tcp", 8080, "http"),
        ("udp", 3478, ""),
    }
    # Two listeners and one accepted connection.
    assert snap["descriptors_accounted"] == 3
