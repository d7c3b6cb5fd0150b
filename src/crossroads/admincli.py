"""The admin CLI: ``crossroads status``, ``sessions``, ``credentials``, ``revoke``,
``reload``, ``doctor``, ``budget`` and ``drain``, talking to a running ``crossroads serve``.

The server is found, in order, through ``--url``, ``--http-port`` (on
127.0.0.1), or the ``server.json`` that ``crossroads serve`` keeps in the state
directory (``--state-dir``, default as for ``serve``). The admin token is
``--admin-token`` / ``CROSSROADS_ADMIN_TOKEN``, else the one in the state
directory's ``credentials.json``. Everything goes through the console's HTTP API
(``/console/api/...``), so the CLI works against a remote server too, except
``reload``, which signals the local process (SIGHUP).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import click
import httpx

from crossroads.runtime import SERVER_FILE
from crossroads.services.base import show_address
from crossroads.state import CREDENTIALS_FILE, resolve_state_dir
from crossroads.types import frozen

F = TypeVar("F", bound=Callable[..., Any])
R = TypeVar("R")

#: HTTP timeout of one CLI request: a local server answers in milliseconds; a
#: remote one gets a generous margin before the command gives up.
HTTP_TIMEOUT = 10.0
#: Clock skew that breaks TURN REST credentials in practice: a credential made
#: on a client whose clock is ahead looks expired to the server; one minute is
#: well within the 24 h TTL coturn's documentation suggests, so the doctor only
#: warns beyond it.
CLOCK_SKEW_WARNING = 60.0


@frozen
class Target:
    """A running server as the CLI reaches it."""

    url: str
    token: str
    pid: int | None
    state_dir: Path


def target_options(command: F) -> F:
    for option in (
        click.option("--url", help="URL of the server's HTTP port."),
        click.option("--http-port", type=int, help="HTTP port on 127.0.0.1."),
        click.option(
            "--state-dir",
            default="",
            envvar="CROSSROADS_STATE_DIR",
            help="State directory of the server (default as for serve).",
        ),
        click.option(
            "--admin-token",
            default="",
            envvar="CROSSROADS_ADMIN_TOKEN",
            help="Admin token (default: the one in the state directory).",
        ),
    ):
        command = option(command)
    return command


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise click.ClickException(f"cannot read {path}: {exc}") from None
    return data if isinstance(data, dict) else {}


def find_target(
    url: str | None, http_port: int | None, state_dir: str, admin_token: str
) -> Target:
    directory = resolve_state_dir(state_dir)
    running = _read_json(directory / SERVER_FILE)
    pid = running.get("pid") if isinstance(running.get("pid"), int) else None
    if url:
        found = url.rstrip("/")
    elif http_port:
        found = f"http://127.0.0.1:{http_port}"
    elif isinstance(running.get("url"), str):
        found = str(running["url"])
    else:
        raise click.ClickException(
            f"no running server found in {directory} (no {SERVER_FILE}); "
            "give --url or --http-port"
        )
    token = admin_token or str(
        _read_json(directory / CREDENTIALS_FILE).get("admin_token", "")
    )
    return Target(url=found, token=token, pid=pid, state_dir=directory)


def request(
    target: Target, method: str, path: str, *, admin: bool = False, **kwargs: Any
) -> Any:
    headers = {"Authorization": f"Bearer {target.token}"} if admin else {}
    if admin and not target.token:
        raise click.ClickException(
            "no admin token: give --admin-token or run where the state directory is"
        )
    try:
        response = httpx.request(
            method,
            target.url + path,
            headers=headers,
            timeout=HTTP_TIMEOUT,
            **kwargs,
        )
    except httpx.HTTPError as exc:
        raise click.ClickException(f"{target.url}: {exc}") from None
    if response.status_code == 401:
        raise click.ClickException("the server refused the admin token")
    if response.status_code >= 400:
        try:
            message = response.json().get("message", response.text)
        except ValueError:
            message = response.text
        raise click.ClickException(f"{response.status_code}: {message}")
    return response.json()


# ---------------------------------------------------------------- commands


@click.command()
@target_options
@click.option("--json", "as_json", is_flag=True, help="Print the raw JSON.")
def status(as_json: bool, **where: Any) -> None:
    """What runs where, and the live counters."""
    data = request(find_target(**where), "GET", "/console/api/status")
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    click.echo(
        f"crossroads {data['version']}, up {data['uptime']:.0f} s, "
        f"store {data['store']}"
    )
    for service in data["services"]:
        click.echo(f"{service['name']}: {', '.join(service['listens'])}")
    for spec in data["counters"]:
        value = data["current"][spec["key"]]
        click.echo(f"  {spec['label']:<22} {value:g}")
    click.echo(f"  {'recent warnings':<22} {data['errors']}")


@click.command()
@target_options
@click.argument("kind", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print the raw JSON.")
def sessions(kind: str | None, as_json: bool, **where: Any) -> None:
    """Live sessions: turn, relay, openttd, p2p (all by default)."""
    data: dict[str, list[dict[str, Any]]] = request(
        find_target(**where), "GET", "/console/api/admin/sessions", admin=True
    )
    if kind is not None:
        if kind not in data:
            known = ", ".join(sorted(data)) or "none running"
            raise click.ClickException(f"no {kind} sessions here (kinds: {known})")
        data = {kind: data[kind]}
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    for name, listed in data.items():
        click.echo(f"{name}: {len(listed)}")
        for s in listed:
            expires = (
                f", expires in {s['expires_in']:.0f} s"
                if s["expires_in"] is not None
                else ""
            )
            user = f" user {s['user']}" if s["user"] else ""
            click.echo(f"  {s['id']}  {s['client']}{user}  {s['detail']}{expires}")


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} B"


def budget_rows(snapshot: dict[str, Any], *, ports: bool = True) -> list[list[str]]:
    """The resource budget as table rows (header first): one row per
    registered table, with the listeners whose clients it admits (``ports``
    False: by kind only, as the documentation lists them)."""
    fed_by: dict[str, list[str]] = {}
    for entry in snapshot.get("listeners", []):
        name = f"{entry['transport']} {entry['port']} {entry['kind']}"
        if not ports:
            name = f"{entry['transport']} {entry['kind']}"
        listed = fed_by.setdefault(entry["table"], [])
        if name not in listed:
            listed.append(name)
    rows = [
        [
            "table",
            "listeners",
            "pool",
            "max",
            "per source",
            "fd/item",
            "bytes/item",
            "memory share",
            "pre-auth deadline",
        ]
    ]
    for table in snapshot.get("tables", []):
        deadline = table["preauth_deadline"]
        rows.append(
            [
                table["table"],
                ", ".join(fed_by.get(table["table"], [])) or "-",
                table["pool"],
                str(table["max"]),
                str(table["max_per_source"]),
                str(table["descriptors_per_item"]),
                _size(table["bytes_per_item"]) if table["bytes_per_item"] else "-",
                _size(table["max_bytes"]) if table["max_bytes"] else "-",
                f"{deadline:g} s" if deadline is not None else "-",
            ]
        )
    return rows


def render_budget(
    snapshot: dict[str, Any], *, markdown: bool = False, ports: bool = True
) -> str:
    """:func:`budget_rows` as aligned text, or as a Markdown table."""
    rows = budget_rows(snapshot, ports=ports)
    head = (
        f"descriptor limit {snapshot['fd_limit']} (TCP connections "
        f"{snapshot['connection_pool']}, per-client sockets "
        f"{snapshot['relay_pool']}, reserve {snapshot['reserve']}), memory budget "
        f"{_size(snapshot['memory_budget'])}"
    )
    if markdown:
        lines = ["| " + " | ".join(rows[0]) + " |"]
        lines.append("|" + "---|" * len(rows[0]))
        lines += ["| " + " | ".join(row) + " |" for row in rows[1:]]
        return head + "\n\n" + "\n".join(lines)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))
        for row in rows
    ]
    unlisted = [e for e in snapshot.get("listeners", []) if not e["table"]]
    for entry in unlisted:
        lines.append(
            f"(listener {entry['transport']} {entry['port']} {entry['service']}/"
            f"{entry['kind']} names no table)"
        )
    return head + "\n" + "\n".join(line.rstrip() for line in lines)


@click.command()
@target_options
@click.option("--json", "as_json", is_flag=True, help="Print the raw JSON.")
@click.option("--markdown", is_flag=True, help="Print a Markdown table.")
def budget(as_json: bool, markdown: bool, **where: Any) -> None:
    """The resource budget in force: every table's caps, per-item costs and
    pre-auth deadline, and the listeners that feed it."""
    data = request(
        find_target(**where), "GET", "/console/api/admin/resources", admin=True
    )
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    click.echo(render_budget(data, markdown=markdown))


@click.command()
@target_options
@click.argument("kind")
@click.argument("session_id")
def revoke(kind: str, session_id: str, **where: Any) -> None:
    """End one session (ids as `crossroads sessions` prints them)."""
    request(
        find_target(**where),
        "POST",
        "/console/api/admin/revoke",
        admin=True,
        json={"kind": kind, "id": session_id},
    )
    click.echo(f"revoked {kind} {session_id}")


@click.command()
@target_options
@click.option("--json", "as_json", is_flag=True, help="Print the raw JSON.")
def drain(as_json: bool, **where: Any) -> None:
    """Drain the server as SIGTERM does: no new sessions (TURN clients are sent
    to another node, /readyz answers 503), live ones go on; it exits when they
    end or --drain-timeout passes."""
    data = request(find_target(**where), "POST", "/console/api/admin/drain", admin=True)
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    live = data.get("live_sessions") or {}
    total = sum(v for v in live.values() if isinstance(v, int))
    detail = ", ".join(f"{name} {count}" for name, count in sorted(live.items()))
    left = data.get("seconds_left")
    when = f"; exits at the latest in {left:.0f} s" if isinstance(left, float) else ""
    click.echo(
        f"draining: {total} live session(s){f' ({detail})' if detail else ''}{when}"
    )


@click.command()
@click.option(
    "--state-dir", default="", envvar="CROSSROADS_STATE_DIR", help="State directory."
)
def reload(state_dir: str) -> None:
    """Re-read users, secrets and limits (SIGHUP); live sessions stay."""
    directory = resolve_state_dir(state_dir)
    pid = _read_json(directory / SERVER_FILE).get("pid")
    if not isinstance(pid, int):
        raise click.ClickException(f"no running server recorded in {directory}")
    try:
        os.kill(pid, signal.SIGHUP)
    except ProcessLookupError:
        raise click.ClickException(f"server pid {pid} is not running") from None
    click.echo(f"sent SIGHUP to {pid}; the server logs what it reloaded")


@click.group()
def credentials() -> None:
    """Credentials for clients of this server."""


def _local_secret(state_dir: str, env_name: str, field: str) -> str:
    configured = os.environ.get(env_name, "")
    if configured:
        return configured.split(",")[0].strip()
    stored = _read_json(resolve_state_dir(state_dir) / CREDENTIALS_FILE)
    value = stored.get(field)
    if not isinstance(value, str) or not value:
        raise click.ClickException(
            f"no {field.replace('_', ' ')}: set {env_name} or run where the "
            "state directory is"
        )
    return value


@credentials.command("turn")
@target_options
@click.argument("user")
@click.option(
    "--ttl",
    default=86400,
    show_default=True,
    help="Seconds the credential is valid (coturn's REST API suggests a day).",
)
@click.option("--secret", default="", help="TURN shared secret (default: local).")
def credentials_turn(
    user: str, ttl: int, secret: str, url: str | None, http_port: int | None,
    state_dir: str, admin_token: str,
) -> None:  # fmt: skip
    """Time-limited TURN credentials as WebRTC iceServers JSON.

    With a certificate served, a ``turns:`` URL (TURN over TLS) names its DNS
    name: Firefox refuses ``turns:`` with an IP address. A certificate with
    IP names only gets no ``turns:`` URL, and a note on stderr says why."""
    from crossroads.client.turn import rest_credentials
    from crossroads.web.console import TurnTls, ice_urls

    if ttl <= 0:
        raise click.ClickException("--ttl must be positive")
    secret = secret or _local_secret(state_dir, "CROSSROADS_TURN_SECRET", "turn_secret")
    target = find_target(url, http_port, state_dir, admin_token)
    data = request(target, "GET", "/console/api/status")
    host = urlsplit(target.url).hostname or "127.0.0.1"
    port = _stun_port(data)
    tls = data.get("tls")
    urls, note = ice_urls(
        host,
        port,
        TurnTls(int(tls["port"]), tuple(tls["dns_names"])) if tls else None,
    )
    if note:
        click.echo(note, err=True)
    username, password = rest_credentials(secret, user, ttl)
    body = {
        "iceServers": [
            {
                "urls": urls,
                "username": username,
                "credential": password,
            }
        ]
    }
    click.echo(json.dumps(body, indent=2))


def _stun_port(status_data: dict[str, Any]) -> int:
    for service in status_data["services"]:
        if service["name"] == "stun":
            for line in service["listens"]:
                if line.startswith("udp "):
                    return int(line.split()[1].rsplit(":", 1)[1])
    raise click.ClickException("the server runs no STUN/TURN service")


@credentials.command("api-key")
@click.option(
    "--state-dir", default="", envvar="CROSSROADS_STATE_DIR", help="State directory."
)
def credentials_api_key(state_dir: str) -> None:
    """The relay API key to use (Authorization: Bearer KEY)."""
    click.echo(_local_secret(state_dir, "CROSSROADS_API_KEYS", "relay_api_key"))


# ---------------------------------------------------------------- doctor


@click.command()
@target_options
def doctor(**where: Any) -> None:
    """Check from here what a client needs: ports, public address, NAT, clock,
    and each UDP service (relay, natneg, p2p, raknet) with its own protocol."""
    target = find_target(**where)
    problems = asyncio.run(_doctor(target))
    sys.exit(1 if problems else 0)


async def _doctor(target: Target) -> int:
    from crossroads.client.stun import stun_binding

    problems = 0

    def report(ok: bool, text: str) -> None:
        nonlocal problems
        problems += 0 if ok else 1
        click.echo(f"[{'ok' if ok else 'FAIL'}] {text}")

    try:
        async with httpx.AsyncClient(timeout=HTTP_TIMEOUT) as http:
            response = await http.get(target.url + "/console/api/status")
            response.raise_for_status()
    except httpx.HTTPError as exc:
        report(False, f"HTTP {target.url}: {exc}")
        return problems
    data = response.json()
    report(True, f"HTTP {target.url} answers (crossroads {data['version']})")
    server_date = response.headers.get("date")
    if server_date:
        skew = parsedate_to_datetime(server_date).timestamp() - time.time()
        # The Date header has one-second resolution.
        report(
            abs(skew) <= CLOCK_SKEW_WARNING,
            f"clock: server and this machine differ by {skew:+.0f} s "
            "(TURN REST credentials need synchronised clocks)",
        )
    host = urlsplit(target.url).hostname or "127.0.0.1"
    names = {service["name"] for service in data["services"]}
    if "stun" in names:
        port = _stun_port(data)
        for transport in ("udp", "tcp"):
            try:
                result = await stun_binding((host, port), transport=transport)
            except Exception as exc:  # noqa: BLE001 - reported, not raised
                report(False, f"STUN {transport} {host}:{port}: {exc}")
                continue
            mapped = show_address(result.mapped)
            report(True, f"STUN {transport} {host}:{port}: seen as {mapped}")
            if transport == "udp":
                behind = result.mapped[0] != result.local[0]
                click.echo(
                    f"      {'a NAT is' if behind else 'no NAT'} between this "
                    f"machine ({show_address(result.local)}) and the server"
                )
    for service in data["services"]:
        for line in service["listens"]:
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "tcp" and service["name"] != "stun":
                port = int(parts[1].rsplit(":", 1)[1])
                report(
                    await _tcp_open(host, port),
                    f"{service['name']} tcp {host}:{port} reachable",
                )
    for service in data["services"]:
        check = UDP_CHECKS.get(service["name"])
        if check is not None:
            for ok, text in await check(host, target.url, _udp_ports(service)):
                report(ok, text)
    if target.token:
        try:
            async with httpx.AsyncClient(timeout=HTTP_TIMEOUT) as http:
                response = await http.get(
                    target.url + "/console/api/admin/resources",
                    headers={"Authorization": f"Bearer {target.token}"},
                )
        except httpx.HTTPError as exc:
            report(False, f"resource budget: {exc}")
        else:
            if response.status_code == 200:
                click.echo("resource budget:")
                click.echo(render_budget(response.json()))
            else:
                click.echo(f"resource budget: not shown (HTTP {response.status_code})")
    return problems


#: What to tell the operator when a UDP service does not answer: UDP has no
#: handshake, so the usual cause is a firewall or a forward that drops it.
UDP_HINT = "(open/forward this UDP port to the server; UDP drops show no error)"


def _udp_ports(service: dict[str, Any]) -> list[tuple[int, str]]:
    """(port, role) of each ``udp HOST:PORT (role ...)`` line of a service."""
    found = []
    for line in service["listens"]:
        parts = line.split(maxsplit=2)
        if len(parts) >= 2 and parts[0] == "udp" and ":" in parts[1]:
            role = parts[2].strip("()").split(",")[0] if len(parts) > 2 else ""
            found.append((int(parts[1].rsplit(":", 1)[1]), role))
    return found


CheckLines = list[tuple[bool, str]]


async def _udp_line(
    where: str,
    answer: Awaitable[R],
    judge: Callable[[R], tuple[bool, str]],
    hint: str = UDP_HINT,
) -> tuple[bool, str]:
    """One check line: the probe's answer judged, or why there was none."""
    from crossroads.client.probes import ProbeError

    try:
        value = await answer
    except ProbeError as exc:
        return False, f"{where}: {exc} {hint}"
    ok, text = judge(value)
    return ok, f"{where}: {text}"


