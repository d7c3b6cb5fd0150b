"""The adversarial battery every registered listener gets by default.

One real ``crossroads serve`` with every service, TLS (HTTPS, TURN over TLS and
DTLS, relay wss and DTLS) and the relay WebSocket on, under ``ulimit -n 1024``
and ``--memory-budget 256 MiB``, is started when this module is collected; its
listener registry (``GET /console/api/admin/resources``) parametrizes the tests,
so a listener added tomorrow is attacked without anyone writing a test for it.
Per transport, the attacks a hardened server must take: floods from many loopback sources, one
source hogging, pre-auth state, idle and slowloris peers, a client that never
reads, the reflection ratio. After each attack the invariants of
:mod:`tests.adversarial.battery_support` are checked, and while it runs a real
STUN Binding, TURN Allocate and ``/healthz`` must keep working; once per run
the heavier real clients (coturn's uclient, the PyPI RakNet peer, a Unity-flow
relay client, a real OpenTTD client joining a real dedicated server) run under
every attack at once.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import math
import os
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.adversarial import battery_support as b
from tests.adversarial.battery_support import (
    Baseline,
    BatteryServer,
    Listener,
    check_invariants,
    tables_by_name,
    wait_drained,
)

pytestmark = pytest.mark.timeout(120)

_SERVER: list[BatteryServer] = []


def battery_server() -> BatteryServer:
    """The run's one server, started at the first call (collection)."""
    if not _SERVER:
        server = BatteryServer.start()
        _SERVER.append(server)
        atexit.register(server.stop)
    return _SERVER[0]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "listener" not in metafunc.fixturenames:
        return
    listeners = b.listeners_of(battery_server().snapshot())
    name = metafunc.function.__name__
    if name.startswith("test_udp"):
        listeners = [x for x in listeners if x.transport == "udp"]
    elif name.startswith("test_tcp"):
        listeners = [x for x in listeners if x.transport == "tcp"]
    metafunc.parametrize("listener", listeners, ids=b.listener_ids(listeners))


@pytest.fixture(scope="module")
def server() -> Iterator[BatteryServer]:
    server = battery_server()
    yield server
    if os.environ.get("CROSSROADS_BATTERY_FIGURES"):
        b.write_figures(os.environ["CROSSROADS_BATTERY_FIGURES"])
    server.stop()


def stun_port(server: BatteryServer) -> int:
    for x in b.listeners_of(server.snapshot()):
        if x.transport == "udp" and x.service == "stun" and x.kind == "stun":
            return x.port
    raise AssertionError("no STUN UDP listener in the registry")


def table_of(server: BatteryServer, listener: Listener) -> dict[str, Any] | None:
    return tables_by_name(server.snapshot()).get(listener.table)


# ------------------------------------------------------------------ registry


def test_every_listener_names_a_registered_table(
    server: BatteryServer, listener: Listener
) -> None:
    """A listener must name the table that admits its clients' state."""
    snap = server.snapshot()
    problems = [
        p for p in b.listener_problems(snap) if p.startswith(listener.describe() + " ")
    ]
    assert not problems, problems


def test_the_registry_covers_every_service_and_tls(server: BatteryServer) -> None:
    """The server the battery attacks really runs everything: a registry
    that lost a service would make the battery pass by attacking less."""
    listeners = b.listeners_of(server.snapshot())
    services = {x.service for x in listeners}
    assert {
        "http", "stun", "turn", "openttd", "natneg", "relay", "p2p", "raknet", "qos",
    } <= services, services  # fmt: skip
    ports = {(x.transport, x.port) for x in listeners}
    assert ("tcp", server.https_port) in ports
    assert ("tcp", server.tls_port) in ports and ("udp", server.tls_port) in ports
    assert sum(x.service == "relay" and x.transport == "tcp" for x in listeners) == 2
    assert any(x.kind == "acme-http" for x in listeners)


# ----------------------------------------------------------------------- UDP


