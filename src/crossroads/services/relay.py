"""The ``relay`` service: Unity-Relay-compatible relay nodes and the allocations API.

One process runs, by default, both halves:

- a **relay node**: a UDP socket (7780) speaking the Unity Relay protocol, driven
  by :class:`crossroads.proto.relay.server.RelayServer` behind the fast-path
  endpoint :class:`crossroads.transport.relay.RelayEndpoint`. The node registers
  itself in the store under ``relay:node:<id>`` (region, public address, capacity,
  load) with a TTL refreshed by a heartbeat, so a node that dies disappears from
  the allocation service by itself;
- the **allocations API** (``/v1/allocate``, ``/v1/joincode``, ``/v1/join``,
  ``/v1/regions``; :mod:`crossroads.services.relay_api`), which picks the least-loaded live
  node of a region and hands out sealed connection data and keys.

``--relay-node-only`` and ``--relay-api-only`` split them across processes that
share a Redis store (``--store redis://…``) and a secret (``--relay-secret``, or
one created once in the store).

Store keys (all under ``relay:``)::

    relay:secret              the token/key secret when none is configured
    relay:node:<id>           JSON registration of a live node (TTL = 3 heartbeats)
    relay:pending:<id>        hash: allocations handed out but not yet bound
                              (uuid -> "seats:deadline"), so a burst of requests
                              spreads before the node's next heartbeat
    relay:alloc:<uuid>        hash: a host allocation (node, region, seats,
                              connection data, join code, live connections);
                              refreshed by the node while the host is bound
    relay:joincode:<CODE>     uuid of the host allocation (SET NX, same TTL)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client import Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from crossroads.config import Config as RuntimeConfig
from crossroads.config import check_positive, setting
from crossroads.errors import StoreError
from crossroads.insight import InsightRecorder
from crossroads.metrics import counter_by
from crossroads.proto.insight import Attempt, Step, Usage
from crossroads.proto.policy import AddressPolicy, Scope, scopes_for
from crossroads.proto.relay import joincode
from crossroads.proto.relay.server import (
    AllocationBound,
    AllocationEnded,
    BindRejected,
    ClientRefused,
    Event,
    PeerConnected,
    PeerDisconnected,
    RelayServer,
    RelayServerConfig,
)
from crossroads.proto.relay.token import TokenSealer
from crossroads.ratelog import RateLimitedLog
from crossroads.services.base import (
    Service,
    ServiceContext,
    SessionInfo,
    show_address,
    stop_task,
    stop_tasks,
)
from crossroads.services.qos import Config as QosConfig
from crossroads.services.qos import QosListener, QosService, start_listener
from crossroads.services.relay_allocations import (
    HEARTBEATS_PER_TTL,
    RECORD_FIELDS,
    Allocator,
    NodeInfo,
    alloc_key,
    code_key,
    node_key,
    pending_key,
)
from crossroads.services.relay_api import ApiKeys, make_router
from crossroads.services.relay_dtls import RelayDtls
from crossroads.store.base import Store
from crossroads.store.shared_secret import SharedSecret
from crossroads.transport.admission import Admission, Pool, ResourceBudget
from crossroads.transport.refusals import RefusalLog
from crossroads.transport.relay import Impairment, RelayEndpoint
from crossroads.transport.relay_ws import (
    BIND_TIMEOUT,
    HANDSHAKE_TIMEOUT,
    WS_CONNECTION_BYTES,
    WSS_CONNECTION_BYTES,
    WebSocketListener,
)
from crossroads.transport.sockets import (
    bound_address,
    make_tcp_listener,
    make_udp_socket,
)
from crossroads.transport.tls import TlsAcceptor, tls_tables
from crossroads.types import frozen

NAME = "relay"
log = logging.getLogger("crossroads.relay")

#: Unity's documented session limit: "A maximum of 150 players can join the host
#: in the same session" (reference §1.3, Limits).
UNITY_MAX_CONNECTIONS = 150
#: Events waiting for the store; beyond this they are dropped and counted (the
#: store lags, the relay must not grow without bound).
MAX_PENDING_EVENTS = 10_000
#: The table of the process's resource budget that admits the node's
#: allocations (docs/security.md).
ALLOCATIONS_TABLE = "relay-allocations"
#: Measured memory of one bound allocation with its half of a connected
#: pair: the allocation record, its two data-plane routes (C route objects
#: included) and their links, the per-source token buckets and the token's
#: derived key: ~1.2 KB with tracemalloc and ~1.5 KB of RSS over 40,000
#: allocations (20,000 hosts with one joiner each); 2 KiB with the
#: allocator's slack.
ALLOCATION_BYTES = 2048


def _check_join_code_length(value: int) -> None:
    if not joincode.MIN_LENGTH <= value <= joincode.MAX_LENGTH:
        raise ValueError(f"must be {joincode.MIN_LENGTH}-{joincode.MAX_LENGTH}")


def _check_max_connections(value: int) -> None:
    if not 1 <= value <= 0xFFFF:
        raise ValueError("must be between 1 and 65535")


@frozen
class Config:
    """The ``[relay]`` section."""

    port: int = setting(
        7780, kind="port", help="UDP port of the relay node (Unity Relay)."
    )
    public_host: str = setting(
        "",
        kind="host",
        help="Address clients use to reach this node (default: --public-host, "
        "else the bound address).",
    )
    public_port: int = setting(
        0, kind="port", help="UDP port clients use, when a NAT or proxy changes it."
    )
    dtls: bool = setting(
        True,
        help='Also serve the relay over DTLS 1.2 with PSK (Unity\'s "dtls" '
        "endpoint) on --relay-dtls-port.",
    )
    dtls_port: int = setting(
        7790,
        kind="port",
        help="UDP port of the relay node's DTLS endpoint (with --workers N, "
        "worker i serves it on this port + i).",
    )
    region: str = setting("local", help="Region of this relay node.")
    region_description: str = setting("", help="Human-readable name of the region.")
    node_id: str = setting(
        "", help="Stable ID of this node (default: random at start)."
    )
    capacity: int = setting(
        5000,
        check=check_positive,
        help="Seats on this node; a host allocation reserves 1 + maxConnections.",
    )
    node_only: bool = setting(
        False, help="Run only the relay node (no allocations API)."
    )
    api_only: bool = setting(
        False, help="Run only the allocations API (no relay node)."
    )
    api_keys: tuple[str, ...] = setting(
        (),
        flag="--api-key",
        env="CROSSROADS_API_KEYS",
        help="API key accepted as 'Authorization: Bearer KEY' (repeatable). "
        "With none, the allocations API refuses every request.",
    )
    secret: str = setting(
        "",
        help="Secret shared by the API and relay nodes (>= 16 chars; default: "
        "created once in the store).",
    )
    default_region: str = setting(
        "", help="Region used when a request names none (default: the least loaded)."
    )
    max_connections: int = setting(
        UNITY_MAX_CONNECTIONS,
        check=_check_max_connections,
        help="Largest maxConnections a host may ask for.",
    )
    bind_timeout: float = setting(
        10.0,
        check=check_positive,
        help="Seconds a new allocation has to BIND (Unity: 10).",
    )
    idle_timeout: float = setting(
        10.0,
        check=check_positive,
        help="Seconds without traffic before a client is dropped (Unity: 10).",
    )
    host_alone_timeout: float = setting(
        60.0,
        check=check_positive,
        help="Idle seconds allowed to a host with no joiner (Unity: 60).",
    )
    heartbeat: float = setting(
        5.0,
        check=check_positive,
        help="Seconds between node registrations (the TTL is three of them).",
    )
    qos: bool = setting(
        True,
        help="Answer Unity's QoS protocol for this node's region (the qos "
        "service's listener, or the node's own on --qos-port when the qos "
        "service does not run in this process).",
    )
    join_code_length: int = setting(
        6, check=_check_join_code_length, help="Join code length (6-12)."
    )
    allow_private_peers: bool = setting(
        False,
        help="Accept clients at loopback/private/link-local addresses (LAN and tests).",
    )
    api_rate: float = setting(
        20.0,
        help="Allocate/join calls per second per client IP (0 = no limit; burst 3 s).",
    )
    max_route_pps: float = setting(
        0.0,
        help="RELAY frames per second per direction before it is paused (0 = no limit).",
    )
    websocket: bool = setting(
        False,
        help="Serve the relay over WebSockets too: ws on --relay-ws-port, and "
        "wss on --relay-wss-port when a certificate is configured (--tls-cert).",
    )
    ws_port: int = setting(
        7781,
        kind="port",
        help="TCP port of the relay's ws endpoint (--relay-websocket).",
    )
    wss_port: int = setting(
        7782,
        kind="port",
        help="TCP port of the relay's wss endpoint (--relay-websocket, --tls-cert).",
    )
    wss_host: str = setting(
        "",
        help="Host name advertised for wss: the DNS name of the certificate, "
        "which Unity checks (default: the node's public host).",
    )
    ws_max_connections: int = setting(
        10_000,
        check=check_positive,
        help="WebSocket connections at once on each of ws and wss.",
    )
    ws_max_connections_per_ip: int = setting(
        64,
        check=check_positive,
        help="WebSocket connections at once from one IP (or IPv6 /64) on each "
        "of ws and wss.",
    )

    def __post_init__(self) -> None:
        if self.node_only and self.api_only:
            raise ValueError("node_only and api_only: choose at most one")
        if self.secret and len(self.secret) < 16:
            raise ValueError("secret: must be at least 16 characters")


SECRET_KEY = "relay:secret"


async def resolve_secret(cfg: Config, store: Store) -> bytes:
    """The configured secret, or the one every process of this store shares."""
    if cfg.secret:
        return cfg.secret.encode()
    return await SharedSecret(store, SECRET_KEY, "relay").resolve()


# --------------------------------------------------------------------- relay node


@dataclass(eq=False)
class RelayNode:
    """One relay node: socket, core, registration heartbeat and store bookkeeping."""

    cfg: Config = field(repr=False)
    store: Store
    core: RelayServer
    endpoint: RelayEndpoint
    info: NodeInfo
    #: The DTLS endpoint (``--relay-dtls``), None when off.
    dtls: RelayDtls | None = field(default=None, init=False)
    #: The node's own QoS listener, when the qos service does not run in
    #: this process (None otherwise: that service's listener is registered).
    qos: QosListener | None = field(default=None, init=False)
    events_dropped: int = field(default=0, init=False)
    refusals: RefusalLog = field(init=False)
    _events: asyncio.Queue[Event] = field(
        default_factory=lambda: asyncio.Queue(MAX_PENDING_EVENTS), init=False
    )
    #: Authentication failures: one line per reason a minute at most.
    auth_log: RateLimitedLog = field(
        default_factory=lambda: RateLimitedLog(log), init=False
    )
    #: Bound host allocations -> their join code once known.
    _hosts: dict[uuid.UUID, str | None] = field(default_factory=dict, init=False)
    #: The API's record of each bound host allocation, as last seen: what
    #: the heartbeat re-creates when the store lost it (a Redis restarted
    #: empty), so its join code works again. EXPIRE alone cannot bring
    #: back a key that is gone.
    _records: dict[uuid.UUID, dict[str, bytes]] = field(
        default_factory=dict, init=False
    )
    #: Host records (and join codes) re-created after the store lost them.
    records_restored: int = field(default=0, init=False)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list, init=False)
    #: The ws/wss listeners by name ("ws", "wss") and their servers.
    websockets: dict[str, WebSocketListener] = field(default_factory=dict, init=False)
    ws_servers: list[asyncio.Server] = field(default_factory=list, init=False)
    #: The process's budget, where :data:`ALLOCATIONS_TABLE` is registered.
    budget: ResourceBudget | None = field(default=None, init=False)
    #: Where each ended host-joiner link's record goes (crossroads.insight).
    insight: InsightRecorder = field(default_factory=InsightRecorder, init=False)
    #: Draining (:meth:`drain`): registered as draining, so the allocations
    #: API (of every instance) places new hosts on other nodes and no listing
    #: shows it; bound sessions keep relaying, their records stay refreshed
    #: and their join codes still lead here.
    draining: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.refusals = RefusalLog(
            log,
            "relay: client",
            "a node serves the scope of the address it advertises "
            "(--relay-public-host); --relay-allow-private-peers admits every "
            "private scope",
        )

    def start(self) -> None:
        self.endpoint.on_events = self._enqueue
        self.endpoint.start()
        if self.dtls is not None:
            self.dtls.start()
        self._tasks = [
            asyncio.create_task(self._heartbeat(), name="relay-heartbeat"),
            asyncio.create_task(self._apply_events(), name="relay-events"),
        ]

    async def close(self) -> None:
        if self.dtls is not None:
            self.dtls.close()
        for server in self.ws_servers:
            server.close()
        self.endpoint.close()
        if self.budget is not None:
            self.budget.forget(ALLOCATIONS_TABLE)
            for name in self.websockets:
                self.budget.forget(f"relay-{name}")
            self.budget.forget("tls-handshakes:relay-wss")
            self.budget.forget("tls-connections:relay-wss")
        await stop_tasks(self._tasks)
        with contextlib.suppress(Exception):
            await self.store.delete(node_key(self.info.node_id))
        if self.qos is not None:
            await self.qos.close()

    def _record(self, event: PeerDisconnected) -> None:
        """One record per ended link: a Unity relay session is relayed by
        design (the family has no direct path), so its cause says so; its
        usage is what the link's two routes counted."""
        insight = self.insight
        host_id = uuid.UUID(bytes=event.host_allocation_id)
        code = self.join_code_of(host_id) or host_id.hex
        lived = max(0.0, event.connected_for)
        endpoint = self.endpoint
        lost = endpoint.pop_lost(
            event.allocation_id, event.host_allocation_id
        ) + endpoint.pop_lost(event.host_allocation_id, event.allocation_id)
        usage = Usage(
            packets_up=event.joiner_sent[0],
            bytes_up=event.joiner_sent[1],
            packets_down=event.joiner_received[0],
            bytes_down=event.joiner_received[1],
            # Counted on the routes, then dropped by a QA impairment.
            drops=(("qa-impairment", lost),) if lost else (),
        )
        insight.record(
            Attempt(
                family="relay",
                session=code,
                started=insight.now() - lived,
                duration=lived,
                sides=(
                    insight.side(event.joiner_address[0]),
                    insight.side(event.host_address[0]),
                ),
                steps=(Step("relay", 0.0, lived, event.reason),),
                winner="relay",
                outcome="relayed",
                cause="relay-only",
                usage=usage,
            )
        )

    def _enqueue(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, PeerDisconnected):
                self._record(event)
            if isinstance(event, AllocationBound) and self.dtls is not None:
                # A BIND over DTLS ends the session's pre-auth state.
                self.dtls.bound(event.address)
            if isinstance(event, BindRejected):
                # Logged here, not queued: a flood of bad BINDs must not push
                # the events that update the store out of the bounded queue.
                self.auth_log.log(
                    event.reason,
                    "relay BIND rejected (%s) from %s",
                    event.reason,
                    event.client[0],
                )
                continue
            try:
                self._events.put_nowait(event)
            except asyncio.QueueFull:
                self.events_dropped += 1

    def join_code_of(self, host_id: uuid.UUID) -> str | None:
        """The join code of a bound host allocation, once a heartbeat saw it
        (what the node can re-create after the store lost it)."""
        code = self._hosts.get(host_id)
        if code is None:
            raw = self._records.get(host_id, {}).get("joinCode")
            code = raw.decode() if raw is not None else None
        return code

    def registration(self) -> NodeInfo:
        return dataclasses.replace(
            self.info, load=self.core.load, draining=self.draining
        )

    async def register(self) -> None:
        ttl = self.cfg.heartbeat * HEARTBEATS_PER_TTL
        await self.store.set(
            node_key(self.info.node_id), self.registration().to_json(), ttl=ttl
        )

    async def drain(self) -> None:
        """Leave the node listings now (the API's choice of node, regions, the
        console's node table skip a draining node); a join code of a bound
        host still leads here, so its players still join it."""
        self.draining = True
        with contextlib.suppress(StoreError):
            await self.register()

    async def _heartbeat(self) -> None:
        ttl = self.cfg.heartbeat * HEARTBEATS_PER_TTL
        loop = asyncio.get_running_loop()
        while True:
            # Token deadlines are Unix times; follow wall-clock corrections.
            self.core.wall_offset = time.time() - loop.time()
            try:
                await self.register()
                restored = 0
                for host_id in list(self._hosts):
                    restored += await self._refresh_host(host_id, ttl)
                if restored:
                    self.records_restored += restored
                    log.warning(
                        "relay node %s: the store had lost %d host allocation(s) "
                        "and join codes; re-created them",
                        self.info.node_id,
                        restored,
                    )
            except StoreError:
                pass  # the store logs the outage once; the next beat retries
            except Exception:
                log.warning(
                    "relay node %s: store update failed",
                    self.info.node_id,
                    exc_info=True,
                )
            await asyncio.sleep(self.cfg.heartbeat)

    async def _refresh_host(self, host_id: uuid.UUID, ttl: float) -> bool:
        """Keep a bound host's records (and its join code) alive; re-create
        them when the store lost them (then True)."""
        key = alloc_key(host_id)
        restored = False
        if await self.store.expire(key, ttl):
            if host_id in self._hosts and (
                host_id not in self._records or self._hosts[host_id] is None
            ):
                record = await self.store.hgetall(key)
                if RECORD_FIELDS <= set(record):
                    self._records[host_id] = record
        else:
            record = self._records.get(host_id, {})
            if not record:
                return False  # never seen: nothing to re-create it from
            await self.store.hset(key, record)
            await self.store.expire(key, ttl)
            restored = True
        code = self._hosts.get(host_id)
        if code is None:
            raw = self._records.get(host_id, {}).get("joinCode")
            if raw is None and host_id not in self._records:
                # (A cached record was re-read above: no second round trip.)
                raw = await self.store.hget(key, "joinCode")
            if raw is None:
                return restored
            code = raw.decode()
            if host_id in self._hosts:
                self._hosts[host_id] = code
        if not await self.store.expire(code_key(code), ttl):
            # SET NX: a claim of this code by another allocation (ours lapsed
            # and the code was drawn again) is never overwritten.
            restored |= await self.store.set(
                code_key(code), str(host_id).encode(), ttl=ttl, only_if_absent=True
            )
        return restored

    async def _apply_events(self) -> None:
        while True:
            event = await self._events.get()
            try:
                await self._apply(event)
            except StoreError:
                # Logged once per outage by the store; the heartbeat re-creates
                # what this event would have written.
                self.events_dropped += 1
            except Exception:
                log.warning(
                    "relay node %s: store update failed",
                    self.info.node_id,
                    exc_info=True,
                )

    async def _apply(self, event: Event) -> None:
        ttl = self.cfg.heartbeat * HEARTBEATS_PER_TTL
        log.debug("relay node %s: %s", self.info.node_id, event)
        match event:
            case AllocationBound(is_host=True, rebind=False, allocation_id=aid):
                host_id = uuid.UUID(bytes=aid)
                self._hosts[host_id] = None
                await self.store.hdel(pending_key(self.info.node_id), host_id.hex)
                await self._refresh_host(host_id, ttl)
                await self.register()
            case (
                PeerConnected(host_allocation_id=hid, connections=n)
                | PeerDisconnected(host_allocation_id=hid, connections=n)
            ):
                host_id = uuid.UUID(bytes=hid)
                if host_id in self._hosts:
                    key = alloc_key(host_id)
                    if host_id in self._records:
                        self._records[host_id]["connections"] = str(n).encode()
                    await self.store.hset(key, {"connections": str(n).encode()})
                    # Never leave a hash without a TTL, even if the API's record
                    # expired meanwhile (join treats such a remnant as gone).
                    await self.store.expire(key, ttl)
            case ClientRefused(address=address, verdict=verdict):
                self.refusals.refused(address, verdict)
            case AllocationEnded(is_host=True, allocation_id=aid):
                host_id = uuid.UUID(bytes=aid)
                code = self._hosts.pop(host_id, None)
                self._records.pop(host_id, None)
                if code is None:
                    raw = await self.store.hget(alloc_key(host_id), "joinCode")
                    code = raw.decode() if raw else None
                keys = [alloc_key(host_id)] + ([code_key(code)] if code else [])
                await self.store.delete(*keys)
                await self.register()
            case _:
                pass


