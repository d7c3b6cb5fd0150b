"""The web console at ``/``: what runs, live counters, charts, recent errors,
how to connect clients, and admin pages behind a token.

Everything is served by crossroads itself: two server-rendered pages, one
stylesheet and one small vanilla script (no build step, no CDN; a
Content-Security-Policy of ``'self'`` only). The script polls
``/console/api/status`` every :data:`POLL_SECONDS` and redraws counters and
inline-SVG charts.

Theory of operation. A :class:`Sampler` task reads the runtime's Prometheus
registry every :data:`SAMPLE_SECONDS` and keeps the last :data:`HISTORY_SAMPLES`
readings of a fixed list of counters (:data:`COUNTERS`); rates are the
difference of two readings. An :class:`ErrorRing` logging handler keeps the last
:data:`ERROR_RING` WARNING-or-worse records. Public pages and ``/console/api/status``
show only what a client could learn by connecting anyway: services, ports,
counters. Sessions (client addresses, user names), recent errors and revoke are
under ``/console/api/admin/*``, which needs ``Authorization: Bearer <admin token>``
(compared in constant time); the admin page asks for the token and keeps it in
the tab's sessionStorage (no cookie, so no cross-site request can use it).
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import html
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import KW_ONLY, InitVar, asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CollectorRegistry

import crossroads
from crossroads.config import Config
from crossroads.errors import StoreError
from crossroads.proto.budget import BudgetConfig, FailureBudget
from crossroads.proto.insight import FAMILIES as INSIGHT_FAMILIES
from crossroads.service_types import Impairable, Impairment, Service, SessionAdmin
from crossroads.transport.tasks import cancel_and_wait
from crossroads.transport.tls import Certificates
from crossroads.types import frozen, show_address

#: Seconds between two readings of the counters: fine enough for "packets per
#: second right now", coarse enough to cost nothing (one registry walk).
SAMPLE_SECONDS = 2.0
#: Readings kept: 300 x 2 s = the last ten minutes, the charts' span.
HISTORY_SAMPLES = 300
#: How often the page asks for fresh numbers (the sampling period).
POLL_SECONDS = SAMPLE_SECONDS
#: Recent WARNING/ERROR records kept for the admin page (bounded memory).
ERROR_RING = 100
#: Longest message kept per record: a huge message must not grow the ring.
ERROR_MESSAGE_CHARS = 500
#: The public status is shared by every viewer for this long: one computation
#: per second bounds what polling browsers (or a flood of them) cost.
STATUS_CACHE_SECONDS = 1.0
#: Longest QA delay or jitter the admin API sets (seconds): a game's own
#: timeouts are a few seconds (Unity's relay re-binds after 3 missed 3 s
#: pings), so more would only disconnect it.
MAX_IMPAIR_SECONDS = 10.0
#: Largest NAT-lab matrix file shown (bytes); bigger ones are not read.
MATRIX_MAX_BYTES = 256 * 1024


@frozen
class CounterSpec:
    """One number the console shows: a Prometheus sample, summed over labels."""

    key: str
    label: str
    sample: str
    #: "gauge": the value; "total": a counter's value; "rate": per second.
    kind: str


COUNTERS: tuple[CounterSpec, ...] = (
    CounterSpec("turn_allocations", "TURN allocations", "crossroads_turn_allocations", "gauge"),
    CounterSpec("turn_pps", "TURN packets/s", "crossroads_turn_relayed_packets_total", "rate"),
    CounterSpec("relay_allocations", "Relay allocations", "crossroads_relay_allocations", "gauge"),
    CounterSpec("relay_pps", "Relay packets/s", "crossroads_relay_relayed_packets_total", "rate"),
    CounterSpec("openttd_servers", "OpenTTD servers", "crossroads_openttd_servers", "gauge"),
    CounterSpec("natneg_negotiations", "natneg negotiations", "crossroads_natneg_negotiations_total", "total"),
    CounterSpec("p2p_sessions", "p2p sessions", "crossroads_p2p_sessions", "gauge"),
    CounterSpec("stun_rps", "STUN requests/s", "crossroads_stun_requests_total", "rate"),
)  # fmt: skip


def read_samples(registry: CollectorRegistry) -> dict[str, float]:
    """Current value of every :data:`COUNTERS` sample, summed over its labels."""
    wanted = {spec.sample for spec in COUNTERS}
    values = dict.fromkeys(wanted, 0.0)
    for family in registry.collect():
        for sample in family.samples:
            if sample.name in wanted:
                values[sample.name] += sample.value
    return values


class Sampler:
    """The last :data:`HISTORY_SAMPLES` readings of :data:`COUNTERS`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.history: collections.deque[tuple[float, dict[str, float]]] = (
            collections.deque(maxlen=HISTORY_SAMPLES)
        )

    def sample(self, now: float) -> None:
        self.history.append((now, read_samples(self.registry)))

    def series(self) -> dict[str, list[tuple[float, float]]]:
        """key -> [(wall time, shown value)], oldest first."""
        points = list(self.history)
        out: dict[str, list[tuple[float, float]]] = {s.key: [] for s in COUNTERS}
        for index, (at, values) in enumerate(points):
            for spec in COUNTERS:
                if spec.kind != "rate":
                    out[spec.key].append((at, values[spec.sample]))
                elif index > 0:
                    before_at, before = points[index - 1]
                    elapsed = max(at - before_at, 1e-9)
                    # A counter never goes down; a restart of its service would.
                    delta = max(0.0, values[spec.sample] - before[spec.sample])
                    out[spec.key].append((at, delta / elapsed))
        return out

    def current(self) -> dict[str, float]:
        """Gauges and totals read now; rates over the last sampling period."""
        now_values = read_samples(self.registry)
        series = self.series()
        current: dict[str, float] = {}
        for spec in COUNTERS:
            if spec.kind == "rate":
                points = series[spec.key]
                current[spec.key] = points[-1][1] if points else 0.0
            else:
                current[spec.key] = now_values[spec.sample]
        return current

    async def run(self) -> None:
        while True:
            self.sample(time.time())
            await asyncio.sleep(SAMPLE_SECONDS)