async def _check_relay(host: str, url: str, ports: list[tuple[int, str]]) -> CheckLines:
    from crossroads.client.probes import relay_ping
    from crossroads.proto.relay.messages import ErrorCode

    def judge(code: int) -> tuple[bool, str]:
        ok = code == ErrorCode.ALLOCATION_ID_NOT_FOUND
        return ok, f"Unity Relay answers a PING (ERROR {code})"

    return [
        await _udp_line(f"relay udp {host}:{port}", relay_ping((host, port)), judge)
        for port, _ in ports
    ]


async def _check_natneg(
    host: str, url: str, ports: list[tuple[int, str]]
) -> CheckLines:
    from crossroads.client.probes import NATNEG_CHECKS, natneg_address_check

    # Probe ports only send (ERT tests): they answer nothing, so are skipped.
    return [
        await _udp_line(
            f"natneg udp {host}:{port} ({role})",
            natneg_address_check((host, port), role),
            lambda seen: (True, f"ADDRESS_CHECK seen as {show_address(seen)}"),
            f"(natneg is IPv4 only) {UDP_HINT}",
        )
        for port, role in ports
        if role in NATNEG_CHECKS
    ]


async def _check_raknet(
    host: str, url: str, ports: list[tuple[int, str]]
) -> CheckLines:
    from crossroads.client.probes import raknet_ping, raknet_stride_ping

    lines = [
        await _udp_line(
            f"raknet udp {host}:{port} ({role})",
            raknet_ping((host, port)),
            lambda guid: (True, f"unconnected ping answered (GUID {guid:x})"),
        )
        for port, role in ports[:1]
    ]
    # Without the port-stride socket a RakNet client's first punch waits 5 s
    # (raknet-wire.md §2); its answer comes from the main port.
    lines += [
        await _udp_line(
            f"raknet udp {host}:{port} ({role})",
            raknet_stride_ping((host, port)),
            lambda seen: (True, f"NAT_PING answered (source port {seen})"),
        )
        for port, role in ports[1:2]
    ]
    return lines


