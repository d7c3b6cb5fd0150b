"""FailureBudget: per-source and global token buckets of failed guesses."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from crossroads.proto.budget import BudgetConfig, FailureBudget, source_key


def spend_all(budget: FailureBudget, source: str, now: float, tries: int) -> int:
    return sum(budget.try_spend(source, now) for _ in range(tries))


def test_a_source_gets_its_burst_then_its_rate() -> None:
    budget = FailureBudget(BudgetConfig(1.0, 5.0, 0.0, 1.0))
    assert spend_all(budget, "192.0.2.1", 0.0, 10) == 5
    assert spend_all(budget, "192.0.2.1", 2.0, 10) == 2  # two seconds refill two
    assert spend_all(budget, "192.0.2.2", 2.0, 10) == 5  # another source is separate
    assert budget.refused_source == 5 + 8 + 5


def test_the_global_bucket_bounds_every_source_together() -> None:
    budget = FailureBudget(BudgetConfig(1.0, 5.0, 1.0, 10.0))
    spent = sum(budget.try_spend(f"192.0.2.{i}", 0.0) for i in range(1, 50))
    assert spent == 10
    assert budget.refused_global == 39


def test_a_refunded_try_costs_nothing() -> None:
    budget = FailureBudget(BudgetConfig(0.01, 3.0, 0.01, 3.0))
    for _ in range(100):
        assert budget.try_spend("198.51.100.7", 0.0)
        budget.refund("198.51.100.7")


def test_ipv6_counts_per_64_and_mapped_ipv4_as_ipv4() -> None:
    assert source_key("2001:db8:1:2::5") == source_key("2001:db8:1:2:ffff::9")
    assert source_key("2001:db8:1:2::5") != source_key("2001:db8:1:3::5")
    assert source_key("::ffff:192.0.2.9") == "192.0.2.9"
    assert source_key("not an address") == "not an address"
    budget = FailureBudget(BudgetConfig(0.001, 2.0, 0.0, 1.0))
    tried = [budget.try_spend(f"2001:db8::{i:x}", 0.0) for i in range(1, 10)]
    assert sum(tried) == 2


def test_tracked_sources_are_bounded() -> None:
    budget = FailureBudget(BudgetConfig(1.0, 1.0, 0.0, 1.0), max_sources=100)
    for i in range(1000):
        budget.try_spend(f"10.0.{i // 256}.{i % 256}", 0.0)
    assert budget.tracked_sources == 100


def test_zero_rates_switch_the_budget_off() -> None:
    budget = FailureBudget(BudgetConfig(0.0, 1.0, 0.0, 1.0))
    assert spend_all(budget, "192.0.2.1", 0.0, 1000) == 1000
    assert budget.tracked_sources == 0


@given(
    st.lists(
        st.tuples(st.integers(0, 5), st.floats(0, 0.5), st.booleans()), max_size=200
    )
)
def test_failures_never_exceed_burst_plus_rate_times_time(
    steps: list[tuple[int, float, bool]],
) -> None:
    config = BudgetConfig(2.0, 4.0, 3.0, 6.0)
    budget = FailureBudget(config)
    now = 0.0
    failures = 0
    per_source = [0] * 6
    for source, advance, succeeded in steps:
        now += advance
        if budget.try_spend(f"192.0.2.{source}", now):
            if succeeded:
                budget.refund(f"192.0.2.{source}")
            else:
                failures += 1
                per_source[source] += 1
    assert failures <= config.global_burst + config.global_rate * now + 1e-9
    for count in per_source:
        assert count <= config.per_source_burst + config.per_source_rate * now + 1e-9