class RelayCollector(Collector):
    """Prometheus view of a node's counters, read at scrape time (zero per-packet cost)."""

    def __init__(self, node: RelayNode) -> None:
        self.node = node

    def collect(self) -> Iterable[Metric]:
        core = self.node.core
        yield counter_by(
            "crossroads_relay_dropped_datagrams",
            "Datagrams the relay dropped, by reason.",
            "reason",
            core.drops,
        )
        yield counter_by(
            "crossroads_relay_errors_sent",
            "ERROR messages sent, by code.",
            "code",
            {str(int(code)): count for code, count in core.errors_sent.items()},
        )
        yield counter_by(
            "crossroads_relay_allocations_ended",
            "Allocations that ended, by reason.",
            "reason",
            core.ended_total,
        )
        packets, octets = core.relayed()
        yield CounterMetricFamily(
            "crossroads_relay_relayed_packets", "RELAY frames forwarded.", value=packets
        )
        yield CounterMetricFamily(
            "crossroads_relay_relayed_bytes", "RELAY bytes forwarded.", value=octets
        )
        yield CounterMetricFamily(
            "crossroads_relay_send_failures",
            "Datagrams the kernel refused to send (buffer full).",
            value=self.node.endpoint.send_failures,
        )
        yield CounterMetricFamily(
            "crossroads_relay_store_events_dropped",
            "Node events dropped because the store lagged.",
            value=self.node.events_dropped,
        )
        yield GaugeMetricFamily(
            "crossroads_relay_allocations",
            "Bound allocations.",
            value=len(core.allocations),
        )
        yield GaugeMetricFamily(
            "crossroads_relay_connections",
            "Connected joiner-host pairs.",
            value=core.connections,
        )
        ws_dropped = CounterMetricFamily(
            "crossroads_relay_websocket_dropped",
            "WebSocket connections closed or relay messages dropped, by "
            "listener (ws, wss) and reason.",
            labels=["listener", "reason"],
        )
        for name, listener in self.node.websockets.items():
            for reason, count in sorted(listener.drops.items()):
                ws_dropped.add_metric([name, reason], count)
        yield ws_dropped
        pauses = CounterMetricFamily(
            "crossroads_relay_websocket_read_pauses",
            "Times a WebSocket connection stopped reading because its write "
            "buffer (relay messages, pongs) was full, by listener (ws, wss).",
            labels=["listener"],
        )
        for name, listener in self.node.websockets.items():
            pauses.add_metric([name], listener.read_pauses)
        yield pauses
        yield CounterMetricFamily(
            "crossroads_relay_websocket_gone",
            "Relay messages for a WebSocket connection that had closed "
            "(dropped; its allocation ends by the idle timeout or a new BIND).",
            value=self.node.endpoint.stream_gone,
        )
        yield GaugeMetricFamily(
            "crossroads_relay_load_seats",
            "Seats reserved by bound hosts.",
            value=core.load,
        )
        if self.node.dtls is not None:
            yield from self.node.dtls.metrics()


