"""natneg benchmark: negotiations per second, sessions held, relay forwarding rate.

Runs ``crossroads serve --only natneg`` as a separate process on loopback (so the
load generator does not share its event loop) and measures, each as the median of
several short rounds:

1. **negotiations/s**: pairs of clients (v3, negotiate socket only, as the SDK sends
   them: NN1/NN2/NN3 INITs, an ERT_ACK for the ERT_TEST that times the CONNECTs, a
   CONNECT_ACK for every CONNECT) with a fixed window of
   negotiations in flight; a negotiation counts when both clients got their CONNECT.
   Also the same protocol work on the sans-I/O core alone (no sockets), to show how
   much of the cost is the UDP path.
2. **sessions held**: half-open sessions (one client, waiting for a partner) opened
   until ``--sessions``; the server's RSS and the time a fresh negotiation still takes
   while they are held.
3. **relay forwarding**: datagrams/s through one relay pair (client -> relay side 0
   -> relay side 1 -> client), next to a naive asyncio-protocol forwarder doing the
   same job in a process of its own, as a baseline for the data-plane design.

There is no other natneg server installed on this machine to run side by side
(the public emulators -- OpenSpy, UniSpy, DWC, Kirov -- need their own stacks:
RabbitMQ/Redis/Postgres, Python 2), so the natneg figures stand alone; the relay
figure is compared with the naive forwarder.

    .venv/bin/python benchmarks/natneg.py [--seconds 4] [--rounds 3] [--sessions 50000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

from crossroads.proto.natneg.packets import (
    ConnectAck,
    ConnectPing,
    Init,
    PacketType,
    bytes_to_ip,
)
from crossroads.proto.natneg.server import NatNegServer, ServerConfig

# The figures in docs/benchmarks.md are the C plane's; run as root, `auto`
# would forward these loopback relays in the kernel (benchmarks/kernel_plane.py
# measures that plane). An older tree (--before) ignores the variable.
os.environ.setdefault("CROSSROADS_DATAPLANE", "c")

HOST_A = "127.0.0.1"
HOST_B = "127.0.0.5"  # a second "public" address, so the public-address path is used


def free_port(kind: int = socket.SOCK_DGRAM) -> int:
    with socket.socket(socket.AF_INET, kind) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def server(
    *extra: str,
) -> Iterator[tuple[tuple[str, int], int, subprocess.Popen[bytes]]]:
    """``crossroads serve --only natneg`` on loopback; yields (natneg addr, http port)."""
    port = free_port()
    http = free_port(socket.SOCK_STREAM)
    argv = [
        sys.executable,
        "-m",
        "crossroads",
        "serve",
        "--only",
        "natneg",
        "--host",
        "127.0.0.1",
        "--http-port",
        str(http),
        "--log-level",
        "warning",
        "--natneg-port",
        str(port),
        "--natneg-probe-port",
        "0",
        "--natneg-rate-limit",
        "0",
        # All load comes from one IP (see --natneg-rate-limit 0 above).
        "--no-reflection-budget",
        "--natneg-max-sessions",
        "1000000",
        "--natneg-max-sessions-per-ip",
        "1000000",
        "--natneg-linger",
        "1",
        *extra,
    ]
    process = subprocess.Popen(argv)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{http}/healthz", timeout=1
                ):
                    break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError("crossroads serve did not start") from None
                time.sleep(0.1)
        yield ("127.0.0.1", port), http, process
    finally:
        process.send_signal(signal.SIGINT)  # at once: SIGTERM drains
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def metric(http: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=5) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def udp(ip: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    sock.bind((ip, 0))
    return sock


def inits(cookie: int, index: int) -> list[bytes]:
    return [
        Init(
            3, cookie, pt, index, 0, "10.0.0.1", 4000 if pt >= 2 else 0, "bench"
        ).encode()
        for pt in (1, 2, 3)
    ]


def ert_ack(ert: bytes) -> bytes:
    """The SDK's answer to an ERT_TEST: its first 21 bytes with type ERT_ACK."""
    return ert[:7] + bytes((PacketType.ERT_ACK,)) + ert[8:21]


