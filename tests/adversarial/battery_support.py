"""The adversarial battery's machinery: one real ``crossroads serve``
with every service, TLS, DTLS and the relay WebSocket on, under ``ulimit -n
1024``; its listener registry read from the admin API; the attacks of each
transport; and the invariants checked after every attack.

Nothing here knows a particular listener: the attacks are chosen by transport,
and the opening messages by the listener's ``kind`` (or service) from a small
table, random bytes for a kind nobody described. So a listener added tomorrow
is attacked by default, and one whose table is missing fails.

Invariants (:func:`check_invariants`), after each attack:

- the process is alive and ``/healthz`` answers;
- every table's ``live`` is at most its ``max`` and its largest source at most
  its ``max_per_source``;
- RSS grew by at most what the tables report (sum of ``live *
  bytes_per_item + buffered_bytes``, counted from the baseline) plus
  :data:`RSS_SLACK`;
- the process holds at most ``listeners + sum of live * descriptors_per_item
  + SOCKET_ALLOWANCE`` sockets: a socket the registry does not know fails.

After an attack stops and the deadlines pass (:func:`wait_drained`), every
table is back at its baseline and RSS within :data:`RSS_TOLERANCE` of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import resource
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from crossroads.proto.natneg.packets import Init
from crossroads.proto.punch.rendezvous import Probe
from crossroads.proto.raknet import messages as rk
from tests.conftest import free_port, free_udp_tcp_port

#: The descriptor limit of the child (soft and hard), as `ulimit -n 1024`.
FD_LIMIT = 1024
#: --memory-budget of the child: modest, so the derived caps are small enough
#: for a 2-core machine to reach them.
MEMORY_BUDGET = 256 << 20
ADMIN_TOKEN = "battery-admin-token"
TURN_USER, TURN_PASSWORD = "battery", "battery-password"
API_KEY = "battery-api-key"

#: RSS growth allowed beyond what the tables report: the interpreter's
#: allocator and caches (a flood touches code paths and buffers once: the
#: asyncio transports, the C data plane's batches, uvicorn's parsers), kernel
#: buffers of the attack's own sockets do not count (they are not RSS).
#: Measured: the largest growth of an attack whose tables report nothing was
#: ~10 MiB (see docs/security.md, "The adversarial battery").
RSS_SLACK = 24 << 20
#: After an attack ends and its state drained, RSS may stay this far above the
#: baseline (CPython keeps freed arenas it may reuse; glibc keeps freed heap).
RSS_TOLERANCE = 24 << 20
#: Sockets beyond the registry's: asyncio's self-pipe (a socketpair, two) and
#: the admin API connection the battery reads the registry with (one).
SOCKET_ALLOWANCE = 3
#: Listeners that keep no per-client state, so name no table: (transport,
#: kind). Empty today: every listener names the table that admits what its
#: clients make it keep. Add a kind here only with a comment saying why it
#: keeps nothing.
STATELESS: frozenset[tuple[str, str]] = frozenset()
#: Pre-auth bound for a table that declares no ``preauth_deadline``: the
#: longest read deadline the battery's server is configured with (TLS
#: handshakes, 10 s, HANDSHAKE_TIMEOUT of crossroads.transport.tls).
DEFAULT_PREAUTH_BOUND = 10.0
#: Time beyond a deadline for the server's sweepers to run (STUN sweeps every
#: second, OpenTTD every few) and the kernel to deliver the close.
DEADLINE_SLACK = 6.0
#: The reflection allowance (--reflection-allowance default, docs/security.md
#: "Reflection budget"): bytes per 10 s a source may get beyond what it sent.
REFLECTION_ALLOWANCE = 4096

#: Read deadlines of the child, short so that the battery's waits are short
#: (each is a real setting; the defaults are longer).
SHORT_TIMEOUTS = {
    "--stun-tcp-message-timeout": "3",
    "--openttd-packet-timeout": "3",
    "--http-request-timeout": "5",
    "--natneg-session-timeout": "2",
    "--natneg-linger": "2",
    "--natneg-connect-interval": "0.5",
}

_source_counter = itertools.count(1)


def fresh_sources(count: int) -> list[str]:
    """``count`` loopback addresses no earlier attack of this run used (the
    whole 127/8 is local on Linux): 127.1.0.1 onwards, never 127.0.0.x, which
    the real clients use."""
    out = []
    for _ in range(count):
        n = next(_source_counter)
        out.append(f"127.{1 + n // 62500}.{(n // 250) % 250}.{1 + n % 250}")
    return out


# ---------------------------------------------------------------- listeners


#: Listeners that register after /healthz first answers (the HTTPS port once
#: its certificate is in place, ACME's HTTP-01 port): the registry read at
#: collection must wait for them, or the first test function collected
#: would be parametrized without them.
LATE_KINDS = frozenset({"https", "acme-http"})


@dataclass(frozen=True)
class Listener:
    """One row of the registry's ``listeners``."""

    service: str
    kind: str
    transport: str
    host: str
    port: int
    table: str

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    def describe(self) -> str:
        return f"{self.transport} {self.host}:{self.port} {self.service}/{self.kind}"


