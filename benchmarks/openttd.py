"""OpenTTD coordinator load: registrations/s, listings/s, joins/s, memory per
server at N registered servers, and the TURN relay's throughput.

    .venv/bin/python benchmarks/openttd.py                # 10k servers, both stores
    .venv/bin/python benchmarks/openttd.py --servers 2000 --store memory

It runs ``crossroads serve --only openttd`` as its own process (pinned to one
core) and drives it from this process (pinned to the other) with protocol-level
peers that send exactly what OpenTTD 13 sends:

- registration: SERVER_REGISTER, the STUN round (GC_STUN_REQUEST, one STUN
  connection, two SERCLI_STUN_RESULTs), the coordinator's real game-protocol
  probe answered by a responder here, GC_REGISTER_ACK, then one SERVER_UPDATE.
  Every registered server keeps its connection open, as OpenTTD does;
- listing: CLIENT_LISTING until the end-of-list packet (a tenth of the
  servers are public, so the list has N/10 entries; the public list on
  openttd.org has a few hundred);
- join: CLIENT_CONNECT, GC_CONNECTING + GC_DIRECT_CONNECT, CLIENT_CONNECTED.

Memory per server is the growth of the coordinator's RSS from before the first
registration to after the last update, divided by N.

There is no runnable peer implementation to put beside it: OpenTTD's own
coordinator (OpenTTD/game-coordinator) is not packaged. So the comparison is
between crossroads' two state backends on the same load (in-process store vs a
real redis-server shared by processes), and, for the data plane, between the
TURN relay and a direct loopback TCP connection.

Figures are medians of several short rounds; the whole run is bounded in time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from crossroads.client.openttd import GameInfoResponder, GcClient, PacketStream  # noqa: E402
from crossroads.proto.openttd.coordinator import (  # noqa: E402
    ClientConnect,
    ClientConnected,
    ClientListing,
    GcConnecting,
    GcDirectConnect,
    GcRegisterAck,
    GcStunRequest,
    GcTurnConnect,
    ServerRegister,
    ServerUpdate,
    StunResult,
    encode_peer_packet,
)
from crossroads.proto.openttd.gameinfo import GameInfo, NewGRF, NewGRFSerialization  # noqa: E402
from crossroads.proto.openttd.stun import StunRequest, encode_stun_packet  # noqa: E402
from crossroads.proto.openttd.turn import TurnConnect, encode_turn_packet  # noqa: E402

HOST = "127.0.0.1"
PUBLIC_EVERY = 10


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Server:
    """``crossroads serve --only openttd`` on core 0."""

    def __init__(self, store: str, log: Path) -> None:
        command = [
            "taskset", "-c", "0",
            sys.executable, "-m", "crossroads", "serve", "--host", HOST, "--http-port", "0",
            "--only", "openttd", "--store", store,
            "--openttd-coordinator-port", "0", "--openttd-stun-port", "0", "--openttd-turn-port", "0",
            "--openttd-registrations-per-minute", "1000000000",
            "--openttd-max-servers-per-address", "1000000",
            "--openttd-max-connections-per-address", "1000000",
            "--openttd-max-connections", "1000000",
            "--log-level", "info",
        ]  # fmt: skip
        self.log = log
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=raise_fd_limit,
            )
        deadline = time.monotonic() + 30
        pattern = re.compile(
            r"openttd: tcp [\d.]+:(\d+) \(coordinator\), tcp [\d.]+:(\d+) \(stun\), tcp [\d.]+:(\d+) \(turn\)"
        )
        while time.monotonic() < deadline:
            match = pattern.search(log.read_text())
            if match:
                self.gc, self.stun, self.turn = (int(g) for g in match.groups())
                # The workers of a child process show as its pid.
                self.pid = self.process.pid
                return
            if self.process.poll() is not None:
                break
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"crossroads did not start:\n{log.read_text()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # at once: SIGTERM drains
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class RedisServer:
    def __init__(self, workdir: Path) -> None:
        import socket

        with socket.socket() as s:
            s.bind((HOST, 0))
            self.port = s.getsockname()[1]
        self.process = subprocess.Popen(
            ["taskset", "-c", "0", "redis-server", "--port", str(self.port), "--bind", HOST,
             "--save", "", "--appendonly", "no", "--dir", str(workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((HOST, self.port), 0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)


def info_for(i: int) -> GameInfo:
    return GameInfo(
        server_name=f"Benchmark server {i}",
        server_revision="13.0",
        clients_max=25,
        map_width=256,
        map_height=256,
        companies_max=15,
        dedicated=True,
        game_date=712223,
        start_date=712223,
        newgrfs=(
            NewGRF(
                0x4D560000 + i % 50, (i % 50).to_bytes(16, "little"), f"Set {i % 50}"
            ),
        ),
    )


async def register_one(
    server: Server, game_port: int, i: int, public: bool
) -> GcClient:
    client = await GcClient.connect(HOST, server.gc)
    await client.send_message(ServerRegister(6, 1 if public else 2, game_port, "", ""))
    stun: PacketStream | None = None
    while True:
        message = await client.recv(30)
        if isinstance(message, GcStunRequest):
            token = message.token
            await client.send_message(StunResult(6, token, 10, False))
            stun = await PacketStream.open(HOST, server.stun)
            await stun.send(encode_stun_packet(StunRequest(6, token, 2)))
            await client.send_message(StunResult(6, token, 2, True))
        elif isinstance(message, GcRegisterAck):
            break
    if stun is not None:
        await stun.close()
    await client.send_message(
        ServerUpdate(6, 6, NewGRFSerialization.GRFID_MD5_NAME, info_for(i))
    )
    # Later updates carry no NewGRF names (NST 0), as OpenTTD's do.
    UPDATES[client] = encode_peer_packet(
        ServerUpdate(6, 6, NewGRFSerialization.GRFID_MD5, info_for(i))
    )
    return client


#: The periodic SERVER_UPDATE of every registered fake server.
UPDATES: dict[GcClient, bytes] = {}
#: OpenTTD sends SERVER_UPDATE every 30 s (NETWORK_COORDINATOR_DELAY_BETWEEN_UPDATES);
#: a little sooner here so no record nears its 90 s expiry under load.
UPDATE_EVERY = 25.0


async def keep_updating() -> None:
    """Send every server's update once per period, spread evenly over it."""
    while True:
        clients = list(UPDATES.items())
        if not clients:
            await asyncio.sleep(1)
            continue
        batch = 100
        pause = UPDATE_EVERY / max(1, len(clients) / batch)
        for start in range(0, len(clients), batch):
            for client, data in clients[start : start + batch]:
                if not client.writer.is_closing():
                    client.writer.write(data)
            await asyncio.sleep(pause)


