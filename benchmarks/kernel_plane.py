"""The kernel data plane against the C plane, coturn and the bare forwarder, on veth.

    sudo PYTHONPATH=src .venv/bin/python benchmarks/kernel_plane.py [--allocations 16]

Topology (network namespaces joined by veth, documentation addresses; the
lab of tests/transport/netns_support.py):

    client 192.0.2.2 --- 192.0.2.1 [server] 198.51.100.1 --- 198.51.100.2 peer

Every target relays ChannelData from the client (one allocation per client
socket, each with a channel) to the peer: the header comes off and the data
goes on from the relayed address, as TURN does.

Load: ``xdp_load.bpf.c``, an XDP program run by BPF_PROG_TEST_RUN in
live-frames mode from a thread pinned to CPU 1 in the client namespace. It
writes each allocation's real frame in turn (the client socket's address,
the server's, the ChannelData) and transmits it into the server's veth,
paced on a nanosecond grid; a user-space generator (turn_load.c) tops out
near 300k datagrams/s on one core here, below what the kernel plane
forwards. The peer's device drops and counts what arrives (``load_sink``);
loss is 1 - counted/sent.

The server core: the server's veth the load arrives on polls in its own
NAPI thread, pinned to CPU 0 (at normal priority: under overload it shares
the core with a relay process as ksoftirqd would), and every relay process
is pinned to CPU 0 too. So all the work of relaying a packet (the eBPF program, or the stack,
the socket and the relay process) lands on CPU 0, and "server core
us/pkt" is CPU 0's busy time per delivered packet; the generator and the
sink share CPU 1. The machine has two cores: this is the whole of it.

Targets, each started fresh:

- ``generator alone``: the frames dropped on arrival at the server's veth:
  the generator's and the veth's own ceiling;
- ``kernel routing``: the server namespace as a plain IPv4 router (the
  frames addressed to the peer; no relay): the stack's floor here;
- ``kernel plane (eBPF, tc)``: ``relay.bpf.c`` on the server's devices,
  routes written with :meth:`KernelPlane.install` (UNWRAP_CHANNEL), no
  server process;
- ``crossroads C plane, GSO on/off``: ``crossroads serve --only stun,turn
  --dataplane c`` (real TURN: Allocate with long-term credentials,
  ChannelBind);
- ``coturn -m 1``: ``turnserver`` with one relay thread;
- ``bare forwarder``: ``benchmarks/bare_forwarder.c`` (epoll + recvmmsg/
  sendmmsg and a hash lookup, no TURN).

Per target: the highest delivered rate of a step under 0.5 % loss (raised
x1.5, then bisected), and one step at the same offered rate for all
(``--same-rate``). For the kernel plane also the eBPF program's own run
time per packet (``kernel.bpf_stats_enabled``, fdinfo).

Latency: 2000 ping-pongs (64-byte payload) client -> relay -> peer -> relay ->
client through real sockets (before the load, the sinks passing; both
sockets served by one thread on CPU 1), median round trip; added latency per relay hop is half the difference to the same
ping-pong over kernel routing.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "src"))

from tests.transport.netns_support import (  # noqa: E402
    inside,
    ip,
    ipv4_udp_frame,
    mac_of,
    relay_lab,
)

import relay  # noqa: E402
import turn  # noqa: E402
import turn_saturation as sat  # noqa: E402
import xdp_load  # noqa: E402
from crossroads.transport.kernelplane import (  # noqa: E402
    KernelPlane,
    KernelRoute,
    RouteKind,
)

CLIENT_IP, LISTEN_IP, RELAY_IP, PEER_IP = (
    "192.0.2.2",
    "192.0.2.1",
    "198.51.100.1",
    "198.51.100.2",
)
LISTEN = (LISTEN_IP, 3478)
CHANNEL = 0x4000
Flow = sat.Flow


@dataclass
class Step:
    offered: float
    delivered: float
    loss: float
    core_cpu: float  # CPU-s/s busy on the server core (CPU 0), anyone's
    #: CPU-s/s of the server's work: its NAPI thread (the receive path and
    #: what runs in it: the eBPF program, the stack up to the socket) and
    #: the relay process (0: none).
    napi_cpu: float
    server_cpu: float
    #: ns the eBPF program ran per packet it saw (kernel plane only, else 0).
    bpf_ns: float = 0.0

    @property
    def relay_cpu(self) -> float:
        return self.napi_cpu + self.server_cpu

    @property
    def passed(self) -> bool:
        return self.loss < sat.LOSS_LIMIT

    def us(self, cpu: float) -> float:
        return cpu / self.delivered * 1e6 if self.delivered else 0.0


@dataclass
class Running:
    name: str
    pid: int | None
    #: (client socket, where it sends, ChannelData header, peer socket)
    #: per allocation: what the generator's frames carry.
    flows: list[Flow]
    #: The same allocations from the peer's side: (peer socket, the relayed
    #: address, no header, client socket); empty for the generator alone.
    back: list[Flow]
    #: The eBPF program's descriptor (kernel plane): its run time is read.
    bpf_fd: int | None = None

    def direction(self, down: bool) -> list[Flow]:
        return self.back if down else self.flows


def udp_in(ns: str, host: str, stack: ExitStack) -> socket.socket:
    with inside(ns):
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, 4 * 1024 * 1024)
    sock.bind((host, 0))
    return stack.enter_context(sock)


def bpf_run(fd: int | None) -> tuple[int, int]:
    """(run_time_ns, run_cnt) of a BPF program (needs kernel.bpf_stats_enabled)."""
    if fd is None:
        return 0, 0
    info = dict(
        line.split(":\t", 1)
        for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines()
        if ":\t" in line
    )
    return int(info.get("run_time_ns", 0)), int(info.get("run_cnt", 0))


@dataclass(eq=False)
class Load:
    """The generator, the sinks and the server's NAPI thread of one lab."""

    loader: xdp_load.Loader
    ns: dict[str, str]
    args: argparse.Namespace
    #: The server's NAPI thread (see :func:`server_napi`).
    napi_pid: int = 0
    #: Peer to client (TURN: the ChannelData header goes on), else client
    #: to peer (it comes off).
    down: bool = False
    #: Where the saturation search starts.
    start_rate: float = 200_000

    @property
    def sender(self) -> str:
        """The generator's namespace (its device is its ``eth0``)."""
        return self.ns["peer" if self.down else "client"]

    @property
    def server_device(self) -> str:
        """The server's device the generator's frames arrive on."""
        return "top" if self.down else "toc"

    def frames(self, target: Running) -> list[bytes]:
        sender_mac = mac_of(self.sender, "eth0")
        server_mac = mac_of(self.ns["server"], self.server_device)
        size = self.args.payload
        return [
            ipv4_udp_frame(
                sender_mac,
                server_mac,
                send.getsockname(),
                dest,
                header + bytes(size),
            )
            for send, dest, header, _ in target.direction(self.down)
        ]

    def step(self, gen: xdp_load.Generator, target: Running, rate: float) -> Step:
        """One step: the generator paced at ``rate``, then a window in which
        what it sent and what the sink counted are compared (the generator
        runs on across steps; at most two veth rings' worth, 512 frames, are
        in flight at either end of the window)."""
        self.loader.configure(round(1e9 / rate), self.frames(target))
        time.sleep(self.args.warmup)
        sent0, sunk0 = self.loader.sent(), self.loader.sunk()
        core0 = sat.core_ticks(int(sat.SERVER_CPU))[0]
        proc0 = turn.tree_ticks(target.pid) if target.pid else 0
        napi0 = xdp_load.thread_ticks(self.napi_pid)
        bpf0 = bpf_run(target.bpf_fd)
        t0 = time.monotonic()
        time.sleep(self.args.seconds)
        sent1, sunk1 = self.loader.sent(), self.loader.sunk()
        wall = time.monotonic() - t0
        core1 = sat.core_ticks(int(sat.SERVER_CPU))[0]
        proc1 = turn.tree_ticks(target.pid) if target.pid else 0
        napi1 = xdp_load.thread_ticks(self.napi_pid)
        bpf1 = bpf_run(target.bpf_fd)
        sent, sunk = sent1 - sent0, sunk1 - sunk0
        return Step(
            offered=sent / wall,
            delivered=sunk / wall,
            loss=max(0.0, 100 * (1 - sunk / max(1, sent))),
            core_cpu=(core1 - core0) / turn.TICK / wall,
            napi_cpu=(napi1 - napi0) / turn.TICK / wall,
            server_cpu=(proc1 - proc0) / turn.TICK / wall,
            bpf_ns=(bpf1[0] - bpf0[0]) / max(1, bpf1[1] - bpf0[1]),
        )

    def measure(self, target: Running) -> tuple[Step, Step | None]:
        """The same-rate step, then the saturation search, under one
        generator (the sinks drop only meanwhile)."""
        frames = self.frames(target)
        self.loader.configure(round(1e9 / self.args.same_rate), frames)
        gen = xdp_load.Generator(
            self.loader, self.sender, "eth0", int(sat.LOAD_CPU), frames[0]
        )
        self.loader.sinking(True)
        gen.start()
        try:
            same = self.step(gen, target, self.args.same_rate)
            self.report(target, same)

            def measure(rate: float) -> Step:
                step = self.step(gen, target, rate)
                self.report(target, step)
                return step

            best = sat.search_rate(measure, self.start_rate, self.args.max_steps, 2)
        finally:
            gen.stop()
            self.loader.sinking(False)
        return same, best

    def report(self, target: Running, step: Step) -> None:
        if self.args.verbose:
            print(
                f"    {'v' if self.down else '^'} {target.name:<30} offered {step.offered:>9.0f}/s delivered "
                f"{step.delivered:>9.0f}/s loss {step.loss:6.2f}% napi "
                f"{step.napi_cpu * 100:5.1f}% process {step.server_cpu * 100:5.1f}% "
                f"(core 0 {step.core_cpu * 100:5.1f}%)",
                flush=True,
            )


