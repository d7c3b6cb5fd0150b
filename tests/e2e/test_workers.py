"""``crossroads serve --workers 2`` as real processes on one real Redis.

One server for the module (starting two workers costs seconds): STUN answered by
both workers on one SO_REUSEPORT port, coturn's uclient with 50 sessions and no
loss, a Unity relay session on worker 1's node allocated through worker 0's API,
a natneg negotiation, SIGHUP reaching both workers, and last a worker killed
with SIGKILL that the supervisor restarts while worker 0 keeps answering.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from crossroads.client.relay import Allocation, RelayApi, RelayConnection
from crossroads.client.turn import TurnClient, TurnClientError
from tests.conftest import (
    RedisServer,
    consecutive_free_ports,
    eventually,
    free_port,
    free_udp_tcp_port,
)
from tests.interop.test_turn import assert_no_loss, uclient
from tests.services.natneg_sdk import negotiate_on_loopback

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]

API_KEY = "workers-test-key-0123456789"
USER, PASSWORD = "alice", "secret123"
STARTED = re.compile(r"worker (\d+)/2 started \(pid (\d+)\)")


@dataclass
class Workers:
    process: subprocess.Popen[bytes]
    log: Path
    http_port: int
    stun_port: int
    relay_port: int
    natneg_port: int

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def pids(self) -> dict[int, int]:
        """Worker index -> pid of its latest start, from the supervisor's log."""
        return {int(i): int(pid) for i, pid in STARTED.findall(self.output())}

    def url(self, index: int) -> str:
        return f"http://127.0.0.1:{self.http_port + index}"


def metrics(workers: Workers, index: int) -> str:
    response = httpx.get(workers.url(index) + "/metrics", timeout=5)
    response.raise_for_status()
    return response.text