def listeners_of(snapshot: dict[str, Any]) -> list[Listener]:
    return sorted(
        (Listener(**row) for row in snapshot["listeners"]),
        key=lambda x: (x.transport, x.kind, x.service, x.port),
    )


def listener_ids(listeners: list[Listener]) -> list[str]:
    """Stable pytest ids: ``udp-natneg1``, ``tcp-stun-tcp``, and an ordinal
    for kinds that have several sockets (``udp-p2p-rendezvous-2``)."""
    base = [f"{x.transport}-{x.kind}" for x in listeners]
    seen: dict[str, int] = {}
    out = []
    for name in base:
        if base.count(name) > 1:
            seen[name] = seen.get(name, 0) + 1
            out.append(f"{name}-{seen[name]}")
        else:
            out.append(name)
    return out


def tables_by_name(snapshot: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["table"]: row for row in snapshot["tables"]}


# ------------------------------------------------------------------ process


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _socket_inodes(pid: int) -> list[int]:
    inodes = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.append(int(target[8:-1]))
    return inodes


def describe_sockets(pid: int) -> list[str]:
    """Each socket of ``pid`` as ``tcp 127.0.0.1:5000 -> 127.1.0.3:41000``
    (from /proc/net), for failure messages."""
    wanted = set(_socket_inodes(pid))
    found: dict[int, str] = {}
    for proto in ("tcp", "tcp6", "udp", "udp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{proto}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            inode = int(cols[9])
            if inode in wanted:
                found[inode] = f"{proto} {_addr(cols[1])} -> {_addr(cols[2])}"
    return [found.get(i, f"socket:[{i}] (unix or other)") for i in sorted(wanted)]


def _addr(hexaddr: str) -> str:
    host, port = hexaddr.split(":")
    if len(host) == 8:
        ip = socket.inet_ntop(socket.AF_INET, bytes.fromhex(host)[::-1])
    else:
        raw = bytes.fromhex(host)
        ip = socket.inet_ntop(
            socket.AF_INET6, b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
        )
    return f"{ip}:{int(port, 16)}"


def _all_ports_zero() -> dict[str, str]:
    from crossroads.config import env_name, iter_settings
    from crossroads.services import load_service_modules

    load_service_modules()
    return {
        env_name(section, f): "0"
        for section, f, info in iter_settings()
        if info.kind == "port"
    }


@dataclass(eq=False)
class BatteryServer:
    """The one ``crossroads serve`` child every attack of a run targets."""

    process: subprocess.Popen[bytes]
    http_port: int
    https_port: int
    tls_port: int
    directory: Path
    log: Path
    admin: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        # Keep-alive: the registry is read over one connection opened before
        # any attack, so a flood that fills the HTTP table (as it may: the
        # global cap is for everyone) does not hide the registry.
        self.admin = httpx.Client(
            base_url=f"http://127.0.0.1:{self.http_port}",
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
            timeout=10,
            limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
        )

    @classmethod
    def start(cls) -> BatteryServer:
        http_port, https_port, tls_port = (
            free_port(),
            free_port(),
            free_udp_tcp_port(),
        )
        directory = Path(tempfile.mkdtemp(prefix="crossroads-battery-"))
        env = {
            **os.environ,
            **_all_ports_zero(),
            "XDG_STATE_HOME": str(directory / "state"),
        }
        command = [
            sys.executable, "-m", "crossroads", "serve",
            "--host", "127.0.0.1",
            "--http-port", str(http_port),
            "--https-port", str(https_port),
            "--turn-tls-port", str(tls_port),
            "--tls-dev-cert-dir", str(directory / "tls"),
            # The HTTP-01 listener of --acme-domain is attacked like the
            # others; its certificate authority is a closed loopback port, so
            # the order fails at once (the TLS listeners serve the placeholder).
            "--acme-domain", "localhost",
            "--acme-directory", f"https://127.0.0.1:{free_port()}/directory",
            "--acme-http-port", str(free_port()),
            "--relay-websocket",
            "--admin-token", ADMIN_TOKEN,
            "--memory-budget", str(MEMORY_BUDGET),
            "--turn-user", f"{TURN_USER}:{TURN_PASSWORD}",
            "--api-key", API_KEY,
            *itertools.chain.from_iterable(SHORT_TIMEOUTS.items()),
        ]  # fmt: skip

        def limit() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))

        log = directory / "serve.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                command,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=limit,
            )
        server = cls(process, http_port, https_port, tls_port, directory, log)
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"crossroads serve exited:\n{server.output()}")
            with contextlib.suppress(httpx.TransportError):
                if server.admin.get("/healthz").status_code == 200 and (
                    LATE_KINDS <= {x.kind for x in listeners_of(server.snapshot())}
                ):
                    return server
            if time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"crossroads serve not ready:\n{server.output()}")
            time.sleep(0.1)

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def admin_get(self, path: str) -> httpx.Response:
        """GET on the kept connection; once more on a new one if it was cut.

        The server closes a keep-alive connection idle past
        ``--http-request-timeout`` (5 s here, for the slowloris checks); a
        request sent on it as the close comes meets a reset. A browser sends
        an idempotent request again on a new connection then (RFC 9110
        §9.2.2), and so does this client."""
        try:
            return self.admin.get(path)
        except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError):
            return self.admin.get(path)

    def snapshot(self) -> dict[str, Any]:
        answer = self.admin_get("/console/api/admin/resources")
        assert answer.status_code == 200, (answer.status_code, answer.text[:200])
        result: dict[str, Any] = answer.json()
        return result

    def rss(self) -> int:
        return _rss(self.process.pid)

    def sockets(self) -> int:
        return len(_socket_inodes(self.process.pid))

    def revoke_turn_allocations(self) -> int:
        """End every live TURN allocation as an operator would (admin API);
        how many. A real client's allocation is authenticated state that
        lives until its lifetime unless it deallocates; coturn's uclient
        deallocates at its end, but its Refresh(0) is a UDP datagram that a
        flood may cost it, and then the allocation would outlive the wait."""
        listed = self.admin_get("/console/api/admin/sessions").json()
        count = 0
        for session in listed.get("turn", []):
            answer = self.admin.post(
                "/console/api/admin/revoke", json={"kind": "turn", "id": session["id"]}
            )
            count += answer.status_code == 200
        return count

    def healthz(self) -> int:
        """/healthz over a new connection from 127.0.0.1 (a real client)."""
        try:
            return httpx.get(
                f"http://127.0.0.1:{self.http_port}/healthz", timeout=10
            ).status_code
        except httpx.TransportError as exc:
            raise AssertionError(f"/healthz failed: {exc!r}") from None

    def stop(self) -> None:
        self.admin.close()
        if self.process.poll() is None:
            # SIGINT stops at once; SIGTERM would drain the sessions the
            # battery left (runtime.serve_forever).
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