@contextlib.contextmanager
def server_napi(load: Load, program: str | None) -> Iterator[int]:
    """The server's veth the load arrives on gets NAPI (``program``, unless
    the target attached its own XDP program) polled by a thread on CPU 0."""
    device = load.server_device
    with ExitStack() as stack:
        if program:
            load.loader.attach(load.ns["server"], device, program)
            stack.callback(load.loader.detach, load.ns["server"], device)
        load.napi_pid = stack.enter_context(
            xdp_load.napi_thread(load.ns["server"], device, int(sat.SERVER_CPU))
        )
        yield load.napi_pid


def ping_pong(target: Running, rounds: int = 2000) -> float:
    """Median round trip (us) client -> relay -> peer -> relay -> client,
    both ends in this thread on the generator's CPU (the relay's process, if
    any, on the server's): every target pays the same wakeups."""
    if not target.back:
        return float("nan")
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {int(sat.LOAD_CPU)})
    try:
        return _ping_pong(target, rounds)
    finally:
        os.sched_setaffinity(0, cpus)


def _ping_pong(target: Running, rounds: int) -> float:
    (client, dest, header, peer), (_, back, _, _) = target.flows[0], target.back[0]
    for sock in (client, peer):
        sock.setblocking(True)
        sock.settimeout(1.0)
    relay.drain(client, peer)
    client.setblocking(True)
    peer.setblocking(True)
    client.settimeout(1.0)
    peer.settimeout(1.0)
    payload = bytes(64)
    rtts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        client.sendto(
            header[:2] + struct.pack("!H", 64) + payload if header else payload, dest
        )
        try:
            peer.recv(2048)
            peer.sendto(payload, back)
            client.recv(2048)
        except TimeoutError:
            continue
        rtts.append(time.perf_counter() - t0)
    return statistics.median(rtts) * 1e6 if rtts else float("nan")