def sample(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def healthy(workers: Workers, index: int) -> bool:
    try:
        return httpx.get(workers.url(index) + "/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def start_workers(tmp: Path, redis_url: str) -> Workers:
    """``crossroads serve --workers 2``, ready: both workers answer /healthz."""
    http_port = consecutive_free_ports(2)
    relay_port = consecutive_free_ports(2, socket.SOCK_DGRAM)
    stun_port, alt_port = free_udp_tcp_port(), free_udp_tcp_port()
    natneg_port = free_port(socket.SOCK_DGRAM)
    log = tmp / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CROSSROADS_")}
    env["XDG_STATE_HOME"] = str(tmp / "state")
    with log.open("wb") as output:
        process = subprocess.Popen(
            [
                sys.executable, "-m", "crossroads", "serve", "--workers", "2",
                "--store", redis_url, "--host", "127.0.0.1",
                "--only", "stun,turn,relay,natneg",
                "--http-port", str(http_port),
                "--stun-port", str(stun_port), "--stun-alt-port", str(alt_port),
                "--turn-user", f"{USER}:{PASSWORD}", "--allow-loopback-peers",
                "--relay-port", str(relay_port), "--api-key", API_KEY,
                "--relay-allow-private-peers", "--relay-heartbeat", "1",
                "--natneg-port", str(natneg_port), "--natneg-probe-port", "0",
                # SIGTERM drains: sessions the tests leave end after 5 s.
                "--drain-timeout", "5",
            ],
            stdout=output,
            stderr=subprocess.STDOUT,
            env=env,
        )  # fmt: skip
    server = Workers(process, log, http_port, stun_port, relay_port, natneg_port)
    deadline = time.monotonic() + 45
    while not (healthy(server, 0) and healthy(server, 1)):
        if process.poll() is not None or time.monotonic() > deadline:
            if process.poll() is None:
                process.kill()
            process.wait()
            raise RuntimeError(server.output())
        time.sleep(0.1)
    return server


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    redis = RedisServer()
    try:
        for attempt in range(3):
            tmp = tmp_path_factory.mktemp("workers")
            try:
                server = start_workers(tmp, redis.url)
                break
            except RuntimeError as exc:
                # A port free a moment ago was taken by another program in
                # between (the machine is shared): pick new ones.
                if "Address already in use" not in str(exc) or attempt == 2:
                    raise
        process = server.process
        try:
            yield server
            pids = server.pids()
            process.send_signal(signal.SIGTERM)
            assert process.wait(30) == 0, server.output()
            for pid in pids.values():  # the supervisor reaped them: none is left
                with pytest.raises(ProcessLookupError):
                    os.kill(pid, 0)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    finally:
        redis.stop()


def binding_request() -> tuple[bytes, bytes]:
    transaction = secrets.token_bytes(12)
    return struct.pack("!HHI", 0x0001, 0, 0x2112A442) + transaction, transaction


async def stun_from_many_ports(port: int, sources: int = 24) -> int:
    """Binding requests from ``sources`` source ports; how many were answered
    (each answer checked: a success response to our transaction)."""
    loop = asyncio.get_running_loop()

    async def one() -> bool:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.setblocking(False)
            sock.connect(("127.0.0.1", port))
            request, transaction = binding_request()
            for _ in range(3):  # UDP: a loaded machine may drop one
                sock.send(request)
                try:
                    async with asyncio.timeout(1):
                        answer = await loop.sock_recv(sock, 2048)
                except TimeoutError:
                    continue
                return answer[:2] == b"\x01\x01" and answer[8:20] == transaction
            return False

    results = await asyncio.gather(*(one() for _ in range(sources)))
    return sum(results)


async def test_stun_is_answered_by_both_workers(workers: Workers) -> None:
    before = [
        sample(metrics(workers, i), "crossroads_stun_requests_total") for i in (0, 1)
    ]
    assert await stun_from_many_ports(workers.stun_port, 32) == 32
    after = [
        sample(metrics(workers, i), "crossroads_stun_requests_total") for i in (0, 1)
    ]
    # 32 source ports hashed over 2 sockets: both get some (all on one: 2^-31).
    assert after[0] > before[0] and after[1] > before[1], (before, after)
    for index in (0, 1):
        text = metrics(workers, index)
        assert sample(text, "crossroads_worker_info", worker=str(index), workers="2")
        # Every log line of a worker names it.
        assert f"crossroads[w{index}]: stun: udp 127.0.0.1:{workers.stun_port}" in (
            workers.output()
        )


async def test_turn_uclient_50_sessions_without_loss(workers: Workers) -> None:
    output = await uclient(
        "-y", "-m", "50", "-n", "5", "-z", "20", "-l", "100", "-c",
        "-u", USER, "-w", PASSWORD, "-p", str(workers.stun_port), "127.0.0.1",
    )  # fmt: skip
    assert_no_loss(output)
    created = [
        sample(metrics(workers, i), "crossroads_turn_allocations_created_total")
        for i in (0, 1)
    ]
    # At least one allocation per session, spread by the kernel over both.
    assert sum(created) >= 50 and min(created) > 0, created


async def test_turn_refuses_every_workers_service_ports(workers: Workers) -> None:
    """A TURN client (on whichever worker the kernel chose) cannot relay into
    this server's ports, the other worker's included: both HTTP ports here
    (loopback peers are allowed in this server, its own ports are not)."""
    client = await TurnClient.connect(
        ("127.0.0.1", workers.stun_port), USER, PASSWORD, timeout=10
    )
    async with client:
        await client.allocate()
        for port in (workers.http_port, workers.http_port + 1):
            with pytest.raises(TurnClientError) as refused:
                await client.bind_channel(("127.0.0.1", port))
            assert refused.value.code == 403, port


async def test_relay_session_on_worker_1_allocated_by_worker_0(
    workers: Workers,
) -> None:
    async with RelayApi(workers.url(0), API_KEY) as api:
        ports: dict[int, Allocation] = {}
        for _ in range(6):  # least-loaded placement alternates between nodes
            allocation = await api.allocate(2)
            ports.setdefault(allocation.server[1], allocation)
        assert set(ports) == {workers.relay_port, workers.relay_port + 1}
        on_worker_1 = ports[workers.relay_port + 1]
        host = await RelayConnection.open(on_worker_1)
        await host.bind()
        joined = await api.join(await api.join_code(host.allocation.allocation_id))
        assert joined.server == host.allocation.server
        player = await RelayConnection.open(joined)
        await player.bind()
        await player.connect()
        player.send(host.allocation_id, b"through worker 1")
        assert await host.recv(timeout=5) == (player.allocation_id, b"through worker 1")
        await player.close()
        await host.close()


async def test_natneg_negotiation(workers: Workers) -> None:
    await negotiate_on_loopback(workers.natneg_port, 0xBEEF)


async def test_sighup_reloads_every_worker(workers: Workers) -> None:
    # `crossroads reload` signals the pid in server.json: the supervisor's.
    server = json.loads(
        (workers.log.parent / "state/crossroads/server.json").read_text()
    )
    assert server["pid"] == workers.process.pid
    assert server["url"] == workers.url(0)
    done = workers.output().count("reload done")
    os.kill(server["pid"], signal.SIGHUP)

    async def both_reloaded() -> bool:
        return workers.output().count("reload done") >= done + 2

    await eventually(both_reloaded, "both workers logged 'reload done'", 20)


def udp_socket_inodes(port: int) -> set[int]:
    """Inodes of the UDP sockets bound to 127.0.0.1:``port`` (/proc/net/udp)."""
    wanted = f"0100007F:{port:04X}"
    lines = Path("/proc/net/udp").read_text().splitlines()[1:]
    return {int(line.split()[9]) for line in lines if line.split()[1] == wanted}


def socket_inodes_of(pid: int) -> set[int]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    return inodes


def stun_group(workers: Workers) -> str:
    """Who holds each socket of the STUN port's SO_REUSEPORT group, for a
    failure message."""
    holders = {
        name: socket_inodes_of(pid)
        for name, pid in [
            ("supervisor", workers.process.pid),
            *((f"worker {i}", pid) for i, pid in workers.pids().items()),
        ]
    }
    return "; ".join(
        f"socket {inode}: "
        + ", ".join(n for n, held in holders.items() if inode in held)
        for inode in sorted(udp_socket_inodes(workers.stun_port))
    )


def assert_each_worker_holds_only_its_own_stun_socket(workers: Workers) -> None:
    group = udp_socket_inodes(workers.stun_port)
    assert len(group) == 2, stun_group(workers)
    assert group <= socket_inodes_of(workers.process.pid), stun_group(workers)
    held = [socket_inodes_of(pid) & group for pid in workers.pids().values()]
    assert [len(h) for h in held] == [1, 1] and held[0] != held[1], stun_group(workers)


def test_each_worker_holds_only_its_own_stun_socket(workers: Workers) -> None:
    """The supervisor keeps every worker's socket and passes each worker its
    own: a worker that also held another's would keep it in the group after
    that worker and the supervisor had let it go."""
    assert_each_worker_holds_only_its_own_stun_socket(workers)


async def answering_worker(workers: Workers, sock: socket.socket) -> int:
    """Which worker answers a Binding request from ``sock`` (the one whose
    request counter moved)."""
    loop = asyncio.get_running_loop()
    before = [
        sample(metrics(workers, i), "crossroads_stun_requests_total") for i in (0, 1)
    ]
    request, transaction = binding_request()
    for _ in range(3):
        sock.send(request)
        try:
            async with asyncio.timeout(2):
                answer = await loop.sock_recv(sock, 2048)
        except TimeoutError:
            continue
        assert answer[8:20] == transaction
        break
    else:
        raise AssertionError("no STUN answer")
    after = [
        sample(metrics(workers, i), "crossroads_stun_requests_total") for i in (0, 1)
    ]
    moved = [i for i in (0, 1) if after[i] > before[i]]
    assert len(moved) == 1, (before, after)
    return moved[0]


async def test_restarted_workers_keep_every_client_on_its_worker(
    workers: Workers,
) -> None:
    """SO_REUSEPORT deals a client to a socket by its position in the group,
    and a socket that leaves the group is replaced by the last one: were a dead
    worker's socket to close, the other worker's clients would be dealt out
    again (crossroads.transport.reuseport). The supervisor keeps it, and the
    restarted worker adopts it: nobody moves. Both workers are killed in turn,
    since only the death of a socket that is not last in the group (which one
    is depends on which worker bound first) would move anyone."""
    with contextlib.ExitStack() as stack:
        clients = []
        for _ in range(12):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
            sock.setblocking(False)
            sock.connect(("127.0.0.1", workers.stun_port))
            clients.append(sock)
        before = [await answering_worker(workers, sock) for sock in clients]
        # All on one worker: 2^-11.
        assert set(before) == {0, 1}, (before, stun_group(workers))
        for index in (0, 1):
            old = workers.pids()
            os.kill(old[index], signal.SIGKILL)

            async def restarted(index: int = index, old: dict[int, int] = old) -> bool:
                return workers.pids()[index] != old[index] and healthy(workers, index)

            await eventually(restarted, f"worker {index} restarted", 60)
            after = [await answering_worker(workers, sock) for sock in clients]
            assert after == before, f"clients moved when worker {index} restarted"
            assert_each_worker_holds_only_its_own_stun_socket(workers)


async def test_a_killed_worker_is_restarted_and_the_other_keeps_serving(
    workers: Workers,
) -> None:
    """Last in the module: it kills worker 1."""
    old = workers.pids()
    os.kill(old[1], signal.SIGKILL)
    # Worker 0 keeps answering its clients (worker 1's wait in the socket the
    # supervisor holds for it, and are answered after its restart).
    assert await stun_from_many_ports(workers.stun_port, 16) > 0

    async def restarted() -> bool:
        return workers.pids()[1] != old[1] and healthy(workers, 1)

    await eventually(restarted, "worker 1 restarted with a new pid", 60)
    assert workers.pids()[0] == old[0]  # worker 0 untouched
    assert "worker 1 (pid" in workers.output()

    async def new_worker_answers() -> bool:
        await stun_from_many_ports(workers.stun_port, 16)
        return sample(metrics(workers, 1), "crossroads_stun_requests_total") > 0

    await eventually(new_worker_answers, "the new worker 1 answers STUN", 20)


def test_a_worker_that_cannot_start_stops_the_server_with_code_2(
    tmp_path: Path,
) -> None:
    """Worker 1's HTTP port (--http-port + 1) is taken: it exits 2 at its first
    start, and the supervisor stops worker 0 and exits 2 too, instead of
    restarting it forever. Without Redis, --workers 2 spreads STUN/TURN only."""
    http_port = consecutive_free_ports(2)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CROSSROADS_")}
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("127.0.0.1", http_port + 1))
        squatter.listen()
        result = subprocess.run(
            [
                sys.executable, "-m", "crossroads", "serve", "--workers", "2",
                "--host", "127.0.0.1", "--only", "stun,turn",
                "--http-port", str(http_port), "--turn-user", f"{USER}:{PASSWORD}",
                "--stun-port", str(free_udp_tcp_port()), "--stun-alt-port", "0",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "spreads STUN/TURN" not in result.stderr  # the auto line is not shown
    assert "every worker serves stun, turn" in result.stderr
    assert "worker 1 could not start (exit 2): stopping" in result.stderr


def test_workers_with_nothing_to_spread_is_a_config_error() -> None:
    result = subprocess.run(
        [
            sys.executable, "-m", "crossroads", "serve", "--workers", "2",
            "--only", "natneg", "--host", "127.0.0.1", "--http-port", "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "config error: workers: 2 workers need STUN/TURN" in result.stderr


async def test_clients_served_first_stay_on_their_worker_as_the_others_start(
    tmp_path: Path,
) -> None:
    """The SO_REUSEPORT group is whole before the first client is answered
    (worker 0 binds every worker's socket; the others start after it): TURN
    clients allocated at the very first answer keep reaching their worker once
    worker 1 runs. Before, worker 1 joined the group late and took over about
    half of them (their Refresh got 437, their ChannelData was dropped)."""
    http_port = consecutive_free_ports(2)
    stun_port = free_udp_tcp_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CROSSROADS_")}
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    log = tmp_path / "serve.log"
    with log.open("wb") as output:
        process = subprocess.Popen(
            [
                sys.executable, "-m", "crossroads", "serve", "--workers", "2",
                "--host", "127.0.0.1", "--only", "stun,turn",
                "--http-port", str(http_port), "--turn-user", f"{USER}:{PASSWORD}",
                "--stun-port", str(stun_port), "--stun-alt-port", "0",
                "--drain-timeout", "5",
            ],
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    server = Workers(process, log, http_port, stun_port, 0, 0)
    clients: list[TurnClient] = []
    try:

        async def answers() -> bool:
            assert process.poll() is None, server.output()
            try:
                return await stun_from_many_ports(stun_port, 1) == 1
            except ConnectionRefusedError:  # nothing bound yet: ICMP unreachable
                return False

        await eventually(answers, "the first STUN answer", 45)
        for _ in range(16):
            client = await TurnClient.connect(
                ("127.0.0.1", stun_port), USER, PASSWORD, timeout=10
            )
            clients.append(client)
            await client.allocate()

        async def both_up() -> bool:
            return healthy(server, 0) and healthy(server, 1)

        await eventually(both_up, "both workers up", 45)
        for client in clients:  # a client dealt to another worker gets 437
            assert await client.refresh() > 0
    finally:
        for client in clients:
            with contextlib.suppress(Exception):
                await client.close()
        process.terminate()
        process.wait(30)
