"""Helpers for the Prometheus collectors of services and transports.

Every collector turns the plain counters a core keeps (``{"too-short": 3, ...}``)
into metric families at scrape time, so the packet path pays nothing for
metrics. Most of them are one label over such a table; the
two helpers here write that loop once, in one order (sorted by label value, so
a scrape is stable from one to the next).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector


def add_counts(
    family: CounterMetricFamily, counts: Mapping[str, int], prefix: str = ""
) -> None:
    """Add one sample per entry of ``counts`` to a family with one label, the
    label value being ``prefix`` + the key (``"punch-"`` + ``"unknown-guid"``),
    so the tables of several parts can share one family."""
    for key, count in sorted(counts.items()):
        family.add_metric([prefix + key], count)


def counter_by(
    name: str, documentation: str, label: str, counts: Mapping[str, int]
) -> CounterMetricFamily:
    """A counter family with one label (``reason``, ``result`` ...) and one
    sample per entry of ``counts``."""
    family = CounterMetricFamily(name, documentation, labels=[label])
    add_counts(family, counts)
    return family


def unregister(registry: CollectorRegistry, *collectors: Collector) -> None:
    """Take a closing service's collectors off the runtime's registry. One that
    is not (or no longer) registered is skipped: close stays idempotent."""
    for collector in collectors:
        with contextlib.suppress(KeyError):
            registry.unregister(collector)