# ------------------------------------------------------------------ targets


def channel_header(payload: int) -> bytes:
    return struct.pack("!HH", CHANNEL, payload)


def generator_alone(ns: dict[str, str], stack: ExitStack, n: int, size: int) -> Running:
    flows = [
        (udp_in(ns["client"], CLIENT_IP, stack), LISTEN, b"", None) for _ in range(n)
    ]
    return Running("generator alone", None, flows, [])  # type: ignore[arg-type]


@contextlib.contextmanager
def kernel_routing(
    ns: dict[str, str], stack: ExitStack, n: int, size: int
) -> Iterator[Running]:
    ip("-n", ns["client"], "route", "add", "198.51.100.0/24", "via", LISTEN_IP)
    ip("-n", ns["peer"], "route", "add", "192.0.2.0/24", "via", RELAY_IP)
    forwarding = ["ip", "netns", "exec", ns["server"], "sysctl", "-qw"]
    subprocess.run([*forwarding, "net.ipv4.ip_forward=1"], check=True)
    try:
        flows: list[Flow] = []
        back: list[Flow] = []
        for _ in range(n):
            c = udp_in(ns["client"], CLIENT_IP, stack)
            p = udp_in(ns["peer"], PEER_IP, stack)
            flows.append((c, p.getsockname(), b"", p))
            back.append((p, c.getsockname(), b"", c))
        yield Running("kernel routing (no relay)", None, flows, back)
    finally:
        subprocess.run([*forwarding, "net.ipv4.ip_forward=0"], check=False)
        for namespace, net in (
            (ns["client"], "198.51.100.0/24"),
            (ns["peer"], "192.0.2.0/24"),
        ):
            subprocess.run(["ip", "-n", namespace, "route", "del", net], check=False)