# ------------------------------------------------------------------------ service


@dataclass(eq=False)
class RelayService:
    """The running ``relay`` service."""

    name = NAME

    node: RelayNode | None
    api: bool
    bound: tuple[str, int] | None
    #: The allocations API's view of every node (None on a node-only process).
    allocator: Allocator | None = field(default=None, init=False)
    #: The keys the allocations API accepts (None on a node-only process).
    api_keys: ApiKeys | None = field(default=None, init=False, repr=False)
    _closed: bool = field(default=False, init=False)
    #: The store-held secret (None when --relay-secret is configured).
    secret: SharedSecret | None = field(default=None, init=False, repr=False)
    _secret_task: asyncio.Task[None] | None = field(default=None, init=False)

    def keep_secret(self, shared: SharedSecret, every: float) -> None:
        """Re-publish the shared secret every ``every`` s (store/shared_secret.py)."""
        self.secret = shared
        self._secret_task = asyncio.create_task(
            self._keep_secret(shared, every), name="relay-secret"
        )

    async def _keep_secret(self, shared: SharedSecret, every: float) -> None:
        while True:
            await asyncio.sleep(every)
            try:
                adopted = await shared.republish()
            except StoreError:
                continue  # the store logs the outage once
            if adopted is not None:
                sealer = TokenSealer(shared.current, os.urandom, shared.previous)
                if self.allocator is not None:
                    self.allocator.sealer = sealer
                if self.node is not None:
                    self.node.core.sealer = sealer

    def reload(self, config: RuntimeConfig) -> list[str]:
        """New API keys (``--api-key``) for the allocations API; allocations,
        join codes and relayed sessions are untouched."""
        if self.api_keys is None:
            return []
        keys = config.section(NAME, Config).api_keys
        self.api_keys.replace(keys)
        return [f"relay: {len(keys)} API key(s)"]

    async def drain(self) -> None:
        """New hosts go to other nodes; bound sessions keep relaying."""
        if self.node is not None:
            await self.node.drain()

    def live_sessions(self) -> int:
        return 0 if self.node is None else len(self.node.core.allocations)

    async def live_nodes(self) -> list[NodeInfo]:
        """Every relay node registered in the store (all regions, all
        processes), as the allocations API sees them; [] without the API."""
        if self.allocator is None:
            return []
        return await self.allocator.live_nodes()

    def describe(self) -> list[str]:
        lines = []
        if self.node is not None and self.bound is not None:
            info = self.node.info
            lines.append(
                f"udp {show_address(self.bound)} (node {info.node_id}, region {info.region}, "
                f"public {info.host}:{info.port})"
            )
            if self.node.dtls is not None:
                dtls_host, dtls_port = bound_address(self.node.dtls.endpoint.sock)
                lines.append(
                    f"dtls {show_address((dtls_host, dtls_port))} "
                    f"(public {info.host}:{info.dtls_port})"
                )
        if self.node is not None:
            for name, port in (
                ("ws", self.node.info.ws_port),
                ("wss", self.node.info.wss_port),
            ):
                if port:
                    lines.append(
                        f"{name} tcp port {port} (Unity relay over WebSockets)"
                    )
        if self.api:
            lines.append("http /v1/allocate /v1/joincode /v1/join /v1/regions")
        return lines

    def sessions(self) -> list[SessionInfo]:
        """Bound allocations of this node (hosts and joiners)."""
        if self.node is None:
            return []
        core = self.node.core
        now = asyncio.get_running_loop().time()
        listed = []
        for allocation in core.allocations.values():
            role = "host" if allocation.is_host else "joiner"
            listed.append(
                SessionInfo(
                    id=str(uuid.UUID(bytes=allocation.allocation_id)),
                    client=show_address(allocation.address),
                    detail=f"{role}, {len(allocation.peers)} connected, "
                    f"region {self.node.info.region}",
                    expires_in=max(
                        0.0, allocation.last_activity + core.config.idle_timeout - now
                    ),
                )
            )
        return listed

    def revoke(self, session_id: str) -> bool:
        """Kick one allocation (by its allocationId)."""
        if self.node is None:
            return False
        try:
            allocation_id = uuid.UUID(session_id).bytes
        except ValueError:
            return False
        return self.node.endpoint.kick(allocation_id)

    def impair(self, session_id: str, impairment: Impairment | None) -> bool:
        """QA impairment of one allocation's relayed frames, both ways (by its
        allocationId; None: stop). Admin only, off unless set."""
        if self.node is None:
            return False
        try:
            allocation_id = uuid.UUID(session_id).bytes
        except ValueError:
            return False
        return self.node.endpoint.impair(allocation_id, impairment)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._secret_task is not None:
            await stop_task(self._secret_task)
        if self.node is not None:
            await self.node.close()


