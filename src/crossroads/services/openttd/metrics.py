"""The OpenTTD service's Prometheus metrics (``crossroads_openttd_*``).

Every collector of the service is declared through :func:`counter` and
:func:`gauge`, one line each, so the names share one prefix and the listeners
(coordinator, STUN, TURN, the bus) declare theirs the same way.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

PREFIX = "crossroads_openttd_"


def counter(
    registry: CollectorRegistry, name: str, documentation: str, *labels: str
) -> Counter:
    """The counter ``crossroads_openttd_<name>``, by ``labels``."""
    return Counter(PREFIX + name, documentation, labels, registry=registry)


def gauge(
    registry: CollectorRegistry, name: str, documentation: str, *labels: str
) -> Gauge:
    """The gauge ``crossroads_openttd_<name>``, by ``labels``."""
    return Gauge(PREFIX + name, documentation, labels, registry=registry)


class CoordinatorMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registrations = counter(
            registry,
            "registrations",
            "Server registrations, by result and connection type.",
            "result",
            "connection_type",
        )
        self.servers = gauge(
            registry, "servers", "Servers registered on this instance."
        )
        self.updates = counter(
            registry, "server_updates", "SERVER_UPDATE packets accepted."
        )
        self.listings = counter(
            registry, "listings", "CLIENT_LISTING requests answered."
        )
        self.connects = counter(
            registry,
            "connects",
            "Joins by invite code, by result and by the method that worked or "
            "was last tried.",
            "result",
            "method",
        )
        self.errors = counter(
            registry, "gc_errors", "GC_ERROR packets sent, by error type.", "error"
        )
        self.probes = counter(
            registry,
            "probes",
            "Direct probes (game-protocol exchanges), by result.",
            "result",
        )
        self.ignored = counter(
            registry,
            "ignored",
            "Well-formed reports that were ignored, by reason.",
            "reason",
        )
        self.store_errors = counter(
            registry, "store_errors", "Store operations that failed."
        )