@contextlib.contextmanager
def kernel_plane(
    ns: dict[str, str],
    stack: ExitStack,
    n: int,
    size: int,
    hook: str = "tc",
    forwards: bool = True,
) -> Iterator[Running]:
    """``relay.bpf.c`` with ``--kernel-hook tc`` or ``xdp`` (the XDP program
    sends toward a veth whose peer takes XDP frames: the sinks' programs),
    the server forwarding (XDP's next hops from bpf_fib_lookup) or not
    (from the plane's next_hops map)."""
    forwarding = ["ip", "netns", "exec", ns["server"], "sysctl", "-qw"]
    if hook == "xdp" and forwards:
        subprocess.run([*forwarding, "net.ipv4.conf.all.forwarding=1"], check=True)
        stack.callback(
            subprocess.run, [*forwarding, "net.ipv4.conf.all.forwarding=0"], check=False
        )
    with inside(ns["server"]):
        plane = KernelPlane.load()
        plane.hook = hook
    try:
        flows: list[Flow] = []
        back: list[Flow] = []
        routes: list[KernelRoute] = []
        for i in range(n):
            c = udp_in(ns["client"], CLIENT_IP, stack)
            p = udp_in(ns["peer"], PEER_IP, stack)
            relayed = (RELAY_IP, 50000 + i)
            routes.append(
                KernelRoute(
                    RouteKind.UNWRAP_CHANNEL,
                    c.getsockname(),
                    LISTEN,
                    relayed,
                    p.getsockname(),
                    CHANNEL,
                )
            )
            routes.append(
                KernelRoute(
                    RouteKind.WRAP_CHANNEL,
                    p.getsockname(),
                    relayed,
                    LISTEN,
                    c.getsockname(),
                    CHANNEL,
                )
            )
            flows.append((c, LISTEN, channel_header(size), p))
            back.append((p, relayed, b"", c))
        with inside(ns["server"]):
            plane.attach("toc")
            plane.attach("top")
            if not all(plane.install(route) for route in routes):
                raise RuntimeError("kernel plane refused a route")
        xdp = hook == "xdp"
        if xdp and {plane.hooks[i][0] for i in plane.devices} != {"xdp"}:
            raise RuntimeError(f"XDP not attached everywhere: {plane.hooks}")
        unforwarded = ", no forwarding" if xdp and not forwards else ""
        yield Running(
            f"kernel plane (eBPF, {'XDP' if xdp else 'tc'}{unforwarded})",
            None,
            flows,
            back,
            plane.xdp_program_fd if xdp else plane.program_fd,
        )
    finally:
        with inside(ns["server"]):
            plane.close()


def _turn_flows(
    ns: dict[str, str], stack: ExitStack, n: int, size: int, server: tuple[str, int]
) -> tuple[list[Flow], tuple[Flow, Flow]]:
    """The flows of ``n`` real allocations, client to peer and back."""
    flows: list[Flow] = []
    back: list[Flow] = []
    for _ in range(n):
        c = udp_in(ns["client"], CLIENT_IP, stack)
        p = udp_in(ns["peer"], PEER_IP, stack)
        session = relay.TurnClient(c, server, turn.USER, turn.PASSWORD)
        relayed = session.allocate()
        session.channel_bind(CHANNEL, p.getsockname())
        flows.append((c, server, channel_header(size), p))
        back.append((p, relayed, b"", c))
    return flows, back