def udp_flood(
    listener: Listener, sources: list[str], sockets_per_source: int, rounds: int
) -> list[socket.socket]:
    """Opening messages from every source (several ports each): each round
    sends every opener once more, with a new index (a new natneg cookie, a
    new RakNet GUID)."""
    openers = b.udp_openers(listener)
    socks = [b.udp_socket(s) for s in sources for _ in range(sockets_per_source)]
    i = 0
    for _ in range(rounds):
        for sock in socks:
            i += 1
            for message in openers(i):
                try:
                    sock.sendto(message, listener.address)
                except BlockingIOError:
                    time.sleep(0.001)
        time.sleep(0.02)
    return socks


def test_udp_floods_from_many_sources_and_from_one(
    server: BatteryServer, listener: Listener
) -> None:
    baseline = Baseline.take(server)
    port = stun_port(server)
    label = f"{listener.describe()} flood from 64 sources"
    socks = udp_flood(listener, b.fresh_sources(64), 2, 4)
    with b.held(socks):
        check_invariants(server, baseline, label)
        b.real_clients(server, port, healthz=True)
    # One source hogging: many ports of one address.
    label = f"{listener.describe()} one source hogging"
    before = table_of(server, listener)
    socks = udp_flood(listener, b.fresh_sources(1), 64, 4)
    with b.held(socks):
        check_invariants(server, baseline, label)
        after = table_of(server, listener)
        if before is not None and after is not None:
            assert after["live"] - before["live"] <= after["max_per_source"], (
                f"{label}: one source made {listener.table} hold "
                f"{after['live'] - before['live']} items (cap per source "
                f"{after['max_per_source']})"
            )
        b.real_clients(server, port, healthz=True)
    bound = b.preauth_bound(server.snapshot(), listener)
    wait_drained(server, baseline, listener.describe(), bound)


#: Opening messages of one kind a reflection probe sends: enough that an
#: answer only a few bytes larger than its request (RakNet's 28-byte
#: OPEN_CONNECTION_REPLY_1 to an 18-byte request) exceeds the allowance.
REFLECTION_COUNT = 600


def test_udp_reflection_ratio(server: BatteryServer, listener: Listener) -> None:
    """What one source gets back is at most what it sent plus the allowance
    (docs/security.md, "Reflection budget"), for each opening message of the
    listener's protocol on its own (a fresh source each: the ledger is per
    source)."""
    baseline = Baseline.take(server)
    openers = b.udp_openers(listener)
    kinds = len(openers(0))
    failures = []
    for j in range(kinds):
        (source,) = b.fresh_sources(1)
        sock = b.udp_socket(source)
        sent = received = 0
        try:
            for i in range(REFLECTION_COUNT):
                message = openers(i)[j]
                try:
                    sock.sendto(message, listener.address)
                    sent += len(message)
                except BlockingIOError:
                    pass
                received += b.drain_udp(sock)
                if i % 50 == 49:
                    time.sleep(0.05)
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                received += b.drain_udp(sock)
                time.sleep(0.05)
        finally:
            sock.close()
        what = f"{listener.describe()} reflection of opener {j} ({len(message)} B)"
        b.FIGURES.append(b.Figures(what, 0, 0, sent, received))
        if received > sent + b.REFLECTION_ALLOWANCE:
            failures.append(
                f"{what}: one source sent {sent} bytes and got {received} back "
                f"(allowance {b.REFLECTION_ALLOWANCE})"
            )
    assert not failures, failures
    bound = b.preauth_bound(server.snapshot(), listener)
    wait_drained(server, baseline, listener.describe(), bound)


# ----------------------------------------------------------------------- TCP


def connect_many(
    listener: Listener, sources: list[str], per_source: int
) -> list[socket.socket]:
    socks = []
    for _ in range(per_source):
        for source in sources:
            sock = b.tcp_connect(listener, source)
            if sock is not None:
                socks.append(sock)
    return socks


def still_open(socks: list[socket.socket]) -> int:
    time.sleep(1.0)
    return sum(not b.closed_by_server(s) for s in socks)


