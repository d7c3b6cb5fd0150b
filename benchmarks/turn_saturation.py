"""Saturation: relayed packets/s at < 0.5 % loss and CPU per packet, side by side.

    .venv/bin/python benchmarks/turn_saturation.py [--rounds 3] [--allocations 32]

Unlike benchmarks/turn.py (coturn's uclient, which tops out long before either
server is busy), the load here comes from ``benchmarks/turn_load.c``: one C
process, open loop, ``sendmmsg``/``recvmmsg``, that offers a fixed rate of
datagrams spread over many flows and counts what comes out of the relay. The
Python side does every control exchange on real sockets and hands the sockets
to the generator (inherited file descriptors):

- **TURN**: ``--allocations`` allocations (Allocate with long-term credentials:
  401, then a signed Allocate with MESSAGE-INTEGRITY), each with its own client
  socket and peer socket. Three in four bind a channel (ChannelData both ways);
  the rest only CreatePermission (Send indication client -> peer, Data
  indication peer -> client). Every allocation carries traffic both ways, so
  half the datagrams enter on the listening port and half on relay ports.
- **Unity relay**: ``--allocations / 2`` host/joiner pairs allocated through the
  REST API, BIND and CONNECT done; RELAY frames both ways.
- **natneg relay**: ``--allocations / 2`` negotiations through a server in
  ``--natneg-relay-mode always`` (the INITs of two clients on 127.0.0.1 and
  127.0.0.5, then each client's CONNECT_PING teaches its relay side the port);
  datagrams both ways through the pair.
- **STUN**: Binding requests/s with ``benchmarks/stun_load.c`` (closed loop,
  256 in flight; see benchmarks/stun.py), crossroads against coturn.

For every target the offered rate is raised (x1.5 until a step loses 0.5 % or
more, counting what the generator could not send for full buffers) and then
bisected; a failed step is tried once more (``--retries``) before it counts as
a failure, since one scheduling hiccup of the shared machine can overflow a
socket buffer. The figure kept is the highest *delivered* rate of a
step under 0.5 % loss. A step is ``--warmup`` s unmeasured, ``--seconds`` s
measured, then a drain; datagrams carry a step number, so late ones of an
earlier step never count. CPU per packet is the server's user+system time
(``/proc/<pid>/stat``, all threads) during the measured window divided by the
datagrams delivered in it, at the step kept, and at one more step at the same
offered rate for every target (``--same-rate``, 50,000/s by default), which
compares the work per packet at equal load (batching makes it depend on the
rate) and is less noisy than the loss threshold.

Targets, each started fresh in every round (rounds interleave the targets, so
the machine's other load weighs on all of them alike):

- ``crossroads``: ``crossroads serve --only stun,turn`` / ``--only relay``: one
  process, or ``--workers 1`` and ``--workers 2`` (on CPUs 0,1) once ``serve``
  has that flag (older checkouts have not);
- ``coturn -m 1`` and ``coturn -m 2``: ``turnserver`` with one and two relay
  threads, same credentials, same relay port range size;
- ``bare``: ``benchmarks/bare_forwarder.c``, epoll + recvmmsg/sendmmsg and a
  hash lookup, no TURN at all: the physical limit of this machine for the shape.
- for the relays (Unity, natneg), ``crossroads ... (Python twin)``: the same
  server with ``CROSSROADS_TURN_PURE_PYTHON=1`` (the data plane's pure-Python
  twin);
- with ``--before DIR``, for TURN and the relays, one more target per worker
  count, ``crossroads ... (before)``, that runs the crossroads source tree in
  ``DIR/src`` (e.g. a ``git archive`` of an older commit, with its C extension
  built in place) on the same load: before/after in one run.

Pinning (``taskset``): servers on CPU 0, the load generator on CPU 1; coturn
``-m 2`` gets CPUs 0 and 1 (this machine has two cores), so it shares the
generator's core. Loopback only; every process is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import natneg  # noqa: E402
import relay  # noqa: E402
import stun  # noqa: E402
import turn  # noqa: E402

sys.path.insert(0, str(HERE.parent))
from tests.conftest import RedisServer, consecutive_free_ports  # noqa: E402

HOST = "127.0.0.1"
LOSS_LIMIT = 0.5  # percent, the threshold
SERVER_CPU, LOAD_CPU = "0", "1"
MAGIC = 0x2112A442
#: ChannelData channel of every allocation (each has its own client socket).
CHANNEL = 0x4000
Flow = tuple[socket.socket, tuple[str, int], bytes, socket.socket]


@dataclass
class Target:
    """A running server: its process (for CPU) and a way to build flows."""

    name: str
    process: subprocess.Popen[bytes]
    flows: Callable[[ExitStack, int, int], list[Flow]]


@dataclass
class Step:
    offered: float
    delivered: float
    loss: float
    server_cpu: float  # CPU-seconds per second (the server's own utime+stime)
    load_cpu: float
    #: Busy share of the server's core (CPU 0) from /proc/stat, softirq
    #: included: on loopback the kernel delivers a datagram in softirq context,
    #: which is not always charged to the process that sent it.
    core_busy: float
    sent: int  # datagrams sent in the measured window
    short: int  # datagrams the generator could not send (full buffers)
    #: UDP datagrams the kernel dropped for a full receive buffer during the
    #: step, machine-wide (/proc/net/snmp RcvbufErrors): where the loss was.
    rcvbuf_drops: int
    target: float  # offered rate asked for

    @property
    def passed(self) -> bool:
        # What the generator could not send met a full socket buffer (the
        # relay did not keep up): loss too. A generator that merely fell behind
        # its schedule (CPU 1 busy) sent less, and the delivered rate says so.
        refused = 100 * self.short / max(1, self.sent + self.short)
        return self.loss < LOSS_LIMIT and refused < LOSS_LIMIT

    @property
    def us_per_packet(self) -> float:
        return self.server_cpu / self.delivered * 1e6 if self.delivered else 0.0


@dataclass
class Results:
    """Per target label: the best passing step of each round, and the step at
    the common rate (--same-rate) of each round."""

    best: dict[str, list[Step]] = field(default_factory=dict)
    same_load: dict[str, list[Step]] = field(default_factory=dict)


def pin(cpus: str) -> list[str]:
    return ["taskset", "-c", cpus] if shutil.which("taskset") else []


def build(workdir: Path) -> dict[str, Path]:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("a C compiler (cc) is needed for the load generator")
    binaries = {}
    for name in ("turn_load", "bare_forwarder"):
        binaries[name] = workdir / name
        subprocess.run(
            [compiler, "-O2", "-o", str(binaries[name]), str(HERE / f"{name}.c")],
            check=True,
        )
    binaries["stun_load"] = stun.build_load(workdir)
    return binaries


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)  # at once: SIGTERM drains
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def client_socket(stack: ExitStack) -> socket.socket:
    """A loopback UDP socket with 4 MiB buffers, closed with ``stack``."""
    return stack.enter_context(relay.udp_socket())


# ------------------------------------------------------------------ TURN flows


def channel_data_header(payload: int) -> bytes:
    return struct.pack("!HH", CHANNEL, payload)


def send_indication_header(peer: tuple[str, int], payload: int) -> bytes:
    """Send indication with XOR-PEER-ADDRESS then DATA (RFC 8656 §11.3); the
    payload follows the DATA attribute header (byte 36)."""
    peer_attr = relay._attr(0x0012, relay._xor_address(peer))
    attrs = peer_attr + struct.pack("!HH", 0x0013, payload)
    return struct.pack("!HHI", 0x0016, len(attrs) + payload, MAGIC) + bytes(12) + attrs


def turn_flows(
    server: tuple[str, int], stack: ExitStack, allocations: int, payload: int
) -> list[Flow]:
    flows: list[Flow] = []
    for index in range(allocations):
        client, peer = client_socket(stack), client_socket(stack)
        peer_address = peer.getsockname()
        session = relay.TurnClient(client, server, turn.USER, turn.PASSWORD)
        relayed = session.allocate()
        if index % 4 == 3:
            session.create_permission(peer_address)
            header = send_indication_header(peer_address, payload)
        else:
            session.channel_bind(CHANNEL, peer_address)
            header = channel_data_header(payload)
        flows.append((client, server, header, peer))
        flows.append((peer, relayed, b"", client))
    return flows


def bare_turn_flows(
    port: int, stack: ExitStack, allocations: int, payload: int
) -> list[Flow]:
    """The same shape on the bare forwarder: its '!' control datagram stands for
    Allocate + ChannelBind (channel 0: a permission only)."""
    server = (HOST, port)
    flows: list[Flow] = []
    for index in range(allocations):
        client, peer = client_socket(stack), client_socket(stack)
        peer_address = peer.getsockname()
        channel = 0 if index % 4 == 3 else CHANNEL
        bind = b"!" + struct.pack("!HH", index, channel)
        bind += socket.inet_aton(peer_address[0]) + struct.pack("!H", peer_address[1])
        answer = relay.exchange(client, bind, server)
        relayed = (HOST, struct.unpack_from("!H", answer, 3)[0])
        if channel:
            header = channel_data_header(payload)
        else:
            header = send_indication_header(peer_address, payload)
        flows.append((client, server, header, peer))
        flows.append((peer, relayed, b"", client))
    return flows


def workers_flag() -> bool:
    """Whether ``crossroads serve`` has ``--workers`` in this checkout."""
    help_text = subprocess.run(
        [sys.executable, "-m", "crossroads", "serve", "--help"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return "--workers" in help_text


def crossroads_label(workers: int | None) -> str:
    return (
        "crossroads (1 process)"
        if workers is None
        else f"crossroads --workers {workers}"
    )


@dataclass(frozen=True)
class Variant:
    """Which crossroads runs: the installed one, its pure-Python data plane, or
    another source tree (``--before``)."""

    suffix: str = ""
    pure_python: bool = False
    source: Path | None = None


def spawn_crossroads(
    workers: int | None, flags: list[str], variant: Variant = Variant()
) -> subprocess.Popen[bytes]:
    """``crossroads serve`` with ``flags``: one process on CPU 0, or
    ``--workers N`` on CPUs 0 and 1 for N > 1 (as coturn -m 2)."""
    cpus = SERVER_CPU if workers is None or workers == 1 else "0,1"
    extra = [] if workers is None else ["--workers", str(workers)]
    command = [
        *pin(cpus), sys.executable, "-m", "crossroads", "serve", "--host", HOST,
        "--log-level", "warning", *extra, *flags,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("CROSSROADS_")}
    # The plane these figures are for (docs/benchmarks.md): as root, `auto`
    # would forward the natneg part's loopback pairs in the kernel (an older
    # tree, --before, ignores the variable).
    env["CROSSROADS_DATAPLANE"] = "c"
    if variant.pure_python:
        env["CROSSROADS_TURN_PURE_PYTHON"] = "1"
        env["CROSSROADS_DATAPLANE"] = "python"
    if variant.source is not None:
        # Ahead of the editable install's path entry.
        env["PYTHONPATH"] = str(variant.source / "src")
    return subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
    )


def start_crossroads_turn(workers: int | None, variant: Variant = Variant()) -> Target:
    port = turn.free_port()
    low = 20000 + ((port + 11) % 20) * 1000
    http_port = consecutive_free_ports(workers or 1)
    process = spawn_crossroads(
        workers,
        [
            "--only", "stun,turn", "--http-port", str(http_port),
            "--stun-port", str(port), "--stun-alt-port", "0",
            "--turn-user", f"{turn.USER}:{turn.PASSWORD}", "--turn-realm", turn.REALM,
            "--allow-loopback-peers", "--relay-ports", f"{low}-{low + 999}",
        ],
        variant,
    )  # fmt: skip
    try:
        turn.wait_udp_ready(port)
        # Every worker serving before the allocations: the requests of a
        # client hashed to a worker still starting wait in its socket, and this
        # script's simple TURN client would read their late answers as its own.
        wait_workers(http_port, workers)
    except BaseException:
        stop(process)
        raise
    return Target(
        crossroads_label(workers) + variant.suffix,
        process,
        lambda stack, n, size: turn_flows((HOST, port), stack, n, size),
    )


def start_coturn_turn(threads: int) -> tuple[Target, turn.Server]:
    server = turn.start_coturn(threads, SERVER_CPU if threads == 1 else "0,1")
    target = Target(
        f"coturn -m {threads}",
        server.process,
        lambda stack, n, size: turn_flows((HOST, server.port), stack, n, size),
    )
    return target, server


def start_bare(binary: Path, relays: int, pairs: bool) -> Target:
    port = turn.free_port()
    process = subprocess.Popen(
        [*pin(SERVER_CPU), str(binary), HOST, str(port), str(relays)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert process.stdout is not None
    if not process.stdout.readline().startswith(b"ready"):
        stop(process)
        raise RuntimeError("bare_forwarder did not start")
    if pairs:
        return Target(
            "bare forwarder",
            process,
            lambda stack, n, size: bare_pair_flows(port, stack, n, size),
        )
    return Target(
        "bare forwarder",
        process,
        lambda stack, n, size: bare_turn_flows(port, stack, n, size),
    )


# ------------------------------------------------------------ Unity relay flows


def pair_flows(
    pairs: list[tuple[socket.socket, socket.socket, bytes, bytes, tuple[str, int]]],
    payload: int,
) -> list[Flow]:
    flows: list[Flow] = []
    for host, joiner, hid, jid, server in pairs:
        to_host = relay.m.relay_frame(jid, hid, bytes(payload))[:-payload]
        to_joiner = relay.m.relay_frame(hid, jid, bytes(payload))[:-payload]
        flows.append((joiner, server, to_host, host))
        flows.append((host, server, to_joiner, joiner))
    return flows


def bare_pair_flows(
    port: int, stack: ExitStack, allocations: int, payload: int
) -> list[Flow]:
    server = (HOST, port)
    pairs = []
    for index in range(max(1, allocations // 2)):
        host, joiner = client_socket(stack), client_socket(stack)
        token = b"&" + struct.pack("!I", index + 1)
        relay.exchange(host, token, server)
        relay.exchange(joiner, token, server)
        relay.drain(host)
        host.setblocking(True)
        hid, jid = struct.pack("!16s", b"host%d" % index), bytes(16)
        pairs.append((host, joiner, hid, jid, server))
    return pair_flows(pairs, payload)


class BenchRedis:
    """A private redis-server (tests/conftest.py's), started on first use:
    ``--workers 2`` of the Unity relay needs a shared store (each worker is a
    relay node of its own, registered there; crossroads.workers)."""

    def __init__(self) -> None:
        self.server: RedisServer | None = None

    def url(self) -> str:
        if self.server is None:
            self.server = RedisServer()
        return self.server.url

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


REDIS = BenchRedis()


def wait_workers(http_port: int, workers: int | None) -> None:
    """Until every worker of ``--workers N`` answers its /healthz (worker i on
    the HTTP port + i)."""
    for index in range(1, workers or 1):
        relay.wait_until(
            lambda index=index: _healthy(http_port + index), f"worker {index}"
        )


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}/healthz", timeout=1):
            return True
    except (OSError, urllib.error.URLError):
        return False


def start_crossroads_relay(workers: int | None, variant: Variant = Variant()) -> Target:
    http_port = consecutive_free_ports(workers or 1)
    relay_port = consecutive_free_ports(workers or 1, socket.SOCK_DGRAM)
    store = ["--store", REDIS.url()] if workers is not None and workers > 1 else []
    process = spawn_crossroads(
        workers,
        [
            "--http-port", str(http_port), "--only", "relay",
            "--relay-port", str(relay_port), "--api-key", relay.API_KEY,
            "--relay-allow-private-peers", "--relay-api-rate", "0", *store,
        ],
        variant,
    )  # fmt: skip
    base = f"http://{HOST}:{http_port}"
    try:
        relay.wait_until(lambda: bool(relay.http_json(f"{base}/v1/regions")), "relay")
        # Every worker's node up before allocating: the load must reach all.
        wait_workers(http_port, workers)
    except BaseException:
        stop(process)
        raise

    def flows(stack: ExitStack, allocations: int, payload: int) -> list[Flow]:
        pairs = []
        for _ in range(max(1, allocations // 2)):
            host, joiner = client_socket(stack), client_socket(stack)
            hid, jid, server = relay.connect_pair(base, host, joiner)
            pairs.append((host, joiner, hid, jid, server))
        return pair_flows(pairs, payload)

    return Target(
        crossroads_label(workers).replace("crossroads", "crossroads relay")
        + variant.suffix,
        process,
        flows,
    )


# ------------------------------------------------------------ natneg relay flows

#: The second client's address: natneg relays between two public IPs.
NATNEG_SECOND_HOST = natneg.HOST_B


def natneg_client_socket(stack: ExitStack, host: str) -> socket.socket:
    sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
    for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, 4 * 1024 * 1024)
    sock.bind((host, 0))
    return sock


def start_crossroads_natneg(
    workers: int | None, variant: Variant = Variant()
) -> Target:
    port, http_port = turn.free_port(), relay.free_port(socket.SOCK_STREAM)
    process = spawn_crossroads(
        workers,
        [
            "--only", "natneg", "--http-port", str(http_port),
            "--natneg-port", str(port), "--natneg-probe-port", "0",
            "--natneg-rate-limit", "0", "--no-reflection-budget",
            "--natneg-relay-mode", "always", "--natneg-relay-allow", "127.0.0.0/8",
            "--natneg-relay-host", HOST,
        ],
        variant,
    )  # fmt: skip
    base = f"http://{HOST}:{http_port}"
    try:
        relay.wait_until(lambda: bool(relay.http_json(f"{base}/healthz")), "natneg")
    except BaseException:
        stop(process)
        raise
    cookies = iter(range(0x5A7000, 0x5A7000 + (1 << 20)))

    def flows(stack: ExitStack, allocations: int, payload: int) -> list[Flow]:
        made: list[Flow] = []
        for _ in range(max(1, allocations // 2)):
            cookie = next(cookies)
            side0, side1 = asyncio.run(natneg.relay_pair((HOST, port), cookie))
            a = natneg_client_socket(stack, HOST)
            b = natneg_client_socket(stack, NATNEG_SECOND_HOST)
            for sock, side in ((a, side0), (b, side1)):
                sock.sendto(natneg.ConnectPing(3, cookie, *side, 0, 0).encode(), side)
            time.sleep(0.05)
            relay.drain(a, b)
            a.setblocking(True)
            b.setblocking(True)
            made.append((a, side0, b"", b))
            made.append((b, side1, b"", a))
        return made

    return Target(
        crossroads_label(workers).replace("crossroads", "crossroads natneg relay")
        + variant.suffix,
        process,
        flows,
    )


# ------------------------------------------------------------------ measuring


def core_ticks(cpu: int) -> tuple[int, int]:
    """(busy, total) ticks of one CPU from /proc/stat (busy: all but idle
    and iowait)."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith(f"cpu{cpu} "):
            values = [int(v) for v in line.split()[1:]]
            total = sum(values[:8])
            return total - values[3] - values[4], total
    raise RuntimeError(f"cpu{cpu} not in /proc/stat")


def run_step(
    load: Path,
    target: Target,
    flows: list[Flow],
    rate: float,
    args: argparse.Namespace,
    epoch: int,
) -> Step:
    table = "".join(
        f"{send.fileno()} {dest[0]} {dest[1]} {header.hex() or '-'} {recv.fileno()}\n"
        for send, dest, header, recv in flows
    )
    fds = sorted({s.fileno() for f in flows for s in (f[0], f[3])})
    command = [
        *pin(LOAD_CPU), str(load), f"{rate:.0f}", str(args.warmup), str(args.seconds),
        str(args.drain), str(args.payload), str(epoch),
    ]  # fmt: skip
    generator = subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        pass_fds=fds,
        text=True,
    )
    assert generator.stdin is not None
    generator.stdin.write(table)
    generator.stdin.close()
    time.sleep(args.warmup)
    server0 = turn.tree_ticks(target.process.pid)
    core0 = core_ticks(int(SERVER_CPU))
    drops0 = turn.udp_rcvbuf_errors()
    load0 = turn.cpu_ticks(generator.pid)
    wall0 = time.monotonic()
    time.sleep(args.seconds)
    server1 = turn.tree_ticks(target.process.pid)
    core1 = core_ticks(int(SERVER_CPU))
    drops1 = turn.udp_rcvbuf_errors()
    load1 = turn.cpu_ticks(generator.pid)
    wall = time.monotonic() - wall0
    assert generator.stdout is not None
    out = generator.stdout.read()
    generator.wait(args.drain + 30)
    fields = dict(part.split("=") for part in out.split())
    return Step(
        offered=float(fields["offered"]),
        delivered=float(fields["delivered"]),
        loss=float(fields["loss"]),
        server_cpu=(server1 - server0) / turn.TICK / wall,
        load_cpu=(load1 - load0) / turn.TICK / wall,
        core_busy=(core1[0] - core0[0]) / max(1, core1[1] - core0[1]),
        sent=int(fields["sent"]),
        short=int(fields["short"]),
        rcvbuf_drops=drops1 - drops0,
        target=rate,
    )