class ErrorRing(logging.Handler):
    """Keeps the last :data:`ERROR_RING` WARNING-or-worse records."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=ERROR_RING
        )

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string must not break logging
            message = str(record.msg)
        self.records.append(
            {
                "time": record.created,
                "level": record.levelname,
                "logger": record.name,
                "message": message[:ERROR_MESSAGE_CHARS],
            }
        )


# ------------------------------------------------------------------ snippets


@frozen
class ClientPorts:
    """The ports clients use, as bound (0 in a configuration means "any")."""

    stun: int = 3478
    coordinator: int = 3976
    openttd_stun: int = 3975
    relay: int = 7780
    http: int = 8080


class RelayNode(Protocol):
    """What the console shows of one relay node (the relay service's
    ``NodeInfo`` has these fields)."""

    @property
    def node_id(self) -> str: ...
    @property
    def region(self) -> str: ...
    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int: ...
    @property
    def load(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def qos_host(self) -> str: ...
    @property
    def qos_port(self) -> int: ...


async def _no_relay_nodes() -> Sequence[RelayNode]:
    return []


@frozen
class TurnTls:
    """TURN over TLS as clients reach it: the port and the certificate's DNS
    names (``/console/api/status`` field ``tls``)."""

    port: int
    dns_names: tuple[str, ...]


#: Why no ``turns:`` URL is offered when the certificate names no usable host.
NO_TURNS_NAME = (
    "turns: not listed: the certificate names no DNS name for this host, and "
    "Firefox refuses turns: with an IP address; add a DNS name to the certificate"
)


def turns_name(host: str, dns_names: tuple[str, ...]) -> str | None:
    """The DNS name a ``turns:`` URL should carry, or None.

    ``host`` itself when the certificate covers it (exactly, or by a one-label
    wildcard, RFC 6125 §6.4.3), else the certificate's first DNS name that is
    not a wildcard. Never an IP literal: Firefox refuses ``turns:`` with one,
    and a name is what the client checks the certificate against.
    """
    wanted = host.lower().rstrip(".")
    for name in dns_names:
        name = name.lower().rstrip(".")
        if name == wanted:
            return host
        label, dot, rest = wanted.partition(".")
        if name.startswith("*.") and dot and label and rest == name[2:]:
            return host
    return next((name for name in dns_names if not name.startswith("*")), None)


def ice_urls(
    host: str, stun_port: int, tls: TurnTls | None
) -> tuple[list[str], str | None]:
    """The iceServers URLs of this server (RFC 7064/7065): STUN, TURN over UDP
    and TCP, and ``turns:`` (TURN over TLS) when a certificate with a DNS name is
    served; and a note saying why ``turns:`` is missing, if it is."""
    shown = f"[{host}]" if ":" in host else host
    urls = [
        f"stun:{shown}:{stun_port}",
        f"turn:{shown}:{stun_port}?transport=udp",
        f"turn:{shown}:{stun_port}?transport=tcp",
    ]
    if tls is None:
        return urls, None
    name = turns_name(host, tls.dns_names)
    if name is None:
        return urls, NO_TURNS_NAME
    return [*urls, f"turns:{name}:{tls.port}?transport=tcp"], None


def connect_snippets(
    host: str, ports: ClientPorts, tls: TurnTls | None = None
) -> list[tuple[str, str]]:
    """(title, text) for each kind of client, with this server's address."""
    shown = f"[{host}]" if ":" in host else host
    stun_port, coordinator, openttd_stun = (
        ports.stun,
        ports.coordinator,
        ports.openttd_stun,
    )
    relay_port, http_port = ports.relay, ports.http
    urls, note = ice_urls(host, stun_port, tls)
    turn_urls = ", ".join(f'"{url}"' for url in urls[1:])
    return [
        (
            "WebRTC (browser, libwebrtc)",
            (f"// {note}\n" if note else "")
            + "const pc = new RTCPeerConnection({iceServers: [\n"
            f'  {{urls: ["{urls[0]}"]}},\n'
            f"  {{urls: [{turn_urls}],\n"
            '   username: "<from crossroads credentials turn USER>",\n'
            '   credential: "<idem>"}]});',
        ),
        (
            "coturn test client",
            f"turnutils_uclient -y -W <turn secret> -u me -p {stun_port} {shown}",
        ),
        (
            "OpenTTD 12-14",
            f"export OTTD_COORDINATOR_CS={shown}:{coordinator}\n"
            f"export OTTD_STUN_CS={shown}:{openttd_stun}\nopenttd -D",
        ),
        (
            "GameSpy natneg (hosts file)",
            f"{host}  <gamename>.natneg1.gamespy.com\n"
            f"{host}  <gamename>.natneg2.gamespy.com\n"
            f"{host}  <gamename>.natneg3.gamespy.com",
        ),
        (
            f"Unity Relay-style client (REST API, relay node UDP {relay_port})",
            f'curl -H "Authorization: Bearer <api key>" -d \'{{"maxConnections": 4}}\' '
            f"http://{shown}:{http_port}/v1/allocate",
        ),
        (
            "crossroads p2p SDK demo",
            f"crossroads host --server ws://{shown}:{http_port}/p2p/v1/ws",
        ),
    ]