def test_tcp_many_sources_and_one_source(
    server: BatteryServer, listener: Listener
) -> None:
    baseline = Baseline.take(server)
    port = stun_port(server)
    table = table_of(server, listener)
    cap = table["max"] if table else 64
    per_source_cap = table["max_per_source"] if table else 8
    # Past the global cap from sources that each stay under theirs.
    per_source = max(1, min(per_source_cap, 8))
    count = min(300, cap + 16)
    sources = b.fresh_sources(math.ceil(count / per_source))
    label = f"{listener.describe()} {count} connections from {len(sources)} sources"
    server.snapshot()  # keeps the admin connection fresh
    with b.held(connect_many(listener, sources, per_source)) as socks:
        held = still_open(socks)
        check_invariants(server, baseline, label)
        if table is not None:
            room = cap - baseline.live.get(listener.table, 0)
            assert held <= room, (
                f"{label}: {held} connections stayed open, the table "
                f"{listener.table} has room for {room}"
            )
        b.real_clients(server, port, healthz=listener.table != "http")
    wait_drained(server, baseline, label, b.DEADLINE_SLACK)
    label = f"{listener.describe()} one source hogging"
    with b.held(
        connect_many(listener, b.fresh_sources(1), per_source_cap + 8)
    ) as socks:
        held = still_open(socks)
        check_invariants(server, baseline, label)
        # Without a table the cap is unknown (the registry test names it).
        assert table is None or held <= per_source_cap, (
            f"{label}: {held} connections from one source stayed open; the "
            f"per-source cap of {listener.table or 'its (missing) table'} is "
            f"{per_source_cap}"
        )
        b.real_clients(server, port, healthz=True)
    wait_drained(server, baseline, label, b.DEADLINE_SLACK)


def test_tcp_idle_slow_and_preauth_peers_are_closed(
    server: BatteryServer, listener: Listener
) -> None:
    """Idle peers, slowloris peers and (TLS) a ClientHello then silence are
    all closed by the server's deadlines."""
    baseline = Baseline.take(server)
    tls = b.speaks_tls(listener)
    inner = b.inner_protocol(listener)
    partial = b.tls_hello() if tls else b.PARTIAL[inner]
    sources = b.fresh_sources(3)
    idle = connect_many(listener, sources[:1], 4)
    slow = connect_many(listener, sources[1:2], 4)
    preauth = connect_many(listener, sources[2:], 4)
    for sock in preauth:
        sock.send(partial[: len(partial) - 1])
    sent = dict.fromkeys(slow, 0)

    def trickle(open_: list[socket.socket]) -> None:
        for sock in open_:
            if sock in sent and sent[sock] < len(partial) - 1:
                try:
                    sock.send(partial[sent[sock] : sent[sock] + 1])
                    sent[sock] += 1
                except OSError:
                    pass

    bound = b.preauth_bound(server.snapshot(), listener)
    label = f"{listener.describe()} idle/slow/pre-auth peers"
    with b.held(idle + slow + preauth) as socks:
        assert socks, f"{label}: no connection accepted at all"
        check_invariants(server, baseline, label)
        remaining = b.wait_all_closed(socks, bound + b.DEADLINE_SLACK, trickle)
        assert remaining == 0, (
            f"{label}: {remaining} of {len(socks)} peers still open "
            f"{bound + b.DEADLINE_SLACK:.0f} s later (pre-auth deadline of "
            f"{listener.table or 'no table'}: {bound} s)"
        )
    wait_drained(server, baseline, label, b.DEADLINE_SLACK)


#: What a client that never reads sends at most: enough that answers
#: buffered without a bound (WebSocket pongs to a client that never reads) exceed
#: RSS_SLACK several times over.
NEVER_READ_VOLUME = 48 << 20


