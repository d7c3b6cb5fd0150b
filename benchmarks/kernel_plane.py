"""The kernel data plane against the C plane, coturn and the bare forwarder, on veth.

    sudo PYTHONPATH=src .venv/bin/python benchmarks/kernel_plane.py [--allocations 16]

Topology (network namespaces joined by veth, documentation addresses; the
lab of tests/transport/netns_support.py):

    client 192.0.2.2 --- 192.0.2.1 [server] 198.51.100.1 --- 198.51.100.2 peer

Load: ``benchmarks/turn_load.c`` (open loop, sendmmsg/recvmmsg), built and
driven as in benchmarks/turn_saturation.py; its sockets are made in the
client and peer namespaces and inherited. Every allocation binds a channel:
ChannelData client -> server (header off, to the peer) and peer -> relayed
address (header on, to the client), as TURN does.

Targets, each started fresh, the server pinned to CPU 0 and the generator to
CPU 1 (this machine has two):

- ``generator alone``: the generator's flows between two of its own sockets
  in the client namespace (no relay, no veth): its own ceiling;
- ``kernel routing``: the server namespace as a plain IPv4 router (client
  and peer send to each other; no relay): the topology's floor;
- ``kernel plane``: ``relay.bpf.c`` on the server's two devices, the routes
  written with :meth:`KernelPlane.install` (UNWRAP_CHANNEL and WRAP_CHANNEL
  per allocation), no server process;
- ``crossroads C plane, GSO on/off``: ``crossroads serve --only stun,turn
  --dataplane c --udp-gso/--no-udp-gso`` in the server namespace (real TURN:
  Allocate with long-term credentials, ChannelBind);
- ``coturn -m 1``: ``turnserver`` with one relay thread;
- ``bare forwarder``: ``benchmarks/bare_forwarder.c`` (epoll + recvmmsg/
  sendmmsg and a hash lookup, no TURN).

Per target: the highest delivered rate of a step under 0.5 % loss (raised
x1.5, then bisected), and one step at the same offered rate for all
(``--same-rate``). CPU: the server process's own time where there is one, and
the machine's (both cores' busy ticks in /proc/stat, softirq included), since
on veth the kernel's forwarding runs in softirq on whichever core sent the
packet, charged to no relay process; for the kernel plane also the eBPF
program's own run time per packet (``kernel.bpf_stats_enabled``, fdinfo).
The machine is shared: other work's CPU lands in the machine figure too.

Latency: 500 ping-pongs (64-byte payload) client -> relay -> peer -> relay ->
client, median round trip; added latency per relay hop is half the difference
to the same ping-pong over kernel routing.
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

from tests.transport.netns_support import inside, ip, relay_lab  # noqa: E402

import relay  # noqa: E402
import turn  # noqa: E402
import turn_saturation as sat  # noqa: E402
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
    server_cpu: float  # CPU-s/s of the server process (0: none)
    machine_cpu: float  # CPU-s/s of both cores (busy ticks)
    short: int
    sent: int
    #: ns the eBPF program ran per packet it saw (kernel plane only, else 0).
    bpf_ns: float = 0.0

    @property
    def passed(self) -> bool:
        refused = 100 * self.short / max(1, self.sent + self.short)
        return self.loss < sat.LOSS_LIMIT and refused < sat.LOSS_LIMIT

    def us(self, cpu: float) -> float:
        return cpu / self.delivered * 1e6 if self.delivered else 0.0


@dataclass
class Running:
    name: str
    pid: int | None
    flows: list[Flow]
    #: (send socket, destination, header, receive socket, echo destination)
    #: for the ping-pong: the client's flow and the peer's way back.
    ping: tuple[Flow, Flow]
    #: The eBPF program's descriptor (kernel plane): its run time is read.
    bpf_fd: int | None = None


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


def machine_ticks() -> int:
    busy = 0
    for cpu in (0, 1):
        busy += sat.core_ticks(cpu)[0]
    return busy


def run_step(
    load: Path, target: Running, rate: float, args: argparse.Namespace, epoch: int
) -> Step:
    flows = target.flows
    table = "".join(
        f"{send.fileno()} {dest[0]} {dest[1]} {header.hex() or '-'} {recv.fileno()}\n"
        for send, dest, header, recv in flows
    )
    fds = sorted({s.fileno() for f in flows for s in (f[0], f[3])})
    command = [
        *sat.pin(sat.LOAD_CPU), str(load), f"{rate:.0f}", str(args.warmup),
        str(args.seconds), str(args.drain), str(args.payload), str(epoch),
    ]  # fmt: skip
    gen = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=fds, text=True
    )
    assert gen.stdin is not None and gen.stdout is not None
    gen.stdin.write(table)
    gen.stdin.close()
    time.sleep(args.warmup)
    s0 = turn.tree_ticks(target.pid) if target.pid else 0
    b0 = bpf_run(target.bpf_fd)
    m0, w0 = machine_ticks(), time.monotonic()
    time.sleep(args.seconds)
    s1 = turn.tree_ticks(target.pid) if target.pid else 0
    m1, wall = machine_ticks(), time.monotonic() - w0
    b1 = bpf_run(target.bpf_fd)
    out = gen.stdout.read()
    gen.wait(args.drain + 30)
    fields = dict(part.split("=") for part in out.split())
    return Step(
        offered=float(fields["offered"]),
        delivered=float(fields["delivered"]),
        loss=float(fields["loss"]),
        server_cpu=(s1 - s0) / turn.TICK / wall,
        machine_cpu=(m1 - m0) / turn.TICK / wall,
        short=int(fields["short"]),
        sent=int(fields["sent"]),
        bpf_ns=(b1[0] - b0[0]) / max(1, b1[1] - b0[1]),
    )


def search(
    load: Path, target: Running, args: argparse.Namespace, epochs: Iterator[int]
) -> Step | None:
    """x1.5 until a step loses (one retry), then bisect to 8 %."""

    def measure(rate: float) -> Step:
        step = run_step(load, target, rate, args, next(epochs))
        if args.verbose:
            print(
                f"    {target.name:<30} offered {step.offered:>9.0f}/s delivered "
                f"{step.delivered:>9.0f}/s loss {step.loss:6.2f}% server "
                f"{step.server_cpu * 100:5.1f}% machine {step.machine_cpu * 100:5.1f}%",
                flush=True,
            )
        return step

    return sat.search_rate(measure, args.start_rate, args.max_steps, 2)


def ping_pong(target: Running, rounds: int = 500) -> float:
    """Median round trip (us) client -> relay -> peer -> relay -> client."""
    (client, dest, header, peer), (_, back, _, _) = target.ping
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
    flows: list[Flow] = []
    for _ in range(n):
        a = udp_in(ns["client"], CLIENT_IP, stack)
        b = udp_in(ns["client"], CLIENT_IP, stack)
        flows.append((a, b.getsockname(), b"", b))
        flows.append((b, a.getsockname(), b"", a))
    return Running("generator alone", None, flows, (flows[0], flows[1]))


@contextlib.contextmanager
def kernel_routing(
    ns: dict[str, str], stack: ExitStack, n: int, size: int
) -> Iterator[Running]:
    ip("-n", ns["client"], "route", "add", "198.51.100.0/24", "via", LISTEN_IP)
    ip("-n", ns["peer"], "route", "add", "192.0.2.0/24", "via", RELAY_IP)
    subprocess.run(
        ["ip", "netns", "exec", ns["server"], "sysctl", "-qw", "net.ipv4.ip_forward=1"],
        check=True,
    )
    try:
        flows: list[Flow] = []
        for _ in range(n):
            c = udp_in(ns["client"], CLIENT_IP, stack)
            p = udp_in(ns["peer"], PEER_IP, stack)
            flows.append((c, p.getsockname(), b"", p))
            flows.append((p, c.getsockname(), b"", c))
        yield Running("kernel routing (no relay)", None, flows, (flows[0], flows[1]))
    finally:
        subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                ns["server"],
                "sysctl",
                "-qw",
                "net.ipv4.ip_forward=0",
            ],
            check=False,
        )
        subprocess.run(
            ["ip", "-n", ns["client"], "route", "del", "198.51.100.0/24"], check=False
        )
        subprocess.run(
            ["ip", "-n", ns["peer"], "route", "del", "192.0.2.0/24"], check=False
        )


@contextlib.contextmanager
def kernel_plane(
    ns: dict[str, str], stack: ExitStack, n: int, size: int
) -> Iterator[Running]:
    stats = Path("/proc/sys/kernel/bpf_stats_enabled")
    before = stats.read_text().strip()
    stats.write_text("1")  # the program's run time per packet (fdinfo)
    with inside(ns["server"]):
        plane = KernelPlane.load()
        try:
            plane.attach("toc")
            plane.attach("top")
            flows: list[Flow] = []
            for i in range(n):
                c = udp_in(ns["client"], CLIENT_IP, stack)
                p = udp_in(ns["peer"], PEER_IP, stack)
                relayed = (RELAY_IP, 50000 + i)
                for route in (
                    KernelRoute(
                        RouteKind.UNWRAP_CHANNEL,
                        c.getsockname(),
                        LISTEN,
                        relayed,
                        p.getsockname(),
                        CHANNEL,
                    ),
                    KernelRoute(
                        RouteKind.WRAP_CHANNEL,
                        p.getsockname(),
                        relayed,
                        LISTEN,
                        c.getsockname(),
                        CHANNEL,
                    ),
                ):
                    if not plane.install(route):
                        raise RuntimeError("kernel plane refused a route")
                flows.append((c, LISTEN, channel_header(size), p))
                flows.append((p, relayed, b"", c))
            yield Running(
                "kernel plane (eBPF, tc)",
                None,
                flows,
                (flows[0], flows[1]),
                plane.program_fd,
            )
        finally:
            plane.close()
            stats.write_text(before)


def _turn_flows(
    ns: dict[str, str], stack: ExitStack, n: int, size: int, server: tuple[str, int]
) -> list[Flow]:
    flows: list[Flow] = []
    for _ in range(n):
        c = udp_in(ns["client"], CLIENT_IP, stack)
        p = udp_in(ns["peer"], PEER_IP, stack)
        session = relay.TurnClient(c, server, turn.USER, turn.PASSWORD)
        relayed = session.allocate()
        session.channel_bind(CHANNEL, p.getsockname())
        flows.append((c, server, channel_header(size), p))
        flows.append((p, relayed, b"", c))
    return flows


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
        flows = _turn_flows(ns, stack, n, size, LISTEN)
        name = f"crossroads C plane, GSO {'on' if gso else 'off'}"
        yield Running(name, proc.pid, flows, (flows[0], flows[1]))
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
        flows = _turn_flows(ns, stack, n, size, LISTEN)
        yield Running("coturn -m 1", proc.pid, flows, (flows[0], flows[1]))
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
        for index in range(n):
            c = udp_in(ns["client"], CLIENT_IP, stack)
            p = udp_in(ns["peer"], PEER_IP, stack)
            host, port = p.getsockname()
            bind = b"!" + struct.pack("!HH", index, CHANNEL)
            bind += socket.inet_aton(host) + struct.pack("!H", port)
            answer = relay.exchange(c, bind, LISTEN)
            relayed = (RELAY_IP, struct.unpack_from("!H", answer, 3)[0])
            flows.append((c, LISTEN, channel_header(size), p))
            flows.append((p, relayed, b"", c))
        yield Running("bare forwarder", proc.pid, flows, (flows[0], flows[1]))
    finally:
        sat.stop(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--allocations", type=int, default=16)
    parser.add_argument("--payload", type=int, default=100, help="bytes, x4, >= 12")
    parser.add_argument("--warmup", type=float, default=0.3)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--drain", type=float, default=0.3)
    parser.add_argument("--start-rate", type=float, default=100_000)
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--same-rate", type=float, default=100_000)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (namespaces, eBPF)")
    workdir = Path(tempfile.mkdtemp(prefix="crossroads-bench-kp-"))
    epochs = iter(range(1, 1 << 30))
    n, size = args.allocations, args.payload
    rows: list[tuple[str, Step | None, Step, float]] = []
    try:
        binaries = sat.build(workdir)
        with relay_lab("kb") as ns:
            starters: list[
                Callable[[ExitStack], contextlib.AbstractContextManager[Running]]
            ] = [
                lambda st: contextlib.nullcontext(generator_alone(ns, st, n, size)),
                lambda st: kernel_routing(ns, st, n, size),
                lambda st: kernel_plane(ns, st, n, size),
                lambda st: crossroads_turn(ns, st, n, size, gso=True),
                lambda st: crossroads_turn(ns, st, n, size, gso=False),
                lambda st: coturn(ns, st, n, size),
                lambda st: bare(ns, st, n, size, binaries["bare_forwarder"]),
            ]
            print(
                f"kernel plane: {n} allocations (ChannelData both ways), {size}-byte "
                f"payloads, steps of {args.seconds:g} s; servers on CPU 0, generator on CPU 1"
            )
            for start in starters:
                with ExitStack() as stack:
                    target = stack.enter_context(start(stack))
                    rtt = ping_pong(target)
                    same = run_step(
                        binaries["turn_load"],
                        target,
                        args.same_rate,
                        args,
                        next(epochs),
                    )
                    best = search(binaries["turn_load"], target, args, epochs)
                rows.append((target.name, best, same, rtt))
                text = f"{best.delivered:>9.0f}/s" if best else "      n/a"
                print(f"  {target.name:<30} {text}  rtt {rtt:7.1f} us", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    floor = next((r[3] for r in rows if r[0].startswith("kernel routing")), 0.0)
    same_rate = f"@{args.same_rate / 1000:.0f}k/s"
    print(
        f"\n{'target':<30} {'relayed/s <0.5%':>16} {'server us/pkt':>14} "
        f"{'server us/pkt ' + same_rate:>22} {'eBPF ns/pkt':>12} "
        f"{'machine us/pkt ' + same_rate:>23} {'rtt us':>7} {'added/hop us':>13}"
    )
    for name, best, same, rtt in rows:
        rate = f"{best.delivered:.0f}" if best else "n/a"
        server = f"{best.us(best.server_cpu):.2f}" if best and best.server_cpu else "-"
        at_same = f"{same.us(same.server_cpu):.2f}" if same.server_cpu else "-"
        at_same += f" (loss {same.loss:.1f}%)"
        bpf = f"{same.bpf_ns:.0f}" if same.bpf_ns else "-"
        machine = f"{same.us(same.machine_cpu):.2f}"
        base = name == "generator alone" or name.startswith("kernel routing")
        added = "-" if base else f"{(rtt - floor) / 2:+.1f}"
        print(
            f"{name:<30} {rate:>16} {server:>14} {at_same:>22} {bpf:>12} "
            f"{machine:>23} {rtt:>7.1f} {added:>13}"
        )


if __name__ == "__main__":
    main()
