"""The ``[turn]`` settings and what is derived from them: the credentials,
the core's settings and the allocation table's caps (the TURN service,
:mod:`crossroads.services.turn`, runs them)."""

from __future__ import annotations

import ipaddress
import logging
from pathlib import Path

from crossroads.config import (
    check_networks,
    check_non_negative,
    check_positive,
    setting,
)
from crossroads.errors import ConfigError
from crossroads.proto.turn.auth import (
    Credentials,
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
from crossroads.proto.turn.server import TurnSettings
from crossroads.types import Address, frozen

log = logging.getLogger("crossroads.turn")


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
#: descriptors (a flood
#: from one IP made 3,000 allocations in 28 s before there was one).
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
#: then leaves the listener's table, and the stream plane's two pipes (four
#: descriptors) that splice(2) a TCP pair (a TLS pair has none).
DESCRIPTORS_PER_PEER_CONNECTION = 6
#: Memory of one peer data connection and its client data connection: the
#: stream route and its sockets, and the data held before ConnectionBind
#: (MAX_PENDING_PEER_BYTES, RFC 6062 §5.3); a TCP pair's bytes in flight are
#: in its pipes (kernel pages), a TLS pair's in its transport's buffers.
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


def credentials(config: Config) -> Credentials:
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


def allocation_caps(config: Config) -> tuple[int, int]:
    """The configured total and per-source caps of the allocation table:
    ``--turn-total-quota`` (0: the relay port range; the budget derives the
    cap in force from the descriptors and memory left) and ``--turn-ip-quota``
    (0: no cap of its own; the budget's fraction of the total still holds)."""
    low, high = config.relay_ports
    total = config.total_quota or (high - low + 1)
    return total, config.ip_quota or total


def settings(config: Config) -> TurnSettings:
    return TurnSettings(
        realm=config.realm,
        max_lifetime=float(config.max_lifetime),
        user_quota=config.user_quota,
        # The resource budget's table holds these (see allocation_caps).
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


def relay_hosts(
    config: Config, host: str, public: str
) -> dict[Family, tuple[str, str]]:
    """family -> (bind address, advertised address or "" = find per client),
    from ``--turn-relay-ip(6)``, ``--turn-external-ip``, ``--host`` and
    ``--public-host``."""
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
