"""TURN relay throughput: crossroads against coturn, same load, same run.

Load: coturn's own tools. ``turnutils_peer`` is a UDP echo peer;
``turnutils_uclient -c -X -z 1 -m M`` runs M client sessions, each sending one
120-byte message per millisecond through a TURN channel to the peer and back, so
the offered load is M x 1000 round trips/s = M x 2000 relayed datagrams/s (one
client->peer, one peer->client per round trip).

For each server the offered load is stepped up. A step passes when uclient
reports less than 0.5 % lost packets; the figure kept is the highest relayed
datagram rate of a passing step (median of the per-second ``tot_recv_msgs``
deltas in the steady part, x 2). Server CPU comes from ``/proc/<pid>/stat``
(user + system) over the whole uclient run, reported as CPU-seconds per second
per 10 k relayed datagrams/s.

Fair per core: by default each server is pinned to CPU 0 and the load (uclient +
peer) to CPU 1 (``taskset``), coturn runs with one relay thread (``-m 1``) and
crossroads with one process. On a 2-core machine the load generator (one core)
saturates before either server does, so the relayed rate is mostly the
generator's; the CPU each server spends per packet at the same offered load is
the figure that compares the relays, and the summary prints both.

Usage::

    .venv/bin/python benchmarks/turn.py                 # default steps
    .venv/bin/python benchmarks/turn.py --steps 5,10,20,30 --messages 3000

Everything runs on 127.0.0.1 with ephemeral ports and is bounded in time.
"""

from __future__ import annotations

import argparse
import os
import re
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

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
USER, PASSWORD, REALM = "bench", "bench-secret", "bench.local"
#: Payload bytes per message (as in the reference measurements, §1.4).
LENGTH = 120
LOSS_LIMIT = 0.5  # percent
#: Extra `crossroads serve` flags (--crossroads-flag).
EXTRA_ARGS: list[str] = []


def free_port() -> int:
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.bind(("127.0.0.1", 0))
            port = int(udp.getsockname()[1])
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
            try:
                tcp.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port")


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime (fields 14, 15)


def tree_ticks(pid: int) -> int:
    """CPU ticks of ``pid`` and its children (worker processes)."""
    total = cpu_ticks(pid)
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if children.exists():
        for child in children.read_text().split():
            try:
                total += tree_ticks(int(child))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return total


TICK = os.sysconf("SC_CLK_TCK")


def udp_rcvbuf_errors() -> int:
    """System-wide UDP datagrams dropped for a full socket buffer."""
    lines = Path("/proc/net/snmp").read_text().splitlines()
    udp = [line.split() for line in lines if line.startswith("Udp:")]
    header, values = udp[0], udp[1]
    return int(values[header.index("RcvbufErrors")])


def wait_udp_ready(port: int, timeout: float = 15.0) -> None:
    """Wait until something answers a STUN Binding request on ``port``."""
    request = b"\x00\x01\x00\x00\x21\x12\xa4\x42" + os.urandom(12)
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(0.2)
        while time.monotonic() < deadline:
            sock.sendto(request, ("127.0.0.1", port))
            try:
                sock.recv(2048)
                return
            except OSError:
                continue
    raise RuntimeError(f"no STUN answer on port {port}")


@dataclass
class Server:
    name: str
    process: subprocess.Popen[bytes]
    port: int
    directory: str
    #: The port uclient talks to: ``port``, or the TLS port (benchmarks/turn_tls.py).
    client_port: int = 0

    def __post_init__(self) -> None:
        self.client_port = self.client_port or self.port

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # at once: SIGTERM drains
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


def pin(cpus: str | None) -> list[str]:
    return ["taskset", "-c", cpus] if cpus and shutil.which("taskset") else []


