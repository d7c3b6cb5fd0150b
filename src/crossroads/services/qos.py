"""QoS servers: the UDP echo Unity's QoS client measures regions with.

Every relay node answers the QoS protocol (docs/qos.md) so that a client can
measure its round trip to the node's region before it asks for an
allocation: in ``crossroads serve`` this service runs beside the relay node
and the node registers this listener's endpoint with its heartbeat; a relay
node started without it (``--only relay``) starts its own listener
(:func:`start_listener`). ``crossroads serve --only qos`` runs a QoS server
alone, for a region whose relay nodes run elsewhere: it then registers itself
in the store under ``qos:server:<id>`` (region, endpoint; TTL three
heartbeats), and the discovery API (:mod:`crossroads.web.qos`) lists it while
its region has a relay node with room.

The listener is bounded like every UDP listener: answers are always smaller
than their requests (no amplification), a source is throttled, then dropped,
over ``--qos-rate`` requests per second, and the per-source rate state is a
table of the resource budget (``qos-sources``) that lives one second.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from crossroads.config import check_positive, setting
from crossroads.errors import StoreError
from crossroads.metrics import counter_by, unregister
from crossroads.proto.qos.server import DEFAULT_RATE, WINDOW, QosServer
from crossroads.services.base import Service, ServiceContext, stop_task
from crossroads.store.base import Store
from crossroads.transport.admission import Admission, Pool, ResourceBudget
from crossroads.transport.driver import DatagramDriver
from crossroads.transport.pktinfo import open_datagram_endpoint
from crossroads.transport.sockets import bind_socket, bound_address
from crossroads.types import Address, frozen, show_address

NAME = "qos"
log = logging.getLogger("crossroads.qos")

#: The budget's table of per-source rate state.
SOURCES_TABLE = "qos-sources"
#: Measured fixed memory of one source's rate state: a dict entry (key string
#: of an IPv4 address ~60 B, slot and int ~40 B) and its place in the
#: admitted list (8 B), plus the budget's own per-source count (~100 B).
#: tracemalloc over 10,000 sources gives ~190 B each
#: (tests/services/test_qos.py::test_bytes_per_source_is_measured).
SOURCE_BYTES = 256
#: Store key prefix of a QoS server that runs without a relay node.
SERVER_PREFIX = "qos:server:"
#: Registrations live three heartbeats, like relay nodes'
#: (services/relay_allocations.py HEARTBEATS_PER_TTL).
HEARTBEATS_PER_TTL = 3


@frozen
class Config:
    """The ``[qos]`` section."""

    port: int = setting(
        7700,
        kind="port",
        help="UDP port of the QoS server (Unity/Multiplay QoS protocol); every "
        "worker of --workers N serves it.",
    )
    public_host: str = setting(
        "",
        kind="host",
        help="Address clients measure (default: --relay-public-host, "
        "--public-host, else the bound address).",
    )
    public_port: int = setting(
        0, kind="port", help="UDP port clients use, when a NAT or proxy changes it."
    )
    region: str = setting(
        "", help="Region this QoS server measures (default: --relay-region)."
    )
    rate: int = setting(
        DEFAULT_RATE,
        check=check_positive,
        help="Requests per second a source gets answered before it is "
        "throttled (twice that: dropped).",
    )
    max_sources: int = setting(
        65_536,
        check=check_positive,
        help="Sources whose rate is tracked at once (more share one throttled "
        "overflow).",
    )
    heartbeat: float = setting(
        5.0,
        check=check_positive,
        help="Seconds between registrations of a QoS server that runs without "
        "a relay node (the TTL is three of them).",
    )


@frozen
class QosServerInfo:
    """A QoS server as registered in the store (one without a relay node)."""

    server_id: str
    region: str
    host: str
    port: int

    @property
    def endpoint(self) -> str:
        return show_address((self.host, self.port))

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "id": self.server_id,
                "region": self.region,
                "host": self.host,
                "port": self.port,
            }
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> QosServerInfo:
        data = json.loads(raw)
        return cls(
            str(data["id"]), str(data["region"]), str(data["host"]), int(data["port"])
        )


async def registered_servers(store: Store) -> list[QosServerInfo]:
    """Every live QoS server registered without a relay node."""
    found = []
    for key in await store.keys(SERVER_PREFIX):
        raw = await store.get(key)
        if raw is None:
            continue
        try:
            found.append(QosServerInfo.from_json(raw))
        except (ValueError, KeyError, TypeError):
            log.warning("ignoring malformed QoS server record %s", key)
    return found


def sources_table(budget: ResourceBudget, cfg: Config) -> Admission:
    """Register the per-source rate state: no descriptor (one shared socket),
    its measured memory, and a life of one rate window (it is cleared when
    the window ends, proto/qos/server.py)."""
    return budget.table(
        SOURCES_TABLE,
        max_items=cfg.max_sources,
        max_per_source=1,
        pool=Pool.NONE,
        bytes_per_item=SOURCE_BYTES,
        # A fifth of a table's memory share: 65,536 sources of 256 B are 16
        # MiB, and a larger share would only be taken from the other tables.
        weight=0.2,
        preauth_deadline=WINDOW,
    )


class _Collector(Collector):
    def __init__(self, listener: QosListener) -> None:
        self.listener = listener

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        core = self.listener.core
        yield CounterMetricFamily(
            "crossroads_qos_answered", "QoS requests answered.", value=core.answered
        )
        yield CounterMetricFamily(
            "crossroads_qos_throttled",
            "QoS answers sent with flow control 'throttle'.",
            value=core.throttled,
        )
        yield counter_by(
            "crossroads_qos_dropped",
            "QoS datagrams dropped, by reason.",
            "reason",
            core.drops,
        )
        yield GaugeMetricFamily(
            "crossroads_qos_sources",
            "Sources with rate state (this window).",
            value=core.sources,
        )


@dataclass(eq=False)
class QosListener:
    """One QoS socket and its core."""

    core: QosServer
    bound: Address
    #: What clients measure (host, port).
    public: Address
    region: str
    transport: asyncio.DatagramTransport | None = None
    _budget: ResourceBudget | None = field(default=None, repr=False)
    _metrics: tuple[CollectorRegistry, Collector] | None = field(
        default=None, repr=False
    )

    @property
    def endpoint(self) -> str:
        """``host:port`` as discovery lists it (Unity: endpoint index 0)."""
        return show_address(self.public)

    def describe(self) -> str:
        return f"udp {show_address(self.bound)} (QoS, region {self.region})"

    async def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None
            self.core.close()
        if self._budget is not None:
            self._budget.forget(SOURCES_TABLE)
            self._budget = None
        if self._metrics is not None:
            registry, collector = self._metrics
            unregister(registry, collector)
            self._metrics = None


def _public_host(ctx: ServiceContext, cfg: Config, relay_host: str, bound: str) -> str:
    for host in (cfg.public_host, relay_host, ctx.config.core.public_host):
        if host:
            return host
    if bound not in ("0.0.0.0", "::"):
        return bound
    return "127.0.0.1"


def _relay_settings(ctx: ServiceContext) -> tuple[str, str, bool]:
    """(region, public host, whether a relay node of this process registers
    the listener) from the relay section. Read by name, not imported: the
    relay service imports this module."""
    relay = ctx.config.sections.get("relay")
    if relay is None:
        return "local", "", False
    node = ctx.config.enabled("relay") and not getattr(relay, "api_only", False)
    return str(relay.region), str(relay.public_host), node


async def start_listener(ctx: ServiceContext) -> QosListener:
    """Bind the QoS port, register it with the budget and run its core."""
    cfg = ctx.section(NAME, Config)
    relay_region, relay_host, _ = _relay_settings(ctx)
    sock = bind_socket(ctx.host, cfg.port, socket.SOCK_DGRAM, shared=True)
    try:
        bound = bound_address(sock)
        table = sources_table(ctx.resources, cfg)
        core = QosServer(rate=cfg.rate, admission=table)
        public = (
            _public_host(ctx, cfg, relay_host, bound[0]),
            cfg.public_port or bound[1],
        )
        listener = QosListener(core, bound, public, cfg.region or relay_region)
        listener._budget = ctx.resources
        ctx.resources.listen(NAME, NAME, "udp", bound, SOURCES_TABLE)
        listener.transport = await open_datagram_endpoint(DatagramDriver(core), sock)
    except BaseException:
        sock.close()
        ctx.resources.forget(SOURCES_TABLE)
        raise
    collector = _Collector(listener)
    ctx.metrics.register(collector)
    listener._metrics = (ctx.metrics, collector)
    return listener


@dataclass(eq=False)
class QosService:
    """The ``qos`` service: a listener, and its registration when no relay
    node of this process registers it."""

    listener: QosListener
    store: Store
    heartbeat: float
    name: str = NAME
    info: QosServerInfo | None = None
    _task: asyncio.Task[None] | None = field(default=None, repr=False)

    def describe(self) -> list[str]:
        return [self.listener.describe()]

    async def register(self) -> None:
        if self.info is not None:
            await self.store.set(
                SERVER_PREFIX + self.info.server_id,
                self.info.to_json(),
                ttl=self.heartbeat * HEARTBEATS_PER_TTL,
            )

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat)
            try:
                await self.register()
            except StoreError:
                pass  # the store logs the outage once; the next beat retries

    def start_registration(self) -> None:
        self.info = QosServerInfo(
            f"{self.listener.region}-qos-{uuid.uuid4().hex[:12]}",
            self.listener.region,
            *self.listener.public,
        )
        self._task = asyncio.create_task(self._beat(), name="qos-heartbeat")

    async def close(self) -> None:
        if self._task is not None:
            await stop_task(self._task)
            self._task = None
            if self.info is not None:
                try:
                    await self.store.delete(SERVER_PREFIX + self.info.server_id)
                except StoreError:
                    pass
        await self.listener.close()


async def serve(ctx: ServiceContext) -> Service:
    cfg = ctx.section(NAME, Config)
    listener = await start_listener(ctx)
    service = QosService(listener, ctx.store, cfg.heartbeat)
    if not _relay_settings(ctx)[2]:
        # No relay node in this process registers this listener: register it
        # on its own, so discovery lists it for its region.
        service.start_registration()
        try:
            await service.register()
        except BaseException:
            await service.close()
            raise
    return service