# --------------------------------------------------------------- invariants


def accounted_bytes(snapshot: dict[str, Any]) -> int:
    return sum(
        t["live"] * t["bytes_per_item"] + t["buffered_bytes"]
        for t in snapshot["tables"]
    )


def accounted_sockets(snapshot: dict[str, Any]) -> int:
    held = sum(
        t["live"] * t["descriptors_per_item"]
        for t in snapshot["tables"]
        if t.get("pool") != "none"
    )
    return len(snapshot["listeners"]) + held


@dataclass
class Baseline:
    rss: int
    accounted: int
    live: dict[str, int]
    sockets: int

    @classmethod
    def take(cls, server: BatteryServer) -> Baseline:
        snap = server.snapshot()
        return cls(
            server.rss(),
            accounted_bytes(snap),
            {t["table"]: t["live"] for t in snap["tables"]},
            server.sockets(),
        )


@dataclass
class Figures:
    """What one check measured (printed in the battery's summary)."""

    label: str
    rss_growth: int
    reported: int
    sockets: int
    accounted_sockets: int


#: Every check of the run, for the summary at the end.
FIGURES: list[Figures] = []


def check_invariants(
    server: BatteryServer, baseline: Baseline, label: str
) -> dict[str, Any]:
    """Assert the battery's invariants now; return the snapshot."""
    assert server.alive, f"{label}: crossroads serve died:\n{server.output()}"
    snap: dict[str, Any] = {}
    # The process's sockets against the registry: read both twice, so a
    # connection accepted between the two readings is not taken for an
    # unknown socket; a socket the registry does not know stays.
    excess = 0
    for _ in range(4):
        before = server.sockets()
        snap = server.snapshot()
        after = server.sockets()
        excess = min(before, after) - accounted_sockets(snap) - SOCKET_ALLOWANCE
        if excess <= 0:
            break
        time.sleep(0.3)
    for t in snap["tables"]:
        assert t["live"] <= t["max"], f"{label}: table {t['table']} over its cap: {t}"
        assert t.get("largest_source", 0) <= t["max_per_source"], (
            f"{label}: a source holds more of {t['table']} than its cap: {t}"
        )
    sockets = server.sockets()
    assert excess <= 0, (
        f"{label}: the process holds {excess} socket(s) the registry does not "
        f"account for ({len(snap['listeners'])} listeners + live items x "
        f"descriptors_per_item + {SOCKET_ALLOWANCE}); its sockets:\n"
        + "\n".join(describe_sockets(server.process.pid))
    )
    growth = server.rss() - baseline.rss
    reported = accounted_bytes(snap) - baseline.accounted
    FIGURES.append(Figures(label, growth, reported, sockets, accounted_sockets(snap)))
    assert growth <= max(0, reported) + RSS_SLACK, (
        f"{label}: RSS grew by {growth / 2**20:.1f} MiB, the tables report "
        f"{reported / 2**20:.1f} MiB (+{RSS_SLACK >> 20} MiB slack): "
        + ", ".join(
            f"{t['table']}={t['live']}x{t['bytes_per_item']}+{t['buffered_bytes']}"
            for t in snap["tables"]
            if t["live"]
        )
    )
    return snap