class Negotiations:
    """Windowed load: ``window`` negotiations in flight, a new one per completion."""

    def __init__(self, target: tuple[str, int], window: int, sockets: int = 32) -> None:
        self.target = target
        self.window = window
        self.socks = [(udp(HOST_A), 0) for _ in range(sockets)] + [
            (udp(HOST_B), 1) for _ in range(sockets)
        ]
        self.pairs = sockets
        self.next_cookie = 1
        self.started: dict[int, float] = {}
        self.got: dict[int, int] = {}
        self.completed = 0
        self.latencies: list[float] = []
        self.running = False

    def start_one(self) -> None:
        cookie = self.next_cookie
        self.next_cookie += 1
        slot = cookie % self.pairs
        self.started[cookie] = time.monotonic()
        self.got[cookie] = 0
        for index, (sock, _) in enumerate(
            (self.socks[slot], self.socks[self.pairs + slot])
        ):
            for packet in inits(cookie, index):
                sock.sendto(packet, self.target)

    def on_readable(self, sock: socket.socket, index: int) -> None:
        while True:
            try:
                data, addr = sock.recvfrom(512)
            except BlockingIOError:
                return
            if len(data) >= 21 and data[7] == PacketType.ERT_TEST:
                sock.sendto(ert_ack(data), addr)  # as the SDK does, at once
                continue
            if len(data) < 20 or data[7] != PacketType.CONNECT:
                continue
            cookie = int.from_bytes(data[8:12], "big")
            sock.sendto(ConnectAck(3, cookie, 0, index).encode(), addr)
            bit = 1 << index
            seen = self.got.get(cookie)
            if seen is None or seen & bit:
                continue
            seen |= bit
            self.got[cookie] = seen
            if seen == 3:
                self.completed += 1
                self.latencies.append(time.monotonic() - self.started.pop(cookie))
                del self.got[cookie]
                if self.running:
                    self.start_one()

    async def run(self, seconds: float) -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        for sock, index in self.socks:
            loop.add_reader(sock.fileno(), self.on_readable, sock, index)
        self.running = True
        for _ in range(self.window):
            self.start_one()
        await asyncio.sleep(0.5)  # warm-up
        self.completed, self.latencies = 0, []
        begin = time.monotonic()
        await asyncio.sleep(seconds)
        elapsed = time.monotonic() - begin
        done = self.completed
        self.running = False
        p50 = statistics.median(self.latencies) if self.latencies else float("nan")
        await asyncio.sleep(0.2)
        for sock, _ in self.socks:
            loop.remove_reader(sock.fileno())
            sock.close()
        return done / elapsed, p50


def core_only(seconds: float) -> float:
    """The same negotiations through the sans-I/O core: no sockets at all."""
    core = NatNegServer(
        ServerConfig(rate_limit=0, max_sessions_per_ip=10**9, linger=0.001)
    )
    a, b = (HOST_A, 40000), (HOST_B, 40001)
    cookie, now = 0, 0.0
    end = time.monotonic() + seconds
    begin = time.monotonic()
    while time.monotonic() < end:
        for _ in range(200):
            cookie += 1
            now += 0.001
            for index, addr in ((0, a), (1, b)):
                for packet in inits(cookie, index):
                    core.receive_datagram(packet, addr, now)
            for wire, to, endpoint in core.datagrams_to_send(now):
                if wire[7] == PacketType.ERT_TEST:
                    core.receive_datagram(ert_ack(wire), to, now, endpoint)
            for index, addr in ((0, a), (1, b)):
                for _ in range(3):
                    core.receive_datagram(
                        ConnectAck(3, cookie, 0, index).encode(), addr, now
                    )
            core.datagrams_to_send(now)
            core.pop_events()
            if (deadline := core.get_timer()) is not None and deadline <= now:
                core.handle_timer(now)
    return cookie / (time.monotonic() - begin)