def search(
    load: Path,
    target: Target,
    flows: list[Flow],
    start: float,
    args: argparse.Namespace,
    epochs: Iterator[int],
) -> Step | None:
    """Raise the offered rate x1.5 until a step loses, then bisect: the best
    passing step (highest delivered rate)."""

    def measure(rate: float) -> Step:
        step = run_step(load, target, flows, rate, args, next(epochs))
        if args.verbose:
            print(
                f"    {target.name:<28} offered {step.offered:>9.0f}/s  delivered "
                f"{step.delivered:>9.0f}/s  loss {step.loss:6.2f}%  server "
                f"{step.server_cpu * 100:5.1f}%  core {step.core_busy * 100:5.1f}%  "
                f"load {step.load_cpu * 100:5.1f}%  short {step.short}  "
                f"rcvbuf-drops {step.rcvbuf_drops}",
                flush=True,
            )
        return step

    # A failed step is tried again (--retries): on a machine shared with
    # other work one scheduling hiccup of a few ms overflows a socket
    # buffer and would end the search early.
    return search_rate(measure, start, args.max_steps, 1 + args.retries)


class SearchStep(Protocol):
    @property
    def passed(self) -> bool: ...
    @property
    def delivered(self) -> float: ...


S = TypeVar("S", bound=SearchStep)