def listener_problems(snapshot: dict[str, Any]) -> list[str]:
    """Listeners that name no table (and are not :data:`STATELESS`), or name
    one that is not registered."""
    tables = tables_by_name(snapshot)
    problems = []
    for x in listeners_of(snapshot):
        if not x.table:
            if (x.transport, x.kind) not in STATELESS:
                problems.append(
                    f"{x.describe()} names no table: register the table that "
                    "admits its clients' state and pass it to "
                    "ResourceBudget.listen (or list its kind in STATELESS, "
                    "with the reason)"
                )
        elif x.table not in tables:
            problems.append(
                f"{x.describe()} names table {x.table!r}, which is not registered"
            )
    return problems


def preauth_bound(snapshot: dict[str, Any], listener: Listener) -> float:
    table = tables_by_name(snapshot).get(listener.table)
    deadline = table.get("preauth_deadline") if table else None
    return float(deadline or DEFAULT_PREAUTH_BOUND)


def wait_drained(
    server: BatteryServer, baseline: Baseline, label: str, bound: float
) -> None:
    """Wait (at most ``bound`` + slack) until every table is back at its
    baseline, then check RSS came back within :data:`RSS_TOLERANCE`."""
    deadline = time.monotonic() + bound + DEADLINE_SLACK
    while True:
        snap = server.snapshot()
        high = {
            t["table"]: (t["live"], baseline.live.get(t["table"], 0))
            for t in snap["tables"]
            if t["live"] > baseline.live.get(t["table"], 0)
        }
        if not high:
            break
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{label}: tables not drained {bound + DEADLINE_SLACK:.0f} s after "
                f"the attack (live, baseline): {high}"
            )
        time.sleep(0.25)
    growth = server.rss() - baseline.rss
    assert growth <= RSS_TOLERANCE, (
        f"{label}: RSS stayed {growth / 2**20:.1f} MiB above the baseline after "
        f"the attack drained (tolerance {RSS_TOLERANCE >> 20} MiB)"
    )
    assert server.healthz() == 200


# ---------------------------------------------------------- opening messages


def stun_request(method: int) -> bytes:
    """A 20-byte STUN request without attributes (Binding 0x0001, Allocate
    0x0003): no credentials, so TURN answers 401."""
    return struct.pack("!HHI", method, 0, 0x2112A442) + os.urandom(12)


def dtls_client_hello() -> bytes:
    """A DTLS 1.2 ClientHello (the relay's PSK client's first flight; the
    cookie exchange is the same for every DTLS port)."""
    from crossroads.proto.dtls.client import PskDtlsClient

    client = PskDtlsClient(("192.0.2.1", 1), b"x", bytes(64), os.urandom)
    client.start(0.0)
    ((hello, _),) = client.datagrams_to_send(0.0)
    return bytes(hello)


