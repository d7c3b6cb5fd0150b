"""The ``turn`` service: a TURN relay (RFC 8656, RFC 6062) on the STUN/TURN port.

How it is wired
---------------
TURN shares port 3478 (UDP and TCP, IPv4 and IPv6) with STUN. The port is one
engine in transport/ (:class:`~crossroads.transport.stunport.StunTurnPort`),
bound by the ``stun`` service with TURN's route table from the start; this
service runs TURN's half of it (:class:`~crossroads.transport.turnrelay.
TurnPlane`: the sans-I/O control core
:class:`~crossroads.proto.turn.server.TurnServer`, the relays, the routes) with
its configuration, credentials and peer policy, and keeps its metrics, logs,
connection insight and admin. With ``--only turn`` it starts the STUN service
itself (TURN clients use Binding too).

Per-packet work never touches this module: ChannelData, Send and Data
indications are forwarded by the data plane's routes
(:mod:`crossroads.transport.turnplane`), and what the routes do not take is
decided and framed by the core and sent by the plane (transport -> proto ->
transport).

Metrics (``/metrics``, counted in plain ints and exported at scrape time):
``crossroads_turn_allocations``, ``crossroads_turn_permissions``,
``crossroads_turn_channels``, ``crossroads_turn_tcp_connections`` (gauges);
``crossroads_turn_relayed_packets_total{direction}``,
``crossroads_turn_relayed_bytes_total{direction}``,
``crossroads_turn_dropped_total{reason}``,
``crossroads_turn_responses_total{method,code}``,
``crossroads_turn_allocations_created_total``, ``..._deleted_total{reason}``,
``crossroads_turn_stale_nonce_releases_total``,
``crossroads_turn_credential_renewals_total``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import secrets
import time
from collections.abc import Iterator
from typing import Any, cast

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from crossroads.config import Config as RuntimeConfig
from crossroads.errors import ConfigError
from crossroads.metrics import counter_by, unregister
from crossroads.proto.insight import Attempt, Step, Usage
from crossroads.proto.policy import AddressPolicy, Scope, parse_networks
from crossroads.proto.turn.allocation import Allocation, FiveTuple
from crossroads.proto.turn.auth import NonceMinter
from crossroads.proto.turn.constants import Family
from crossroads.proto.turn.ports import PortAllocator
from crossroads.proto.turn.server import (
    AllocationDeleted,
    AuthFailed,
    PeerRefused,
    RelayBinder,
    TurnEvent,
    TurnServer,
    TurnSettings,
)
from crossroads.ratelog import RateLimitedLog
from crossroads.services.base import ServiceContext, SessionInfo, show_address
from crossroads.services.stun import Endpoint, StunService
from crossroads.services.turn_config import (
    ALLOCATION_TABLE,
    ALLOCATION_WEIGHT,
    BYTES_PER_ALLOCATION,
    BYTES_PER_PEER_CONNECTION,
    DEFAULT_IP_QUOTA,
    DEFAULT_USER_QUOTA,
    DESCRIPTORS_PER_ALLOCATION,
    DESCRIPTORS_PER_PEER_CONNECTION,
    PEER_CONNECTION_TABLE,
    PEER_CONNECTION_WEIGHT,
    Config,
    allocation_caps,
    credentials,
    relay_hosts,
    settings,
)
from crossroads.services.turn_nodes import TurnNodes
from crossroads.transport.admission import Pool
from crossroads.transport.dataplane import RouteTapLike
from crossroads.transport.dtls import DtlsCollector, DtlsListener
from crossroads.transport.refusals import RefusalLog
from crossroads.transport.reuseport import sibling_ports
from crossroads.transport.sockets import listening_ports
from crossroads.transport.streamplane import HeldStream, Route
from crossroads.transport.tls import Certificates
from crossroads.transport.turnplane import ACCELERATED
from crossroads.transport.turnrelay import (
    ClientLink,
    RelayStats,
    TcpRelay,
    TurnPlane,
    TurnRoutes,
    UdpRelay,
)
from crossroads.types import Address

NAME = "turn"
log = logging.getLogger("crossroads.turn")
__all__ = [
    "ALLOCATION_TABLE",
    "ALLOCATION_WEIGHT",
    "BYTES_PER_ALLOCATION",
    "DEFAULT_IP_QUOTA",
    "DEFAULT_USER_QUOTA",
    "DESCRIPTORS_PER_ALLOCATION",
    "Config",
    "TurnService",
    "serve",
]


# ------------------------------------------------------------------ metrics


class _Collector(Collector):
    def __init__(self, service: TurnService) -> None:
        self.service = service

    def collect(self) -> Iterator[Any]:
        service = self.service
        core = service.core
        stats = service.stats
        for name, help_text, value in (
            ("allocations", "Live TURN allocations.", len(core.allocations)),
            ("permissions", "Live TURN permissions.", core.permission_count),
            ("channels", "Live TURN channel bindings.", core.channel_count),
            (
                "tcp_connections",
                "RFC 6062 peer data connections.",
                len(core.connections),
            ),
        ):
            gauge = GaugeMetricFamily(f"crossroads_turn_{name}", help_text)
            gauge.add_metric([], value)
            yield gauge
        packets = CounterMetricFamily(
            "crossroads_turn_relayed_packets",
            "Datagrams relayed (to_peer: from clients; to_client: from peers).",
            labels=["direction"],
        )
        to_peer, to_peer_bytes, to_client, to_client_bytes, errors = service.counters()
        packets.add_metric(["to_peer"], to_peer)
        packets.add_metric(["to_client"], to_client)
        yield packets
        volume = CounterMetricFamily(
            "crossroads_turn_relayed_bytes",
            "Application bytes relayed.",
            labels=["direction"],
        )
        volume.add_metric(["to_peer"], to_peer_bytes)
        volume.add_metric(["to_client"], to_client_bytes)
        yield volume
        merged = dict(stats.drops)
        if errors:
            merged["data-plane-malformed-or-send-error"] = errors
        throttled = service.routes.throttled()
        if throttled:
            merged["bandwidth-limit"] = throttled
        yield counter_by(
            "crossroads_turn_dropped",
            "Input dropped by TURN, by reason.",
            "reason",
            merged,
        )
        responses = CounterMetricFamily(
            "crossroads_turn_responses",
            "TURN responses by method and code (0 = success).",
            labels=["method", "code"],
        )
        for (method, code), count in sorted(core.counters.responses.items()):
            responses.add_metric([method, str(code)], count)
        yield responses
        created = CounterMetricFamily(
            "crossroads_turn_allocations_created", "Allocations created."
        )
        created.add_metric([], core.counters.allocations_created)
        yield created
        yield counter_by(
            "crossroads_turn_allocations_deleted",
            "Allocations deleted, by reason.",
            "reason",
            core.counters.allocations_deleted,
        )
        stale = CounterMetricFamily(
            "crossroads_turn_stale_nonce_releases",
            "Refresh(LIFETIME=0) honoured although its nonce was stale.",
        )
        stale.add_metric([], core.counters.stale_nonce_releases)
        yield stale
        renewals = CounterMetricFamily(
            "crossroads_turn_credential_renewals",
            "Allocations taken over by a later time-limited username of their user.",
        )
        renewals.add_metric([], core.counters.credential_renewals)
        yield renewals


# ------------------------------------------------------------------ service


class TurnService:
    """The running TURN service: configuration, credentials, metrics, logs
    and admin of the TURN plane it runs on the STUN/TURN port."""

    name = NAME

    def __init__(
        self,
        ctx: ServiceContext,
        config: Config,
        stun: StunService,
        owns_stun: bool,
    ) -> None:
        self.ctx = ctx
        self.config = config
        self.stun = stun
        self.port = stun.port
        self.owns_stun = owns_stun
        self.loop = asyncio.get_running_loop()
        self.relay_hosts = relay_hosts(config, ctx.host, ctx.config.core.public_host)
        low, high = config.relay_ports
        total, per_source = allocation_caps(config)
        #: TURN allocations and their relay sockets, in the process's budget.
        self.allocation_table = ctx.resources.table(
            ALLOCATION_TABLE,
            max_items=total,
            max_per_source=per_source,
            pool=Pool.RELAY,
            descriptors_per_item=DESCRIPTORS_PER_ALLOCATION,
            bytes_per_item=BYTES_PER_ALLOCATION,
            weight=ALLOCATION_WEIGHT,
        )
        #: RFC 6062 peer data connections (and their client data connections).
        self.peer_connection_table = ctx.resources.table(
            PEER_CONNECTION_TABLE,
            max_items=total * TurnSettings().max_connections,
            max_per_source=per_source * TurnSettings().max_connections,
            pool=Pool.RELAY,
            descriptors_per_item=DESCRIPTORS_PER_PEER_CONNECTION,
            bytes_per_item=BYTES_PER_PEER_CONNECTION,
            weight=PEER_CONNECTION_WEIGHT,
        )
        policy = AddressPolicy(
            allow=parse_networks(config.allowed_peers),
            deny=parse_networks(config.denied_peers),
            self_addresses=ctx.own_addresses(),
            admitted=(
                frozenset({Scope.LOOPBACK})
                if config.allow_loopback_peers
                else frozenset()
            ),
        )

        def make_core(binder: RelayBinder) -> TurnServer:
            return TurnServer(
                settings(config),
                credentials(config),
                # A per-process nonce key: nonces do not survive a restart
                # (clients just get a 438 and retry).
                NonceMinter(
                    secrets.token_bytes(32), lifetime=float(config.nonce_lifetime)
                ),
                policy,
                PortAllocator(low, high, cast(Any, secrets)),
                binder,
                # Other workers' ports are this server's too (--workers N).
                own_ports=lambda: listening_ports() | sibling_ports(),
                reflection=ctx.reflection_budget(),
                admission=self.allocation_table,
            )

        self.plane = self.port.serve_turn(
            lambda routes: TurnPlane(
                self.port,
                routes,
                make_core,
                relay_hosts=self.relay_hosts,
                max_bps=config.max_bps,
                peer_connections=self.peer_connection_table,
                on_event=self._on_event,
                on_socket_closed=ctx.kernel_drops.close,
            )
        )
        self.core = self.plane.core
        #: Authentication failures: one line per reason a minute at most.
        self.auth_log = RateLimitedLog(log)
        #: This node in the store's TURN node listing (services/turn_nodes.py).
        self.nodes: TurnNodes | None = None
        self._collector = _Collector(self)
        self._dtls_collector = DtlsCollector(self.port.dtls_listeners)
        self._closed = False
        self.refusals = RefusalLog(
            log,
            "turn: peer",
            "answered 403; --allow-loopback-peers or --turn-allowed-peers "
            "admit more (the relayed addresses of live allocations always are)",
        )

    # The plane's state, as the metrics, the console and the tests read it.

    @property
    def routes(self) -> TurnRoutes:
        return self.plane.routes

    @property
    def stats(self) -> RelayStats:
        return self.plane.stats

    @property
    def relays(self) -> set[UdpRelay]:
        return self.plane.relays

    @property
    def peer_pipes(self) -> dict[int, HeldStream]:
        return self.plane.held  # RFC 6062 peer connections before ConnectionBind

    @property
    def client_pipes(self) -> dict[int, Route]:
        return self.plane.joined  # RFC 6062 data connections, joined

    @property
    def taps(self) -> dict[Endpoint, RouteTapLike]:
        """The listener taps in front of the port's UDP sockets."""
        return self.plane.routes.taps

    @property
    def dtls_listeners(self) -> list[DtlsListener]:
        return self.port.dtls_listeners

    def counters(self) -> tuple[int, int, int, int, int]:
        """(to_peer packets, to_peer bytes, to_client packets, to_client bytes,
        data-plane drops), Python and C paths and RFC 6062 data connections."""
        return self.plane.counters()

    def _process_events(self) -> None:
        """Act on the core's pending events (after a direct call into it)."""
        self.plane.process_events()

    def handle_stun(self, data: bytes, client: Address, endpoint: Endpoint) -> None:
        """A non-Binding STUN message, as the port hands it to the plane."""
        self.plane.stun(data, client, endpoint)

    def start(self) -> None:
        self.ctx.metrics.register(self._collector)

    async def listen_dtls(self, port: int, certificates: Certificates) -> None:
        """Serve TURN over DTLS on UDP ``port`` (:meth:`StunTurnPort.listen_dtls`)."""
        await self.port.listen_dtls(self.ctx.host, port, certificates)
        self.ctx.metrics.register(self._dtls_collector)

    # ------------------------------------------------------------ events

    def _on_event(self, event: TurnEvent) -> None:
        """What the plane hands up after acting on the core's event."""
        match event:
            case AllocationDeleted(allocation=allocation, reason=reason):
                link = allocation.transport_data
                if isinstance(link, ClientLink):
                    self._record(allocation, link, reason)
            case PeerRefused(peer=peer, verdict=verdict):
                self.refusals.refused(peer, verdict)
            case AuthFailed(reason=reason, username=username, client=client):
                # The username is the client's own text: repr() and a cap
                # keep it on one line; no password or key is ever known here.
                self.auth_log.log(
                    reason,
                    "TURN authentication failed (%s) from %s, username %r",
                    reason,
                    client[0],
                    username[:64],
                )

    def _record(self, allocation: Allocation, link: ClientLink, reason: str) -> None:
        """One insight record per allocation (TURN relays by definition: a
        client asks for one when it needs it), with what it relayed. Billed
        to ``realm/user`` (the quota user of a time-limited name)."""
        insight = self.ctx.insight
        lived = max(0.0, time.time() - link.created)
        to_peer_packets, to_peer_bytes, to_client_packets, to_client_bytes = link.usage
        # Named by its relayed address (the server's, not the client's: the
        # client's address is only in the pseudonymous side).
        relayed = [
            show_address(relay.address)
            for relay in allocation.relays.values()
            if isinstance(relay, UdpRelay | TcpRelay)
        ]
        transport = allocation.five_tuple[0].name.lower()
        rtt = link.stream.round_trip() if link.stream is not None else None
        rtt_ms = None if rtt is None else rtt * 1000
        insight.record(
            Attempt(
                family="turn",
                session=f"{transport}/{','.join(relayed)}",
                started=insight.now() - lived,
                duration=lived,
                sides=(insight.side(link.client[0], rtt_ms=rtt_ms),),
                steps=(
                    Step("allocate", 0.0, 0.0, "ok"),
                    Step("relay", 0.0, lived, reason),
                ),
                winner="relay",
                outcome="relayed",
                cause="relay-only",
                game=f"{allocation.realm}/{allocation.quota_user}"[:64],
                usage=Usage(
                    packets_up=to_peer_packets,
                    bytes_up=to_peer_bytes,
                    packets_down=to_client_packets,
                    bytes_down=to_client_bytes,
                    rtt_ms=rtt_ms,
                ),
            )
        )

    # ------------------------------------------------------------ admin

    def reload(self, config: RuntimeConfig) -> list[str]:
        """Apply new users (``--turn-user``, ``--turn-users-file`` re-read),
        secrets and limits without touching live allocations.

        Raises:
            ConfigError: the users file is unreadable, or the realm changed.
        """
        section = config.section(NAME, Config)
        users = credentials(section)
        try:
            self.core.reconfigure(settings(section), users)
        except ValueError as exc:
            raise ConfigError(f"turn.realm: {exc}") from None
        table = self.allocation_table
        table.configured_max, table.configured_per_source = allocation_caps(section)
        return [
            f"turn: {len(users.users)} users, {len(users.secrets)} "
            f"secrets, user quota {section.user_quota}, total quota "
            f"{table.max_items} ({table.max_per_source} per IP)"
        ]

    @staticmethod
    def _session_id(five: FiveTuple) -> str:
        transport, client, server = five
        return f"{transport.name.lower()}/{show_address(client)}/{show_address(server)}"

    def sessions(self) -> list[SessionInfo]:
        """Live allocations (the console's and ``crossroads sessions turn``'s view)."""
        now = self.loop.time()
        listed = []
        for five, allocation in self.core.allocations.items():
            relayed = ", ".join(
                show_address(relay.address) for relay in allocation.relays.values()
            )
            listed.append(
                SessionInfo(
                    id=self._session_id(five),
                    client=show_address(five[1]),
                    user=allocation.username,
                    detail=f"relayed {relayed}; {len(allocation.permissions)} "
                    f"permissions, {len(allocation.channels)} channels",
                    expires_in=max(0.0, allocation.expires - now),
                )
            )
        return listed

    def revoke(self, session_id: str) -> bool:
        """Delete one allocation now, as if it expired (relays closed)."""
        for five, allocation in list(self.core.allocations.items()):
            if self._session_id(five) == session_id:
                self.plane.revoke([allocation])
                return True
        return False

    def revoke_user(self, username: str) -> int:
        """Delete every allocation of ``username`` (the full name, or the user
        part of a time-limited ``expiry:user`` name); return how many."""
        doomed = [
            allocation
            for allocation in self.core.allocations.values()
            if username in (allocation.username, allocation.quota_user)
        ]
        self.plane.revoke(doomed)
        return len(doomed)

    # ------------------------------------------------------------ drain

    def node_addresses(self) -> list[Address]:
        """Where clients reach this node's TURN, for the other nodes' drains:
        the advertised relay address of each family (IP literals only) and
        the STUN port."""
        port = self.stun.primary[1]
        found: list[Address] = []
        for _, advertised in self.relay_hosts.values():
            try:
                found.append((str(ipaddress.ip_address(advertised)), port))
            except ValueError:
                continue  # a name, or "" (found per client): not advertisable
        return found

    async def drain(self) -> None:
        """New Allocates get 300 to a peer node (else 486); live allocations
        keep their refreshes, permissions, channels and data."""
        self.core.drain(self.core.settings.alternate_servers)
        if self.nodes is not None:
            await self.nodes.drain()

    def live_sessions(self) -> int:
        return len(self.core.allocations)

    def describe(self) -> list[str]:
        low, high = self.config.relay_ports
        lines = list(self.stun.describe()) if self.owns_stun else []
        lines += [
            f"udp {show_address(listener.local)} (dtls)"
            for listener in self.port.dtls_listeners
        ]
        where = self.stun.describe()[:1]
        lines.append(
            f"on the STUN sockets ({', '.join(where) or 'none'}), "
            f"relay ports {low}-{high}"
        )
        lines.append(
            "data plane: " + ("C (recvmmsg/sendmmsg)" if ACCELERATED else "pure Python")
        )
        settings = self.core.settings
        table = self.allocation_table
        lines.append(
            f"quotas: {settings.user_quota or 'no limit'} per user, "
            f"{table.max_per_source} per IP, {table.max_items} in total"
        )
        for family, (bind, advertised) in self.relay_hosts.items():
            label = "ipv4" if family == Family.IPV4 else "ipv6"
            lines.append(f"relay {label} {bind} (advertised {advertised or 'auto'})")
        return lines

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.nodes is not None:
            await self.nodes.close()
        unregister(self.ctx.metrics, self._dtls_collector)
        await self.port.stop_turn()
        unregister(self.ctx.metrics, self._collector)
        self.ctx.resources.forget(ALLOCATION_TABLE)
        self.ctx.resources.forget(PEER_CONNECTION_TABLE)
        if self.owns_stun:
            await self.stun.close()


