"""RakNet benchmark: crossroads' RakNet server next to the real RakNet 4.081
C++ peer (PyPI ``raknet==0.3.0``) acting as server, on the same load.

Both servers run as their own process on loopback; the load generator is
this process, driving real RakNet C++ client peers from the same wheel.
Each figure is the median of several rounds:

1. **connections/s**: ``--clients`` fresh RakNet peers connect at once; the
   time until every one has ID_CONNECTION_REQUEST_ACCEPTED.
2. **memory per connection**: the server's RSS with those clients connected,
   minus before, divided by the number of clients (first round: a fresh
   server process).
3. **reliable messages/s**: ``--senders`` connected peers each keep
   ``--window`` reliable ordered requests in flight for ``--seconds``; a
   request is answered by the server with one reliable ordered message
   (crossroads: ID_NAT_REQUEST_BOUND_ADDRESSES -> ID_NAT_RESPOND_BOUND_ADDRESSES,
   its NatPunchthroughServer; the C++ server: a Python loop over the C++
   peer answering the same request with the same reply, as a game server
   using the wheel would).
4. **punchthrough sessions/s** (crossroads only -- the wheel has no
   NatPunchthroughServer): the whole request / most-recent-port /
   CONNECT_AT_TIME / ready exchange for pairs of clients, on the sans-I/O
   core with in-memory clients (no sockets).

    .venv/bin/python benchmarks/raknet.py [--clients 200] [--rounds 3] [--seconds 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# ``python benchmarks/raknet.py`` puts benchmarks/ first on sys.path, where
# this very file would shadow the ``raknet`` wheel.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
import raknet  # noqa: E402

sys.path.insert(0, str(ROOT))
from tests.proto.raknet.support import Client, Network  # noqa: E402

from crossroads.proto.raknet.messages import MessageId  # noqa: E402
from crossroads.proto.raknet.node import RakNetNode  # noqa: E402
from crossroads.proto.raknet.peer import ServerConfig  # noqa: E402

ACCEPTED = 0x10
REQUEST = bytes([MessageId.NAT_REQUEST_BOUND_ADDRESSES])
REPLY_ID = MessageId.NAT_RESPOND_BOUND_ADDRESSES
HIGH = raknet.PacketPriority.HIGH_PRIORITY
ORDERED = raknet.PacketReliability.RELIABLE_ORDERED

#: The C++ baseline: the wheel's peer as a server, answering the request the
#: way crossroads' NatPunchthroughServer does (same reply size: 2 addresses).
CPP_SERVER = """
import sys, time, raknet
peer = raknet.RakPeer()
peer.startup(host="127.0.0.1", port=int(sys.argv[1]), max_connections=int(sys.argv[2]))
peer.max_incoming_connections = int(sys.argv[2])
reply = bytes.fromhex("7d02" "0480fffffe0000" "0480fffffe0000")
print("ready", flush=True)
while True:
    packet = peer.receive()
    if packet is None:
        time.sleep(0.0005)
        continue
    if packet.data[:1] == b"\\x7c":
        peer.send(reply, raknet.PacketPriority.HIGH_PRIORITY,
                  raknet.PacketReliability.RELIABLE_ORDERED, 0, packet.system_address)