def search_rate(
    measure: Callable[[float], S], start: float, max_steps: int, tries: int
) -> S | None:
    """The saturation search of every harness here: raise the offered rate
    x1.5 until a step loses (each rate tried up to ``tries`` times), then
    bisect until the bounds are within 8 %; the best passing step."""
    passed: list[S] = []
    low, high, rate = 0.0, 0.0, start
    for _ in range(max_steps):
        for _ in range(tries):
            step = measure(rate)
            if step.passed:
                break
        if step.passed:
            passed.append(step)
            low = rate
        else:
            high = rate
        if not high:
            rate *= 1.5
        elif not low:
            rate /= 2
        elif high / low < 1.08:
            break
        else:
            rate = (low + high) / 2
    return max(passed, key=lambda s: s.delivered) if passed else None


def measure_round(
    load: Path,
    starters: list[tuple[str, Callable[[], Target]]],
    results: Results,
    args: argparse.Namespace,
    epochs: Iterator[int],
) -> None:
    for label, starter in starters:
        previous = results.best.setdefault(label, [])
        start = 0.7 * previous[-1].delivered if previous else args.start_rate
        with ExitStack() as stack:
            try:
                target = starter()
            except RuntimeError as exc:
                # A port found free was taken in between (the machine is
                # shared): one more try with new ports.
                print(f"  {label}: {exc}; starting it again", flush=True)
                target = starter()
            stack.callback(stop, target.process)
            flows = target.flows(stack, args.allocations, args.payload)
            # The same-rate step first: after the search's overloaded steps a
            # slow target is still draining full socket buffers of datagrams
            # from earlier steps (megabytes each), which would count as loss.
            same = run_step(load, target, flows, args.same_rate, args, next(epochs))
            best = search(load, target, flows, start, args, epochs)
        results.same_load.setdefault(label, []).append(same)
        same_text = (
            f"  at {args.same_rate:.0f}/s: {same.us_per_packet:5.2f} us/packet"
            f" (loss {same.loss:.2f}%)"
        )
        if best is None:
            print(f"  {label:<28} no step under {LOSS_LIMIT}% loss{same_text}")
            continue
        previous.append(best)
        print(
            f"  {label:<28} {best.delivered:>9.0f} relayed/s (loss {best.loss:.2f}%)"
            f"  server CPU {best.server_cpu * 100:5.1f}%"
            f"  {best.us_per_packet:5.2f} us/packet{same_text}",
            flush=True,
        )


