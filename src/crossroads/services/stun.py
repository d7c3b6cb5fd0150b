"""The ``stun`` service: STUN Binding (RFC 8489) and NAT behaviour discovery
(RFC 5780) over UDP and TCP, IPv4 and IPv6, on the STUN/TURN port.

Sockets
-------
Port ``--stun-port`` (3478) on ``--host``, UDP and TCP. With RFC 5780 on
(``--stun-rfc5780``, the default) also ``--stun-alt-port`` (3479) on the same IP,
and, when ``--stun-alt-host`` names a second IP, both ports on that IP too: four
UDP and four TCP endpoints, as RFC 5780 §6 asks. When ``--host`` is the IPv4
wildcard (``0.0.0.0``), the same ports are also bound on ``::`` (IPv6 only), so
the server answers both families; a machine without IPv6 just skips that.

The port itself -- its sockets, the sorting of each datagram, the Binding core
and, when TURN runs, TURN's route table from bind time -- is one engine in
transport/ (:class:`~crossroads.transport.stunport.StunTurnPort`); this
service holds its configuration and metrics. UDP sockets are drained in
batches with ``recvmmsg`` and answered with one ``sendmmsg`` per batch
(``--stun-batch-io``, Linux, on by default); elsewhere each datagram is one
asyncio callback.

Metrics (in the runtime registry, counted in plain ints on the hot path and
exported at scrape time): ``crossroads_stun_requests_total{transport}``,
``crossroads_stun_responses_total{transport,class}``,
``crossroads_stun_dropped_total{reason}`` (``rate-limited`` is the rate-limit
counter), ``crossroads_stun_tcp_connections``.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

import crossroads
from crossroads.config import check_non_negative, check_positive, setting
from crossroads.errors import ConfigError
from crossroads.metrics import counter_by, unregister
from crossroads.proto.reflection import ReflectionBudget
from crossroads.services.base import ServiceContext
from crossroads.transport.admission import Admission
from crossroads.transport.pktinfo import is_wildcard
from crossroads.transport.sockets import family_of
from crossroads.transport.stunport import (
    TCP_CONTROL_ALLOWANCE,
    TCP_MAX_UNSENT,
    TCP_WRITE_STALL_TIMEOUT,
    BatchUdpEndpoint,
    Endpoint,
    PortConfig,
    PortStats,
    StunTurnPort,
    TcpConnection,
    UdpEndpoint,
)
from crossroads.types import Address, frozen

__all__ = [
    "TCP_CONTROL_ALLOWANCE",
    "TCP_MAX_UNSENT",
    "TCP_WRITE_STALL_TIMEOUT",
    "BatchUdpEndpoint",
    "Config",
    "Endpoint",
    "StunService",
    "TcpConnection",
    "UdpEndpoint",
    "serve",
]

NAME = "stun"
log = logging.getLogger("crossroads.stun")


@frozen
class Config:
    """``[stun]`` settings."""

    port: int = setting(3478, kind="port", help="STUN/TURN port, UDP and TCP.")
    alt_port: int = setting(
        3479,
        kind="port",
        help="RFC 5780 alternate port (CHANGE-REQUEST change-port, OTHER-ADDRESS).",
    )
    alt_host: str = setting(
        "",
        kind="host",
        help="Second IP of this host for RFC 5780 (change-IP, OTHER-ADDRESS); "
        "empty = none: OTHER-ADDRESS is then never sent.",
    )
    rfc5780: bool = setting(
        True,
        help="RFC 5780 behaviour discovery: alternate port, RESPONSE-ORIGIN, "
        "CHANGE-REQUEST, RESPONSE-PORT, PADDING.",
    )
    software: str = setting(
        f"crossroads {crossroads.__version__}",
        help="SOFTWARE attribute in responses; empty to leave it out.",
    )
    tcp: bool = setting(True, help="Also serve STUN over TCP.")
    batch_io: bool = setting(
        True,
        help="Read and answer UDP in batches with recvmmsg/sendmmsg (Linux); "
        "off, or where unavailable: one asyncio callback per datagram.",
    )
    rate_limit: int = setting(
        100,
        check=check_non_negative,
        help="Binding requests answered per second per source IP; 0 = unlimited.",
    )
    rate_limit_sources: int = setting(
        100_000,
        check=check_positive,
        help="Source IPs tracked by the rate limiter per second (memory bound).",
    )
    tcp_max_connections: int = setting(
        10_000,
        check=check_positive,
        help="Concurrent TCP connections (also capped by the descriptor share "
        "of the listener, see docs/security.md); more are closed at once.",
    )
    tcp_max_connections_per_ip: int = setting(
        128,
        check=check_positive,
        help="Concurrent TCP connections from one IPv4 address or IPv6 /64.",
    )
    tcp_message_timeout: float = setting(
        10.0,
        check=check_positive,
        help="Seconds a TCP client has to send its first complete message after "
        "connecting, and to finish any message it has started (slowloris).",
    )
    tcp_idle_timeout: float = setting(
        900.0,
        check=check_positive,
        help="Seconds before an idle TCP connection is closed.",
    )

    def __post_init__(self) -> None:
        if self.rfc5780 and self.port and self.port == self.alt_port:
            raise ValueError("alt_port: must differ from port")


# ------------------------------------------------------------------ metrics


class _Collector(Collector):
    def __init__(self, service: StunService) -> None:
        self.service = service

    def collect(self) -> Iterator[Any]:
        service = self.service
        stats = service.stats
        udp = service.udp_endpoints
        requests = CounterMetricFamily(
            "crossroads_stun_requests",
            "STUN Binding messages handled by the STUN server.",
            labels=["transport"],
        )
        requests.add_metric(["udp"], sum(e.requests for e in udp))
        requests.add_metric(["tcp"], stats.tcp_requests)
        yield requests
        responses = CounterMetricFamily(
            "crossroads_stun_responses",
            "STUN responses sent by the STUN server.",
            labels=["transport", "class"],
        )
        responses.add_metric(["udp", "success"], sum(e.success for e in udp))
        responses.add_metric(["udp", "error"], sum(e.errors for e in udp))
        responses.add_metric(["tcp", "success"], stats.tcp_success)
        responses.add_metric(["tcp", "error"], stats.tcp_error)
        yield responses
        yield counter_by(
            "crossroads_stun_dropped",
            "Input dropped by the STUN service, by reason.",
            "reason",
            stats.drops,
        )
        gauge = GaugeMetricFamily(
            "crossroads_stun_tcp_connections", "Open STUN/TURN TCP connections."
        )
        gauge.add_metric([], stats.tcp_connections)
        yield gauge


# ------------------------------------------------------------------ service


class StunService:
    """The running STUN service: the configuration and metrics of the
    STUN/TURN port (:attr:`port`). Other services find it in
    ``ctx.running["stun"]``."""

    name = NAME

    def __init__(self, ctx: ServiceContext, config: Config) -> None:
        self.ctx = ctx
        self.config = config
        self.port = StunTurnPort(
            PortConfig(
                software=config.software,
                rate_limit=config.rate_limit,
                rate_limit_sources=config.rate_limit_sources,
                tcp=config.tcp,
                batch_io=config.batch_io,
                tcp_max_connections=config.tcp_max_connections,
                tcp_max_connections_per_ip=config.tcp_max_connections_per_ip,
                tcp_message_timeout=config.tcp_message_timeout,
                tcp_idle_timeout=config.tcp_idle_timeout,
                turn=ctx.config.enabled("turn"),
            ),
            ctx.resources,
            ctx.reflection_budget,
            ctx.route_table,
        )
        self._collector = _Collector(self)
        self._closed = False

    # The port's state, as the metrics, the console and the tests read it.

    @property
    def stats(self) -> PortStats:
        return self.port.stats

    @property
    def udp_endpoints(self) -> list[UdpEndpoint | BatchUdpEndpoint]:
        return self.port.udp_endpoints

    @property
    def connections(self) -> set[TcpConnection]:
        return self.port.connections

    @property
    def reflection(self) -> ReflectionBudget:
        """Binding replies over UDP per source IP (docs/security.md)."""
        return self.port.reflection

    @property
    def admission(self) -> Admission:
        return self.port.admission

    @property
    def tls_addresses(self) -> list[Address]:
        return self.port.tls_addresses

    @property
    def primary(self) -> Address:
        """The bound (host, port) of the primary UDP socket."""
        return self.port.primary

    def sweep(self, now: float) -> None:
        """The TCP deadlines (:meth:`StunTurnPort.sweep`)."""
        self.port.sweep(now)

    def describe(self) -> list[str]:
        return list(self.port.descriptions)

    def tls_protocol_factory(self) -> Callable[[], asyncio.Protocol]:
        return self.port.tls_protocol_factory()

    def add_tls_address(self, address: Address) -> None:
        self.port.add_tls_address(address)

    async def listen_tls(self, port: int, context: ssl.SSLContext) -> int:
        """Serve STUN/TURN over TLS on ``port`` of ``--host``; return the port."""
        return await self.port.listen_tls(self.ctx.host, port, context)

    async def start(self) -> None:
        cfg = self.config
        host = self.ctx.host
        public = self.ctx.config.core.public_host
        ports = [cfg.port, cfg.alt_port] if cfg.rfc5780 else [cfg.port]
        hosts = [host]
        if cfg.alt_host:
            if not cfg.rfc5780:
                raise ConfigError("stun.alt_host: needs RFC 5780 (--stun-rfc5780)")
            if is_wildcard(host):
                raise ConfigError(
                    "stun.alt_host: RFC 5780 with a second IP needs --host set to "
                    "this host's first IP, not a wildcard"
                )
            if family_of(host) != family_of(cfg.alt_host) or cfg.alt_host == host:
                raise ConfigError(
                    "stun.alt_host: must be another address of --host's family"
                )
            hosts.append(cfg.alt_host)
        sets = [(hosts, False)]
        if host == "0.0.0.0":
            sets.append((["::"], True))
        await self.port.bind(sets, ports, public)
        self.ctx.metrics.register(self._collector)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self.port.close()
        unregister(self.ctx.metrics, self._collector)


async def serve(ctx: ServiceContext) -> StunService:
    """Bind the STUN/TURN port and start answering."""
    service = StunService(ctx, ctx.section(NAME, Config))
    try:
        await service.start()
    except BaseException:
        await service.close()
        raise
    return service