"""


def free_port(kind: int = socket.SOCK_DGRAM) -> int:
    with socket.socket(socket.AF_INET, kind) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


@contextmanager
def crossroads_server(clients: int) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    port = free_port()
    argv = [
        sys.executable, "-m", "crossroads", "serve", "--only", "raknet",
        "--host", "127.0.0.1", "--http-port", str(free_port(socket.SOCK_STREAM)),
        "--log-level", "warning", "--raknet-port", str(port),
        "--raknet-second-port", "0",
        # Every client is on 127.0.0.1, and a source may hold at most an
        # eighth of the table (docs/security.md).
        "--raknet-max-connections", str(clients * 16),
        "--raknet-max-connections-per-ip", str(clients * 2),
        "--raknet-handshakes-per-second", "1000000",
    ]  # fmt: skip
    process = subprocess.Popen(argv)
    try:
        wait_for_pong(port, process)
        yield port, process
    finally:
        stop(process)


@contextmanager
def cpp_server(clients: int) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-c", CPP_SERVER, str(port), str(clients * 4)],
        stdout=subprocess.PIPE,
        cwd="/",  # no benchmarks/raknet.py shadowing the wheel
    )
    try:
        assert process.stdout is not None and process.stdout.readline().startswith(
            b"ready"
        )
        yield port, process
    finally:
        stop(process)


def stop(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGINT)  # at once: SIGTERM drains
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def wait_for_pong(port: int, process: subprocess.Popen[bytes]) -> None:
    peer = raknet.RakPeer()
    peer.startup(port=0)
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline and process.poll() is None:
            peer.ping("127.0.0.1", port)
            end = time.monotonic() + 0.2
            while time.monotonic() < end:
                packet = peer.receive()
                if packet is not None and packet.data[0] == 0x1C:
                    return
                time.sleep(0.005)
        raise RuntimeError("the server did not start")
    finally:
        peer.shutdown(0)


def connect_all(port: int, count: int) -> tuple[float, list[tuple[object, object]]]:
    """Connect ``count`` fresh peers; (seconds until all accepted, peers)."""
    peers = []
    for _ in range(count):
        peer = raknet.RakPeer()
        peer.startup(host="127.0.0.1", port=0, max_connections=1)
        peers.append(peer)
    start = time.perf_counter()
    for peer in peers:
        peer.connect("127.0.0.1", port)
    pending = dict(enumerate(peers))
    servers: dict[int, object] = {}
    deadline = start + 60
    while pending and time.perf_counter() < deadline:
        for index, peer in list(pending.items()):
            packet = peer.receive()
            while packet is not None:
                if packet.data[0] == ACCEPTED:
                    servers[index] = packet.system_address
                    del pending[index]
                    break
                packet = peer.receive()
        time.sleep(0.0005)
    elapsed = time.perf_counter() - start
    if pending:
        raise RuntimeError(f"{len(pending)} of {count} peers did not connect")
    return elapsed, [(peers[i], servers[i]) for i in range(count)]


def close_all(pairs: list[tuple[object, object]]) -> None:
    for peer, _ in pairs:
        peer.shutdown(0.05)  # type: ignore[attr-defined]


def messages_per_second(
    pairs: list[tuple[object, object]], window: int, seconds: float
) -> float:
    for peer, server in pairs:
        for _ in range(window):
            peer.send(REQUEST, HIGH, ORDERED, 0, server)  # type: ignore[attr-defined]
    answered = 0
    start = time.perf_counter()
    end = start + seconds
    while time.perf_counter() < end:
        idle = True
        for peer, server in pairs:
            packet = peer.receive()  # type: ignore[attr-defined]
            while packet is not None:
                if packet.data[0] == REPLY_ID:
                    answered += 1
                    idle = False
                    peer.send(REQUEST, HIGH, ORDERED, 0, server)  # type: ignore[attr-defined]
                packet = peer.receive()  # type: ignore[attr-defined]
        if idle:
            time.sleep(0.0002)
    return answered / (time.perf_counter() - start)


def punchthrough_core(pairs: int) -> float:
    """Sessions/s of the whole punchthrough exchange on the sans-I/O node."""
    node = RakNetNode(ServerConfig(handshakes_per_second=1e9), guid=1)
    net = Network(node)
    clients = [
        Client(net, (f"198.51.{(i >> 8) & 255}.{i & 255}", 40000), 1000 + i)
        for i in range(2 * pairs)
    ]
    for client in clients:
        client.connect(1.0)
    start = time.perf_counter()
    now = 2.0
    for i in range(pairs):
        a, b = clients[2 * i], clients[2 * i + 1]
        now += 0.001
        a.send(
            bytes([MessageId.NAT_PUNCHTHROUGH_REQUEST]) + b.guid.to_bytes(8, "big"), now
        )
        (ask,) = a.take(MessageId.NAT_GET_MOST_RECENT_PORT)
        b.take(MessageId.NAT_GET_MOST_RECENT_PORT)
        for client in (a, b):
            client.send(ask + (40001).to_bytes(2, "big"), now)
        assert a.take(MessageId.TIMESTAMP) and b.take(MessageId.TIMESTAMP)
        for client in (a, b):
            client.send(bytes([MessageId.NAT_CLIENT_READY]), now)
    return pairs / (time.perf_counter() - start)


def run(name: str, server, args: argparse.Namespace) -> dict[str, float]:  # type: ignore[no-untyped-def]
    rates, memory, messages = [], [], []
    with server(args.clients) as (port, process):
        for _ in range(args.rounds):
            before = rss_kib(process.pid)
            elapsed, pairs = connect_all(port, args.clients)
            rates.append(args.clients / elapsed)
            memory.append((rss_kib(process.pid) - before) / args.clients)
            messages.append(
                messages_per_second(pairs[: args.senders], args.window, args.seconds)
            )
            close_all(pairs)
            time.sleep(1.0)  # let the server see the disconnections
    return {
        "connections/s": statistics.median(rates),
        # the first round only: later rounds reuse what the first one allocated
        "KiB/connection": memory[0],
        "messages/s": statistics.median(messages),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--senders", type=int, default=8)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=2000)
    args = parser.parse_args()
    ours = run("crossroads", crossroads_server, args)
    theirs = run("raknet", cpp_server, args)
    punch = statistics.median(punchthrough_core(args.pairs) for _ in range(args.rounds))
    print(
        f"RakNet benchmark on {os.cpu_count()} cores; median of {args.rounds} rounds, "
        f"{args.clients} clients, {args.senders} senders x {args.window} in flight"
    )
    print(f"{'':28}{'crossroads':>12}{'RakNet C++':>12}{'ratio':>8}")
    for key in ("connections/s", "messages/s", "KiB/connection"):
        ratio = ours[key] / theirs[key] if theirs[key] else float("nan")
        print(f"{key:28}{ours[key]:12.0f}{theirs[key]:12.0f}{ratio:8.2f}")
    print(
        f"{'punchthrough sessions/s':28}{punch:12.0f}{'-':>12}   (sans-I/O core, in-memory clients)"
    )


if __name__ == "__main__":
    main()