def client_policy(cfg: Config, ctx: ServiceContext, public_host: str) -> AddressPolicy:
    """Who may BIND: not internal or own addresses, except the scope this node
    advertises (a node at 127.0.0.1 serves loopback clients), and every
    non-global scope with ``--relay-allow-private-peers``."""
    admitted = scopes_for([public_host])
    if cfg.allow_private_peers:
        admitted |= {Scope.LOOPBACK, Scope.PRIVATE, Scope.LINK_LOCAL}
    return AddressPolicy(self_addresses=ctx.own_addresses(), admitted=admitted)


async def listen_websockets(
    cfg: Config, ctx: ServiceContext, endpoint: RelayEndpoint
) -> tuple[dict[str, WebSocketListener], list[asyncio.Server], dict[str, int]]:
    """The ws listener, and the wss one when a certificate is configured
    (transport/relay_ws.py); their bound ports by name.

    Their own ports, not the HTTP app's: a WebSocket connection is a relay
    client of this node (the HTTP app may run in another process, with
    ``--relay-api-only``), Unity asks for ``GET /``, which is the web console
    there, and a relay message must not pay for ASGI routing."""
    loop = asyncio.get_running_loop()
    listeners: dict[str, WebSocketListener] = {}
    servers: list[asyncio.Server] = []
    ports: dict[str, int] = {}
    certificates = ctx.certificates
    wanted = [("ws", cfg.ws_port)]
    if certificates is not None:
        wanted.append(("wss", cfg.wss_port))
    else:
        log.warning("relay: no certificate (--tls-cert), so no wss endpoint")
    try:
        for name, port in wanted:
            admission = ctx.resources.table(
                f"relay-{name}",
                max_items=cfg.ws_max_connections,
                max_per_source=cfg.ws_max_connections_per_ip,
                pool=Pool.CONNECTIONS,
                descriptors_per_item=1,
                # The most one connection holds (write buffer bound, a
                # read's pongs, TLS buffers for wss), measured.
                bytes_per_item=(
                    WSS_CONNECTION_BYTES if name == "wss" else WS_CONNECTION_BYTES
                ),
                # The upgrade, then a BIND (transport/relay_ws.py); then the
                # idle rule (relay messages only, pings do not count) ends a
                # silent client.
                preauth_deadline=HANDSHAKE_TIMEOUT + BIND_TIMEOUT,
            )
            listener = WebSocketListener(endpoint, admission, cfg.idle_timeout)
            sock = make_tcp_listener(ctx.host, port)
            ctx.resources.listen(
                NAME, name, "tcp", bound_address(sock), f"relay-{name}"
            )
            factory: Callable[[], asyncio.BaseProtocol] = listener.connection
            if name == "wss" and certificates is not None:
                # Its own TLS tables; the descriptor is the wss listener's.
                tables = tls_tables(
                    ctx.resources,
                    "relay-wss",
                    listener=admission,
                    max_connections=cfg.ws_max_connections,
                    max_per_source=cfg.ws_max_connections_per_ip,
                )
                factory = functools.partial(
                    TlsAcceptor,
                    certificates.context,
                    listener.connection,
                    tables,
                    listener.drop,
                )
            server = await loop.create_server(factory, sock=sock)
            servers.append(server)
            listeners[name] = listener
            ports[name] = bound_address(sock)[1]
    except BaseException:
        for server in servers:
            server.close()
        for name in listeners:
            ctx.resources.forget(f"relay-{name}")
        ctx.resources.forget("tls-handshakes:relay-wss")
        ctx.resources.forget("tls-connections:relay-wss")
        raise
    return listeners, servers, ports