def summary(
    title: str, results: Results, reference: str, args: argparse.Namespace
) -> None:
    print(f"\n{title}: medians over rounds")
    print(
        f"  {'target':<44} {'relayed/s <0.5% loss':>21} {'server CPU':>11}"
        f" {'core busy':>10} {'us CPU/packet':>14} {f'us/pkt @{args.same_rate:.0f}/s':>16}"
    )
    medians: dict[str, tuple[float, float]] = {}
    for label, same in results.same_load.items():
        steps = results.best.get(label, [])
        at_same = statistics.median(s.us_per_packet for s in same)
        if not steps:
            print(
                f"  {label:<44} {'n/a':>21} {'':>11} {'':>10} {'':>14} {at_same:>16.2f}"
            )
            continue
        rate = statistics.median(s.delivered for s in steps)
        per_packet = statistics.median(s.us_per_packet for s in steps)
        cpu = statistics.median(s.server_cpu for s in steps)
        busy = statistics.median(s.core_busy for s in steps)
        medians[label] = (rate, at_same)
        print(
            f"  {label:<44} {rate:>21.0f} {cpu * 100:>10.1f}% {busy * 100:>9.1f}%"
            f" {per_packet:>14.2f} {at_same:>16.2f}"
        )
    ours = medians.get(reference)
    if ours is None:
        return
    for label, (rate, at_same) in medians.items():
        if label != reference:
            # A target that delivered nothing at --same-rate has no CPU per packet.
            cpu_ratio = f"{ours[1] / at_same:.2f}" if at_same else "n/a"
            print(
                f"  {reference} / {label}: relayed/s {ours[0] / rate:.2f}; "
                f"CPU per packet at {args.same_rate:.0f}/s {cpu_ratio}"
                f" (>1: crossroads spends more)"
            )