def _wait_stun(
    ns: dict[str, str],
    stack: ExitStack,
    server: tuple[str, int],
    proc: subprocess.Popen[bytes],
) -> None:
    sock = udp_in(ns["client"], CLIENT_IP, stack)
    sock.settimeout(0.2)
    request = b"\x00\x01\x00\x00\x21\x12\xa4\x42" + os.urandom(12)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the server exited")
        sock.sendto(request, server)
        try:
            sock.recv(2048)
            return
        except TimeoutError:
            continue
    raise RuntimeError("the server did not answer STUN")


def in_server(
    ns: dict[str, str], command: list[str], **kw: object
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [*sat.pin(sat.SERVER_CPU), "ip", "netns", "exec", ns["server"], *command],
        **kw,  # type: ignore[arg-type]
    )


@contextlib.contextmanager
def crossroads_turn(
    ns: dict[str, str], stack: ExitStack, n: int, size: int, gso: bool
) -> Iterator[Running]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CROSSROADS_")}
    proc = in_server(
        ns,
        [
            sys.executable, "-m", "crossroads", "serve", "--only", "stun,turn",
            "--host", LISTEN_IP, "--turn-relay-ip", RELAY_IP, "--http-port", "8080",
            "--stun-port", str(LISTEN[1]), "--stun-alt-port", "0",
            "--turn-user", f"{turn.USER}:{turn.PASSWORD}", "--turn-realm", turn.REALM,
            "--turn-allowed-peers", "198.51.100.0/24", "--relay-ports", "50000-50999",
            "--dataplane", "c", "--udp-gso" if gso else "--no-udp-gso",
            "--log-level", "warning",
        ],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
    )  # fmt: skip
    try:
        _wait_stun(ns, stack, LISTEN, proc)
        flows, back = _turn_flows(ns, stack, n, size, LISTEN)
        name = f"crossroads C plane, GSO {'on' if gso else 'off'}"
        yield Running(name, proc.pid, flows, back)
    finally:
        sat.stop(proc)


