"""The ``turn`` service: a TURN relay (RFC 8656, RFC 6062) on the STUN sockets.

How it is wired
---------------
TURN shares port 3478 (UDP and TCP, IPv4 and IPv6) with STUN. The ``stun``
service owns those sockets and hands this service every non-Binding STUN message
and every ChannelData message through typed hooks (:class:`~crossroads.services.stun.TurnHooks`,
:meth:`crossroads.services.stun.StunService.attach_turn`). With ``--only turn``
(no ``stun`` service), this service starts the STUN listener itself, so Binding
still works — TURN clients use it too.

Control plane and data plane
----------------------------
Requests go to the sans-I/O core (:class:`crossroads.proto.turn.server.TurnServer`),
which keeps the allocation table and the forwarding tables, and asks this module
(its :class:`~crossroads.proto.turn.server.RelayBinder`) for relay sockets.

Per-packet work never touches the core, a message object or the store:

- ChannelData, both ways, is forwarded by the relay data plane's route table
  (:mod:`crossroads.transport.turnplane`): taps on the listening sockets and
  on the relay sockets, one lookup per datagram, the ChannelData header taken
  off or put on by the route, a per-relay bandwidth budget;
- client -> peer, Send indication: the attribute walk of
  :func:`~crossroads.proto.turn.fastpath.parse_send_indication`, a permission
  lookup and a ``sendto``;
- peer -> client without a channel (:meth:`UdpRelay.from_peer`, the relay
  tap's fallback): a Data indication built with ``struct`` when the peer has a
  permission; anything else is dropped and counted.

RFC 6062 TCP relays: each TCP allocation has a listening socket on its relayed
address; peer data connections (accepted, or opened by Connect) are buffered
until the client's ConnectionBind, then piped to the client data connection,
which this service takes over from the STUN listener.

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
import contextlib
import errno
import ipaddress
import logging
import os
import secrets
import socket
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
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
from crossroads.proto.stun.constants import HEADER_LENGTH
from crossroads.proto.stun.message import PortTraffic, peek_header, sort_traffic
from crossroads.proto.stun.server import BindingCore
from crossroads.proto.turn.allocation import Allocation, FiveTuple, Listener
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
    Transport,
)
from crossroads.proto.turn.fastpath import (
    data_indication,
    parse_send_indication,
    xor_peer_address,
)
from crossroads.proto.turn.ports import PortAllocator
from crossroads.proto.turn.server import (
    AllocationCreated,
    AllocationDeleted,
    AuthFailed,
    BindConnection,
    CloseConnection,
    ConnectPeer,
    PeerRefused,
    TurnServer,
    TurnSettings,
)
from crossroads.ratelog import RateLimitedLog
from crossroads.services.base import (
    ServiceContext,
    SessionInfo,
    show_address,
    stop_tasks,
)
from crossroads.services.stun import (
    BatchUdpEndpoint,
    Endpoint,
    StunService,
    TcpConnection,
    TurnHooks,
    UdpEndpoint,
)
from crossroads.services.turn_nodes import TurnNodes
from crossroads.transport.admission import Pool
from crossroads.transport.dataplane import (
    RouteTapLike,
    TapReaders,
    make_budget,
    make_tap,
)
from crossroads.transport.driver import CoreTimer
from crossroads.transport.dtls import (
    DtlsCollector,
    DtlsListener,
    DtlsTables,
    dtls_tables,
    open_dtls_listener,
)
from crossroads.transport.refusals import RefusalLog
from crossroads.transport.reuseport import sibling_ports
from crossroads.transport.sockets import listening_ports, set_buffers
from crossroads.transport.tls import Certificates
from crossroads.transport.turnplane import (
    ACCELERATED,
    MAX_DATA_ROUTES,
    PAD,
    SEND_INDICATION_KEY,
    approve,
    channel_header,
    channel_key,
    data_route,
    listener_tap,
    send_route,
    to_client_route,
    to_peer_route,
)
from crossroads.types import Address, frozen

NAME = "turn"
log = logging.getLogger("crossroads.turn")

#: ChannelData header: channel number, length (RFC 8656 §12.4).
_CHANNEL_HEADER = struct.Struct("!HH").pack
#: Drop reason of relayed data for a TCP/TLS client whose connection has
#: :data:`~crossroads.services.stun.TCP_MAX_UNSENT` bytes unsent (the client
#: stalls; its connection and allocation stay).
DROP_CLIENT_BUFFER_FULL = "tcp-client-buffer-full"
#: A pipe pauses reading when the other side has this much unsent (bytes).
PIPE_HIGH_WATER = 256 * 1024
#: Linux IP_MTU_DISCOVER / IP_PMTUDISC_DO: set the DF bit (RFC 8656 §7.2
#: DONT-FRAGMENT; §11.2 "the server sets the DF bit").
_IP_MTU_DISCOVER = getattr(socket, "IP_MTU_DISCOVER", 10)
_IP_PMTUDISC_DO = getattr(socket, "IP_PMTUDISC_DO", 2)
_IPV6_DONTFRAG = getattr(socket, "IPV6_DONTFRAG", 62)
#: Kernel buffers of relay sockets (same reasoning as the STUN sockets:
#: bursts are dropped by a small default buffer long before Python is busy).
RELAY_BUFFER_BYTES = 1024 * 1024


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


# ------------------------------------------------------------------ stats


class Stats:
    """Data-plane counters: plain ints on the hot path, exported at scrape time."""

    __slots__ = (
        "to_peer_packets",
        "to_peer_bytes",
        "to_client_packets",
        "to_client_bytes",
        "retired_errors",
        "retired_throttled",
        "drops",
    )

    def __init__(self) -> None:
        self.to_peer_packets = 0
        self.to_peer_bytes = 0
        self.to_client_packets = 0
        self.to_client_bytes = 0
        #: Send errors and malformed drops counted by relays that are gone.
        self.retired_errors = 0
        #: Datagrams dropped by the bandwidth limit of relays that are gone.
        self.retired_throttled = 0
        self.drops: dict[str, int] = {}

    def drop(self, reason: str) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + 1


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
        for reason, count in core.counters.drops.items():
            merged[reason] = merged.get(reason, 0) + count
        if errors:
            merged["data-plane-malformed-or-send-error"] = errors
        throttled = stats.retired_throttled + sum(
            r.budget.throttled for r in service.relays
        )
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


# ------------------------------------------------------------------ clients


class ClientLink:
    """How to reach the client of an allocation: a UDP socket + address, or a
    TCP connection (ChannelData padded to 4 bytes, RFC 8656 §12.5)."""

    __slots__ = ("endpoint", "client", "tcp", "out", "usage", "created")

    def __init__(self, endpoint: Endpoint, client: Address) -> None:
        self.endpoint = endpoint
        self.client = client
        #: What the allocation relayed (connection insight): to-peer packets
        #: and bytes, to-client packets and bytes, added up from the route
        #: and tap counters when they go (the data plane counts; nothing is
        #: written per datagram for it) and on the Python path.
        self.usage = [0, 0, 0, 0]
        self.created = time.time()
        self.tcp = endpoint.transport == "tcp"
        #: What peer -> client routes leave from: the listening UDP socket,
        #: unless replies must leave from each client's destination address
        #: (wildcard bind) or go through the endpoint (TCP framing, DTLS).
        self.out: EndpointSocket | None = None
        if (
            isinstance(endpoint, UdpEndpoint | BatchUdpEndpoint)
            and not endpoint.replies_from_destination
            and endpoint.fileno() >= 0
        ):
            self.out = EndpointSocket(endpoint)

    def send(self, data: bytes) -> None:
        self.endpoint.send(data, self.client)


class EndpointSocket:
    """A listening UDP endpoint as a route's out socket: its fd for the C data
    plane, its ``send`` for the pure-Python twin."""

    __slots__ = ("endpoint",)

    def __init__(self, endpoint: UdpEndpoint | BatchUdpEndpoint) -> None:
        self.endpoint = endpoint

    def fileno(self) -> int:
        return self.endpoint.fileno()

    def sendto(self, data: bytes, addr: Address) -> None:
        self.endpoint.send(data, addr)


# ------------------------------------------------------------------ UDP relays


@dataclass(eq=False)
class _RelaySocket:
    """What every relay of an allocation is made from: its socket, bound for
    ``allocation`` in ``family``, and the ``address`` it is advertised at."""

    service: TurnService
    allocation: Allocation
    family: Family
    sock: socket.socket
    address: Address
    closed: bool = field(default=False, init=False)


@dataclass(eq=False)
class UdpRelay(_RelaySocket):
    """One relay socket of a UDP allocation (a ``RelayPort`` for the core).

    A tap of the relay data plane reads it (see
    :mod:`crossroads.transport.turnplane`): data from a peer with a channel and
    a live permission leaves as ChannelData by its route; everything else comes
    to :meth:`from_peer` (ChannelData in Python for clients the plane does not
    send to, a Data indication, or a counted drop). The core's ``route_*``
    calls write the routes of both directions.
    """

    def __post_init__(self) -> None:
        service, allocation, sock = self.service, self.allocation, self.sock
        #: ``--turn-max-bps``, both directions, every route of this relay.
        self.budget = make_budget(service.config.max_bps)
        self.permissions = allocation.permissions
        self.stats = service.stats
        link = allocation.transport_data
        assert isinstance(link, ClientLink)
        self.link = link
        self.client = link.client
        self.client_send = link.endpoint.send
        #: A TCP/TLS client's connection: relayed data for it is dropped
        #: (counted) while its write buffer is full, never the connection.
        self.stream = (
            link.endpoint if isinstance(link.endpoint, TcpConnection) else None
        )
        #: Peer -> channel number, for bindings whose permission is live.
        self.peer_channels: dict[Address, int] = {}
        #: The relay socket's route table: peer -> route to the client.
        self.peer_routes: dict[Address, Any] = {}
        #: The channels this relay routes client -> peer.
        self.channels: set[int] = set()
        #: Peers (by IP) with a learned Data indication route in peer_routes.
        self.data_peers: dict[str, set[Address]] = {}
        self.tap: RouteTapLike = service.relay_tap(
            sock, self.peer_routes, self.from_peer
        )
        self.send_key = (self.client, SEND_INDICATION_KEY)
        if service.tapped(link.endpoint) and not link.tcp:
            # Send indications of this client's, once parsed, checked for a
            # permission and a peer the control plane need not judge per port,
            # leave from this relay socket on the data plane (the first relay
            # of a dual allocation takes them; the other family's go to the
            # Python path, which handles both).
            table = service.listener_routes(link.endpoint)
            if self.send_key not in table:
                table[self.send_key] = send_route(
                    sock, self.permissions, service.core.self_peers, self.budget
                )
        #: XOR-PEER-ADDRESS of IPv4 peers does not depend on the transaction
        #: id: cache it (bounded by the permission count in practice).
        self._peer_attributes: dict[Address, bytes] = {}
        self._txid_prefix = os.urandom(8)
        self._txid_counter = 0

    @property
    def bps(self) -> float:
        return self.budget.bps

    def allow(self, size: int) -> bool:
        """Spend ``size`` bytes of the relay's bandwidth budget (False: drop)."""
        return self.budget.allow(size)

    def sendto(self, data: bytes, addr: Address) -> None:
        """Send to a peer from the relayed address (Send indications)."""
        try:
            self.sock.sendto(data, addr)
        except OSError:
            self.stats.drop("relay-send-error")

    # -- the core's forwarding decisions, as routes ----------------------------

    def route_channel(self, number: int, peer: Address) -> None:
        table = self.service.listener_routes(self.link.endpoint)
        table[channel_key(self.client, number)] = to_peer_route(
            self.sock, peer, self.budget
        )
        self.channels.add(number)

    def unroute_channel(self, number: int) -> None:
        self.channels.discard(number)
        self._count(channel_key(self.client, number))
        self.service.unroute_listener(
            self.link.endpoint, channel_key(self.client, number)
        )

    def route_peer(self, peer: Address, number: int) -> None:
        self.peer_channels[peer] = number
        self._forget_learned(peer)  # ChannelData from now on
        if self.link.out is not None:
            self.peer_routes[peer] = to_client_route(
                self.link.out, self.client, number, self.budget
            )

    def unroute_peer(self, peer: Address) -> None:
        self.peer_channels.pop(peer, None)
        self.peer_routes.pop(peer, None)
        self._forget_learned(peer)

    def _forget_learned(self, peer: Address) -> None:
        learned = self.data_peers.get(peer[0])
        if learned is not None:
            learned.discard(peer)

    def unroute_permission(self, ip: str) -> None:
        for peer in self.data_peers.pop(ip, ()):
            self.peer_routes.pop(peer, None)

    def unroute_all(self) -> None:
        for number in list(self.channels):
            self.unroute_channel(number)
        self.peer_channels.clear()
        self.peer_routes.clear()
        self.data_peers.clear()
        table = self.service.listener_routes_if_any(self.link.endpoint)
        if table is not None:
            route = table.get(self.send_key)
            if route is not None and route.sock is self.sock:
                self._count(self.send_key)
                self.service.unroute_listener(self.link.endpoint, self.send_key)

    def _count(self, key: Any) -> None:
        """Add what a client -> peer route forwarded to the allocation's usage
        before it goes."""
        table = self.service.listener_routes_if_any(self.link.endpoint)
        route = table.get(key) if table is not None else None
        if route is not None:
            usage = self.link.usage
            usage[0] += route.packets
            usage[1] += route.octets

    # -- what the routes do not forward ----------------------------------------

    def from_peer(self, data: bytes, addr: Address) -> None:
        """A datagram from a peer without a route (RFC 8656 §11.3, §12)."""
        channel = self.peer_channels.get(addr)
        if channel is not None:
            # A client the plane does not send to (TCP, DTLS, wildcard bind).
            self._channel_data(channel, data)
            return
        if addr[0] not in self.permissions:
            self.stats.drop("peer-no-permission")
            return
        service = self.service
        core = service.core
        self_peer = addr[0] in core.self_peers
        if self_peer and core.self_peer_refused(addr, self.client[0]):
            # One of the server's own hosts: a permission covers the IP, the
            # port is judged here (a freed relayed port may belong to any
            # socket of the server now).
            return
        if self.budget.bps and not self.budget.allow(len(data)):
            return
        attribute = self._peer_attributes.get(addr)
        if attribute is None and ":" not in addr[0]:
            if len(self._peer_attributes) > 1024:
                self._peer_attributes.clear()
            attribute = self._peer_attributes[addr] = xor_peer_address(addr, b"")
        self._txid_counter = (self._txid_counter + 1) & 0xFFFFFFFF
        txid = self._txid_prefix + self._txid_counter.to_bytes(4, "big")
        indication = data_indication(addr, data, txid, attribute)
        if self.stream is not None:
            if not self.stream.send_relayed(indication):
                self.stats.drop(DROP_CLIENT_BUFFER_FULL)
                return
        else:
            self.client_send(indication, self.client)
        stats = self.stats
        stats.to_client_packets += 1
        stats.to_client_bytes += len(data)
        usage = self.link.usage
        usage[2] += 1
        usage[3] += len(data)
        if self.link.out is not None and self.learned < MAX_DATA_ROUTES:
            # The next ones from this peer take the data plane, until its
            # permission lapses (unroute_permission) or a channel is bound.
            self.peer_routes[addr] = data_route(
                self.link.out, self.client, addr, os.urandom(8), self.budget
            )
            self.data_peers.setdefault(addr[0], set()).add(addr)
            if self_peer:
                service.learned_self_peer(addr, self)

    @property
    def learned(self) -> int:
        """Data indication routes learned (at most MAX_DATA_ROUTES)."""
        return sum(len(peers) for peers in self.data_peers.values())

    def _channel_data(self, channel: int, data: bytes) -> None:
        size = len(data)
        if self.budget.bps and not self.budget.allow(size):
            return
        frame = channel_header(channel, size) + data
        if self.stream is not None:
            # RFC 8656 §12.5: over TCP padded to a multiple of 4 bytes.
            if not self.stream.send_relayed(frame + PAD[size & 3]):
                self.stats.drop(DROP_CLIENT_BUFFER_FULL)
                return
        else:
            self.client_send(frame, self.client)
        stats = self.stats
        stats.to_client_packets += 1
        stats.to_client_bytes += size
        usage = self.link.usage
        usage[2] += 1
        usage[3] += size

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.unroute_all()
        self.service.retire(self)
        # Counting what the kernel dropped on it: a relay of a short call may
        # never have been seen by a scrape.
        self.service.ctx.kernel_drops.close(self.sock)


