"""QoS answers per second per core: crossroads' QoS server vs a bare echo.

    .venv/bin/python benchmarks/qos.py [--rounds 3] [--duration 2] [--sockets 8] [--window 16]

``crossroads serve --only qos --qos-rate 1000000000`` (the load comes from one
address, which the default per-source rate would throttle) and, as the
ceiling of a Python datagram server on this machine, a bare uvloop echo,
each pinned to CPU 0 (``taskset -c 0`` when available). The load generator
(this script, pinned to CPU 1) keeps ``window`` 25-byte Unity QoS requests
("QoS request" title) in flight on each of ``sockets`` UDP sockets and counts
answers; the server's CPU time during the measured window comes from
/proc/<pid>/stat, so "per core" is answers per CPU-second of the server.
Rounds alternate the two servers; medians are printed, with the ratio.

Loopback only; each round is bounded by ``--duration``.
"""

from __future__ import annotations

import argparse
import os
import select
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

HOST = "127.0.0.1"
TICK = os.sysconf("SC_CLK_TCK")
ROOT = Path(__file__).resolve().parent.parent

ECHO_SERVER = """
import asyncio, sys, uvloop
class Echo(asyncio.DatagramProtocol):
    def connection_made(self, transport): self.transport = transport
    def datagram_received(self, data, addr): self.transport.sendto(data[12:], addr)
async def main():
    loop = asyncio.get_running_loop()
    await loop.create_datagram_endpoint(Echo, local_addr=("127.0.0.1", int(sys.argv[1])))
    await asyncio.Event().wait()
uvloop.run(main())
"""


def request(sequence: int) -> bytes:
    title = b"QoS request"
    return (
        struct.pack("<BBB", 0x59, 0, len(title) + 1)
        + title
        + struct.pack("<BHQ", sequence % 5, 0x1234, time.time_ns() // 1_000_000)
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def pinned(cpu: int) -> list[str]:
    return ["taskset", "-c", str(cpu)] if shutil.which("taskset") else []


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def start(kind: str, port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    if kind == "crossroads":
        argv = [
            sys.executable, "-m", "crossroads", "serve", "--only", "qos",
            "--host", HOST, "--http-port", "0", "--qos-port", str(port),
            "--qos-rate", "1000000000",
        ]  # fmt: skip
    else:
        argv = [sys.executable, "-c", ECHO_SERVER, str(port)]
    process = subprocess.Popen(
        [*pinned(0), *argv],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.settimeout(0.2)
    try:
        while time.monotonic() < deadline:
            probe.sendto(request(0), (HOST, port))
            try:
                probe.recv(64)
                return process
            except TimeoutError:
                continue
    finally:
        probe.close()
    process.kill()
    raise RuntimeError(f"{kind} did not answer")


def load(port: int, duration: float, sockets: int, window: int) -> int:
    socks = []
    for _ in range(sockets):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        s.connect((HOST, port))
        s.setblocking(False)
        socks.append(s)
    data = request(1)
    answers = 0
    try:
        for s in socks:
            for _ in range(window):
                s.send(data)
        end = time.monotonic() + duration
        while time.monotonic() < end:
            ready, _, _ = select.select(socks, [], [], 0.05)
            for s in ready:
                while True:
                    try:
                        s.recv(64)
                    except BlockingIOError:
                        break
                    answers += 1
                    try:
                        s.send(data)
                    except BlockingIOError:
                        pass
            if not ready:
                for s in socks:  # refill windows lost to drops
                    for _ in range(window):
                        try:
                            s.send(data)
                        except BlockingIOError:
                            break
    finally:
        for s in socks:
            s.close()
    return answers


def measure(kind: str, args: argparse.Namespace) -> tuple[float, float]:
    port = free_port()
    process = start(kind, port)
    try:
        before = cpu_ticks(process.pid)
        started = time.monotonic()
        answers = load(port, args.duration, args.sockets, args.window)
        elapsed = time.monotonic() - started
        cpu = (cpu_ticks(process.pid) - before) / TICK
    finally:
        process.send_signal(signal.SIGINT)  # at once: SIGTERM drains
        process.wait(10)
    return answers / elapsed, answers / max(cpu, 1e-9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=2.0)
    parser.add_argument("--sockets", type=int, default=8)
    parser.add_argument("--window", type=int, default=16)
    args = parser.parse_args()
    if shutil.which("taskset"):
        os.sched_setaffinity(0, {1})
    results: dict[str, list[tuple[float, float]]] = {"crossroads": [], "echo": []}
    for i in range(args.rounds):
        order = ["crossroads", "echo"] if i % 2 == 0 else ["echo", "crossroads"]
        for kind in order:
            results[kind].append(measure(kind, args))
    print(f"{'server':<12} {'answers/s':>12} {'per CPU-second':>16}")
    medians = {}
    for kind, rows in results.items():
        rate = statistics.median(r[0] for r in rows)
        per_core = statistics.median(r[1] for r in rows)
        medians[kind] = per_core
        print(f"{kind:<12} {rate:>12,.0f} {per_core:>16,.0f}")
    print(
        f"crossroads / bare echo per core: {medians['crossroads'] / medians['echo']:.2f}"
    )


if __name__ == "__main__":
    main()