def test_tcp_client_that_never_reads(server: BatteryServer, listener: Listener) -> None:
    baseline = Baseline.take(server)
    tls = b.speaks_tls(listener)
    preamble, request = b.request_stream(b.inner_protocol(listener))
    (source,) = b.fresh_sources(1)
    raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    raw.bind((source, 0))
    raw.settimeout(5)
    raw.connect(listener.address)
    sock: socket.socket = raw
    label = f"{listener.describe()} a client that never reads"
    try:
        if tls:
            sock = b.client_context().wrap_socket(raw, server_hostname="localhost")
        sock.settimeout(2)
        sent = 0
        try:
            sock.sendall(preamble)
            chunk = request * max(1, 16384 // len(request))
            while sent < NEVER_READ_VOLUME:
                sock.sendall(chunk)
                sent += len(chunk)
        except (TimeoutError, OSError, ssl.SSLError):
            pass  # the server stopped reading, or cut us: both are fine
        check_invariants(server, baseline, label)
    finally:
        b.close_all([sock])
    wait_drained(server, baseline, label, b.DEADLINE_SLACK)


# --------------------------------------------------------- all at once, heavy


async def uclient_run(port: int) -> None:
    from tests.interop.test_turn import assert_no_loss, uclient

    output = await uclient(
        "-y", "-u", b.TURN_USER, "-w", b.TURN_PASSWORD,
        "-m", "2", "-n", "10", "-z", "10", "-l", "100", "-p", str(port), "127.0.0.1",
    )  # fmt: skip
    assert_no_loss(output)


async def raknet_run(port: int) -> None:
    from tests.interop.raknet_support import RakNetPeer

    peer = RakNetPeer()
    try:
        await peer.connect("127.0.0.1", port)
    finally:
        peer.close()


async def relay_run(http_port: int) -> None:
    from crossroads.client.relay import RelayApi, RelayConnection

    async with RelayApi(f"http://127.0.0.1:{http_port}", b.API_KEY) as api:
        allocation = await api.allocate(max_connections=2)
        code = await api.join_code(allocation.allocation_id)
        joined = await api.join(code)
        host = await RelayConnection.open(allocation)
        guest = await RelayConnection.open(joined)
        try:
            await host.bind()
            await guest.bind()
            await guest.connect()
        finally:
            await guest.close()
            await host.close()


@dataclass(frozen=True)
class _Coordinator:
    """What the OpenTTD interop helpers need of a crossroads: the variables
    that point a real OpenTTD at its coordinator and STUN ports."""

    coordinator: int
    stun: int

    @property
    def env(self) -> dict[str, str]:
        return {
            "OTTD_COORDINATOR_CS": f"127.0.0.1:{self.coordinator}",
            "OTTD_STUN_CS": f"127.0.0.1:{self.stun}",
        }


@contextlib.contextmanager
def openttd_server(
    listeners: list[Listener], workdir: Path
) -> Iterator[tuple[Any, _Coordinator] | None]:
    """A real OpenTTD 13 dedicated server, invite-only, registered with the
    battery's coordinator (None where openttd is not installed)."""
    from tests.conftest import free_port
    from tests.interop.openttd_support import OpenTTDServer, openttd_available

    if not openttd_available():
        yield None
        return
    ports = {x.kind: x.port for x in listeners if x.service == "openttd"}
    coordinator = _Coordinator(ports["openttd-coordinator"], ports["openttd-stun"])
    game = OpenTTDServer(
        workdir, coordinator, name="battery-game", bind="127.0.0.1",
        port=free_port(), game_type="invite-only", cpu=0,
    )  # type: ignore[arg-type]  # fmt: skip
    try:
        game.registration()
        yield game, coordinator
    finally:
        game.stop()


def openttd_join(game: Any, coordinator: _Coordinator, workdir: Path) -> None:
    """A real OpenTTD 13 client joins the game by its invite code."""
    from tests.interop.openttd_support import OpenTTDClient

    client = OpenTTDClient(
        workdir, coordinator, name="battery-player",  # type: ignore[arg-type]
        code=game.registration()["code"], cpu=1,
    )  # fmt: skip
    try:
        assert "has joined the game" in game.joined("battery-player", 60)
    finally:
        client.stop()


def test_all_listeners_at_once_while_real_clients_play(
    server: BatteryServer, tmp_path: Path
) -> None:
    """Every UDP listener flooded and every TCP listener half full of idle
    peers at once, while coturn's uclient, a stock RakNet peer, a Unity relay
    host and guest, and a real OpenTTD client joining a real dedicated server
    by invite code use the server."""
    baseline = Baseline.take(server)
    listeners = b.listeners_of(server.snapshot())
    with openttd_server(listeners, tmp_path) as openttd:
        play_under_every_attack(server, baseline, listeners, openttd, tmp_path)
    # The players are gone (the OpenTTD server's coordinator connection with
    # them); their TURN allocations are authenticated state with a lifetime,
    # ended here as an operator would.
    server.revoke_turn_allocations()
    wait_drained(server, baseline, "every listener at once", b.DEFAULT_PREAUTH_BOUND)


def play_under_every_attack(
    server: BatteryServer,
    baseline: Baseline,
    listeners: list[Listener],
    openttd: tuple[Any, _Coordinator] | None,
    workdir: Path,
) -> None:
    raknet = next(
        x for x in listeners if x.service == "raknet" and x.transport == "udp"
    )
    socks: list[socket.socket] = []
    for x in listeners:
        if x.transport == "udp":
            socks += udp_flood(x, b.fresh_sources(8), 1, 2)
        else:
            table = table_of(server, x)
            want = (table["max"] // 2) if table else 16
            per = max(1, (table["max_per_source"] // 2) if table else 4)
            socks += connect_many(x, b.fresh_sources(math.ceil(want / per)), per)
    label = "every listener at once"
    with b.held(socks):

        async def clients() -> None:
            players = [
                uclient_run(stun_port(server)),
                raknet_run(raknet.port),
                relay_run(server.http_port),
            ]
            if openttd is not None:
                players.append(asyncio.to_thread(openttd_join, *openttd, workdir))
            await asyncio.gather(*players)

        asyncio.run(clients())
        check_invariants(server, baseline, label)


# ------------------------------------------------ the battery can fail itself


HOLDER = """
import socket, sys, time
socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print("ready", flush=True)
time.sleep(60)
"""


def fake_snapshot(listeners: int, live: int = 0) -> dict[str, Any]:
    rows = [
        {"service": "x", "kind": f"k{i}", "transport": "udp", "host": "127.0.0.1",
         "port": 1000 + i, "table": "t"}
        for i in range(listeners)
    ]  # fmt: skip
    return {
        "listeners": rows,
        "tables": [
            {"table": "t", "pool": "relay", "live": live, "max": 10,
             "max_per_source": 2, "largest_source": 0, "descriptors_per_item": 1,
             "bytes_per_item": 0, "buffered_bytes": 0, "preauth_deadline": None}
        ],
    }  # fmt: skip


def test_the_socket_check_catches_a_socket_the_registry_does_not_know() -> None:
    """A real process holding 6 UDP sockets against a registry that knows of
    2 listeners and 1 live item: the check reports 3 unknown sockets; told of
    all 6, it reports none."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, "6"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None and process.stdout.readline() == "ready\n"
        sockets = len(b._socket_inodes(process.pid))
        assert sockets == 6
        known = b.accounted_sockets(fake_snapshot(2, live=1))
        assert sockets - known == 3
        assert sockets - b.accounted_sockets(fake_snapshot(5, live=1)) == 0
        described = b.describe_sockets(process.pid)
        assert sum(d.startswith("udp 127.0.0.1:") for d in described) == 6
    finally:
        process.kill()
        process.wait()


def test_the_listener_check_catches_a_listener_without_a_table() -> None:
    snap = fake_snapshot(2)
    assert b.listener_problems(snap) == []
    snap["listeners"][1]["table"] = ""
    snap["listeners"][0]["table"] = "gone"
    problems = b.listener_problems(snap)
    assert len(problems) == 2
    assert "names table 'gone', which is not registered" in problems[0]
    assert "names no table" in problems[1]