@contextlib.contextmanager
def coturn(
    ns: dict[str, str], stack: ExitStack, n: int, size: int
) -> Iterator[Running]:
    directory = tempfile.mkdtemp(prefix="bench-kp-coturn-")
    proc = in_server(
        ns,
        [
            "turnserver", "-n", "--no-stdout-log", "--log-file=stdout", "--simple-log",
            "-L", LISTEN_IP, "--relay-ip", RELAY_IP, "-p", str(LISTEN[1]),
            "--no-tls", "--no-dtls", "--no-cli", "-a", "-f", "-r", turn.REALM,
            f"--user={turn.USER}:{turn.PASSWORD}", "-m", "1",
            "--min-port=50000", "--max-port=50999",
            f"--pidfile={directory}/turnserver.pid", f"--db={directory}/turndb",
        ],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        _wait_stun(ns, stack, LISTEN, proc)
        flows, back = _turn_flows(ns, stack, n, size, LISTEN)
        yield Running("coturn -m 1", proc.pid, flows, back)
    finally:
        sat.stop(proc)
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def bare(
    ns: dict[str, str], stack: ExitStack, n: int, size: int, binary: Path
) -> Iterator[Running]:
    proc = in_server(
        ns, [str(binary), "0.0.0.0", str(LISTEN[1]), str(n)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        if not proc.stdout.readline().startswith(b"ready"):
            raise RuntimeError("bare_forwarder did not start")
        flows: list[Flow] = []
        back: list[Flow] = []
        for index in range(n):
            c = udp_in(ns["client"], CLIENT_IP, stack)
            p = udp_in(ns["peer"], PEER_IP, stack)
            host, port = p.getsockname()
            bind = b"!" + struct.pack("!HH", index, CHANNEL)
            bind += socket.inet_aton(host) + struct.pack("!H", port)
            answer = relay.exchange(c, bind, LISTEN)
            relayed = (RELAY_IP, struct.unpack_from("!H", answer, 3)[0])
            flows.append((c, LISTEN, channel_header(size), p))
            back.append((p, relayed, b"", c))
        yield Running("bare forwarder", proc.pid, flows, back)
    finally:
        sat.stop(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--allocations", type=int, default=16)
    parser.add_argument(
        "--payload", type=int, default=100, help="bytes after the header"
    )
    parser.add_argument("--warmup", type=float, default=0.3)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--start-rate", type=float, default=200_000)
    parser.add_argument("--max-steps", type=int, default=10)
    parser.add_argument("--same-rate", type=float, default=200_000)
    parser.add_argument(
        "--only",
        help="comma-separated: generator,routing,kernel,xdp,xdp-unforwarded,gso,"
        "nogso,coturn,bare (xdp-unforwarded: not in the default run)",
    )
    parser.add_argument(
        "--direction",
        choices=("up", "down", "both"),
        default="both",
        help="up: client -> peer (ChannelData header off); down: peer -> client (on)",
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="runs of every target; medians reported"
    )
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (namespaces, eBPF)")
    workdir = Path(tempfile.mkdtemp(prefix="crossroads-bench-kp-"))
    n, size = args.allocations, args.payload
    #: (target, direction) -> per round: (best step, same-rate step, rtt)
    rows: dict[tuple[str, str], list[tuple[Step | None, Step, float]]] = {}
    directions = {"up": [False], "down": [True], "both": [False, True]}[args.direction]
    stats = Path("/proc/sys/kernel/bpf_stats_enabled")
    stats_before = stats.read_text().strip()
    try:
        binaries = sat.build(workdir)
        loader = xdp_load.Loader.load(xdp_load.build(workdir))
        with relay_lab("kb") as ns, ExitStack() as lab:
            lab.callback(loader.close)
            stats.write_text("1")  # the eBPF program's run time per packet
            # Both ends' veths take frames through NAPI (the sinks' XDP
            # programs, passing until a step), polled by threads on the
            # generator's CPU.
            for namespace in (ns["client"], ns["peer"]):
                loader.attach(namespace, "eth0", "load_sink")
                lab.enter_context(
                    xdp_load.napi_thread(
                        namespace, "eth0", int(sat.LOAD_CPU), xdp_load.SINK_PRIORITY
                    )
                )
            # Static neighbours: no ARP during a step, whatever the sinks drop.
            for namespace, device, host, of in (
                (ns["server"], "top", PEER_IP, ns["peer"]),
                (ns["server"], "toc", CLIENT_IP, ns["client"]),
            ):
                mac = mac_of(of, "eth0").hex(":")
                ip(
                    "-n",
                    namespace,
                    "neigh",
                    "replace",
                    host,
                    "lladdr",
                    mac,
                    "dev",
                    device,
                    "nud",
                    "permanent",
                )
            ip(
                "-n",
                ns["client"],
                "neigh",
                "replace",
                LISTEN_IP,
                "lladdr",
                mac_of(ns["server"], "toc").hex(":"),
                "dev",
                "eth0",
                "nud",
                "permanent",
            )
            ip(
                "-n",
                ns["peer"],
                "neigh",
                "replace",
                RELAY_IP,
                "lladdr",
                mac_of(ns["server"], "top").hex(":"),
                "dev",
                "eth0",
                "nud",
                "permanent",
            )
            load = Load(loader, ns, args)
            starters: list[
                tuple[
                    str,
                    str | None,
                    Callable[[ExitStack], contextlib.AbstractContextManager[Running]],
                ]
            ] = [
                ("generator", "load_sink", lambda st: contextlib.nullcontext(generator_alone(ns, st, n, size))),
                ("routing", "load_pass", lambda st: kernel_routing(ns, st, n, size)),
                ("kernel", "load_pass", lambda st: kernel_plane(ns, st, n, size)),
                ("xdp", None, lambda st: kernel_plane(ns, st, n, size, "xdp")),
                ("xdp-unforwarded", None, lambda st: kernel_plane(ns, st, n, size, "xdp", forwards=False)),
                ("gso", "load_pass", lambda st: crossroads_turn(ns, st, n, size, gso=True)),
                ("nogso", "load_pass", lambda st: crossroads_turn(ns, st, n, size, gso=False)),
                ("coturn", "load_pass", lambda st: coturn(ns, st, n, size)),
                ("bare", "load_pass", lambda st: bare(ns, st, n, size, binaries["bare_forwarder"])),
            ]  # fmt: skip
            wanted = (
                args.only.split(",")
                if args.only
                else [key for key, _, _ in starters if key != "xdp-unforwarded"]
            )
            print(
                f"kernel plane: {n} allocations (ChannelData client -> peer), "
                f"{size}-byte payloads, steps of {args.seconds:g} s; the server's "
                "NAPI thread and process on CPU 0, the generator and the sink on CPU 1"
            )
            for round_ in range(1, args.rounds + 1):
                print(f"round {round_} of {args.rounds}", flush=True)
                for key, program, start in starters:
                    if wanted and key not in wanted:
                        continue
                    for down in directions:
                        if down and program == "load_sink":
                            continue  # the generator alone: one way is enough
                        load.down = down
                        with ExitStack() as stack:
                            target = stack.enter_context(start(stack))
                            way = "peer -> client" if down else "client -> peer"
                            runs = rows.setdefault((target.name, way), [])
                            # A later round starts below the last one's best.
                            best_before = [r[0].delivered for r in runs if r[0]]
                            load.start_rate = (
                                0.7 * best_before[-1]
                                if best_before
                                else args.start_rate
                            )
                            rtt = ping_pong(target)
                            stack.enter_context(server_napi(load, program))
                            same, best = load.measure(target)
                        runs.append((best, same, rtt))
                        text = f"{best.delivered:>9.0f}/s" if best else "      n/a"
                        print(
                            f"  {target.name:<30} {way:<15} {text}  rtt {rtt:7.1f} us",
                            flush=True,
                        )
    finally:
        stats.write_text(stats_before)
        shutil.rmtree(workdir, ignore_errors=True)
    print_table(rows, args)


def _median(values: list[float]) -> float:
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


def print_table(
    rows: dict[tuple[str, str], list[tuple[Step | None, Step, float]]],
    args: argparse.Namespace,
) -> None:
    """Medians over the rounds (each round's relayed/s in the last column)."""
    floor = _median(
        [
            rtt
            for (name, _), runs in rows.items()
            for _, _, rtt in runs
            if name.startswith("kernel routing")
        ]
    )
    same_rate = f"@{args.same_rate / 1000:.0f}k/s"
    print(
        f"\nmedians of {args.rounds} round(s)\n"
        f"{'target':<30} {'direction':<15} {'relayed/s <0.5%':>16} {'server us/pkt':>14} "
        f"{'server us/pkt ' + same_rate:>22} {'of it process':>14} "
        f"{'eBPF ns/pkt':>12} {'rtt us':>7} {'added/hop us':>13}  rounds"
    )
    for (name, way), runs in rows.items():
        bests = [b for b, _, _ in runs if b]
        sames = [s for _, s, _ in runs]
        rtt = _median([r for _, _, r in runs])
        rate = f"{_median([b.delivered for b in bests]):.0f}" if bests else "n/a"
        core = f"{_median([b.us(b.relay_cpu) for b in bests]):.2f}" if bests else "-"
        at_same = (
            f"{_median([s.us(s.relay_cpu) for s in sames]):.2f} "
            f"(loss {_median([s.loss for s in sames]):.1f}%)"
        )
        process = (
            f"{_median([s.us(s.server_cpu) for s in sames]):.2f}"
            if any(s.server_cpu for s in sames)
            else "-"
        )
        bpf = (
            f"{_median([s.bpf_ns for s in sames]):.0f}"
            if any(s.bpf_ns for s in sames)
            else "-"
        )
        base = name == "generator alone" or name.startswith("kernel routing")
        added = "-" if base or rtt != rtt else f"{(rtt - floor) / 2:+.1f}"
        each = " ".join(
            f"{b.delivered / 1000:.0f}k" if b else "n/a" for b, _, _ in runs
        )
        print(
            f"{name:<30} {way:<15} {rate:>16} {core:>14} {at_same:>22} {process:>14} "
            f"{bpf:>12} {rtt:>7.1f} {added:>13}  {each}"
        )


if __name__ == "__main__":
    main()