# ------------------------------------------------------------------ matrix


def matrix_table(path: Path | None) -> str:
    """The NAT-lab matrix (a Markdown pipe table) as an HTML table, or ""."""
    if path is None:
        return ""
    try:
        if path.stat().st_size > MATRIX_MAX_BYTES:
            return ""
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    rows = [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in text.splitlines()
        if line.strip().startswith("|")
    ]
    rows = [r for r in rows if not all(set(c) <= set("-: ") for c in r)]
    if len(rows) < 2:
        return ""
    head = "".join(f'<th scope="col">{html.escape(c)}</th>' for c in rows[0])
    body = "".join(
        "<tr>"
        + f'<th scope="row">{html.escape(row[0])}</th>'
        + "".join(f"<td>{html.escape(c)}</td>" for c in row[1:])
        + "</tr>"
        for row in rows[1:]
    )
    return (
        '<div class="scroll"><table><caption>Latest NAT-lab matrix '
        f"({html.escape(path.name)})</caption><thead><tr>{head}</tr></thead>"
        f"<tbody>{body}</tbody></table></div>"
    )


# ------------------------------------------------------------------ console


SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; "
        "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
        "form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


@dataclass(eq=False)
class Console:
    """The console of one runtime (routes, sampler task, error ring)."""

    _: KW_ONLY
    config: Config = field(repr=False)
    metrics: InitVar[CollectorRegistry]
    services: Callable[[], Mapping[str, Service]]
    # What the console reads of particular services, given by the runtime
    # (web/ does not import services/: the layer order in tests/test_imports.py).
    #: Every live relay node (the relay service's store view), [] without one.
    relay_nodes_source: Callable[[], Awaitable[Sequence[RelayNode]]] = _no_relay_nodes
    #: The ports clients reach the services of this process on, as bound, by
    #: :class:`ClientPorts` field (``stun``, ``coordinator`` ...; not ``http``).
    bound_ports: Callable[[], Mapping[str, int]] = dict
    #: The port TURN over TLS listens on, None when it does not.
    turn_tls_port: Callable[[], int | None] = lambda: None
    #: The runtime's resource registry (listeners, tables, caps), read by
    #: ``crossroads doctor`` and the adversarial battery; None: not shown.
    resources: Callable[[], dict[str, Any]] | None = None
    #: The process's TLS certificate (its DNS names go into ``turns:`` URLs).
    certificates: Certificates | None = None
    #: Whether the instance drains (a banner on every page says so).
    draining: Callable[[], bool] = lambda: False
    #: Start a drain; returns its status (``POST /console/api/admin/drain``).
    drain: Callable[[], dict[str, Any]] | None = None
    matrix_path: Path | None = None
    sampler: Sampler = field(init=False)
    errors: ErrorRing = field(default_factory=ErrorRing, init=False)
    started: float = field(default_factory=time.time, init=False)
    _task: asyncio.Task[None] | None = field(default=None, init=False)
    _status: dict[str, Any] | None = field(default=None, init=False)
    _status_at: float = field(default=0.0, init=False)
    #: Wrong admin tokens a source, and the process, may try (the
    #: ``--guess-*`` budget every other secret has; before, 188 wrong tokens
    #: a second were answered 401 without end).
    token_guesses: FailureBudget = field(init=False)

    def __post_init__(self, metrics: CollectorRegistry) -> None:
        self.sampler = Sampler(metrics)
        core = self.config.core
        self.token_guesses = FailureBudget(
            BudgetConfig.from_settings(core.guess_per_source, core.guess_global)
        )

    def start(self) -> None:
        logging.getLogger("crossroads").addHandler(self.errors)
        self._task = asyncio.create_task(self.sampler.run(), name="console-sampler")

    async def close(self) -> None:
        logging.getLogger("crossroads").removeHandler(self.errors)
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    # ------------------------------------------------------------ data

    def store_kind(self) -> str:
        """The store's kind only: a Redis URL may carry a password."""
        url = self.config.core.store
        return url.split(":", 1)[0] if "://" in url else url

    async def relay_nodes(self) -> list[dict[str, Any]]:
        """Relay nodes by region with their load (public: clients are handed
        these addresses by the allocations API anyway)."""
        try:
            nodes = await self.relay_nodes_source()
        except StoreError:
            return []
        return [
            {
                "region": n.region,
                "node": n.node_id,
                "address": show_address((n.host, n.port)),
                "load": n.load,
                "capacity": n.capacity,
                # What clients measure the region with (0: no QoS server).
                "qos": show_address((n.qos_host, n.qos_port)) if n.qos_port else "",
            }
            for n in sorted(nodes, key=lambda n: (n.region, n.node_id))
        ]

    async def status(self) -> dict[str, Any]:
        """The public status, computed at most once per :data:`STATUS_CACHE_SECONDS`
        however many browsers poll it (a registry walk and a store read each)."""
        now = time.monotonic()
        if self._status is None or now - self._status_at >= STATUS_CACHE_SECONDS:
            self._status = await self._fresh_status()
            self._status_at = now
        # Never cached: a drain shows at once.
        return {**self._status, "draining": self.draining()}

    async def _fresh_status(self) -> dict[str, Any]:
        services = self.services()
        return {
            "relay_nodes": await self.relay_nodes(),
            "version": crossroads.__version__,
            "uptime": time.time() - self.started,
            "store": self.store_kind(),
            "services": [
                {"name": name, "listens": service.describe()}
                for name, service in services.items()
            ],
            "counters": [
                {"key": s.key, "label": s.label, "kind": s.kind} for s in COUNTERS
            ],
            "current": self.sampler.current(),
            "series": self.sampler.series(),
            "errors": len(self.errors.records),
            "tls": asdict(tls) if (tls := self.turn_tls()) is not None else None,
        }

    def turn_tls(self) -> TurnTls | None:
        """TURN over TLS if this process serves it: its port and the DNS names
        of the certificate (public: every TLS client is shown it)."""
        port = self.turn_tls_port()
        if self.certificates is None or port is None:
            return None
        return TurnTls(port, self.certificates.dns_names)

    def session_admins(self) -> dict[str, SessionAdmin]:
        return {
            name: service
            for name, service in self.services().items()
            if isinstance(service, SessionAdmin)
        }

    def authorized(self, request: Request) -> bool:
        """The request carries the admin token (constant-time compare; no
        budget: :meth:`refusal` is what the admin routes ask)."""
        token = self.config.core.admin_token
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if not token or scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(given.strip().encode(), token.encode())

    def refusal(self, request: Request) -> JSONResponse | None:
        """None when the request may use the admin API; else the answer.

        A bearer token is a guess: it spends one token of the guessing budget
        (per source and for the process, proto/budget.py) before it is
        compared, and a right one is refunded, so guessing gets 429 once the
        budget is spent, right or wrong, and an admin who types the token
        right pays nothing. A request with no bearer token guesses nothing."""
        token = self.config.core.admin_token
        scheme, _, _ = request.headers.get("authorization", "").partition(" ")
        if not token or scheme.lower() != "bearer":
            return _forbidden()
        source = request.client.host if request.client else ""
        now = time.monotonic()
        if not self.token_guesses.try_spend(source, now):
            return JSONResponse(
                {
                    "code": "rate_limited",
                    "message": "too many wrong admin tokens; retry later",
                },
                status_code=429,
                headers={"Retry-After": "10"},
            )
        if not self.authorized(request):
            return _forbidden()
        self.token_guesses.refund(source)
        return None

    def client_ports(self, http_port: int) -> ClientPorts:
        """Where this process's services actually listen (public accessors)."""
        return ClientPorts(**{**self.bound_ports(), "http": http_port})

    # ------------------------------------------------------------ pages

    def page(
        self, title: str, body: str, *, admin: bool, kind: str = ""
    ) -> HTMLResponse:
        kind = kind or ("admin" if admin else "public")
        nav_public = 'aria-current="page"' if kind == "public" else ""
        nav_admin = 'aria-current="page"' if kind == "admin" else ""
        nav_insight = 'aria-current="page"' if kind == "insight" else ""
        document = f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(title)} · crossroads</title>
