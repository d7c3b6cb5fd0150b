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
connection insight and admin. With ``--only turn`` (no ``stun`` service), it
starts the STUN service itself, so Binding still works -- TURN clients use it
too.

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
``crossroads_turn_allocations_created_total``,
``crossroads_turn_allocations_deleted_total{reason}``,
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
from pathlib import Path
from typing import Any, cast

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from crossroads.config import Config as RuntimeConfig
from crossroads.config import (
    check_networks,
    check_non_negative,
    check_positive,
    setting,
)
from crossroads.errors import ConfigError
from crossroads.metrics import counter_by, unregister
from crossroads.proto.insight import Attempt, Step, Usage
from crossroads.proto.policy import AddressPolicy, Scope, parse_networks
from crossroads.proto.turn.allocation import Allocation, FiveTuple
from crossroads.proto.turn.auth import (
    Credentials,
    NonceMinter,
    merge_users,
    parse_user_spec,
    parse_users_file,
)
from crossroads.proto.turn.constants import (
    CHANNEL_MAX_RFC5766,
    CHANNEL_MAX_RFC8656,
    DEFAULT_MAX_ALLOCATION_LIFETIME,
    MAX_PENDING_PEER_BYTES,
    NONCE_LIFETIME,
    Family,
)
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
from crossroads.services.turn_nodes import TurnNodes
from crossroads.transport.admission import Pool
from crossroads.transport.dataplane import RouteTapLike
from crossroads.transport.dtls import DtlsCollector, DtlsListener
from crossroads.transport.refusals import RefusalLog
from crossroads.transport.reuseport import sibling_ports
from crossroads.transport.sockets import listening_ports
from crossroads.transport.tls import Certificates
from crossroads.transport.turnplane import ACCELERATED
from crossroads.transport.turnrelay import (
    ClientLink,
    Pipe,
    RelayStats,
    TcpRelay,
    TurnPlane,
    TurnRoutes,
    UdpRelay,
)
from crossroads.types import Address, frozen

NAME = "turn"
log = logging.getLogger("crossroads.turn")
#: ``Stats`` is the relays' counters (transport/turnrelay.py).
Stats = RelayStats


# ------------------------------------------------------------------ config


def _check_users(values: tuple[str, ...]) -> None:
    for value in values:
        parse_user_spec(value)


def _check_alternates(values: tuple[str, ...]) -> None:
    for value in values:
        _parse_host_port(value)


#: Default allocations per user. A browser makes one or two per peer
#: connection (UDP, sometimes TCP/TLS, IPv4 and IPv6); 128 leaves room for an
#: application that shares one static user between its players, while one
#: leaked credential cannot hold the whole port range.
DEFAULT_USER_QUOTA = 128
#: Default allocations per client IP: a carrier-grade NAT puts many players
#: behind one address, so this is larger than the per-user quota; one host
#: still cannot hold more than a small part of the relay ports and
#: descriptors (issue 12: one IP made 3,000 allocations in 28 s).
DEFAULT_IP_QUOTA = 256
#: Default cap on time-limited credentials: one day, what coturn-style
#: deployments hand out (draft-uberti-behave-turn-rest-00 suggests 86400 s).
DEFAULT_MAX_CREDENTIAL_TTL = 86400
#: The resource budget's table of TURN allocations (docs/security.md).
ALLOCATION_TABLE = "turn-allocations"
#: Descriptors an allocation holds at most: one relay socket per address
#: family (RFC 8656 §7.1 dual allocations).
DESCRIPTORS_PER_ALLOCATION = 2
#: Memory one allocation holds in the process, measured: 7.7 KB of RSS per UDP
#: allocation with one permission and one channel (1,000 allocations of a
#: ``crossroads serve`` subprocess; allocation, relay, routes and tap, socket
#: object). The relay socket's kernel buffers are the kernel's (udp_mem).
BYTES_PER_ALLOCATION = 8 * 1024
#: The allocations' share of the relay pool against other relay tables (each
#: weight 1 by default): TURN is the relay every WebRTC client falls back to,
#: so it gets twice a game-specific relay's share.
ALLOCATION_WEIGHT = 2.0
#: The resource budget's table of RFC 6062 peer data connections.
PEER_CONNECTION_TABLE = "turn-peer-connections"
#: A peer data connection holds its own descriptor and, once bound, the
#: client data connection the STUN listener hands over (RFC 6062 §5.4), which
#: then leaves the listener's table.
DESCRIPTORS_PER_PEER_CONNECTION = 2
#: Memory of one peer data connection and its client data connection: two
#: asyncio transports and protocols, and the data buffered before
#: ConnectionBind (MAX_PENDING_PEER_BYTES, RFC 6062 §5.3) or while the other
#: side's write buffer is above its high-water mark (PIPE_HIGH_WATER).
BYTES_PER_PEER_CONNECTION = 8 * 1024 + MAX_PENDING_PEER_BYTES
#: RFC 6062 TCP relays are rare (no browser asks for them): a small share of
#: the relay pool, so they cannot take the descriptors UDP allocations need.
PEER_CONNECTION_WEIGHT = 0.5