def start_coturn(
    threads: int, cpus: str | None, tls: tuple[Path, Path] | None = None
) -> Server:
    """``tls``: (certificate, key) to also serve TURN over TLS and DTLS
    (client_port)."""
    directory = tempfile.mkdtemp(prefix="bench-coturn-")
    port = free_port()
    tls_port = free_port() if tls else 0
    tls_args = (
        ["--cert", str(tls[0]), "--pkey", str(tls[1]), "--tls-listening-port",
         str(tls_port), "--alt-tls-listening-port", str(free_port())]
        if tls
        else ["--no-tls"]
    )  # fmt: skip
    low = 20000 + (port % 20) * 1000
    command = [
        *pin(cpus),
        "turnserver",
        "-n",
        "--log-file=stdout",
        "--simple-log",
        "--no-stdout-log",
        "-L",
        "127.0.0.1",
        "-E",
        "127.0.0.1",
        "-p",
        str(port),
        "--allow-loopback-peers",
        *tls_args,
        # With a certificate, DTLS on the TLS port number too (UDP).
        *([] if tls else ["--no-dtls"]),
        "--no-cli",
        "-a",
        "-f",
        "-r",
        REALM,
        f"--user={USER}:{PASSWORD}",
        "-m",
        str(threads),
        f"--min-port={low}",
        f"--max-port={low + 999}",
        f"--pidfile={directory}/turnserver.pid",
        f"--db={directory}/turndb",
    ]
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=directory
    )
    server = Server("coturn", process, port, directory, tls_port)
    try:
        wait_udp_ready(port)
    except BaseException:
        server.stop()
        raise
    return server


def start_crossroads(
    _count: int, cpus: str | None, tls: tuple[Path, Path] | None = None
) -> Server:
    """``tls``: (certificate, key) to also serve TURN over TLS and DTLS
    (client_port)."""
    directory = tempfile.mkdtemp(prefix="bench-crossroads-")
    port = free_port()
    tls_port = free_port() if tls else 0
    tls_args = (
        ["--tls-cert", str(tls[0]), "--tls-key", str(tls[1]),
         "--turn-tls-port", str(tls_port)]
        if tls
        else []
    )  # fmt: skip
    low = 20000 + ((port + 7) % 20) * 1000
    command = [
        *pin(cpus),
        PYTHON,
        "-m",
        "crossroads",
        "serve",
        "--only",
        "turn",
        "--host",
        "127.0.0.1",
        "--http-port",
        "0",
        "--stun-port",
        str(port),
        "--stun-alt-port",
        "0",
        "--turn-user",
        f"{USER}:{PASSWORD}",
        "--turn-realm",
        REALM,
        "--allow-loopback-peers",
        "--relay-ports",
        f"{low}-{low + 999}",
        "--log-level",
        "warning",
    ]
    command += tls_args + EXTRA_ARGS
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
    )
    server = Server("crossroads", process, port, directory, tls_port)
    try:
        wait_udp_ready(port)
    except BaseException:
        server.stop()
        raise
    return server


@dataclass
class Step:
    sessions: int
    offered: int  # relayed datagrams/s
    relayed: float  # relayed datagrams/s, median steady second
    loss: float  # percent
    cpu_per_10k: float  # CPU-seconds per second per 10 k relayed datagrams/s
    cpu_share: float  # CPU-seconds per second during the run
    rcvbuf_errors: int  # UDP datagrams the kernel dropped (full buffers), all sockets

    @property
    def passed(self) -> bool:
        return self.loss < LOSS_LIMIT


_LOSS = re.compile(r"Total lost packets (\d+) \(([\d.]+)%\)")
_RECV = re.compile(r"msz=\d+, tot_send_msgs=(\d+), tot_recv_msgs=(\d+)")