def relay_bind() -> bytes:
    """A Unity relay BIND with made-up connection data and a wrong HMAC
    (unity-relay reference: type 0, 255 bytes of connection data, HMAC)."""
    from crossroads.proto.relay.messages import Bind

    return Bind(1, os.urandom(255), os.urandom(32)).encode()


def raknet_openers(server: tuple[str, int], i: int) -> list[bytes]:
    """OPEN_CONNECTION_REQUEST_1 (the 18-byte form, no padding, and a padded
    one) and _2 with a fresh GUID (raknet-wire.md §1): _2 is what makes a
    RakNet server create a connection."""
    short = bytes([rk.MessageId.OPEN_CONNECTION_REQUEST_1]) + rk.MAGIC + b"\x06"
    return [
        short,
        rk.OpenConnectionRequest1(6, 576).encode(),
        rk.OpenConnectionRequest2(server, 576, 0x1000 + i).encode(),
    ]


def qos_request(i: int) -> bytes:
    """A Unity QoS request (25 bytes, "QoS request" title; docs/qos.md),
    packed by the independent client."""
    from tests.qos_client import request

    return request(i % 5, i & 0xFFFF, i)


def natneg_init(i: int) -> bytes:
    """A version-3 natneg INIT with cookie ``i`` (each a new session)."""
    base = int.from_bytes(os.urandom(2), "big") << 16
    return Init(3, base + i, 0, 0, 0).encode()


def udp_openers(listener: Listener) -> Callable[[int], list[bytes]]:
    """The opening messages of a UDP listener's protocol, the i-th of a
    flood (by kind, then by service; random bytes for an unknown one)."""
    kind, service = listener.kind, listener.service
    garbage = [os.urandom(64)]
    if "dtls" in kind or (service == "turn" and not kind.startswith("stun")):
        return lambda i: [dtls_client_hello(), *garbage]
    if service == "stun" or kind.startswith("stun"):
        return lambda i: [stun_request(0x0001), stun_request(0x0003), *garbage]
    if service == "relay":
        # The relay's UDP port or its DTLS port (told apart by kind once the
        # service names them): both messages, each port ignores the other's.
        return lambda i: [relay_bind(), dtls_client_hello(), *garbage]
    if service == "natneg":
        return lambda i: [natneg_init(i), *garbage]
    if service == "raknet":
        return lambda i: [*raknet_openers(listener.address, i), *garbage]
    if service == "p2p":
        return lambda i: [Probe(os.urandom(16), 0, i & 0xFFFF).encode(), *garbage]
    if kind == "qos":
        return lambda i: [qos_request(i), *garbage]
    return lambda i: [os.urandom(48), os.urandom(200)]