<link rel="stylesheet" href="/console/static/console.css">
<link rel="icon" href="/console/static/favicon.svg" type="image/svg+xml">
<script src="/console/static/console.js" defer></script>
</head>
<body data-page="{kind}" data-poll="{POLL_SECONDS}">
<a class="skip" href="#main">Skip to content</a>
<header>
<p class="brand">crossroads <span class="version">{html.escape(crossroads.__version__)}</span></p>
<nav aria-label="Console">
<ul>
<li><a href="/" {nav_public}>Overview</a></li>
<li><a href="/admin" {nav_admin}>Admin</a></li>
<li><a href="/metrics">Metrics</a></li>
<li><a href="/insight" {nav_insight}>Insight</a></li>
</ul>
</nav>
</header>
<main id="main" tabindex="-1">
{DRAINING_BANNER if self.draining() else ""}
<h1>{html.escape(title)}</h1>
{body}
</main>
<footer><p>crossroads {html.escape(crossroads.__version__)} · store: {html.escape(self.store_kind())}</p></footer>
</body>
</html>
"""
        return HTMLResponse(document, headers=SECURITY_HEADERS)

    async def overview(self, host: str, http_port: int) -> HTMLResponse:
        status = await self.status()
        cards = "".join(
            f'<li class="card"><span class="label" id="label-{s.key}">'
            f"{html.escape(s.label)}</span>"
            f'<span class="value" data-counter="{s.key}" '
            f'aria-labelledby="label-{s.key}">'
            f"{_number(status['current'][s.key])}</span>"
            f'<span class="chart" data-chart="{s.key}"></span></li>'
            for s in COUNTERS
        )
        rows = "".join(
            f'<tr><th scope="row">{html.escape(entry["name"])}</th>'
            f'<td><ul class="plain">{"".join(f"<li>{html.escape(line)}</li>" for line in entry["listens"])}</ul></td></tr>'
            for entry in status["services"]
        )
        snippets = "".join(
            f"<details><summary>{html.escape(title)}</summary>"
            f"<pre><code>{html.escape(text)}</code></pre></details>"
            for title, text in connect_snippets(
                host, self.client_ports(http_port), self.turn_tls()
            )
        )
        node_rows = "".join(
            f'<tr><th scope="row">{html.escape(n["region"])}</th>'
            f"<td>{html.escape(n['node'])}</td><td>{html.escape(n['address'])}</td>"
            f"<td>{n['load']} / {n['capacity']}</td>"
            f"<td>{html.escape(n.get('qos', '')) or '-'}</td></tr>"
            for n in status["relay_nodes"]
        )
        nodes_section = (
            '<section aria-labelledby="nodes-h"><h2 id="nodes-h">Relay nodes</h2>'
            '<div class="scroll"><table><caption>Unity relay nodes by region '
            "(seats reserved / capacity)</caption><thead><tr>"
            '<th scope="col">Region</th><th scope="col">Node</th>'
            '<th scope="col">Address</th><th scope="col">Load</th>'
            '<th scope="col">QoS (UDP)</th></tr></thead>'
            f"<tbody>{node_rows}</tbody></table></div></section>"
            if node_rows
            else ""
        )
        matrix = matrix_table(self.matrix_path)
        matrix_section = (
            f'<section aria-labelledby="matrix-h"><h2 id="matrix-h">NAT lab</h2>'
            f"{matrix}</section>"
            if matrix
            else ""
        )
        body = f"""