def stun_rounds(
    binaries: dict[str, Path], args: argparse.Namespace, worker_counts: list[int | None]
) -> None:
    """Binding requests/s, crossroads at each worker count vs coturn -m 1 and
    -m 2 (benchmarks/stun.py's servers and closed-loop generator, 16 sockets x
    16 in flight: 16 source ports, which SO_REUSEPORT spreads over workers)."""
    workdir = Path(tempfile.mkdtemp(prefix="crossroads-bench-sat-stun-"))
    servers: list[stun.Server] = []
    stun_args = argparse.Namespace(
        duration=args.seconds * 2, warmup=args.warmup, sockets=16, window=16
    )
    try:
        for count in worker_counts:
            servers.append(
                stun.start_crossroads(workdir, crossroads_label(count), workers=count)
            )
        servers.append(stun.start_coturn(workdir, 1, "coturn -m 1"))
        servers.append(stun.start_coturn(workdir, 2, "coturn -m 2"))
        rows: dict[str, list[tuple[float, float]]] = {s.name: [] for s in servers}
        for round_no in range(args.rounds):
            order = servers if round_no % 2 == 0 else servers[::-1]
            for server in order:
                rows[server.name].append(
                    stun.run_round(binaries["stun_load"], server, stun_args)
                )
    finally:
        for server in servers:
            stop(server.process)
        shutil.rmtree(workdir, ignore_errors=True)
    print("\nSTUN Binding (closed loop, 256 in flight): medians over rounds")
    medians = {}
    for name, values in rows.items():
        rate = statistics.median(r for r, _ in values)
        per_cpu = statistics.median(r / c for r, c in values if c > 0)
        medians[name] = (rate, per_cpu)
        print(f"  {name:<28} {rate:>10.0f} req/s  {per_cpu:>10.0f} req per CPU-second")
    for count in worker_counts:
        ours = medians[crossroads_label(count)]
        peer = "coturn -m 2" if count is not None and count > 1 else "coturn -m 1"
        theirs = medians[peer]
        print(
            f"  {crossroads_label(count)} / {peer}: req/s {ours[0] / theirs[0]:.2f}, "
            f"per CPU-second {ours[1] / theirs[1]:.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--allocations", type=int, default=32)
    parser.add_argument("--payload", type=int, default=100, help="bytes, x4, >= 12")
    parser.add_argument("--warmup", type=float, default=0.3)
    parser.add_argument("--seconds", type=float, default=1.0, help="measured/step")
    parser.add_argument("--drain", type=float, default=0.3)
    parser.add_argument("--start-rate", type=float, default=40_000)
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument(
        "--same-rate",
        type=float,
        default=50_000,
        help="offered rate of the extra step that compares CPU per packet",
    )
    parser.add_argument(
        "--retries", type=int, default=1, help="tries again of a failed step"
    )
    parser.add_argument(
        "--only",
        default="turn,relay,natneg,stun",
        help="parts to run (comma separated)",
    )
    parser.add_argument(
        "--before",
        type=Path,
        help="a crossroads source tree (DIR/src) to run as '(before)'",
    )
    parser.add_argument(
        "--no-twin",
        action="store_true",
        help="skip the relays' pure-Python data plane targets",
    )
    parser.add_argument("--verbose", action="store_true", help="print every step")
    args = parser.parse_args()
    parts = set(args.only.split(","))
    if args.payload < 12 or args.payload % 4:
        parser.error("--payload must be a multiple of 4, at least 12")
    for tool in ("turnserver", "taskset"):
        if not shutil.which(tool):
            sys.exit(f"{tool} not found (make install)")
    workdir = Path(tempfile.mkdtemp(prefix="crossroads-bench-sat-"))
    epochs = iter(range(1, 1 << 30))
    # --workers N is measured at 1 and 2 once it exists; until then
    # crossroads is one process.
    worker_counts: list[int | None] = [1, 2] if workers_flag() else [None]
    print(
        f"saturation: {args.allocations} allocations, {args.payload}-byte payloads, "
        f"steps of {args.seconds:g} s, {args.rounds} rounds; servers on CPU "
        f"{SERVER_CPU} (coturn -m 2 on CPUs 0,1), load generator on CPU {LOAD_CPU}"
    )
    if worker_counts == [None]:
        print("crossroads has no --workers flag in this checkout: one process only")
    try:
        binaries = build(workdir)
        turn_variants = [Variant()]
        if args.before is not None:
            turn_variants.append(Variant(" (before)", source=args.before.resolve()))
        if "turn" in parts:
            coturn_servers: list[turn.Server] = []

            def coturn(threads: int) -> Target:
                target, server = start_coturn_turn(threads)
                coturn_servers.append(server)
                return target

            starters: list[tuple[str, Callable[[], Target]]] = [
                *(
                    (
                        crossroads_label(n) + v.suffix,
                        lambda n=n, v=v: start_crossroads_turn(n, v),
                    )
                    for v in turn_variants
                    for n in worker_counts
                ),
                ("coturn -m 1", lambda: coturn(1)),
                ("coturn -m 2", lambda: coturn(2)),
                (
                    "bare forwarder",
                    lambda: start_bare(
                        binaries["bare_forwarder"], args.allocations, pairs=False
                    ),
                ),
            ]
            results = Results()
            try:
                for round_no in range(args.rounds):
                    print(f"TURN round {round_no + 1}", flush=True)
                    measure_round(
                        binaries["turn_load"], starters, results, args, epochs
                    )
            finally:
                for server in coturn_servers:
                    server.stop()
            summary(
                "TURN (ChannelData and Send/Data indications, both ways)",
                results,
                crossroads_label(worker_counts[0]),
                args,
            )
        variants = [Variant()]
        if not args.no_twin:
            variants.append(Variant(" (Python twin)", pure_python=True))
        if args.before is not None:
            variants.append(Variant(" (before)", source=args.before.resolve()))
        # A natneg session's INITs must meet in one process, so ``serve``
        # refuses ``--only natneg --workers 2`` by design: that part runs in
        # one worker only.
        relays: list[
            tuple[str, str, str, Callable[[int | None, Variant], Target], bool]
        ] = [
            ("relay", "Unity relay", "crossroads relay", start_crossroads_relay, True),
            (
                "natneg",
                "natneg relay",
                "crossroads natneg relay",
                start_crossroads_natneg,
                False,
            ),
        ]
        for part, title, name, start, scales in relays:
            if part not in parts:
                continue
            part_worker_counts = (
                worker_counts
                if scales
                else [n for n in worker_counts if n is None or n <= 1]
            )
            if part_worker_counts != worker_counts:
                print(f"{title}: one worker only (it does not run in several)")
            relay_starters: list[tuple[str, Callable[[], Target]]] = [
                *(
                    (
                        crossroads_label(n).replace("crossroads", name) + v.suffix,
                        lambda n=n, v=v, start=start: start(n, v),
                    )
                    for v in variants
                    for n in part_worker_counts
                ),
                (
                    "bare forwarder",
                    lambda: start_bare(binaries["bare_forwarder"], 0, pairs=True),
                ),
            ]
            relay_results = Results()
            for round_no in range(args.rounds):
                print(f"{title} round {round_no + 1}", flush=True)
                measure_round(
                    binaries["turn_load"], relay_starters, relay_results, args, epochs
                )
            summary(
                f"{title} (both ways)",
                relay_results,
                crossroads_label(part_worker_counts[0]).replace("crossroads", name),
                args,
            )
        if "stun" in parts:
            stun_rounds(binaries, args, worker_counts)
    except urllib.error.URLError as exc:
        sys.exit(f"REST call failed: {exc}")
    finally:
        REDIS.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