async def hold_sessions(target: tuple[str, int], count: int, budget: float) -> int:
    """Open ``count`` half-open sessions (client 0 only), paced by INIT_ACKs."""
    loop = asyncio.get_running_loop()
    socks = [udp(HOST_A) for _ in range(64)]
    acked = 0
    sent = 0

    def readable(sock: socket.socket) -> None:
        nonlocal acked
        while True:
            try:
                data, _ = sock.recvfrom(512)
            except BlockingIOError:
                return
            if len(data) >= 21 and data[7] == PacketType.INIT_ACK and data[12] == 3:
                acked += 1

    for sock in socks:
        loop.add_reader(sock.fileno(), readable, sock)
    end = time.monotonic() + budget
    try:
        while acked < count and time.monotonic() < end:
            while sent < count and sent - acked < 1000:
                sent += 1
                for packet in inits(10_000_000 + sent, 0):
                    socks[sent % len(socks)].sendto(packet, target)
            await asyncio.sleep(0.002)
    finally:
        for sock in socks:
            loop.remove_reader(sock.fileno())
            sock.close()
    return acked


# ------------------------------------------------------------------ relay

NAIVE_FORWARDER = r"""
import asyncio, sys
class Side(asyncio.DatagramProtocol):
    def __init__(self): self.peer = None; self.src = None; self.transport = None
    def connection_made(self, t): self.transport = t
    def datagram_received(self, data, addr):
        if self.src is None: self.src = addr
        if addr == self.src and self.peer.src is not None:
            self.peer.transport.sendto(data, self.peer.src)
async def main():
    loop = asyncio.get_running_loop()
    a, b = Side(), Side()
    a.peer, b.peer = b, a
    ta, _ = await loop.create_datagram_endpoint(lambda: a, local_addr=("127.0.0.1", 0))
    tb, _ = await loop.create_datagram_endpoint(lambda: b, local_addr=("127.0.0.1", 0))
    print(ta.get_extra_info("sockname")[1], tb.get_extra_info("sockname")[1], flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


async def blast(
    side0: tuple[str, int], side1: tuple[str, int], cookie: int, seconds: float
) -> float:
    """Datagrams/s delivered A -> side0 -> side1 -> B, 64 in flight at most."""
    a, b = udp(HOST_A), udp(HOST_B)
    loop = asyncio.get_running_loop()
    try:
        # The first datagram from each side is a CONNECT_PING with the cookie: what
        # the SDK sends first, and what the relay learns the client's port from.
        for _ in range(3):
            a.sendto(ConnectPing(3, cookie, *side0, 0, 0).encode(), side0)
            b.sendto(ConnectPing(3, cookie, *side1, 0, 0).encode(), side1)
            await asyncio.sleep(0.05)
        while True:
            try:
                a.recvfrom(512)
            except BlockingIOError:
                break
        received = 0
        arrived = asyncio.Event()

        def readable() -> None:
            nonlocal received
            while True:
                try:
                    b.recvfrom(2048)
                except BlockingIOError:
                    break
                received += 1
            arrived.set()

        loop.add_reader(b.fileno(), readable)
        payload = b"x" * 200
        sent = 0
        begin = time.monotonic()
        end = begin + seconds
        while time.monotonic() < end:
            while sent - received < 64:
                a.sendto(payload, side0)
                sent += 1
            arrived.clear()
            try:
                await asyncio.wait_for(arrived.wait(), 0.05)
            except TimeoutError:
                sent = received  # lost in flight: refill the window
        elapsed = time.monotonic() - begin
        loop.remove_reader(b.fileno())
        return received / elapsed
    finally:
        a.close()
        b.close()


async def relay_pair(
    target: tuple[str, int], cookie: int
) -> tuple[tuple[str, int], tuple[str, int]]:
    """Negotiate one pair through a relay_mode=always server; the relay sides."""
    a, b = udp(HOST_A), udp(HOST_B)
    try:
        for index, sock in ((0, a), (1, b)):
            for packet in inits(cookie, index):
                sock.sendto(packet, target)
        targets: dict[int, tuple[str, int]] = {}
        end = time.monotonic() + 5
        while len(targets) < 2 and time.monotonic() < end:
            for index, sock in ((0, a), (1, b)):
                try:
                    data, addr = sock.recvfrom(512)
                except BlockingIOError:
                    continue
                if data[7] == PacketType.CONNECT:
                    targets[index] = (
                        bytes_to_ip(data, 12),
                        int.from_bytes(data[16:18], "big"),
                    )
                    sock.sendto(ConnectAck(3, cookie, 0, index).encode(), addr)
            await asyncio.sleep(0.005)
        return targets[0], targets[1]
    finally:
        a.close()
        b.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--sessions", type=int, default=50_000)
    args = parser.parse_args()
    print(
        f"natneg benchmark on {os.cpu_count()} cores; median of {args.rounds} rounds of {args.seconds:.0f} s"
    )

    rates, p50s = [], []
    with server("--natneg-session-timeout", "10") as (target, http, _):
        for _ in range(args.rounds):
            rate, p50 = await Negotiations(target, args.window).run(args.seconds)
            rates.append(rate)
            p50s.append(p50)
        _, idle_p50 = await Negotiations(target, 16, sockets=8).run(2.0)
        sent = metric(http, "crossroads_natneg_packets_sent_total")
    core_rates = [core_only(args.seconds / 2) for _ in range(args.rounds)]
    print(
        f"negotiations/s over UDP     : {statistics.median(rates):9.0f}   "
        f"(window {args.window}, p50 INIT->both CONNECTs {1000 * statistics.median(p50s):.1f} ms; "
        f"{sent:.0f} packets sent by the server)"
    )
    print(
        f"negotiations/s core only    : {statistics.median(core_rates):9.0f}   (sans-I/O, no sockets)"
    )

    with server("--natneg-session-timeout", "600") as (target, http, process):
        before = rss_mib(process.pid)
        begin = time.monotonic()
        held = await hold_sessions(target, args.sessions, budget=60)
        opened_in = time.monotonic() - begin
        sessions = metric(http, "crossroads_natneg_sessions")
        after = rss_mib(process.pid)
        rate, p50 = await Negotiations(target, 16, sockets=8).run(2.0)
        print(
            f"sessions held               : {sessions:9.0f}   ({held} opened in {opened_in:.1f} s; "
            f"RSS {before:.0f} -> {after:.0f} MiB, {1024 * (after - before) / max(1, sessions):.2f} KiB/session)"
        )
        print(
            f"  p50 negotiation, window 16: {1000 * p50:7.1f} ms with them held, "
            f"{1000 * idle_p50:.1f} ms on an empty server"
        )

    relay_rates = []
    with server(
        "--natneg-relay-mode",
        "always",
        "--natneg-relay-allow",
        "127.0.0.0/8",
        "--natneg-relay-host",
        "127.0.0.1",
    ) as (target, http, _):
        for round_ in range(args.rounds):
            side0, side1 = await relay_pair(target, 0xBEEF00 + round_)
            relay_rates.append(
                await blast(side0, side1, 0xBEEF00 + round_, args.seconds)
            )
    naive_rates = []
    for _ in range(args.rounds):
        # A fresh forwarder per round: it learns its two sources once, like ours.
        naive = subprocess.Popen(
            [sys.executable, "-c", NAIVE_FORWARDER], stdout=subprocess.PIPE, text=True
        )
        try:
            assert naive.stdout is not None
            port0, port1 = (int(p) for p in naive.stdout.readline().split())
            naive_rates.append(
                await blast(("127.0.0.1", port0), ("127.0.0.1", port1), 0, args.seconds)
            )
        finally:
            naive.terminate()
            naive.wait()
    relay, baseline = statistics.median(relay_rates), statistics.median(naive_rates)
    print(
        f"relay datagrams/s           : {relay:9.0f}   (200-byte datagrams, 64 in flight)"
    )
    ratio = relay / baseline if baseline else float("nan")
    print(
        f"naive asyncio forwarder     : {baseline:9.0f}   "
        f"ratio crossroads/naive = {ratio:.2f}"
    )


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