def _parse_host_port(text: str) -> Address:
    host, sep, port = text.strip().rpartition(":")
    if not sep:
        raise ValueError(f"{text!r} is not host:port")
    host = host.strip("[]")
    try:
        ipaddress.ip_address(host)
        number = int(port)
    except ValueError:
        raise ValueError(f"{text!r} is not ip:port") from None
    if not 1 <= number <= 65535:
        raise ValueError(f"{text!r}: bad port")
    return host, number


@frozen
class Config:
    """``[turn]`` settings."""

    realm: str = setting("crossroads", help="Realm of the long-term credentials.")
    user: tuple[str, ...] = setting(
        (),
        check=_check_users,
        help="A static user 'name:password' (repeatable).",
    )
    users_file: str = setting(
        "", help="File of 'name:password' lines (# comments), read at start."
    )
    secret: tuple[str, ...] = setting(
        (),
        help="Shared secret for coturn-style time-limited credentials "
        "(use-auth-secret); several may be given to rotate.",
    )
    relay_ports: tuple[int, int] = setting(
        (49152, 65535),
        kind="port_range",
        flag="--relay-ports",
        help="Range of relay ports, e.g. 49152-65535.",
    )
    relay_ip: str = setting(
        "",
        kind="host",
        help="IPv4 address relay sockets bind to (default: --host when it is "
        "an IPv4 address).",
    )
    relay_ip6: str = setting(
        "",
        kind="host",
        help="IPv6 address relay sockets bind to (empty: no IPv6 relays unless "
        "--host is IPv6).",
    )
    external_ip: str = setting(
        "",
        kind="host",
        help="Relayed IPv4 address to advertise when relays bind a private or "
        "wildcard address (default: --public-host, then the bound address).",
    )
    allow_loopback_peers: bool = setting(
        False,
        flag="--allow-loopback-peers",
        help="Allow peers on 127.0.0.0/8 and ::1 (tests, local setups).",
    )
    same_host_loopback_peers: bool = setting(
        False,
        help="Allow loopback peers to clients that are themselves on loopback "
        "(development mode turns it on so the printed test command works on one "
        "machine; remote clients still get 403, own service ports stay refused).",
    )
    allowed_peers: tuple[str, ...] = setting(
        (),
        check=check_networks,
        help="Peer ranges always allowed (CIDR), overriding the deny lists.",
    )
    denied_peers: tuple[str, ...] = setting(
        (),
        check=check_networks,
        help="Extra peer ranges denied (CIDR).",
    )
    max_lifetime: int = setting(
        int(DEFAULT_MAX_ALLOCATION_LIFETIME),
        help="Longest allocation lifetime granted, seconds (default 600 s is "
        "what clients get without asking).",
    )
    user_quota: int = setting(
        DEFAULT_USER_QUOTA,
        check=check_non_negative,
        help="Allocations per user (the user part of a time-limited username) "
        "(0 = no limit): 486 beyond.",
    )
    ip_quota: int = setting(
        DEFAULT_IP_QUOTA,
        check=check_non_negative,
        help="Allocations per client IP address (0 = no cap of its own), never "
        "more than an eighth of the total: 486 beyond.",
    )
    total_quota: int = setting(
        0,
        check=check_non_negative,
        help="Allocations in this process: 486 beyond, or 300 to an alternate "
        "server. 0 = the relay port range; the resource budget caps it by the "
        "descriptors and memory left (see docs/security.md).",
    )
    nonce_lifetime: int = setting(
        int(NONCE_LIFETIME),
        check=check_positive,
        help="Seconds a nonce stays fresh before 438 Stale Nonce (a closing "
        "Refresh with LIFETIME 0 is honoured with a stale nonce anyway).",
    )
    max_credential_ttl: int = setting(
        DEFAULT_MAX_CREDENTIAL_TTL,
        check=check_non_negative,
        help="Longest validity of a time-limited (--turn-secret) username, "
        "seconds from now; a username expiring later is refused (0 = no cap).",
    )
    alternate_server: tuple[str, ...] = setting(
        (),
        check=_check_alternates,
        help="ip:port a full server redirects to (300 Try Alternate); repeatable.",
    )
    allow_unauthenticated: bool = setting(
        False, help="Serve TURN without credentials (not advised)."
    )
    tcp_relay: bool = setting(True, help="Accept TCP relay allocations (RFC 6062).")
    rfc8656_channels: bool = setting(
        False,
        help="Only accept channel numbers 0x4000-0x4FFF (RFC 8656) instead of "
        "0x4000-0x7FFF (RFC 5766, what most clients use).",
    )
    max_bps: int = setting(
        0,
        help="Bandwidth limit per allocation in bytes/s, both directions "
        "together (0 = none); excess datagrams are dropped and counted.",
    )
    max_permissions: int = setting(1024, help="Permissions per allocation: 508 beyond.")
    tls_port: int = setting(
        5349,
        kind="port",
        help="TURN over TLS (TCP) and DTLS (UDP) port (RFC 8656 §3: 5349), "
        "served when a certificate is configured (--tls-cert).",
    )
    unauthenticated_rate: float = setting(
        100.0,
        check=check_non_negative,
        help="401/438 answers per second per source IP (flood protection).",
    )

    def __post_init__(self) -> None:
        if self.max_lifetime < 600:
            raise ValueError("max_lifetime: must be at least 600 (RFC 8656 default)")
        if self.relay_ip and ":" in self.relay_ip:
            raise ValueError("relay_ip: must be an IPv4 address")
        if self.relay_ip6 and ":" not in self.relay_ip6:
            raise ValueError("relay_ip6: must be an IPv6 address")


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
        self.relay_hosts = self._relay_hosts(ctx)
        low, high = config.relay_ports
        total, per_source = _allocation_caps(config)
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
                _settings(config),
                _credentials(config),
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
    def peer_pipes(self) -> dict[int, Pipe]:
        return self.plane.peer_pipes

    @property
    def client_pipes(self) -> dict[int, Pipe]:
        return self.plane.client_pipes

    @property
    def taps(self) -> dict[Endpoint, RouteTapLike]:
        """The listener taps in front of the port's UDP sockets."""
        return self.plane.routes.taps

    @property
    def dtls_listeners(self) -> list[DtlsListener]:
        return self.port.dtls_listeners

    def counters(self) -> tuple[int, int, int, int, int]:
        """(to_peer packets, to_peer bytes, to_client packets, to_client bytes,
        data-plane drops), Python and C paths together."""
        return self.plane.routes.counters()

    def _process_events(self) -> None:
        """Act on the core's pending events (after a direct call into it)."""
        self.plane.process_events()

    def handle_stun(self, data: bytes, client: Address, endpoint: Endpoint) -> None:
        """A non-Binding STUN message, as the port hands it to the plane."""
        self.plane.stun(data, client, endpoint)

    def _relay_hosts(self, ctx: ServiceContext) -> dict[Family, tuple[str, str]]:
        """family -> (bind address, advertised address or "" = find per client)."""
        host = ctx.host
        public = ctx.config.core.public_host
        config = self.config
        hosts: dict[Family, tuple[str, str]] = {}
        v4 = config.relay_ip or ("0.0.0.0" if host in ("0.0.0.0", "::") else "")
        if not v4 and ":" not in host:
            v4 = host
        if v4:
            advertised = config.external_ip or (
                public if public and ":" not in public else ""
            )
            if not advertised and v4 != "0.0.0.0":
                advertised = v4
            hosts[Family.IPV4] = (v4, advertised)
        v6 = config.relay_ip6 or (host if ":" in host else "")
        if v6:
            advertised6 = public if public and ":" in public else ""
            if not advertised6 and v6 != "::":
                advertised6 = v6
            hosts[Family.IPV6] = (v6, advertised6)
        return hosts

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
        insight.record(
            Attempt(
                family="turn",
                session=f"{transport}/{','.join(relayed)}",
                started=insight.now() - lived,
                duration=lived,
                sides=(insight.side(link.client[0]),),
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
        credentials = _credentials(section)
        try:
            self.core.reconfigure(_settings(section), credentials)
        except ValueError as exc:
            raise ConfigError(f"turn.realm: {exc}") from None
        table = self.allocation_table
        table.configured_max, table.configured_per_source = _allocation_caps(section)
        return [
            f"turn: {len(credentials.users)} users, {len(credentials.secrets)} "
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


def _credentials(config: Config) -> Credentials:
    users = dict(merge_users(config.user, _read_users(config.users_file)))
    credentials = Credentials(
        config.realm, users, config.secret, max_ttl=float(config.max_credential_ttl)
    )
    if not credentials.enabled and not config.allow_unauthenticated:
        log.warning(
            "TURN has no users and no secret: every Allocate will get 401 "
            "(add --turn-user name:password or --turn-secret)"
        )
    return credentials


def _allocation_caps(config: Config) -> tuple[int, int]:
    """The configured total and per-source caps of the allocation table:
    ``--turn-total-quota`` (0: the relay port range; the budget derives the
    cap in force from the descriptors and memory left) and ``--turn-ip-quota``
    (0: no cap of its own; the budget's fraction of the total still holds)."""
    low, high = config.relay_ports
    total = config.total_quota or (high - low + 1)
    return total, config.ip_quota or total


def _settings(config: Config) -> TurnSettings:
    return TurnSettings(
        realm=config.realm,
        max_lifetime=float(config.max_lifetime),
        user_quota=config.user_quota,
        # The resource budget's table holds these (see _allocation_caps).
        ip_quota=0,
        total_quota=0,
        max_permissions=config.max_permissions,
        channel_max=(
            CHANNEL_MAX_RFC8656 if config.rfc8656_channels else CHANNEL_MAX_RFC5766
        ),
        allow_unauthenticated=config.allow_unauthenticated,
        alternate_servers=tuple(_parse_host_port(a) for a in config.alternate_server),
        tcp_relay=config.tcp_relay,
        same_host_loopback_peers=config.same_host_loopback_peers,
        unauthenticated_rate=config.unauthenticated_rate,
        unauthenticated_burst=max(1.0, config.unauthenticated_rate * 2),
    )


def _read_users(path: str) -> dict[str, str]:
    if not path:
        return {}
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"turn.users_file: {exc}") from None
    try:
        return parse_users_file(text)
    except ValueError as exc:
        raise ConfigError(f"turn.users_file: {path}: {exc}") from None


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
