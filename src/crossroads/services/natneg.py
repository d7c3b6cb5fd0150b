"""``natneg``: the GameSpy NAT negotiation server (UDP 27901) with relay fallback.

The protocol lives in :mod:`crossroads.proto.natneg.server` (sans-I/O); this module
binds the sockets, feeds the core, runs its timer, allocates relays when the core
asks (:mod:`crossroads.transport.natneg_relay`) and exports metrics.

Addresses
---------
SDK clients resolve ``<game>.natneg1.<domain>``, ``natneg2`` and ``natneg3`` and send to
port 27901 on each (ref §1). What crossroads can learn depends on how many IPs those
names resolve to:

* **Two or three IPs** -- natneg1 and natneg2 on ``host``, natneg3 on a second IP
  (``natneg3_host``), or one IP each: the NN1 and NN3 INITs then reach different
  addresses, so a symmetric NAT shows as different public ports (relay fallback),
  and the SDK's NAT detection (NATify) can tell symmetric NATs from cones and, with
  an IP the client's ERT socket never contacts (natneg3: that socket sends only to
  natneg1 and natneg2; or ``probe_host``), IP filtering from port filtering. The NAT
  lab runs the two-IP layout and the SDK classifies every kind right through it.
* **One IP** -- all three names resolve to ``host``; natneg2/natneg3 share its socket
  and only ``probe_port`` (a second port on the same IP) is available as a probe
  source. This *cannot detect*: symmetric NATs (every INIT reaches one ip:port, so
  every NAT maps it to one public port: no automatic relay for symmetric pairs,
  only after a failed REPORT), and address-restricted vs full-cone filtering
  (reported as full cone). Port-restricted filtering is still detected.
* Other *ports* on one IP (``natneg2_port`` != ``port``) separate natneg1/2/3 only for
  clients that can be told a port -- the SDK cannot (MATCHUP_PORT is 27901) -- and a
  NAT that maps per destination IP (address-dependent) still looks like a cone.
  Tests use them on loopback.

Binding ``0.0.0.0`` with several public IPs is wrong: replies could leave from
another IP than the client sent to, and its NAT would drop them. Bind each IP.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import json
import logging
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from crossroads.config import (
    CONVERTERS,
    check_networks,
    check_non_negative,
    check_positive,
    convert_setting,
    setting,
)
from crossroads.errors import ConfigError
from crossroads.insight import InsightRecorder
from crossroads.metrics import add_counts, counter_by, unregister
from crossroads.proto.insight import Attempt, Step, Usage
from crossroads.proto.natneg.packets import PacketType
from crossroads.proto.natneg.server import (
    RELAY_REASONS,
    Event,
    NatNegServer,
    NatNegSocket,
    NegotiationFinished,
    Outcome,
    RelayMode,
    RelayNeeded,
    ReportReceived,
    ServerConfig,
    SessionClosed,
    SessionId,
)
from crossroads.proto.policy import AddressPolicy, parse_networks, scopes_for
from crossroads.services.base import ServiceContext, SessionInfo
from crossroads.transport.admission import Admission, Pool, ResourceBudget
from crossroads.transport.driver import SocketSetDriver
from crossroads.transport.natneg_relay import RelayPool
from crossroads.transport.sockets import make_udp_socket
from crossroads.types import Address, frozen, show_address

NAME = "natneg"
log = logging.getLogger("crossroads.natneg")

#: Tables of the process's resource budget (docs/security.md).
SESSIONS_TABLE = "natneg-sessions"
RELAYS_TABLE = "natneg-relays"
#: Measured resident memory of one negotiation session that has seen one
#: INIT (the session, its client record, the heap entry, the per-source and
#: rate-limiter entries): ~1.3 KB with tracemalloc over 10,000 sessions, so
#: 2 KiB with the allocator's slack.
SESSION_BYTES = 2048
#: Measured memory of one relay pair beyond its two descriptors: two socket
#: objects, two route taps (C state included) and the pair record: ~1.6 KB
#: with tracemalloc, ~1.3 KB of RSS over 400 pairs; 4 KiB leaves room for the
#: routes a pair learns and the allocator's slack.
RELAY_PAIR_BYTES = 4096


def _check_relay_mode(value: str) -> None:
    if value not in {mode.value for mode in RelayMode}:
        raise ValueError(f"{value!r} is not one of auto, always, never")


def parse_port_range(value: str) -> tuple[int, int] | None:
    """``""`` (OS-chosen ports) or ``"low-high"``."""
    if not value:
        return None
    converted: tuple[int, int] = CONVERTERS["port_range"](value)
    return converted


def _check_optional_port(value: int) -> None:
    if not -1 <= value <= 65535:
        raise ValueError(f"{value} is not -1 or a port number (0-65535)")


def _check_port_range(value: str) -> None:
    parse_port_range(value)


@frozen
class Config:
    """``[natneg]``: GameSpy NAT negotiation (flags ``--natneg-*``)."""

    enabled: bool = setting(True, help="Run the natneg server (config.json 'enabled').")
    host: str = setting(
        "",
        kind="host",
        help="natneg1 bind address, IPv4 ('' = the core --host).",
    )
    port: int = setting(
        27901, kind="port", help="natneg1 UDP port (SDK clients always use 27901)."
    )
    natneg2_host: str = setting(
        "", kind="host", help="Address natneg2.<domain> resolves to ('' = host)."
    )
    natneg2_port: int = setting(
        -1,
        check=_check_optional_port,
        help="natneg2 UDP port (-1 = same as port).",
    )
    natneg3_host: str = setting(
        "", kind="host", help="Address natneg3.<domain> resolves to ('' = host)."
    )
    natneg3_port: int = setting(
        -1,
        check=_check_optional_port,
        help="natneg3 UDP port (-1 = same as port).",
    )
    probe_port: int = setting(
        -1,
        check=_check_optional_port,
        help="Second port on host, source of the 'unsolicited port' NAT probe "
        "(-1 = port + 1, 0 = any free port).",
    )
    probe_host: str = setting(
        "",
        kind="host",
        help="A local IP no natneg name resolves to: source of the "
        "'unsolicited IP' NAT probe ('' = natneg3 if it is a third IP).",
    )
    session_timeout: float = setting(
        30.0,
        check=check_positive,
        help="Seconds to wait for both clients before CONNECT with an error.",
    )
    force_lan_mode: bool = setting(
        False,
        help="Always send the peer's private (INIT) address: LAN parties only.",
    )
    timed_connect: bool = setting(
        True,
        help="Time the two CONNECTs from each client's measured round trip so both "
        "first pings leave at once, for the pairs whose NATs may need it (both may "
        "filter by port); false: send both together, as GameSpy did.",
    )
    client_poll: float = setting(
        0.01,
        check=check_non_negative,
        help="How often the games read their sockets (s; the SDK sample: every "
        "10 ms): the CONNECT lead is shortened by half of it so a poll-inflated "
        "round trip never makes it overshoot.",
    )
    connect_interval: float = setting(
        1.0,
        check=check_positive,
        help="CONNECT resend interval until CONNECT_ACK (s).",
    )
    connect_attempts: int = setting(
        10,
        check=check_positive,
        help="CONNECT sends per client before giving up.",
    )
    linger: float = setting(
        20.0,
        check=check_positive,
        help="Seconds a finished session answers duplicates.",
    )
    relay_mode: str = setting(
        "auto",
        check=_check_relay_mode,
        help="Relay fallback: auto (when a direct path looks impossible), always, never.",
    )
    relay_host: str = setting(
        "",
        kind="host",
        help="IPv4 address clients are told to relay through "
        "('' = --public-host, else host if it is not a wildcard).",
    )
    relay_ports: str = setting(
        "",
        check=_check_port_range,
        help="Relay UDP port range like 50000-59999 ('' = OS-chosen).",
    )
    relay_idle_timeout: float = setting(
        60.0,
        check=check_positive,
        help="Release a relay pair after this many idle seconds.",
    )
    max_relays: int = setting(1000, check=check_positive, help="Relay pairs at most.")
    relay_allow: tuple[str, ...] = setting(
        (),
        check=check_networks,
        help="Networks (CIDR) whose clients may still be relayed: loopback, "
        "private, link-local and the server's own addresses are refused "
        "otherwise (except the scope of the advertised relay address).",
    )
    max_sessions: int = setting(
        100_000,
        check=check_positive,
        help="Concurrent negotiation sessions at most.",
    )
    max_sessions_per_ip: int = setting(
        64,
        check=check_positive,
        help="Concurrent sessions one source IP may open.",
    )
    rate_limit: float = setting(
        200.0,
        check=check_non_negative,
        help="Packets per second per source IP (0 = no limit).",
    )
    config_json: str = setting(
        "",
        flag="--natneg-config-json",
        help="A seed-style config.json whose 'natneg' object (host, port, enabled, "
        "session_timeout, force_lan_mode) overrides these settings.",
    )


# ------------------------------------------------------------- seed config.json

#: The seed's ``config.json`` keys (seeds/002, "Configuration"): settings of
#: this section, converted and checked as their flags are.
SEED_KEYS = ("host", "port", "enabled", "session_timeout", "force_lan_mode")
#: The seed's defaults for keys a config.json leaves out where they differ from
#: crossroads': ``force_lan_mode`` defaults to true there ("LAN mode (default)").
SEED_DEFAULTS: dict[str, Any] = {"force_lan_mode": True}


def apply_seed_config(config: Config, path: Path) -> Config:
    """``config`` with the ``natneg`` object of a seed ``config.json`` applied.

    Keys it names override; ``force_lan_mode`` left out means the seed's default
    (true). Unknown keys inside ``natneg`` are an error (a typo must not be ignored);
    other top-level objects (other servers of that emulator) are ignored.

    Raises:
        ConfigError: unreadable file, bad JSON, no ``natneg`` object, bad value.
    """
    where = f"natneg.config_json ({path})"
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{where}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: not JSON: {exc}") from None
    section = document.get("natneg") if isinstance(document, dict) else None
    if not isinstance(section, dict):
        raise ConfigError(f'{where}: no "natneg" object')
    fields = {f.name: f for f in dataclasses.fields(Config)}
    values = {**SEED_DEFAULTS}
    for key, raw in section.items():
        if key not in SEED_KEYS:
            known = ", ".join(SEED_KEYS)
            raise ConfigError(f"{where}: unknown key natneg.{key} (known: {known})")
        values[key] = convert_setting(NAME, fields[key], raw, str(path))
    return dataclasses.replace(config, **values)


# ---------------------------------------------------------------- addresses


def _ipv4_host(host: str, what: str) -> str:
    if host in ("", "::"):
        return "0.0.0.0"
    if host == "::1":
        # The same intent ("loopback only") in the only family natneg has.
        return "127.0.0.1"
    if ipaddress.ip_address(host).version != 4:
        # Every address field of the protocol is 4 bytes (ref §3).
        raise ConfigError(
            f"natneg.{what}: {host} is IPv6; natneg is IPv4-only"
            " (set --natneg-host to an IPv4 address, or leave natneg out of --only)"
        )
    return host


@frozen
class Layout:
    """Which socket serves which :class:`NatNegSocket`, and the probe choices."""

    binds: dict[NatNegSocket, Address]
    #: Endpoints that share the socket of another (endpoint -> owner).
    shared: dict[NatNegSocket, NatNegSocket]
    unsolicited_ip: NatNegSocket | None
    unsolicited_port: NatNegSocket | None


def plan_layout(cfg: Config, core_host: str) -> Layout:
    """Decide the sockets for a config (pure, so tests can check it)."""
    host = _ipv4_host(cfg.host or core_host, "host")
    nn2_host = _ipv4_host(cfg.natneg2_host or host, "natneg2_host")
    nn3_host = _ipv4_host(cfg.natneg3_host or host, "natneg3_host")
    nn2 = (nn2_host, cfg.port if cfg.natneg2_port < 0 else cfg.natneg2_port)
    nn3 = (nn3_host, cfg.port if cfg.natneg3_port < 0 else cfg.natneg3_port)
    probe_port = cfg.probe_port
    if probe_port < 0:
        probe_port = cfg.port + 1 if 0 < cfg.port < 65535 else 0
    wanted: list[tuple[NatNegSocket, Address]] = [
        (NatNegSocket.PRIMARY, (host, cfg.port)),
        (NatNegSocket.NATNEG2, nn2),
        (NatNegSocket.NATNEG3, nn3),
        (NatNegSocket.PROBE_PORT, (host, probe_port)),
    ]
    if cfg.probe_host:
        probe_ip = _ipv4_host(cfg.probe_host, "probe_host")
        wanted.append((NatNegSocket.PROBE_IP, (probe_ip, probe_port)))
    # "Same as port" on the same host is the same socket, even for port 0.
    same_as_primary = {
        NatNegSocket.NATNEG2: cfg.natneg2_port < 0 and nn2_host == host,
        NatNegSocket.NATNEG3: cfg.natneg3_port < 0 and nn3_host == host,
    }
    binds: dict[NatNegSocket, Address] = {}
    shared: dict[NatNegSocket, NatNegSocket] = {}
    for endpoint, address in wanted:
        owner: NatNegSocket | None = None
        if same_as_primary.get(endpoint):
            owner = NatNegSocket.PRIMARY
        elif address[1] != 0:
            # Port 0 means "any free port": never the same socket as another.
            owner = next((e for e, a in binds.items() if a == address), None)
        if owner is None:
            binds[endpoint] = address
        else:
            shared[endpoint] = owner
    if NatNegSocket.PROBE_PORT in shared:
        raise ConfigError("natneg.probe_port: must differ from the natneg ports")
    unsolicited_ip: NatNegSocket | None = None
    if NatNegSocket.PROBE_IP in binds:
        unsolicited_ip = NatNegSocket.PROBE_IP
    elif NatNegSocket.NATNEG3 in binds and nn3[0] not in (host, nn2[0], "0.0.0.0"):
        # The NATify ERT socket sends to natneg1 and natneg2 only (ref §5).
        unsolicited_ip = NatNegSocket.NATNEG3
    return Layout(binds, shared, unsolicited_ip, NatNegSocket.PROBE_PORT)


# ---------------------------------------------------------------- metrics


class _Collector(Collector):
    """Reads the core's and the relay pool's counters at scrape time."""

    def __init__(self, service: NatNegService) -> None:
        self.service = service

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        core = self.service.core
        received = CounterMetricFamily(
            "crossroads_natneg_packets_received",
            "natneg packets decoded, by type.",
            labels=["type"],
        )
        for ptype in PacketType:
            received.add_metric([ptype.name.lower()], core.stats.received[ptype])
        yield received
        yield counter_by(
            "crossroads_natneg_dropped",
            "natneg datagrams dropped, by reason.",
            "reason",
            core.stats.dropped,
        )
        yield counter_by(
            "crossroads_natneg_liveness_checks",
            "Liveness ERTs to clients silent since their INITs when their partner"
            " came, by result (asked, alive, replaced by a restart, gone).",
            "result",
            core.stats.liveness,
        )
        yield CounterMetricFamily(
            "crossroads_natneg_packets_sent",
            "natneg packets sent.",
            value=core.stats.sent,
        )
        yield GaugeMetricFamily(
            "crossroads_natneg_sessions",
            "natneg sessions held (including lingering ones).",
            value=core.session_count,
        )
        relay = self.service.relay
        if relay is not None:
            yield GaugeMetricFamily(
                "crossroads_natneg_relays",
                "Relay pairs allocated now.",
                value=relay.active,
            )
            yield CounterMetricFamily(
                "crossroads_natneg_relay_packets",
                "Datagrams forwarded by natneg relays.",
                value=relay.packets(),
            )
            allocations = CounterMetricFamily(
                "crossroads_natneg_relay_allocations",
                "Relay pair requests, by result.",
                labels=["result"],
            )
            allocations.add_metric(["allocated"], relay.stats.allocated)
            # One result per refusal verdict (refused-loopback, refused-self, ...).
            add_counts(allocations, relay.stats.refused_by, "refused-")
            allocations.add_metric(["failed"], relay.stats.failed)
            yield allocations


# ---------------------------------------------------------------- service

#: Game names remembered between a REPORT and its negotiation's end: a
#: bound whatever REPORTs come (entries leave when the negotiation ends).
MAX_GAME_NAMES = 10_000

#: A step's outcome, by how the negotiation ended (natneg has no more detail:
#: a FAILED REPORT means the client's pings timed out, ref §6).
_OUTCOME_STEP = {
    Outcome.CONNECTED: "ok",
    Outcome.UNREPORTED: "ok-unreported",
    Outcome.FAILED: "timed-out",
    Outcome.UNACKED: "unacked",
    Outcome.DEADBEAT: "partner-never-came",
    Outcome.INIT_TIMEOUT: "init-timeout",
    Outcome.RESTARTED: "restarted",
    Outcome.GONE: "gone",
}


class NatNegService:
    """The running natneg service: sockets, core, timer, relay pool."""

    name = NAME

    def __init__(
        self,
        core: NatNegServer,
        relay: RelayPool | None,
        insight: InsightRecorder | None = None,
    ) -> None:
        self.core = core
        self.relay = relay
        #: Where each finished negotiation's record goes (crossroads.insight).
        self.insight = insight if insight is not None else InsightRecorder()
        #: Relayed sessions: why, and when (loop time) the relay was decided.
        self._relaying: dict[SessionId, tuple[str, float]] = {}
        #: Records of relayed negotiations, completed with the pair's usage
        #: when the pair is released (bounded by the relay pairs).
        self._deferred: dict[SessionId, Attempt] = {}
        #: The game name the clients REPORTed, by cookie (bounded below).
        self._games: dict[int, str] = {}
        if relay is not None:
            relay.on_release = self._pair_released
        self.addresses: dict[NatNegSocket, Address] = {}
        self._loop = asyncio.get_running_loop()
        #: The core on its sockets (opened by :func:`serve`).
        self.driver = SocketSetDriver(core, self._handle_events)
        self._collector: _Collector | None = None
        self._registry: Any = None
        self._closed = False
        self._notes: list[str] = []
        #: The budget its tables are registered with (None: not registered).
        self.resources: ResourceBudget | None = None
        self.negotiations = Counter(
            "crossroads_natneg_negotiations",
            "Finished natneg sessions, by outcome.",
            ["outcome", "relayed", "attempt"],
            registry=None,
        )
        #: Why the server relayed, one label per :data:`RELAY_REASONS` (a first
        #: attempt relayed by prediction, or a retry after a failure).
        self.relay_reasons = Counter(
            "crossroads_natneg_relay_decisions",
            "Negotiations sent to a relay, by why a direct path was predicted to fail.",
            ["reason"],
            registry=None,
        )
        for reason in RELAY_REASONS:
            self.relay_reasons.labels(reason)
        self.reports = Counter(
            "crossroads_natneg_reports",
            "REPORTs received, by the client's result.",
            ["result"],
            registry=None,
        )

    # The core's events ------------------------------------------------------

    def _handle_events(self, events: list[Event], now: float) -> None:
        for event in events:
            match event:
                case RelayNeeded(
                    session=session, client_ips=ips, reason=reason, detail=detail
                ):
                    pair = self.relay.allocate(session, ips) if self.relay else None
                    if pair is None:
                        log.info(
                            "natneg %08x: relay needed (%s: %s) but unavailable",
                            session.cookie,
                            reason,
                            detail,
                        )
                        self.core.relay_unavailable(session, now)
                    else:
                        self.relay_reasons.labels(reason).inc()
                        self._relaying[session] = (reason, now)
                        log.info(
                            "natneg %08x: relaying (%s: %s) via %s:%d / %s:%d",
                            session.cookie,
                            reason,
                            detail,
                            *pair[0],
                            *pair[1],
                        )
                        self.core.relay_allocated(session, pair[0], pair[1], now)
                case NegotiationFinished(
                    session=session,
                    outcome=outcome,
                    relayed=relayed,
                    first_attempt=first_attempt,
                ):
                    self.negotiations.labels(
                        outcome.value,
                        str(relayed).lower(),
                        "first" if first_attempt else "retry",
                    ).inc()
                    log.debug("natneg %08x: %s", session.cookie, outcome.value)
                    self._finished(event, now)
                case SessionClosed(session=session, replaced=replaced):
                    # Replaced: a new negotiation on the cookie gets its own pair
                    # and nothing will use this one. Ended: a pair that never heard
                    # both clients never will (a pair in use lives on for the game
                    # until idle).
                    relay = self.relay
                    if relay is not None and (replaced or not relay.in_use(session)):
                        relay.release(session)
                    self._relaying.pop(session, None)
                case ReportReceived(success=success, cookie=cookie, game_name=game):
                    self.reports.labels("success" if success else "failure").inc()
                    if game and len(self._games) < MAX_GAME_NAMES:
                        self._games[cookie] = game[:64]

    # Connection insight ---------------------------------------------------

    def _finished(self, event: NegotiationFinished, now: float) -> None:
        """The negotiation's record: recorded now, or (relayed) when its pair
        is released, with what the pair carried."""
        insight = self.insight
        session = event.session
        outcome = event.outcome
        relaying = self._relaying.pop(session, None)
        sides = tuple(
            insight.side(ip, kind, None if rtt is None else rtt * 1000)
            for ip, kind, rtt in event.clients
        )
        game = self._games.pop(session.cookie, "")
        connected = outcome in (Outcome.CONNECTED, Outcome.UNREPORTED)
        result = _OUTCOME_STEP.get(outcome, outcome.value)
        if relaying is not None:
            reason, decided = relaying
            relay_start = max(0.0, event.duration - (now - decided))
            punch = "predicted-to-fail" if reason != "forced" else "skipped"
            steps = (
                Step("punch", 0.0, relay_start, punch),
                Step("relay", relay_start, event.duration - relay_start, result),
            )
            attempt = Attempt(
                family="natneg",
                session=f"{session.cookie:08x}",
                started=insight.now() - event.duration,
                duration=event.duration,
                sides=sides,
                steps=steps,
                winner="relay" if connected else "",
                outcome="relayed" if connected else "failed",
                cause=reason if connected else f"{reason}; relay {outcome.value}",
                game=game,
            )
            if self.relay is not None and self.relay.holds(session):
                self._deferred[session] = attempt
                return
            insight.record(attempt)
            return
        cause = "" if outcome == Outcome.CONNECTED else outcome.value
        if not event.first_attempt and outcome != Outcome.CONNECTED:
            cause = f"{cause}; client retried after failure"
        insight.record(
            Attempt(
                family="natneg",
                session=f"{session.cookie:08x}",
                started=insight.now() - event.duration,
                duration=event.duration,
                sides=sides,
                steps=(Step("punch", 0.0, event.duration, result),),
                winner="punch" if connected else "",
                outcome="direct" if connected else "failed",
                cause=cause,
                game=game,
            )
        )

    def _pair_released(
        self,
        session: SessionId,
        lived: float,
        up: tuple[int, int],
        down: tuple[int, int],
    ) -> None:
        attempt = self._deferred.pop(session, None)
        if attempt is None:
            return
        usage = Usage(
            packets_up=up[0], bytes_up=up[1], packets_down=down[0], bytes_down=down[1]
        )
        self.insight.record(dataclasses.replace(attempt, usage=usage))

    # The Service protocol ---------------------------------------------------

    def sessions(self) -> list[SessionInfo]:
        """Negotiations in progress (seconds long, not revocable) and relay
        pairs (``relay-<cookie>-<serial>``, revocable: the pair's sockets close;
        the serial tells apart negotiations that reuse a cookie)."""
        listed = [
            SessionInfo(
                id=str(summary.cookie),
                client=summary.owner_ip,
                detail=f"negotiation {summary.state}, {summary.clients}/2 clients, "
                f"{summary.age:.0f} s old",
                revocable=False,
            )
            for summary in self.core.session_summaries(self._loop.time())
        ]
        if self.relay is not None:
            listed += [
                SessionInfo(
                    id=f"relay-{session.cookie}-{session.serial}",
                    client=f"{ips[0]} <-> {ips[1]}",
                    detail=f"relay pair, {packets} datagrams relayed",
                )
                for session, ips, packets in self.relay.pair_summaries()
            ]
        return listed

    def revoke(self, session_id: str) -> bool:
        """Close a relay pair (``relay-<cookie>-<serial>``)."""
        if self.relay is None:
            return False
        for session, _ips, _packets in self.relay.pair_summaries():
            if session_id == f"relay-{session.cookie}-{session.serial}":
                self.relay.release(session)
                return True
        return False

    def describe(self) -> list[str]:
        if not self.driver.sockets and not self._notes:
            return ["disabled"]
        roles = {
            NatNegSocket.PRIMARY: "natneg1",
            NatNegSocket.NATNEG2: "natneg2",
            NatNegSocket.NATNEG3: "natneg3",
            NatNegSocket.PROBE_PORT: "probe port",
            NatNegSocket.PROBE_IP: "probe ip",
        }
        lines = [
            f"udp {show_address(address)} ({roles[endpoint]})"
            for endpoint, address in self.addresses.items()
        ]
        return lines + self._notes

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.driver.close()
        if self.relay is not None:
            await self.relay.close()
        if self.resources is not None:
            self.resources.forget(SESSIONS_TABLE)
            self.resources.forget(RELAYS_TABLE)
        if self._collector is not None and self._registry is not None:
            unregister(
                self._registry,
                self._collector,
                self.negotiations,
                self.relay_reasons,
                self.reports,
            )


def core_config(cfg: Config, layout: Layout) -> ServerConfig:
    """The core's settings from the service config."""
    return ServerConfig(
        session_timeout=cfg.session_timeout,
        connect_interval=cfg.connect_interval,
        connect_attempts=cfg.connect_attempts,
        linger=cfg.linger,
        force_lan_mode=cfg.force_lan_mode,
        timed_connect=cfg.timed_connect,
        client_poll=cfg.client_poll,
        relay_mode=RelayMode(cfg.relay_mode),
        max_sessions=cfg.max_sessions,
        max_sessions_per_ip=cfg.max_sessions_per_ip,
        rate_limit=cfg.rate_limit,
        # The burst lets one client's whole INIT/ACK exchange through at once.
        rate_burst=max(cfg.rate_limit * 2, 20.0),
        unsolicited_ip=layout.unsolicited_ip,
        unsolicited_port=layout.unsolicited_port,
    )


