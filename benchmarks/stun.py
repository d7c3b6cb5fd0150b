"""STUN Binding requests per second: crossroads vs coturn, same load, same core.

    .venv/bin/python benchmarks/stun.py [--rounds 5] [--duration 3] [--sockets 16] [--window 16]

Both servers run at the same time for the whole benchmark, each pinned to CPU 0
(``taskset -c 0``): ``crossroads serve --only stun`` (one process, uvloop) and
coturn's ``turnserver`` with one relay thread (``-m 1``). The load generator,
``benchmarks/stun_load.c`` (compiled here with ``cc -O2``), is pinned to CPU 1
and keeps ``window`` Binding requests in flight on each of ``sockets`` UDP
sockets; it counts valid Binding success responses. Rounds alternate between
the two servers (the order flips each round) and the medians are reported,
with the CPU time each server used during its measured window (from
/proc/<pid>/stat), so "per core" means responses per CPU-second of the server.

crossroads runs with ``--stun-rate-limit 0`` and ``--no-reflection-budget``:
all load comes from one IP, which the default per-source limit (100/s) and the
reflection budget (answers at most 4 KiB beyond the requests per 10 s) would
cut. A third line measures a bare
uvloop echo server (no STUN work at all) as the ceiling for a Python
DatagramProtocol on this machine. ``--variants`` adds crossroads with the rate
limiter counting (limit 10^9/s) and crossroads without recvmmsg batching.

Loopback only. Needs: coturn (turnserver), cc, taskset.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from turn import TICK, tree_ticks

HERE = Path(__file__).resolve().parent
HOST = "127.0.0.1"

ECHO_SERVER = """
import asyncio, sys, uvloop
class Echo(asyncio.DatagramProtocol):
    def connection_made(self, transport): self.transport = transport
    def datagram_received(self, data, addr): self.transport.sendto(data, addr)
async def main():
    loop = asyncio.get_running_loop()
    await loop.create_datagram_endpoint(Echo, local_addr=("127.0.0.1", int(sys.argv[1])))
    await asyncio.Event().wait()
uvloop.run(main())
"""


@dataclass
class Server:
    name: str
    process: subprocess.Popen[bytes]
    port: int
    #: The echo server answers with the request itself (type 0x0001).
    echo: bool = False


def free_port() -> int:
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.bind((HOST, 0))
            port = int(udp.getsockname()[1])
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
            try:
                tcp.bind((HOST, port))
            except OSError:
                continue
        if port < 65535:
            return port
    raise RuntimeError("no free port")


def pinned(cpu: int | str, command: list[str]) -> list[str]:
    return ["taskset", "-c", str(cpu), *command] if shutil.which("taskset") else command


def cpu_seconds(pid: int) -> float:
    """CPU time of ``pid`` and of its children (the workers of
    ``crossroads serve --workers N``)."""
    return tree_ticks(pid) / TICK


def wait_ready(port: int, echo: bool = False) -> None:
    request = bytes.fromhex("000100002112a442") + os.urandom(12)
    deadline = time.monotonic() + 20
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.settimeout(0.2)
        while time.monotonic() < deadline:
            probe.sendto(request, (HOST, port))
            try:
                probe.recvfrom(2048)
                return
            except TimeoutError:
                continue
    raise RuntimeError(f"server on port {port} did not answer")


def binding_response_size(port: int) -> int:
    request = bytes.fromhex("000100002112a442") + os.urandom(12)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.settimeout(2)
        probe.sendto(request, (HOST, port))
        return len(probe.recvfrom(2048)[0])


def start_crossroads(
    workdir: Path,
    name: str = "crossroads",
    rate_limit: int = 0,
    batch_io: bool = True,
    workers: int | None = None,
) -> Server:
    """``workers``: pass ``--workers N`` (N > 1 runs on CPUs 0 and 1)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CROSSROADS_")}
    command = [
        sys.executable, "-m", "crossroads", "serve", "--only", "stun",
        "--host", HOST, "--http-port", "0", "--stun-port", str(port),
        "--stun-alt-port", "0", "--stun-rate-limit", str(rate_limit),
        "--log-level", "warning", "--no-reflection-budget",
        "--stun-batch-io" if batch_io else "--no-stun-batch-io",
    ]  # fmt: skip
    if workers is not None:
        command += ["--workers", str(workers)]
    cpus = "0,1" if workers is not None and workers > 1 else 0
    log = (workdir / f"{name.replace(' ', '_')}.log").open("wb")
    process = subprocess.Popen(pinned(cpus, command), stdout=log, stderr=log, env=env)
    server = Server(name, process, port)
    wait_ready(port)
    return server