<section aria-labelledby="live-h">
<h2 id="live-h">Live</h2>
<p class="muted">Updated every {POLL_SECONDS:g} s; charts show the last ten minutes.
<span id="updated" role="status" aria-live="polite"></span></p>
<ul class="cards">{cards}</ul>
<p>Recent warnings and errors: <span data-errors>{status["errors"]}</span> (listed on the admin page).</p>
</section>
<section aria-labelledby="services-h">
<h2 id="services-h">Services</h2>
<div class="scroll"><table>
<caption>What runs where (store: {html.escape(status["store"])}, version {html.escape(status["version"])})</caption>
<thead><tr><th scope="col">Service</th><th scope="col">Listens on</th></tr></thead>
<tbody>{rows}</tbody>
</table></div>
</section>
{nodes_section}
<section aria-labelledby="connect-h">
<h2 id="connect-h">Connect a client</h2>
{snippets}
</section>
{matrix_section}
"""
        return self.page("Overview", body, admin=False)

    def admin_page(self) -> HTMLResponse:
        kinds = "".join(
            f'<section aria-labelledby="sessions-{name}-h" class="sessions" '
            f'data-kind="{html.escape(name)}">'
            f'<h2 id="sessions-{name}-h">{html.escape(name)} sessions</h2>'
            '<p class="muted" data-empty>Not loaded.</p></section>'
            for name in self.session_admins()
        )
        body = f"""