def allocation_table(budget: ResourceBudget, cfg: Config) -> Admission:
    """Register the node's allocations: no descriptor of their own (every
    client shares the node's sockets), their measured memory, and no pre-auth
    deadline: an allocation exists only after a BIND signed with the key of
    a token this node's API sealed (proto/relay/server.py). Hosts reserve
    seats for their joiners, so twice the seats leaves room for joiners bound
    but not yet connected; a source holds at most the budget's fraction of
    that (the per-source cap is left to the budget)."""
    total = 2 * cfg.capacity
    return budget.table(
        ALLOCATIONS_TABLE,
        max_items=total,
        max_per_source=total,
        pool=Pool.NONE,
        bytes_per_item=ALLOCATION_BYTES,
    )


def _public_host(cfg: Config, ctx: ServiceContext, bound_host: str) -> str:
    if cfg.public_host:
        return cfg.public_host
    if ctx.config.core.public_host:
        return ctx.config.core.public_host
    if bound_host not in ("0.0.0.0", "::"):
        return bound_host
    log.warning(
        "relay: bound to %s with no --relay-public-host/--public-host; "
        "advertising 127.0.0.1 to clients",
        bound_host,
    )
    return "127.0.0.1"


async def serve(ctx: ServiceContext) -> Service:
    cfg = ctx.section(NAME, Config)
    shared = None if cfg.secret else SharedSecret(ctx.store, SECRET_KEY, "relay")
    secret = cfg.secret.encode() if shared is None else await shared.resolve()
    sealer = TokenSealer(secret, os.urandom)
    node: RelayNode | None = None
    bound: tuple[str, int] | None = None
    if not cfg.api_only:
        node_id = cfg.node_id or f"{cfg.region}-{uuid.uuid4().hex[:12]}"
        sock = make_udp_socket(ctx.host, cfg.port)
        try:
            bound = bound_address(sock)
            public_host = _public_host(cfg, ctx, bound[0])
            loop = asyncio.get_running_loop()
            allocations = allocation_table(ctx.resources, cfg)
            core = RelayServer(
                RelayServerConfig(
                    node_id=node_id,
                    idle_timeout=cfg.idle_timeout,
                    host_alone_timeout=cfg.host_alone_timeout,
                    policy=client_policy(cfg, ctx, public_host),
                    max_route_pps=cfg.max_route_pps,
                ),
                sealer,
                wall_offset=time.time() - loop.time(),
                reflection=ctx.reflection_budget(),
                admission=allocations,
            )
            ctx.resources.listen(NAME, NAME, "udp", bound, ALLOCATIONS_TABLE)
            endpoint = RelayEndpoint(core, sock, table=ctx.route_table)
            dtls_sock = make_udp_socket(ctx.host, cfg.dtls_port) if cfg.dtls else None
            ws: tuple[
                dict[str, WebSocketListener], list[asyncio.Server], dict[str, int]
            ] = ({}, [], {})
            if cfg.websocket:
                ws = await listen_websockets(cfg, ctx, endpoint)
        except BaseException:
            sock.close()
            ctx.resources.forget(ALLOCATIONS_TABLE)
            raise
        qos_listener: QosListener | None = None
        if cfg.qos:
            running = ctx.running.get("qos")
            if isinstance(running, QosService):
                qos_public = running.listener.public
            else:
                try:
                    qos_listener = await start_listener(ctx)
                except BaseException:
                    sock.close()
                    if dtls_sock is not None:
                        dtls_sock.close()
                    ctx.resources.forget(ALLOCATIONS_TABLE)
                    raise
                qos_public = qos_listener.public
            qos_cfg = ctx.section("qos", QosConfig)
            # The node's own host unless the QoS server was given one.
            qos_host = qos_cfg.public_host or public_host
            qos_port = qos_public[1]
        else:
            qos_host, qos_port = "", 0
        info = NodeInfo(
            node_id=node_id,
            region=cfg.region,
            description=cfg.region_description or cfg.region,
            host=public_host,
            port=cfg.public_port or bound[1],
            capacity=cfg.capacity,
            load=0,
            dtls_port=bound_address(dtls_sock)[1] if dtls_sock is not None else 0,
            ws_port=ws[2].get("ws", 0),
            wss_port=ws[2].get("wss", 0),
            wss_host=cfg.wss_host,
            qos_host=qos_host,
            qos_port=qos_port,
        )
        node = RelayNode(cfg, ctx.store, core, endpoint, info)
        node.qos = qos_listener
        node.budget = ctx.resources
        node.insight = ctx.insight
        node.websockets, node.ws_servers = ws[0], ws[1]
        if dtls_sock is not None:
            node.dtls = RelayDtls(endpoint, dtls_sock, ctx.resources)
            ctx.resources.listen(
                "relay",
                "relay-dtls",
                "udp",
                bound_address(dtls_sock),
                "dtls-sessions:relay",
            )
        node.start()
        try:
            await node.register()
        except Exception:
            await node.close()
            raise
        ctx.metrics.register(RelayCollector(node))
    api = not cfg.node_only
    api_keys: ApiKeys | None = None
    service = RelayService(node, api, bound)
    if api:
        allocator = Allocator(ctx.store, sealer, cfg)
        requests = Counter(
            "crossroads_relay_api_requests",
            "Allocations API requests, by endpoint and HTTP status.",
            ["endpoint", "status"],
            registry=ctx.metrics,
        )
        api_keys = ApiKeys(cfg.api_keys)
        router = make_router(
            allocator,
            api_keys,
            requests,
            rate=cfg.api_rate,
            burst=max(1.0, cfg.api_rate * 3),
            key_budget=ctx.guess_budget(),
            join_budget=ctx.guess_budget(),
        )
        ctx.add_router(router)
        service.allocator = allocator
        if not cfg.api_keys:
            log.warning(
                "relay: no --api-key configured; the allocations API refuses requests"
            )
    service.api_keys = api_keys
    if shared is not None:
        service.keep_secret(shared, cfg.heartbeat)
    return service
