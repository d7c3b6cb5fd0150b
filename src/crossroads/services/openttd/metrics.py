"""The OpenTTD coordinator's Prometheus metrics (``crossroads_openttd_*``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class CoordinatorMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registrations = Counter(
            "crossroads_openttd_registrations",
            "Server registrations, by result and connection type.",
            ["result", "connection_type"],
            registry=registry,
        )
        self.servers = Gauge(
            "crossroads_openttd_servers",
            "Servers registered on this instance.",
            registry=registry,
        )
        self.updates = Counter(
            "crossroads_openttd_server_updates",
            "SERVER_UPDATE packets accepted.",
            registry=registry,
        )
        self.listings = Counter(
            "crossroads_openttd_listings",
            "CLIENT_LISTING requests answered.",
            registry=registry,
        )
        self.connects = Counter(
            "crossroads_openttd_connects",
            "Joins by invite code, by result and by the method that worked or was last tried.",
            ["result", "method"],
            registry=registry,
        )
        self.errors = Counter(
            "crossroads_openttd_gc_errors",
            "GC_ERROR packets sent, by error type.",
            ["error"],
            registry=registry,
        )
        self.probes = Counter(
            "crossroads_openttd_probes",
            "Direct probes (game-protocol exchanges), by result.",
            ["result"],
            registry=registry,
        )
        self.ignored = Counter(
            "crossroads_openttd_ignored",
            "Well-formed reports that were ignored, by reason.",
            ["reason"],
            registry=registry,
        )
        self.store_errors = Counter(
            "crossroads_openttd_store_errors",
            "Store operations that failed.",
            registry=registry,
        )