def run_step(
    server: Server,
    sessions: int,
    messages: int,
    cpus: str | None,
    flags: tuple[str, ...] = ("-X",),
    interval_ms: int = 1,
) -> Step:
    """One uclient run; ``flags``: its transport flags (``-t -S``: TLS);
    ``interval_ms``: between two messages of a session (uclient -z)."""
    peer_port = free_port()
    peer = subprocess.Popen(
        [*pin(cpus), "turnutils_peer", "-L", "127.0.0.1", "-p", str(peer_port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(0.2)
        command = [
            *pin(cpus),
            "turnutils_uclient",
            "-e",
            "127.0.0.1",
            "-r",
            str(peer_port),
            *flags,
            "-c",
            "-m",
            str(sessions),
            "-n",
            str(messages),
            "-l",
            str(LENGTH),
            "-z",
            str(interval_ms),
            "-u",
            USER,
            "-w",
            PASSWORD,
            "-p",
            str(server.client_port),
            "127.0.0.1",
        ]
        ticks0 = tree_ticks(server.process.pid)
        drops0 = udp_rcvbuf_errors()
        started = time.monotonic()
        try:
            result = subprocess.run(
                command, capture_output=True, text=True, timeout=90, check=False
            )
            output = result.stdout + result.stderr
        except subprocess.TimeoutExpired as exc:
            output = (
                (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else ""
            )
        elapsed = time.monotonic() - started
        ticks = tree_ticks(server.process.pid) - ticks0
        drops = udp_rcvbuf_errors() - drops0
    finally:
        peer.terminate()
        peer.wait(5)
    received = [int(m.group(2)) for m in _RECV.finditer(output)]
    deltas = [b - a for a, b in zip(received, received[1:], strict=False)]
    # Steady part: seconds where at least 60 % of the best second came through
    # (drops the staggered start and the tail).
    best = max(deltas, default=0)
    steady = [d for d in deltas if d >= 0.6 * best] or [0]
    loss_match = _LOSS.search(output)
    loss = float(loss_match.group(2)) if loss_match else 100.0
    if loss >= LOSS_LIMIT:
        saved = (
            Path(tempfile.gettempdir()) / f"turn-bench-{server.name}-m{sessions}.log"
        )
        saved.write_text(output)
        print(f"  (uclient output of the lossy run: {saved})", flush=True)
    total_recv = received[-1] if received else 0
    relayed_total = 2 * total_recv
    cpu_seconds = ticks / TICK
    relayed = 2 * statistics.median(steady)
    cpu_share = cpu_seconds / elapsed if elapsed else 0.0
    per_10k = (cpu_seconds / relayed_total * 10_000) if relayed_total else float("nan")
    offered = sessions * 2000 // interval_ms
    return Step(sessions, offered, relayed, loss, per_10k, cpu_share, drops)


def report(label: str, step: Step) -> None:
    mark = "ok " if step.passed else "LOSS"
    print(
        f"  {label:<24} offered {step.offered:>6}/s  relayed {step.relayed:>8.0f}/s"
        f"  loss {step.loss:6.2f}%  cpu {step.cpu_share * 100:5.1f}%"
        f"  cpu/10k {step.cpu_per_10k:.3f} s  rcvbuf-drops {step.rcvbuf_errors}"
        f"  {mark}",
        flush=True,
    )


def median_step(tries: list[Step]) -> Step:
    """The run with the median relayed rate (its own CPU and loss figures)."""
    ordered = sorted(tries, key=lambda s: s.relayed)
    return ordered[(len(ordered) - 1) // 2]


def interleaved(
    servers: list[tuple[str, Server]],
    steps: list[int],
    messages: int,
    load_cpus: str | None,
    rounds: int,
    flags: tuple[str, ...] = ("-X",),
    interval_ms: int = 1,
) -> dict[str, list[Step]]:
    """Each step, each round: one uclient run per server, back to back, so that
    the other tenants of a shared machine weigh on both alike."""
    results: dict[str, list[Step]] = {label: [] for label, _ in servers}
    alive = {label for label, _ in servers}
    for sessions in steps:
        tries: dict[str, list[Step]] = {label: [] for label in alive}
        for _ in range(rounds):
            for label, server in servers:
                if label in alive:
                    tries[label].append(
                        run_step(
                            server, sessions, messages, load_cpus, flags, interval_ms
                        )
                    )
        for label, _ in servers:
            if label not in alive:
                continue
            step = median_step(tries[label])
            results[label].append(step)
            report(label, step)
            if step.loss > 5:
                alive.discard(label)  # well past its knee
        if not alive:
            break
    return results


def best(steps: list[Step]) -> Step | None:
    passing = [s for s in steps if s.passed]
    return max(passing, key=lambda s: s.relayed) if passing else None


def summarize(label_c: str, label_x: str, results: dict[str, list[Step]]) -> None:
    """The best passing step of each server and the two ratios."""
    coturn = results.get(label_c, [])
    ours = results[label_x]
    top_c, top_x = best(coturn), best(ours)
    print()
    for name, top in ((label_c, top_c), (label_x, top_x)):
        if top is None:
            print(f"  {name:<24} no step under {LOSS_LIMIT}% loss")
        else:
            print(
                f"  {name:<24} best {top.relayed:8.0f} relayed/s (<{LOSS_LIMIT}% loss)"
                f" at offered {top.offered}/s; cpu per 10k pps {top.cpu_per_10k:.3f} s"
                f" (~{10_000 / top.cpu_per_10k:,.0f} pps per core)"
            )
    if top_c and top_x:
        print(
            f"  ratio crossroads/coturn, highest relayed pps:  "
            f"{top_x.relayed / top_c.relayed:.2f}"
        )
        # CPU per packet at the highest load both passed (same offered load).
        common = [
            (c, x)
            for c, x in zip(coturn, ours, strict=False)
            if c.passed and x.passed and c.offered == x.offered
        ]
        if common:
            c, x = common[-1]
            print(
                f"  ratio coturn/crossroads, CPU per packet at {c.offered}/s offered: "
                f"{c.cpu_per_10k / x.cpu_per_10k:.2f}  (>1: crossroads uses less)"
            )


def argument_parser(doc: str | None, steps: str) -> argparse.ArgumentParser:
    """The arguments every TURN benchmark takes (``steps``: default -m values)."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    parser.add_argument("--steps", default=steps, help="uclient -m values")
    parser.add_argument("--messages", type=int, default=3000, help="uclient -n")
    parser.add_argument("--rounds", type=int, default=3, help="runs per step (median)")
    parser.add_argument("--no-pin", action="store_true", help="do not use taskset")
    return parser


def prepare(
    args: argparse.Namespace, title: str, uclient_flags: str
) -> tuple[list[int], str | None, str | None]:
    """Check coturn's tools are installed, print the banner; the steps and the
    CPUs of the server and of the load from the common arguments."""
    for tool in ("turnserver", "turnutils_uclient", "turnutils_peer"):
        if not shutil.which(tool):
            sys.exit(f"{tool} not found: apt-get install coturn")
    steps = [int(s) for s in args.steps.split(",")]
    server_cpus, load_cpus = (None, None) if args.no_pin else ("0", "1")
    print(
        f"{title} benchmark: uclient {uclient_flags} -l {LENGTH} -n {args.messages}, "
        f"steps -m {args.steps}; server on CPU {server_cpus or 'any'}, "
        f"load on CPU {load_cpus or 'any'}"
    )
    return steps, server_cpus, load_cpus


def main() -> None:
    parser = argument_parser(__doc__, "10,25,40,50")
    parser.add_argument(
        "--crossroads-flag",
        action="append",
        default=[],
        help="extra flag for crossroads serve (repeatable), e.g. --no-stun-batch-io",
    )
    parser.add_argument(
        "--skip-coturn", action="store_true", help="only measure crossroads"
    )
    args = parser.parse_args()
    EXTRA_ARGS.extend(args.crossroads_flag)
    steps, server_cpus, load_cpus = prepare(args, "TURN relay", "-c -X -z 1")
    label_c, label_x = "coturn (1 relay thread)", "crossroads (1 process)"
    print()
    servers: list[tuple[str, Server]] = []
    try:
        if not args.skip_coturn:
            servers.append((label_c, start_coturn(1, server_cpus)))
        servers.append((label_x, start_crossroads(1, server_cpus)))
        results = interleaved(servers, steps, args.messages, load_cpus, args.rounds)
    finally:
        for _, server in servers:
            server.stop()
    summarize(label_c, label_x, results)


if __name__ == "__main__":
    main()