async def bounded(
    count: int, concurrency: int, job: Callable[[int], Awaitable[None]]
) -> float:
    """Run ``job(0..count-1)`` with ``concurrency`` at once; returns seconds."""
    queue = iter(range(count))

    async def worker() -> None:
        for i in queue:
            await job(i)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - start


async def timed_loop(
    seconds: float,
    concurrency: int,
    setup: Callable[[], Awaitable[GcClient]],
    step: Callable[[GcClient], Awaitable[None]],
) -> float:
    """Operations per second of ``step`` from ``concurrency`` persistent peers."""
    clients = [await setup() for _ in range(concurrency)]
    done = 0
    stop = time.perf_counter() + seconds

    async def worker(client: GcClient) -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await step(client)
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in clients))
    elapsed = time.perf_counter() - start
    for client in clients:
        await client.close()
    return done / elapsed


async def listing_step(client: GcClient) -> None:
    """One listing, read as raw packets (decoding would cost this process more
    than the coordinator spends producing it)."""
    await client.send(encode_peer_packet(ClientListing(6, 6, "13.0", 0)))
    while True:
        packet_type, payload = await client.recv_packet(30)
        if packet_type == 5 and payload == b"\x00\x00":
            return


def join_step(codes: list[str]) -> Callable[[GcClient], Awaitable[None]]:
    counter = 0

    async def step(client: GcClient) -> None:
        nonlocal counter
        code = codes[counter % len(codes)]
        counter += 1
        await client.send_message(ClientConnect(6, code))
        connecting = await client.recv(30)
        assert isinstance(connecting, GcConnecting), connecting
        direct = await client.recv(30)
        assert isinstance(direct, GcDirectConnect), direct
        await client.send_message(ClientConnected(6, connecting.token))

    return step


