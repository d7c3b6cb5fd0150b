"""crossroads.metrics: one label over a table of counts, in a stable order."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily

from crossroads.metrics import add_counts, counter_by, unregister


def _samples(family: CounterMetricFamily) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for s in family.samples]


def test_counter_by_has_one_sample_per_key_sorted_by_key() -> None:
    family = counter_by("x_dropped", "Dropped, by reason.", "reason", {"b": 2, "a": 1})
    assert _samples(family) == [
        ("x_dropped_total", {"reason": "a"}, 1),
        ("x_dropped_total", {"reason": "b"}, 2),
    ]


def test_add_counts_prefixes_the_label_so_tables_share_a_family() -> None:
    family = counter_by("x_dropped", "Dropped, by reason.", "reason", {"short": 3})
    add_counts(family, {"unknown": 4, "late": 5}, "punch-")
    assert [s.labels["reason"] for s in family.samples] == [
        "short",
        "punch-late",
        "punch-unknown",
    ]
    assert [s.value for s in family.samples] == [3, 5, 4]


def test_unregister_takes_collectors_off_and_may_be_repeated() -> None:
    registry = CollectorRegistry()
    first = Counter("x_first", "First.", registry=registry)
    second = Counter("x_second", "Second.", registry=registry)
    unregister(registry, first)
    assert registry.get_sample_value("x_first_total") is None
    assert registry.get_sample_value("x_second_total") == 0
    unregister(registry, first, second)  # first is gone already: skipped
    assert registry.get_sample_value("x_second_total") is None