class DivertedEndpoint(asyncio.DatagramProtocol):
    """The protocol of an asyncio STUN endpoint's transport while TURN's
    listener tap routes its datagrams (the tap's fallback is the endpoint's
    own dispatch)."""

    def __init__(self, endpoint: UdpEndpoint, tap: RouteTapLike) -> None:
        self.endpoint = endpoint
        self.datagram_received = tap.datagram_received  # type: ignore[method-assign]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.endpoint.connection_made(transport)

    def error_received(self, exc: Exception) -> None:
        self.endpoint.error_received(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.endpoint.connection_lost(exc)


# ------------------------------------------------------------------ TCP relays


class Pipe(asyncio.Protocol):
    """One side of a spliced pair of TCP connections, with flow control."""

    def __init__(self, service: TurnService, connection_id: int, name: str) -> None:
        self.service = service
        self.connection_id = connection_id
        self.name = name
        self.transport: asyncio.Transport | None = None
        self.other: Pipe | None = None
        #: Bytes received before the other side exists (bounded, RFC 6062 §5.3).
        self.pending = bytearray()
        self.closed = False
        #: The client host a peer connection is admitted for in the budget's
        #: peer connection table (released once, when it ends).
        self.admitted: str | None = None

    def release(self) -> None:
        """Give the peer connection's place in the budget back (once)."""
        if self.admitted is not None:
            self.service.peer_connection_table.release(self.admitted)
            self.admitted = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        other = self.other
        if other is not None and other.transport is not None:
            other.transport.write(data)
            stats = self.service.stats
            if self.name == "peer":
                stats.to_client_packets += 1
                stats.to_client_bytes += len(data)
            else:
                stats.to_peer_packets += 1
                stats.to_peer_bytes += len(data)
            return
        self.pending += data
        if len(self.pending) >= MAX_PENDING_PEER_BYTES and self.transport:
            # Stop reading: TCP flow control holds the peer back.
            self.transport.pause_reading()

    def pause_writing(self) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.resume_reading()

    def splice(self, other: Pipe) -> None:
        """Connect to ``other`` and flush what was buffered on both sides."""
        self.other = other
        other.other = self
        for side in (self, other):
            if side.pending and side.other and side.other.transport:
                side.other.transport.write(bytes(side.pending))
                side.pending.clear()
            if side.transport is not None:
                side.transport.resume_reading()

    def eof_received(self) -> bool | None:
        self.close()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.release()
        if not self.closed:
            self.closed = True
            self.service.tcp_connection_lost(self.connection_id)
        if self.other is not None and not self.other.closed:
            self.other.close()

    def close(self) -> None:
        self.release()
        if self.closed:
            return
        self.closed = True
        if self.transport is not None:
            self.transport.close()
        self.service.tcp_connection_lost(self.connection_id)
        if self.other is not None:
            self.other.close()


@dataclass(eq=False)
class TcpRelay(_RelaySocket):
    """The listening socket of an RFC 6062 TCP allocation (a ``RelayPort``)."""

    def __post_init__(self) -> None:
        bound = self.sock.getsockname()
        self.bind_address: Address = (bound[0], bound[1])
        self.bps = 0.0  # RFC 6062 data is piped; TCP flow control applies
        self.server: asyncio.Server | None = None
        self.task: asyncio.Task[Any] | None = None

    def allow(self, size: int) -> bool:
        return True

    # No channels on a TCP allocation (RFC 6062 §4: ChannelBind is refused):
    # nothing to route.
    def route_channel(self, number: int, peer: Address) -> None:
        pass

    def unroute_channel(self, number: int) -> None:
        pass

    def route_peer(self, peer: Address, number: int) -> None:
        pass

    def unroute_peer(self, peer: Address) -> None:
        pass

    def unroute_permission(self, ip: str) -> None:
        pass

    def unroute_all(self) -> None:
        pass

    def accepted(self) -> PeerSide:
        return PeerSide(self.service, self)

    def sendto(self, data: bytes, addr: Address) -> None:
        self.service.stats.drop("send-on-tcp-allocation")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.server is not None:
            self.server.close()
        else:
            if self.task is not None:
                self.task.cancel()
            self.sock.close()


class PeerSide(Pipe):
    """A peer data connection accepted on a TCP relay (RFC 6062 §5.3)."""

    def __init__(self, service: TurnService, relay: TcpRelay) -> None:
        super().__init__(service, 0, "peer")
        self.relay = relay

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        client = self.relay.allocation.five_tuple[1][0]
        refused = self.service.peer_connection_table.admit(client)
        if refused is not None:
            self.service.stats.drop(f"peer-connection-{refused}")
            self.closed = True
            transport.close()
            return
        self.admitted = client
        peer = transport.get_extra_info("peername")
        connection_id = self.service.peer_accepted(
            self.relay.allocation, (peer[0], peer[1]), self
        )
        if connection_id is None:
            self.release()
            self.closed = True
            transport.close()
            return
        self.connection_id = connection_id


# ------------------------------------------------------------------ service


def is_stun_message(data: bytes) -> bool:
    """A well-formed STUN message (RFC 8489 §5: header with the magic cookie,
    length matching the datagram): what ends a DTLS session's pre-auth state."""
    header = peek_header(data)
    return (
        header is not None
        and header.magic
        and header.length + HEADER_LENGTH == len(data)
    )


class TurnService:
    """The running TURN service (the STUN/TURN port's :class:`TurnHooks` and
    the core's ``RelayBinder``)."""

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
        self.owns_stun = owns_stun
        self.stats = Stats()
        self.loop = asyncio.get_running_loop()
        self.relay_hosts = self._relay_hosts(ctx)
        credentials = _credentials(config)
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
        self.core = TurnServer(
            _settings(config),
            credentials,
            # A per-process nonce key: nonces do not survive a restart (clients
            # just get a 438 and retry).
            NonceMinter(secrets.token_bytes(32), lifetime=float(config.nonce_lifetime)),
            policy,
            PortAllocator(low, high, cast(Any, secrets)),
            self,
            # Other workers' ports are this server's too (--workers N).
            own_ports=lambda: listening_ports() | sibling_ports(),
            reflection=ctx.reflection_budget(),
            admission=self.allocation_table,
        )
        self.core.clock_offset = time.time() - self.loop.time()
        #: (client, endpoint) -> allocation: the client -> peer route table.
        self.routes: dict[tuple[Address, Endpoint], Allocation] = {}
        #: Peer data connections by RFC 6062 connection id.
        self.peer_pipes: dict[int, Pipe] = {}
        self.client_pipes: dict[int, Pipe] = {}
        #: Live UDP relays.
        self.relays: set[UdpRelay] = set()
        #: Listener taps that take a STUN UDP socket's datagrams before STUN
        #: does (they read it, or its asyncio transport hands them over).
        self.taps: dict[Any, RouteTapLike] = {}
        #: Listener taps without a socket, for endpoints whose ChannelData
        #: comes through the port's hook (TCP, TLS, DTLS, a STUN socket read
        #: by STUN): made when the endpoint's first channel is routed.
        self.hand_taps: dict[Any, RouteTapLike] = {}
        #: What the STUN/TURN port hands this service.
        self.hooks = TurnHooks(
            stun=self.handle_stun,
            channel_data=self.channel_data,
            connection_lost=self.connection_lost,
        )
        #: Reads every tap (C: one epoll set, one event-loop fd).
        self.readers = TapReaders()
        #: Relayed address -> relays that learned a Data indication route
        #: from it, and Send routes that approved it (see :meth:`_forget_relayed`).
        self.self_peer_routes: dict[Address, set[UdpRelay]] = {}
        self.self_peer_approvals: dict[Address, set[Any]] = {}
        self._pending_endpoints: dict[FiveTuple, Endpoint] = {}
        #: Authentication failures: one line per reason a minute at most.
        self.auth_log = RateLimitedLog(log)
        self._timer = CoreTimer(self.loop, self.core.get_timer, self._on_timer)
        self._tasks: set[asyncio.Task[Any]] = set()
        #: This node in the store's TURN node listing (services/turn_nodes.py).
        self.nodes: TurnNodes | None = None
        self._collector = _Collector(self)
        #: TURN over DTLS listeners (see :meth:`listen_dtls`).
        self.dtls_listeners: list[DtlsListener] = []
        #: Their sessions and handshakes in the resource budget (one pair of
        #: tables for the IPv4 and IPv6 listeners).
        self.dtls_tables: DtlsTables | None = None
        self._dtls_collector = DtlsCollector(self.dtls_listeners)
        self._dtls_binding: BindingCore | None = None
        self._closed = False
        self.refusals = RefusalLog(
            log,
            "turn: peer",
            "answered 403; --allow-loopback-peers or --turn-allowed-peers "
            "admit more (the relayed addresses of live allocations always are)",
        )

    # ------------------------------------------------------------ setup

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
        self.stun.attach_turn(self.hooks)
        for endpoint in self.stun.udp_endpoints:
            self._install_tap(endpoint)
        self.ctx.metrics.register(self._collector)

    def _install_tap(self, endpoint: UdpEndpoint | BatchUdpEndpoint) -> None:
        """Put a listener tap in front of one STUN UDP socket.

        An asyncio endpoint diverts its datagrams to the tap (through
        :class:`DivertedEndpoint`). A batched endpoint (recvmmsg,
        ``--stun-batch-io``) stops reading only with the C data plane: the tap
        reads the socket and hands what is not routed ChannelData back to the
        endpoint's :meth:`dispatch` one datagram at a time. Without C, the
        batched endpoint keeps reading and its ChannelData comes through the
        hook (:meth:`channel_data`).
        """
        if isinstance(endpoint, UdpEndpoint):
            if endpoint.fileno() < 0:
                return
            tap = listener_tap(None, {}, endpoint.dispatch)
            if endpoint.divert(DivertedEndpoint(endpoint, tap)):
                self.taps[endpoint] = tap
            return
        if not ACCELERATED or endpoint.replies_from_destination:
            # Wildcard bind: the STUN loop answers Binding from the request's
            # destination address (IP_PKTINFO), which a plain recvmmsg here
            # would lose. Keep its loop; ChannelData comes through the hook.
            return
        tap = listener_tap(endpoint.sock, {}, endpoint.dispatch)
        if endpoint.divert():
            self.readers.add(tap)
            self.taps[endpoint] = tap

    def _restore_taps(self) -> None:
        for endpoint, tap in self.taps.items():
            self.readers.remove(tap)
            tap.close()
            endpoint.restore()
            self._retire_tap(tap)
        self.taps.clear()

    def relay_tap(
        self,
        sock: socket.socket,
        routes: dict[Any, Any],
        fallback: Callable[[bytes, Any], None],
    ) -> RouteTapLike:
        """A tap reading a relay socket (keyed by the peer's address)."""
        tap = make_tap(sock, routes, fallback)
        self.readers.add(tap)
        return tap

    def tapped(self, endpoint: Endpoint) -> bool:
        """Whether a tap sees this endpoint's datagrams before STUN does (so
        a route for Send indications there is used)."""
        return endpoint in self.taps

    def listener_routes_if_any(self, endpoint: Endpoint) -> dict[Any, Any] | None:
        """The endpoint's client -> peer route table, if it has one."""
        tap = self.taps.get(endpoint) or self.hand_taps.get(endpoint)
        return tap.routes if tap is not None else None

    def listener_routes(self, endpoint: Endpoint) -> dict[Any, Any]:
        """The client -> peer route table of a listening endpoint."""
        tap = self.taps.get(endpoint) or self.hand_taps.get(endpoint)
        if tap is None:

            def unrouted(data: bytes, client: Any) -> None:
                self._channel_data_slow(data, client, endpoint)

            tap = self.hand_taps[endpoint] = listener_tap(None, {}, unrouted)
        return tap.routes

    def unroute_listener(self, endpoint: Endpoint, key: Any) -> None:
        """Remove one client -> peer route; a hand-fed tap left empty goes (TCP
        connections and DTLS sessions come and go: no empty tables)."""
        tap = self.taps.get(endpoint) or self.hand_taps.get(endpoint)
        if tap is None:
            return
        tap.routes.pop(key, None)
        if not tap.routes and endpoint in self.hand_taps:
            del self.hand_taps[endpoint]
            self._retire_tap(tap)

    def _retire_tap(self, tap: RouteTapLike) -> None:
        stats = self.stats
        stats.to_peer_packets += tap.forwarded
        stats.to_peer_bytes += tap.forwarded_bytes
        stats.retired_errors += tap.send_errors + tap.malformed

    def learned_self_peer(self, peer: Address, relay: UdpRelay) -> None:
        """``relay`` learned a Data indication route from ``peer``, an
        address of this host: it goes when ``peer`` (a relayed address) does."""
        self.self_peer_routes.setdefault(peer, set()).add(relay)

    def _forget_relayed(self, address: Address) -> None:
        """The relayed ``address`` is gone: no route another allocation
        learned from it and no Send approval to it forwards any more (the
        core ended the channels to it; a new socket may take the port)."""
        for relay in self.self_peer_routes.pop(address, ()):
            relay.unroute_peer(address)
        for route in self.self_peer_approvals.pop(address, ()):
            approved = route.approved
            if approved is not None:
                approved.pop(address, None)

    def retire(self, relay: UdpRelay) -> None:
        """Stop reading a closing relay; fold its counters into the totals."""
        self.relays.discard(relay)
        self._forget_relayed(relay.address)
        tap = relay.tap
        self.readers.remove(tap)
        tap.close()
        stats = self.stats
        stats.to_client_packets += tap.forwarded
        stats.to_client_bytes += tap.forwarded_bytes
        stats.retired_errors += tap.send_errors + tap.malformed
        stats.retired_throttled += relay.budget.throttled
        usage = relay.link.usage
        usage[2] += tap.forwarded
        usage[3] += tap.forwarded_bytes

    def counters(self) -> tuple[int, int, int, int, int]:
        """(to_peer packets, to_peer bytes, to_client packets, to_client bytes,
        data-plane drops), Python and C paths together."""
        stats = self.stats
        taps = [*self.taps.values(), *self.hand_taps.values()]
        relays = [relay.tap for relay in self.relays]
        to_peer = stats.to_peer_packets + sum(t.forwarded for t in taps)
        to_peer_bytes = stats.to_peer_bytes + sum(t.forwarded_bytes for t in taps)
        to_client = stats.to_client_packets + sum(t.forwarded for t in relays)
        to_client_bytes = stats.to_client_bytes + sum(t.forwarded_bytes for t in relays)
        errors = stats.retired_errors + sum(
            t.send_errors + t.malformed for t in (*taps, *relays)
        )
        return to_peer, to_peer_bytes, to_client, to_client_bytes, errors

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
                self.core.delete_allocation(allocation, "revoked")
                self._after_input()
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
        for allocation in doomed:
            self.core.delete_allocation(allocation, "revoked")
        self._after_input()
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
            for listener in self.dtls_listeners
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
        if self.stun.turn is self.hooks:
            self.stun.detach_turn()
        self._restore_taps()
        for listener in self.dtls_listeners:
            listener.close()
        if self.dtls_tables is not None:
            self.dtls_tables.forget()
        unregister(self.ctx.metrics, self._dtls_collector)
        self.core.close()
        self._transmit()
        for pipe in list(self.peer_pipes.values()) + list(self.client_pipes.values()):
            pipe.close()
        self._timer.close()
        await stop_tasks(list(self._tasks))
        self.readers.close()
        unregister(self.ctx.metrics, self._collector)
        self.ctx.resources.forget(ALLOCATION_TABLE)
        self.ctx.resources.forget(PEER_CONNECTION_TABLE)
        if self.owns_stun:
            await self.stun.close()

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ------------------------------------------------------------ DTLS

    async def listen_dtls(self, port: int, certificates: Certificates) -> None:
        """Serve TURN over DTLS (RFC 8656 §3, RFC 7350) on UDP ``port`` of
        ``--host`` (and ``::`` beside a ``0.0.0.0`` bind), the port number of
        TURN over TLS, as coturn does.

        Decrypted datagrams take the path of plain UDP ones (:meth:`handle_dtls`);
        the :class:`~crossroads.transport.dtls.DtlsListener` is the allocation's
        endpoint, so replies and relayed data are encrypted for the client's
        session. Its sessions and handshakes have their own tables
        (``dtls-sessions:turn``, ``dtls-handshakes:turn``); a session must
        send a well-formed STUN message within the TCP first-message deadline
        (``--stun-tcp-message-timeout``) of its handshake, as a TCP or TLS
        connection must.
        """
        host = self.ctx.host
        binds = [(host, False)] + ([("::", True)] if host == "0.0.0.0" else [])
        self._dtls_binding = self.stun.connection_binding_core(rate_limit=0)
        stun_config = self.stun.config
        if self.dtls_tables is None:
            self.dtls_tables = dtls_tables(
                self.ctx.resources,
                "turn",
                max_sessions_per_source=stun_config.tcp_max_connections_per_ip,
                first_message_timeout=stun_config.tcp_message_timeout,
            )
        tables = self.dtls_tables
        for bind_host, v6only in binds:
            try:
                listener = await open_dtls_listener(
                    bind_host,
                    port,
                    v6only,
                    DtlsListener(
                        certificates,
                        self.handle_dtls,
                        tables,
                        self.stun.stats.drop,
                        self.ctx.reflection_budget(),
                        first_message=is_stun_message,
                    ),
                )
            except OSError as exc:
                if bind_host == host:
                    raise
                log.warning("TURN: no IPv6 DTLS listener on [::]: %s", exc)
                continue
            self.dtls_listeners.append(listener)
            self.ctx.resources.listen(
                "turn", "turn-dtls", "udp", listener.local, tables.sessions.name
            )
        self.ctx.metrics.register(self._dtls_collector)

    def handle_dtls(self, data: bytes, client: Address, endpoint: Endpoint) -> None:
        """One decrypted DTLS datagram: dispatched as a plain UDP one would be."""
        if len(data) < 2:
            self.stun.stats.drop("empty")
            return
        kind = sort_traffic(data)
        if kind is PortTraffic.BINDING:
            # Binding: the DTLS handshake proved the address (no budget).
            binding = self._dtls_binding
            assert binding is not None
            now = self.loop.time()
            binding.receive_datagram(data, client, now, 0)
            for reply, dest, _send_from in binding.datagrams_to_send(now):
                endpoint.send(reply, dest)
        elif kind is PortTraffic.STUN:
            self.handle_stun(data, client, endpoint)
        elif kind is PortTraffic.CHANNEL_DATA:
            self.channel_data(data, client, endpoint)
        else:
            self.stun.stats.drop("dtls-not-stun")

    # ------------------------------------------------------------ port hooks

    def channel_data(self, data: bytes, client: Address, endpoint: Endpoint) -> None:
        """ChannelData the port hands over (the ChannelData hook): routed by the
        endpoint's hand-fed tap, or, where a tap in front of the socket did not
        route it already, counted."""
        tap = self.hand_taps.get(endpoint)
        if tap is None:
            self._channel_data_slow(data, client, endpoint)
        else:
            tap.datagram_received(data, client)

    def _channel_data_slow(
        self, data: bytes, client: Address, endpoint: Endpoint
    ) -> None:
        """ChannelData no route forwarded: count why."""
        allocation = self.routes.get((client, endpoint))
        if allocation is None:
            self.stats.drop("channel-no-allocation")
        elif len(data) < 4 or allocation.routes.get((data[0] << 8) | data[1]) is None:
            self.stats.drop("channel-unbound")
        else:
            self.stats.drop("channel-unroutable")

    def handle_stun(self, data: bytes, client: Address, endpoint: Endpoint) -> None:
        """Every non-Binding STUN message from a client."""
        send = data[1] == 0x16 and data[0] == 0  # a Send indication (RFC 8656 §11.2)
        if send and self._fast_send(data, client, endpoint):
            return
        transport = Transport.TCP if endpoint.transport == "tcp" else Transport.UDP
        listener: Listener = (transport, endpoint.local)
        if send:
            route = self.core.send_route(data, client, listener)
            if route is not None:
                relay, peer, payload = route
                allow = getattr(relay, "allow", None)
                if getattr(relay, "bps", 0) and allow and not allow(len(payload)):
                    return
                relay.sendto(payload, peer)
                self.stats.to_peer_packets += 1
                self.stats.to_peer_bytes += len(payload)
                if isinstance(relay, UdpRelay):
                    relay.link.usage[0] += 1
                    relay.link.usage[1] += len(payload)
            return
        # The endpoint a request came in on, for open_relay, the answer and
        # ConnectionBind while the core handles it (the core knows five-tuples,
        # not sockets).
        five: FiveTuple = (transport, client, endpoint.local)
        self._pending_endpoints[five] = endpoint
        try:
            self.core.receive_datagram(data, client, self.loop.time(), listener)
            self._after_input()
        finally:
            self._pending_endpoints.pop(five, None)

    def _fast_send(self, data: bytes, client: Address, endpoint: Endpoint) -> bool:
        """Send indication without a message object; False: use the slow path."""
        allocation = self.routes.get((client, endpoint))
        if allocation is None:
            return False
        parsed = parse_send_indication(data)
        if parsed is None:
            return False
        peer, payload, _dont_fragment = parsed
        relay = allocation.relays.get(Family.IPV6 if ":" in peer[0] else Family.IPV4)
        if relay is None:
            self.stats.drop("send-family-mismatch")
            return True
        if peer[0] not in allocation.permissions:
            self.stats.drop("send-no-permission")
            return True
        if self.core.self_peer_refused(peer, client[0]):
            return True
        if peer[0] in self.core.self_peers:
            # Approved for this port: the Send route may take the next ones
            # for a second (turnplane.SELF_PEER_APPROVAL).
            table = self.listener_routes_if_any(endpoint)
            route = table.get((client, SEND_INDICATION_KEY)) if table else None
            if (
                isinstance(relay, UdpRelay)
                and route is not None
                and route.sock is relay.sock
            ):
                approve(route, peer, time.monotonic())
                if peer in self.core.relayed:
                    self.self_peer_approvals.setdefault(peer, set()).add(route)
        if relay.bps and not relay.allow(len(payload)):
            return True
        relay.sendto(payload, peer)
        stats = self.stats
        stats.to_peer_packets += 1
        stats.to_peer_bytes += len(payload)
        link = allocation.transport_data
        if isinstance(link, ClientLink):
            link.usage[0] += 1
            link.usage[1] += len(payload)
        return True

    def connection_lost(self, client: Address, endpoint: Endpoint) -> None:
        """A TCP control connection closed: its allocation goes (RFC 8656 §3.1)."""
        self.core.client_disconnected((Transport.TCP, client, endpoint.local))
        self._after_input()

    # ------------------------------------------------------------ RelayBinder

    def has_relay_address(self, family: Family) -> bool:
        return family in self.relay_hosts

    def open_relay(
        self,
        allocation: Allocation,
        family: Family,
        port: int,
        transport: Transport,
        dont_fragment: bool,
    ) -> UdpRelay | TcpRelay | None:
        bind_host, advertised = self.relay_hosts[family]
        if not advertised:
            advertised = _route_source(family, allocation.five_tuple[1][0])
            if not advertised:
                return None
        five = allocation.five_tuple
        endpoint = self._pending_endpoints.get(five)
        if endpoint is None:  # only an Allocate request being handled opens relays
            return None
        allocation.transport_data = ClientLink(endpoint, five[1])
        af = socket.AF_INET6 if family == Family.IPV6 else socket.AF_INET
        if transport == Transport.UDP:
            return self._open_udp(
                allocation, family, af, bind_host, port, advertised, dont_fragment
            )
        return self._open_tcp(allocation, family, af, bind_host, port, advertised)

    def _open_udp(
        self,
        allocation: Allocation,
        family: Family,
        af: socket.AddressFamily,
        bind_host: str,
        port: int,
        advertised: str,
        dont_fragment: bool,
    ) -> UdpRelay | None:
        sock = socket.socket(af, socket.SOCK_DGRAM)
        try:
            if af == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            set_buffers(sock, RELAY_BUFFER_BYTES)
            if dont_fragment:
                if af == socket.AF_INET:
                    sock.setsockopt(
                        socket.IPPROTO_IP, _IP_MTU_DISCOVER, _IP_PMTUDISC_DO
                    )
                else:
                    sock.setsockopt(socket.IPPROTO_IPV6, _IPV6_DONTFRAG, 1)
            sock.bind((bind_host, port))
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
                log.warning("relay bind %s:%s failed: %s", bind_host, port, exc)
            return None
        relay = UdpRelay(self, allocation, family, sock, (advertised, port))
        self.relays.add(relay)
        return relay

    def _open_tcp(
        self,
        allocation: Allocation,
        family: Family,
        af: socket.AddressFamily,
        bind_host: str,
        port: int,
        advertised: str,
    ) -> TcpRelay | None:
        # Probe without SO_REUSEPORT first: the port must be ours alone. The
        # listener then uses SO_REUSEPORT so that Connect can open outgoing
        # connections from the same relayed address (RFC 6062 §5.2).
        try:
            with socket.socket(af, socket.SOCK_STREAM) as probe:
                if af == socket.AF_INET6:
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                probe.bind((bind_host, port))
        except OSError:
            return None
        sock = socket.socket(af, socket.SOCK_STREAM)
        try:
            if af == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((bind_host, port))
            sock.listen(64)
            sock.setblocking(False)
        except OSError:
            sock.close()
            return None
        relay = TcpRelay(self, allocation, family, sock, (advertised, port))

        async def listen() -> None:
            relay.server = await self.loop.create_server(relay.accepted, sock=sock)
            if relay.closed:
                relay.server.close()

        relay.task = self._spawn(listen())
        return relay

    # ------------------------------------------------------------ events

    def _process_events(self) -> None:
        for event in self.core.pop_events():
            match event:
                case AllocationCreated(allocation=allocation):
                    link = allocation.transport_data
                    assert isinstance(link, ClientLink)
                    self.routes[(link.client, link.endpoint)] = allocation
                case AllocationDeleted(allocation=allocation, reason=reason):
                    link = allocation.transport_data
                    if isinstance(link, ClientLink):
                        self._record(allocation, link, reason)
                        key = (link.client, link.endpoint)
                        if self.routes.get(key) is allocation:
                            del self.routes[key]
                        if isinstance(link.endpoint, DtlsListener):
                            # Its DTLS session ends with it (as coturn's does).
                            link.endpoint.end_session(link.client)
                case ConnectPeer(connection_id=cid, relay=relay, peer=peer):
                    assert isinstance(relay, TcpRelay)
                    self._spawn(self._connect_peer(cid, relay, peer))
                case BindConnection(connection_id=cid, five_tuple=five):
                    self._bind_connection(cid, five)
                case CloseConnection(connection_id=cid):
                    for table in (self.peer_pipes, self.client_pipes):
                        pipe = table.pop(cid, None)
                        if pipe is not None:
                            pipe.close()
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
            if isinstance(relay, _RelaySocket)
        ]
        transport = allocation.five_tuple[0].name.lower()
        # TURN over TCP shows a round trip: the kernel's smoothed RTT of the
        # client's connection (TCP_INFO), read once, here.
        round_trip = getattr(link.endpoint, "round_trip", None)
        rtt = round_trip() if link.tcp and callable(round_trip) else None
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

    def _after_input(self) -> None:
        """What follows every call into the core: send what it queued for
        clients, act on its events, re-arm its timer (the driver's steps 2-3,
        :mod:`crossroads.transport.driver`)."""
        self._transmit()
        self._timer.rearm()

    def _transmit(self) -> None:
        # Datagrams first: an event may act on a connection an answer still has
        # to go down (BindConnection pipes it after the ConnectionBind answer).
        now = self.loop.time()
        for data, client, (transport, local) in self.core.datagrams_to_send(now):
            self._send_to_client((transport, client, local), data)
        self._process_events()

    def _send_to_client(self, five: FiveTuple, data: bytes) -> None:
        # The endpoint of the request being handled, else the allocation's.
        endpoint = self._pending_endpoints.get(five)
        if endpoint is not None:
            endpoint.send(data, five[1])
            return
        allocation = self.core.allocations.get(five)
        link = allocation.transport_data if allocation is not None else None
        if isinstance(link, ClientLink):
            link.send(data)

    def _on_timer(self, now: float) -> None:
        self.core.clock_offset = time.time() - now
        self.core.handle_timer(now)
        self._transmit()

    # ------------------------------------------------------------ RFC 6062

    async def _connect_peer(self, cid: int, relay: TcpRelay, peer: Address) -> None:
        client = relay.allocation.five_tuple[1][0]
        refused = self.peer_connection_table.admit(client)
        if refused is not None:
            self.stats.drop(f"peer-connection-{refused}")
            self.core.peer_connect_failed(cid)
            self._after_input()
            return
        af = socket.AF_INET6 if relay.family == Family.IPV6 else socket.AF_INET
        sock = socket.socket(af, socket.SOCK_STREAM)
        pipe = Pipe(self, cid, "peer")
        pipe.admitted = client
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            with contextlib.suppress(OSError):
                # RFC 6062 §5.2: from the relayed transport address.
                sock.bind(relay.bind_address)
            await self.loop.sock_connect(sock, peer)
            await self.loop.create_connection(lambda: pipe, sock=sock)
        except (OSError, asyncio.CancelledError) as exc:
            sock.close()
            pipe.release()
            if not isinstance(exc, asyncio.CancelledError):
                self.core.peer_connect_failed(cid)
                self._after_input()
            return
        if cid not in self.core.connections:
            pipe.close()
            return
        self.peer_pipes[cid] = pipe
        self.core.peer_connected(cid, self.loop.time())
        self._after_input()

    def peer_accepted(
        self, allocation: Allocation, peer: Address, pipe: Pipe
    ) -> int | None:
        cid = self.core.peer_accepted(allocation, peer, self.loop.time())
        if cid is not None:
            self.peer_pipes[cid] = pipe
        self._after_input()
        return cid

    def _bind_connection(self, cid: int, five: FiveTuple) -> None:
        """Take the client data connection over from the STUN listener."""
        endpoint = self._pending_endpoints.get(five)
        peer_pipe = self.peer_pipes.get(cid)
        if endpoint is None or peer_pipe is None:
            self.core.connection_closed(cid)
            return
        client_pipe = Pipe(self, cid, "client")
        self.client_pipes[cid] = client_pipe
        stream, leftover = (
            self.stun.detach_tcp(endpoint)
            if isinstance(endpoint, TcpConnection)
            else (None, b"")
        )
        if stream is None:
            self.core.connection_closed(cid)
            return

        def splice() -> None:
            # After the ConnectionBind response (already written) the
            # connection carries raw application data (RFC 6062 §5.4).
            stream.set_protocol(client_pipe)
            client_pipe.connection_made(stream)
            if leftover:
                client_pipe.pending += leftover
            client_pipe.splice(peer_pipe)

        self.loop.call_soon(splice)

    def tcp_connection_lost(self, cid: int) -> None:
        if self._closed:
            return
        self.peer_pipes.pop(cid, None)
        self.client_pipes.pop(cid, None)
        self.core.connection_closed(cid)
        self._after_input()


def _route_source(family: Family, client_host: str) -> str:
    """The local address the kernel would use to reach ``client_host`` (a UDP
    ``connect`` does a route lookup and sends nothing)."""
    af = socket.AF_INET6 if family == Family.IPV6 else socket.AF_INET
    if (":" in client_host) != (family == Family.IPV6):
        return ""
    with socket.socket(af, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((client_host, 9))
        except OSError:
            return ""
        return str(probe.getsockname()[0])


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