async def relay_throughput(
    server: Server, seconds: float
) -> tuple[float, float, float]:
    """MB/s through a TURN pair set up by a real join, and over direct loopback;
    and the relay's CPU cost: server CPU milliseconds per relayed MB."""
    # An unreachable server (probe fails, STUN fails): the join goes to TURN.
    srv = await GcClient.connect(HOST, server.gc)
    await srv.send_message(ServerRegister(6, 2, 1, "", ""))
    while True:
        message = await srv.recv(30)
        if isinstance(message, GcStunRequest):
            await srv.send_message(StunResult(6, message.token, 10, False))
            await srv.send_message(StunResult(6, message.token, 2, False))
        elif isinstance(message, GcRegisterAck):
            code = message.invite_code
            break
    cli = await GcClient.connect(HOST, server.gc)
    await cli.send_message(ClientConnect(6, code))

    async def side(peer: GcClient) -> GcTurnConnect:
        # Both peers fail STUN on both families, as if behind symmetric NAT.
        while True:
            message = await peer.recv(30)
            if isinstance(message, GcStunRequest):
                await peer.send_message(StunResult(6, message.token, 10, False))
                await peer.send_message(StunResult(6, message.token, 2, False))
            elif isinstance(message, GcTurnConnect):
                return message

    client_turn, server_turn = await asyncio.gather(side(cli), side(srv))
    tickets = {"client": client_turn, "server": server_turn}
    a = await PacketStream.open(HOST, server.turn)
    b = await PacketStream.open(HOST, server.turn)
    await a.send(encode_turn_packet(TurnConnect(6, tickets["server"].ticket)))
    await b.send(encode_turn_packet(TurnConnect(6, tickets["client"].ticket)))
    await a.recv_packet(10)
    await b.recv_packet(10)
    await cli.send_message(ClientConnected(6, tickets["client"].token))
    cpu_before, start = cpu_seconds(server.pid), time.perf_counter()
    relayed = await pump(a, b, seconds)
    megabytes = relayed * (time.perf_counter() - start)
    cpu_ms_per_mb = (cpu_seconds(server.pid) - cpu_before) * 1000 / megabytes
    for stream in (a, b, srv, cli):
        await stream.close()

    # Baseline: the same pump over one direct loopback connection.
    accepted: asyncio.Queue[PacketStream] = asyncio.Queue()

    async def on_accept(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await accepted.put(PacketStream(reader, writer))

    listener = await asyncio.start_server(on_accept, HOST, 0)
    port = listener.sockets[0].getsockname()[1]
    c = await PacketStream.open(HOST, port)
    d = await accepted.get()
    direct = await pump(c, d, seconds)
    for stream in (c, d):
        await stream.close()
    listener.close()
    return relayed, direct, cpu_ms_per_mb


async def pump(sender: PacketStream, receiver: PacketStream, seconds: float) -> float:
    """MB/s from ``sender`` to ``receiver``: write for ``seconds``, then EOF."""
    chunk = b"\x00" * (1460 * 64)
    received = 0

    async def send() -> None:
        stop = time.perf_counter() + seconds
        while time.perf_counter() < stop:
            sender.writer.write(chunk)
            await sender.writer.drain()
        sender.writer.write_eof()

    async def receive() -> None:
        nonlocal received
        while data := await receiver.reader.read(1 << 20):
            received += len(data)

    start = time.perf_counter()
    async with asyncio.timeout(seconds + 30):
        await asyncio.gather(send(), receive())
    return received / (time.perf_counter() - start) / 1e6


async def run(store: str, args: argparse.Namespace, workdir: Path) -> dict[str, float]:
    server = Server(store, workdir / f"crossroads-{store.split(':')[0]}.log")
    responder = GameInfoResponder(GameInfo(server_name="bench", server_revision="13.0"))
    await responder.start(HOST)
    results: dict[str, float] = {}
    servers: list[GcClient] = []
    codes: list[str] = []
    UPDATES.clear()
    updater = asyncio.create_task(keep_updating())
    try:
        await asyncio.sleep(0.5)
        baseline = rss_kib(server.pid)
        rounds = max(1, args.rounds)
        per_round = args.servers // rounds
        rates = []
        cpu_before = cpu_seconds(server.pid)
        wall = 0.0
        for r in range(rounds):

            async def job(i: int, r: int = r) -> None:
                index = r * per_round + i
                servers.append(
                    await register_one(
                        server, responder.port, index, index % PUBLIC_EVERY == 0
                    )
                )

            elapsed = await bounded(per_round, args.concurrency, job)
            wall += elapsed
            rates.append(per_round / elapsed)
        results["registrations/s"] = statistics.median(rates)
        results["server CPU while registering"] = (
            cpu_seconds(server.pid) - cpu_before
        ) / wall
        await asyncio.sleep(1.0)  # updates land
        grown = rss_kib(server.pid) - baseline
        results["servers"] = len(servers)
        results["KiB per server"] = grown / len(servers)

        # Codes for joins: the responder answers every probe, so all are direct.
        import httpx  # noqa: PLC0415

        http_port = int(
            re.search(r"http: tcp [\d.]+:(\d+)", server.log.read_text()).group(1)
        )  # type: ignore[union-attr]
        async with httpx.AsyncClient() as http:
            listed = (
                await http.get(f"http://{HOST}:{http_port}/openttd/servers")
            ).json()
        results["public servers listed"] = len(listed)
        codes = [entry["invite_code"] for entry in listed[:100]]

        async def gc_client() -> GcClient:
            return await GcClient.connect(HOST, server.gc)

        cpu_before, start = cpu_seconds(server.pid), time.perf_counter()
        listing_rates = [
            await timed_loop(args.seconds, args.clients, gc_client, listing_step)
            for _ in range(rounds)
        ]
        results["listings/s"] = statistics.median(listing_rates)
        results["server CPU while listing"] = (cpu_seconds(server.pid) - cpu_before) / (
            time.perf_counter() - start
        )
        cpu_before, start = cpu_seconds(server.pid), time.perf_counter()
        join_rates = [
            await timed_loop(args.seconds, args.clients, gc_client, join_step(codes))
            for _ in range(rounds)
        ]
        results["joins/s"] = statistics.median(join_rates)
        results["server CPU while joining"] = (cpu_seconds(server.pid) - cpu_before) / (
            time.perf_counter() - start
        )
        relayed, direct, cost = [], [], []
        for _ in range(rounds):
            r, d, c = await relay_throughput(server, min(2.0, args.seconds))
            relayed.append(r)
            direct.append(d)
            cost.append(c)
        results["TURN relay MB/s"] = statistics.median(relayed)
        results["direct loopback MB/s"] = statistics.median(direct)
        results["TURN relay server CPU ms per MB"] = statistics.median(cost)
    finally:
        updater.cancel()
        for client in servers:
            with contextlib.suppress(Exception):
                client.writer.close()
        await responder.close()
        server.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", type=int, default=10000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--seconds", type=float, default=3.0, help="length of one listing/join round"
    )
    parser.add_argument(
        "--concurrency", type=int, default=100, help="registrations in flight"
    )
    parser.add_argument(
        "--clients", type=int, default=50, help="listing/joining clients"
    )
    parser.add_argument("--store", choices=["memory", "redis", "both"], default="both")
    args = parser.parse_args()
    raise_fd_limit()
    os.sched_setaffinity(0, {1})
    workdir = (
        Path(os.environ.get("TMPDIR", "/tmp"))
        / f"crossroads-bench-openttd-{os.getpid()}"
    )
    workdir.mkdir(parents=True, exist_ok=True)
    stores = ["memory", "redis"] if args.store == "both" else [args.store]
    table: dict[str, dict[str, float]] = {}
    redis: RedisServer | None = None
    try:
        for store in stores:
            url = "memory"
            if store == "redis":
                redis = RedisServer(workdir)
                url = redis.url
            try:
                import uvloop

                table[store] = uvloop.run(run(url, args, workdir))
            except ImportError:
                table[store] = asyncio.run(run(url, args, workdir))
            print(store, table[store], flush=True)
            if redis is not None:
                redis.stop()
                redis = None
    finally:
        if redis is not None:
            redis.stop()
    for values in table.values():
        for kind, cpu in (
            ("registrations/s", "server CPU while registering"),
            ("listings/s", "server CPU while listing"),
            ("joins/s", "server CPU while joining"),
        ):
            values[f"{kind} per core (implied)"] = values[kind] / max(values[cpu], 1e-9)
    print(
        f"\nOpenTTD coordinator, {args.servers} registered servers, 1 crossroads process on core 0,"
    )
    print(f"load generator on core 1; medians of {args.rounds} rounds\n")
    keys = list(next(iter(table.values())).keys())
    header = f"| {'metric':<36} | " + " | ".join(f"{s:>12}" for s in stores)
    if len(stores) == 2:
        header += " | redis/memory |"
    print(header)
    print(
        "|"
        + "-" * 38
        + "|"
        + "|".join("-" * 14 for _ in stores)
        + ("|" + "-" * 14 + "|" if len(stores) == 2 else "")
    )
    for key in keys:
        values = [table[s][key] for s in stores]
        cells = " | ".join(f"{v:>12.2f}" if v < 100 else f"{v:>12.0f}" for v in values)
        line = f"| {key:<36} | {cells}"
        if len(stores) == 2:
            ratio = values[1] / values[0] if values[0] else float("nan")
            line += f" | {ratio:>12.2f} |"
        print(line)
    for store in stores:
        relay = table[store]["TURN relay MB/s"] / table[store]["direct loopback MB/s"]
        print(f"\nTURN relay vs direct loopback ({store} run): {relay:.2f}")


if __name__ == "__main__":
    main()