<form id="token-form" class="token">
<label for="token">Admin token</label>
<input id="token" name="token" type="password" autocomplete="current-password" required>
<button type="submit">Show sessions</button>
<p id="admin-status" role="status" aria-live="polite"></p>
</form>
<div id="admin" hidden>
{kinds}
<section aria-labelledby="errors-h">
<h2 id="errors-h">Recent warnings and errors</h2>
<div id="errors"><p class="muted">None.</p></div>
</section>
</div>
"""
        return self.page("Admin", body, admin=True)

    def insight_page(self) -> HTMLResponse:
        """Connection insight: recent attempts with their path drawn, why
        relayed, why failed, top codes by bytes. The page is a shell; its data
        comes from ``/v1/insight/*`` with the admin token (records name games
        and networks)."""
        families = "".join(
            f'<option value="{f}">{f}</option>' for f in INSIGHT_FAMILIES
        )
        body = f"""
<form id="token-form" class="token">
<label for="token">Admin token</label>
<input id="token" name="token" type="password" autocomplete="current-password" required>
<button type="submit">Show records</button>
<p id="admin-status" role="status" aria-live="polite"></p>
</form>
<div id="insight" hidden>
<p class="muted">From the recent records of the cluster (the store's stream),
newest first; sides are pseudonymous unless the operator keeps raw addresses.</p>
<section aria-labelledby="why-relayed-h">
<h2 id="why-relayed-h">Why relayed</h2>
<div id="why-relayed"></div>
</section>
<section aria-labelledby="why-failed-h">
<h2 id="why-failed-h">Why failed</h2>
<div id="why-failed"></div>
</section>
<section aria-labelledby="top-codes-h">
<h2 id="top-codes-h">Top codes by bytes relayed</h2>
<div id="top-codes"></div>
</section>
<section aria-labelledby="attempts-h">
<h2 id="attempts-h">Recent attempts</h2>
<p><label for="family">Family</label>
<select id="family" name="family"><option value="">all</option>{families}</select></p>
<div id="attempts"></div>
</section>
</div>
"""
        return self.page("Connection insight", body, admin=True, kind="insight")

    # ------------------------------------------------------------ routes

    def router(self) -> APIRouter:
        router = APIRouter(tags=["console"])
        static = resources.files("crossroads.web") / "static"

        @router.get("/", include_in_schema=False)
        async def overview(request: Request) -> HTMLResponse:
            host = self.config.core.public_host or (request.url.hostname or "")
            # The port the browser used is the one clients reach HTTP on.
            port = request.url.port or (443 if request.url.scheme == "https" else 80)
            return await self.overview(host or "127.0.0.1", port)

        @router.get("/favicon.ico", include_in_schema=False)
        async def favicon() -> Response:
            # Browsers ask for it whatever the page says; answer, not 404.
            return Response(
                (static / "favicon.svg").read_bytes(), media_type="image/svg+xml"
            )

        @router.get("/admin", include_in_schema=False)
        async def admin() -> HTMLResponse:
            return self.admin_page()

        @router.get("/insight", include_in_schema=False)
        async def insight() -> HTMLResponse:
            return self.insight_page()

        @router.get("/console/static/{name}", include_in_schema=False)
        async def asset(name: str) -> Response:
            media = {
                "console.js": "text/javascript",
                "console.css": "text/css",
                "favicon.svg": "image/svg+xml",
            }
            if name not in media:
                return JSONResponse(
                    {"code": "not_found", "message": "Not Found"}, status_code=404
                )
            return Response(
                (static / name).read_bytes(),
                media_type=media[name],
                headers=SECURITY_HEADERS,
            )

        @router.get("/console/api/status")
        async def status() -> JSONResponse:
            return JSONResponse(await self.status())

        @router.get("/console/api/admin/sessions")
        async def sessions(request: Request) -> JSONResponse:
            if (refused := self.refusal(request)) is not None:
                return refused
            return JSONResponse(
                {
                    name: [asdict(s) for s in admin.sessions()]
                    for name, admin in self.session_admins().items()
                }
            )

        @router.get("/console/api/admin/resources")
        async def resource_registry(request: Request) -> JSONResponse:
            if (refused := self.refusal(request)) is not None:
                return refused
            snapshot = self.resources() if self.resources is not None else {}
            return JSONResponse(snapshot)

        @router.get("/console/api/admin/errors")
        async def errors(request: Request) -> JSONResponse:
            if (refused := self.refusal(request)) is not None:
                return refused
            return JSONResponse({"errors": list(self.errors.records)})

        @router.post("/console/api/admin/drain")
        async def drain(request: Request) -> JSONResponse:
            if (refused := self.refusal(request)) is not None:
                return refused
            if self.drain is None:
                return JSONResponse(
                    {"code": "not_found", "message": "this server cannot drain"},
                    status_code=404,
                )
            return JSONResponse(self.drain())

        @router.post("/console/api/admin/impair")
        async def impair(request: Request) -> JSONResponse:
            """QA impairment of one relayed session (delay, jitter, loss), so a
            developer can try their game on a bad network with unmodified
            clients; all zero stops it. Off unless set."""
            if (refused := self.refusal(request)) is not None:
                return refused
            try:
                body = await request.json()
                kind, session_id = str(body["kind"]), str(body["id"])
                delay = float(body.get("delay_ms", 0)) / 1000
                jitter = float(body.get("jitter_ms", 0)) / 1000
                loss = float(body.get("loss", 0))
            except (ValueError, KeyError, TypeError, AttributeError):
                return _invalid("need {kind, id, delay_ms, jitter_ms, loss}")
            if not (
                0 <= delay <= MAX_IMPAIR_SECONDS
                and 0 <= jitter <= MAX_IMPAIR_SECONDS
                and 0 <= loss <= 1
            ):
                return _invalid(
                    f"delay_ms and jitter_ms: 0-{MAX_IMPAIR_SECONDS * 1000:.0f}; "
                    "loss: 0-1"
                )
            service = self.services().get(kind)
            impairment = Impairment(delay, jitter, loss)
            if not isinstance(service, Impairable) or not service.impair(
                session_id, impairment if impairment.active else None
            ):
                return JSONResponse(
                    {"code": "not_found", "message": "no such impairable session"},
                    status_code=404,
                )
            return JSONResponse(
                {
                    "impaired": session_id,
                    "kind": kind,
                    "delay_ms": delay * 1000,
                    "jitter_ms": jitter * 1000,
                    "loss": loss,
                }
            )

        @router.post("/console/api/admin/revoke")
        async def revoke(request: Request) -> JSONResponse:
            if (refused := self.refusal(request)) is not None:
                return refused
            try:
                body = await request.json()
                kind, session_id = str(body["kind"]), str(body["id"])
            except (ValueError, KeyError, TypeError):
                return JSONResponse(
                    {"code": "invalid_request", "message": "need {kind, id}"},
                    status_code=400,
                )
            admin = self.session_admins().get(kind)
            if admin is None or not admin.revoke(session_id):
                return JSONResponse(
                    {"code": "not_found", "message": "no such session"},
                    status_code=404,
                )
            return JSONResponse({"revoked": session_id, "kind": kind})

        return router


#: Shown at the top of every console page while the instance drains.
DRAINING_BANNER = (
    '<p class="banner" role="alert" data-draining><strong>Draining:</strong> '
    "this instance takes no new sessions; live ones continue until they end "
    "or the drain timeout passes, then it exits.</p>"
)


def _invalid(message: str) -> JSONResponse:
    return JSONResponse({"code": "invalid_request", "message": message}, 400)


def _forbidden() -> JSONResponse:
    return JSONResponse(
        {
            "code": "forbidden",
            "message": "admin token required (Authorization: Bearer)",
        },
        status_code=401,
        headers={"WWW-Authenticate": "Bearer"},
    )


def _number(value: float) -> str:
    return f"{value:.0f}" if value == int(value) else f"{value:.1f}"