async def serve(ctx: ServiceContext) -> TurnService:
    """Attach TURN to the STUN sockets (starting them when ``stun`` is not run)."""
    config = ctx.section(NAME, Config)
    running = ctx.running.get("stun")
    owns_stun = False
    if isinstance(running, StunService):
        stun = running
    else:
        from crossroads.services import stun as stun_module

        stun = await stun_module.serve(ctx)
        owns_stun = True
    try:
        service = TurnService(ctx, config, stun, owns_stun)
    except BaseException:
        if owns_stun:
            await stun.close()
        raise
    service.start()
    service.nodes = TurnNodes(
        ctx.store,
        service.node_addresses(),
        service.core.drain,
        configured=service.core.settings.alternate_servers,
    )
    service.nodes.start()
    https_port = ctx.config.core.https_port
    if ctx.certificates is not None and https_port and config.tls_port == https_port:
        # One TLS port with HTTPS (443): the runtime's listener sorts each
        # connection and hands TURN ones to the STUN service's protocol; DTLS
        # (UDP) takes the same port number, which HTTPS (TCP) does not use.
        ctx.https_port_guest = stun
        try:
            await service.listen_dtls(config.tls_port, ctx.certificates)
        except BaseException:
            await service.close()
            raise
    elif ctx.certificates is not None:
        try:
            port = await stun.listen_tls(config.tls_port, ctx.certificates.context)
            await service.listen_dtls(port, ctx.certificates)
        except BaseException:
            await service.close()
            raise
    return service