#: Listener kinds in the resource registry, by endpoint.
KINDS = {
    NatNegSocket.PRIMARY: "natneg1",
    NatNegSocket.NATNEG2: "natneg2",
    NatNegSocket.NATNEG3: "natneg3",
    NatNegSocket.PROBE_PORT: "natneg-probe-port",
    NatNegSocket.PROBE_IP: "natneg-probe-ip",
}


def session_table(budget: ResourceBudget, cfg: Config, core: ServerConfig) -> Admission:
    """Register the negotiation sessions: no descriptor, no proof of
    anything (natneg has no authentication), so every session is pre-auth
    state. The longest a session that never completes lives: the wait for
    both clients, the error CONNECTs (the core's ``error_attempts``, one
    interval apart) and the linger that answers late duplicates."""
    deadline = (
        core.session_timeout
        + (core.error_attempts + 1) * core.connect_interval
        + core.linger
    )
    return budget.table(
        SESSIONS_TABLE,
        max_items=cfg.max_sessions,
        max_per_source=cfg.max_sessions_per_ip,
        pool=Pool.NONE,
        bytes_per_item=SESSION_BYTES,
        preauth_deadline=deadline,
    )


def relay_table(budget: ResourceBudget, cfg: Config) -> Admission:
    """Register the relay pairs: two UDP sockets each, from the relay
    descriptor pool; a source (the IP of the session's first client) holds
    at most as many pairs as it may hold sessions."""
    return budget.table(
        RELAYS_TABLE,
        max_items=cfg.max_relays,
        max_per_source=cfg.max_sessions_per_ip,
        pool=Pool.RELAY,
        descriptors_per_item=2,
        bytes_per_item=RELAY_PAIR_BYTES,
    )