async def _check_p2p(host: str, url: str, ports: list[tuple[int, str]]) -> CheckLines:
    from crossroads.client.probes import ProbeError, p2p_rendezvous

    try:
        results = await p2p_rendezvous(url, host)
    except ProbeError as exc:
        hint = "(the WebSocket shares the HTTP port; a proxy must pass Upgrade)"
        return [(False, f"p2p signalling /p2p/v1/ws: {exc} {hint}")]
    lines = [(True, "p2p signalling /p2p/v1/ws: welcome")]
    for index, (where, seen) in enumerate(results):
        text = f"p2p udp {show_address(where)} (rendezvous {index + 1})"
        if isinstance(seen, ProbeError):
            lines.append((False, f"{text}: {seen} {UDP_HINT}"))
        else:
            lines.append((True, f"{text}: seen as {show_address(seen)}"))
    return lines


#: The UDP services the doctor probes with their own protocol, by service name.
UDP_CHECKS: dict[
    str, Callable[[str, str, list[tuple[int, str]]], Awaitable[CheckLines]]
] = {
    "relay": _check_relay,
    "natneg": _check_natneg,
    "raknet": _check_raknet,
    "p2p": _check_p2p,
}


async def _tcp_open(host: str, port: int) -> bool:
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port), HTTP_TIMEOUT
        )
    except (OSError, TimeoutError):
        return False
    writer.close()
    return True


COMMANDS = (status, sessions, revoke, reload, credentials, doctor, budget, drain)