def udp_socket(source: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    sock.bind((source, 0))
    sock.setblocking(False)
    return sock


def drain_udp(sock: socket.socket) -> int:
    """Bytes waiting on ``sock`` (read and discarded)."""
    total = 0
    while True:
        try:
            total += len(sock.recv(65536))
        except (BlockingIOError, ConnectionRefusedError):
            return total


# ---------------------------------------------------------------- TCP side

TLS_KINDS = frozenset({"https", "turn-tls", "relay-wss", "tls"})
PLAIN_KINDS = frozenset({"http", "relay-ws", "acme-http"})


def tls_hello() -> bytes:
    """A TLS ClientHello as the ssl module sends it."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = context.wrap_bio(incoming, outgoing, server_hostname="localhost")
    with contextlib.suppress(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


def client_context() -> ssl.SSLContext:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def speaks_tls(listener: Listener) -> bool:
    """Whether a TCP listener expects TLS: by kind, else by trying."""
    if listener.kind in TLS_KINDS or listener.kind.endswith("-tls"):
        return True
    if listener.kind in PLAIN_KINDS or listener.kind.startswith(("stun", "openttd")):
        return False
    try:
        with (
            socket.create_connection(listener.address, timeout=3) as raw,
            client_context().wrap_socket(raw, server_hostname="localhost"),
        ):
            return True
    except (OSError, ssl.SSLError):
        return False


def inner_protocol(listener: Listener) -> str:
    """What is spoken inside (after TLS, if any): http, stun, openttd, ws."""
    if listener.service == "http" or listener.kind in ("http", "https"):
        return "http"
    if listener.service in ("stun", "turn") or listener.kind.startswith("stun"):
        return "stun"
    if listener.service == "openttd":
        return "openttd"
    if listener.service == "relay":
        return "ws"
    return "unknown"


#: The first bytes of a message each protocol never finishes (slowloris):
#: an HTTP request line and one header, a STUN header announcing 200 bytes,
#: an OpenTTD packet header announcing 100 bytes.
PARTIAL = {
    "http": b"GET /healthz HTTP/1.1\r\nHost: crossroads\r\n",
    "ws": b"GET / HTTP/1.1\r\nHost: crossroads\r\nUpgrade: websocket\r\n",
    "stun": struct.pack("!HHI", 0x0001, 200, 0x2112A442) + os.urandom(12),
    "openttd": struct.pack("<H", 100) + b"\x00",
    "unknown": b"\x00\x10",
}

WS_UPGRADE = (
    b"GET / HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\n"
    b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
    b"Sec-WebSocket-Version: 13\r\n\r\n"
)


def ws_ping(payload: bytes) -> bytes:
    """A masked WebSocket ping (RFC 6455 §5.5.2), payload ≤ 125 bytes."""
    mask = os.urandom(4)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return bytes([0x89, 0x80 | len(payload)]) + mask + masked


def request_stream(inner: str) -> tuple[bytes, bytes]:
    """(preamble, one request): what a client that never reads repeats."""
    if inner == "http":
        return b"", b"GET /healthz HTTP/1.1\r\nHost: crossroads\r\n\r\n"
    if inner == "stun":
        return b"", stun_request(0x0001)
    if inner == "ws":
        return WS_UPGRADE, ws_ping(os.urandom(125))
    return b"", os.urandom(512)


def tcp_connect(
    listener: Listener, source: str, timeout: float = 3.0
) -> socket.socket | None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(timeout)
    try:
        sock.bind((source, 0))
        sock.connect(listener.address)
    except OSError:
        sock.close()
        return None
    sock.setblocking(False)
    return sock


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (EOF or reset; what it sent first
    is read and discarded)."""
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def wait_all_closed(socks: list[socket.socket], within: float, tick: Any) -> int:
    """Wait until the server closed every socket, calling ``tick()`` about
    once a second (a slowloris keeps sending); return how many stay open."""
    deadline = time.monotonic() + within
    open_ = list(socks)
    next_tick = time.monotonic()
    while open_ and time.monotonic() < deadline:
        open_ = [s for s in open_ if not closed_by_server(s)]
        if time.monotonic() >= next_tick:
            tick(open_)
            next_tick = time.monotonic() + 1.0
        time.sleep(0.1)
    return len(open_)


def close_all(socks: list[socket.socket]) -> None:
    for sock in socks:
        with contextlib.suppress(OSError):
            sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
            )
        sock.close()


@contextlib.contextmanager
def held(socks: list[socket.socket]) -> Iterator[list[socket.socket]]:
    try:
        yield socks
    finally:
        close_all(socks)


# ------------------------------------------------------------ real clients


async def stun_binding(port: int, source: str = "127.0.0.1") -> None:
    """A STUN Binding from ``source`` gets its answer (three tries)."""
    sock = udp_socket(source)
    loop = asyncio.get_running_loop()
    try:
        request = stun_request(0x0001)
        for _ in range(3):
            sock.sendto(request, ("127.0.0.1", port))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    answer = await loop.sock_recv(sock, 2048)
                    if answer[8:20] == request[8:20]:
                        assert answer[:2] == b"\x01\x01", answer[:4].hex()
                        return
        raise AssertionError("no answer to a STUN Binding")
    finally:
        sock.close()


async def turn_allocate(port: int) -> None:
    """A TURN Allocate with the static user succeeds, then is freed."""
    from crossroads.client.turn import TurnClient

    client = await TurnClient.connect(
        ("127.0.0.1", port), TURN_USER, TURN_PASSWORD, timeout=5.0
    )
    try:
        await client.allocate()
        assert client.relayed is not None
    finally:
        await client.close()


def real_clients(server: BatteryServer, stun_port: int, *, healthz: bool) -> None:
    """While an attack runs: a STUN Binding, a TURN Allocate and (unless the
    HTTP table is the one flooded) /healthz, each from 127.0.0.1."""

    async def run() -> None:
        await stun_binding(stun_port)
        await turn_allocate(stun_port)

    asyncio.run(run())
    if healthz:
        assert server.healthz() == 200


def write_figures(path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump([vars(x) for x in FIGURES], f, indent=1)