def _relay_advertise(cfg: Config, public_host: str, bind_host: str) -> str | None:
    for candidate in (cfg.relay_host, public_host, bind_host):
        if candidate and candidate not in ("0.0.0.0", "::"):
            if ipaddress.ip_address(candidate).version == 4:
                return candidate
    return None


async def serve(ctx: ServiceContext) -> NatNegService:
    """Bind the natneg sockets (and the relay pool) and start answering."""
    cfg = ctx.section(NAME, Config)
    if cfg.config_json:
        cfg = apply_seed_config(cfg, Path(cfg.config_json))
    core_host = ctx.host
    if not cfg.enabled:
        service = NatNegService(NatNegServer(), None)
        return service
    layout = plan_layout(cfg, core_host)
    core = core_config(cfg, layout)
    sessions = session_table(ctx.resources, cfg, core)
    relay: RelayPool | None = None
    notes: list[str] = []
    bind_host = layout.binds[NatNegSocket.PRIMARY][0]
    advertise = _relay_advertise(cfg, ctx.config.core.public_host, bind_host)
    if cfg.relay_mode != RelayMode.NEVER.value:
        if advertise is None:
            notes.append("relay disabled: set --public-host or --natneg-relay-host")
        else:
            relay = RelayPool(
                bind_host=bind_host,
                advertise_host=advertise,
                port_range=parse_port_range(cfg.relay_ports),
                idle_timeout=cfg.relay_idle_timeout,
                max_pairs=cfg.max_relays,
                admission=relay_table(ctx.resources, cfg),
                kernel_drops=ctx.kernel_drops,
                table=ctx.route_table,
                policy=AddressPolicy(
                    allow=parse_networks(cfg.relay_allow),
                    self_addresses=ctx.own_addresses(),
                    admitted=scopes_for([advertise]),
                ),
            )
            ports = cfg.relay_ports or "ephemeral ports"
            notes.append(f"relay udp {advertise} {ports} (mode {cfg.relay_mode})")
    service = NatNegService(
        NatNegServer(core, ctx.reflection_budget(), sessions),
        relay,
        ctx.insight,
    )
    service.resources = ctx.resources
    service._notes = notes
    sockets: list[socket.socket] = []
    try:
        for endpoint, (host, port) in layout.binds.items():
            try:
                sock = make_udp_socket(host, port)
            except OSError as exc:
                raise OSError(
                    exc.errno,
                    f"natneg {endpoint.name.lower()} {host}:{port}: {exc.strerror}",
                ) from None
            sockets.append(sock)
            await service.driver.open(endpoint, sock)
            address = service.addresses[endpoint] = sock.getsockname()[:2]
            ctx.resources.listen(NAME, KINDS[endpoint], "udp", address, SESSIONS_TABLE)
        for endpoint, owner in layout.shared.items():
            service.driver.share(endpoint, owner)
    except BaseException:
        for sock in sockets:
            sock.close()
        await service.close()
        raise
    registry = ctx.metrics
    service._registry = registry
    service._collector = _Collector(service)
    registry.register(service._collector)
    registry.register(service.negotiations)
    registry.register(service.relay_reasons)
    registry.register(service.reports)
    return service