def start_coturn(workdir: Path, threads: int = 1, name: str = "coturn") -> Server:
    """``turnserver -m threads`` (more than 1: on CPUs 0 and 1)."""
    binary = shutil.which("turnserver")
    if binary is None:
        raise SystemExit("coturn's turnserver is not installed (make install)")
    port = free_port()
    command = [
        binary, "-n", "--log-file", str(workdir / "turnserver.log"), "--simple-log",
        "-L", HOST, "-p", str(port), "--alt-listening-port", "0",
        "--no-tls", "--no-dtls", "--no-cli", "-m", str(threads), "-r", "bench.local",
        "--pidfile", str(workdir / f"turnserver-{port}.pid"),
        "--db", str(workdir / f"turndb-{port}"),
    ]  # fmt: skip
    process = subprocess.Popen(
        pinned("0,1" if threads > 1 else 0, command),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    server = Server(name, process, port)
    wait_ready(port)
    return server


def start_echo(workdir: Path) -> Server:
    port = free_port()
    script = workdir / "echo.py"
    script.write_text(ECHO_SERVER)
    process = subprocess.Popen(pinned(0, [sys.executable, str(script), str(port)]))
    server = Server("uvloop echo (no STUN work)", process, port, echo=True)
    wait_ready(port, echo=True)
    return server


def build_load(workdir: Path) -> Path:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("a C compiler (cc) is needed for the load generator")
    binary = workdir / "stun_load"
    subprocess.run(
        [compiler, "-O2", "-o", str(binary), str(HERE / "stun_load.c")], check=True
    )
    return binary


def run_round(
    load: Path, server: Server, args: argparse.Namespace
) -> tuple[float, float]:
    """(responses per second, server CPU seconds per wall second)."""
    command = pinned(
        1,
        [
            str(load), HOST, str(server.port), str(args.duration), str(args.warmup),
            str(args.sockets), str(args.window),
        ],
    )  # fmt: skip
    if server.echo:
        command.append("echo")
    generator = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    time.sleep(args.warmup)
    cpu_before = cpu_seconds(server.process.pid)
    wall_before = time.monotonic()
    time.sleep(args.duration)
    cpu_after = cpu_seconds(server.process.pid)
    wall = time.monotonic() - wall_before
    out, _ = generator.communicate(timeout=args.duration + args.warmup + 30)
    fields = dict(part.split("=") for part in out.split())
    return float(fields["rate"]), (cpu_after - cpu_before) / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--sockets", type=int, default=16)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--no-echo", action="store_true", help="skip the echo baseline")
    parser.add_argument(
        "--variants",
        action="store_true",
        help="also measure crossroads with its rate limiter on (limit 10^9/s, so "
        "it counts but never refuses) and without recvmmsg batching",
    )
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="crossroads-bench-stun-"))
    servers: list[Server] = []
    try:
        load = build_load(workdir)
        servers.append(start_crossroads(workdir))
        servers.append(start_coturn(workdir))
        if args.variants:
            servers.append(
                start_crossroads(workdir, "crossroads, limiter on", 1_000_000_000)
            )
            servers.append(
                start_crossroads(workdir, "crossroads, no batching", 0, batch_io=False)
            )
        if not args.no_echo:
            servers.append(start_echo(workdir))
        results: dict[str, list[tuple[float, float]]] = {s.name: [] for s in servers}
        for round_no in range(args.rounds):
            order = servers if round_no % 2 == 0 else list(reversed(servers))
            for server in order:
                rate, cpu = run_round(load, server, args)
                results[server.name].append((rate, cpu))
                print(
                    f"round {round_no + 1}: {server.name:28s} {rate:10.0f} req/s"
                    f"  server CPU {cpu * 100:5.1f}%",
                    flush=True,
                )
        sizes = {s.name: binding_response_size(s.port) for s in servers[:2]}
        print()
        print(
            f"load: {args.sockets} sockets x {args.window} in flight, "
            f"{args.rounds} rounds of {args.duration:g} s, servers on CPU 0, "
            f"load generator on CPU 1"
        )
        medians: dict[str, tuple[float, float]] = {}
        for name, rows in results.items():
            rate = statistics.median(r for r, _ in rows)
            per_cpu = statistics.median(r / c for r, c in rows if c > 0)
            medians[name] = (rate, per_cpu)
            size = f", {sizes[name]}-byte response" if name in sizes else ""
            print(
                f"{name:28s} median {rate:10.0f} req/s   "
                f"{per_cpu:10.0f} req per CPU-second{size}"
            )
        cr, co = medians["crossroads"], medians["coturn"]
        print(
            f"ratio crossroads/coturn: {cr[0] / co[0]:.2f} (req/s), "
            f"{cr[1] / co[1]:.2f} (per CPU-second)"
        )
    finally:
        for server in servers:
            if server.process.poll() is None:
                server.process.send_signal(signal.SIGINT)  # SIGTERM drains
                try:
                    server.process.wait(10)
                except subprocess.TimeoutExpired:
                    server.process.kill()
                    server.process.wait()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
