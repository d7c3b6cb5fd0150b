"""TURN interop with real third-party programs, both ways.

- coturn's ``turnutils_uclient`` (with ``turnutils_peer`` as the echo peer)
  against crossroads' TURN service: UDP and TCP to the server, channels and Send
  indications, client-to-client, IPv6, the RFC 6062 TCP relay, time-limited
  credentials, DONT-FRAGMENT with padded ChannelData, dual allocation. Each run
  must end with "Total lost packets 0" and leave no allocation behind.
- crossroads' TURN client against coturn's ``turnserver``.
- the aioice TURN client (a Python implementation) against crossroads.

uclient runs are kept short (2 sessions, a few messages each).
"""

from __future__ import annotations

import asyncio
import re
import shutil
import signal
import socket
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aioice.turn
import pytest

from crossroads.client.turn import TurnClient, TurnClientError, rest_credentials
from crossroads.config import default_config
from crossroads.runtime import Runtime, start
from crossroads.services.turn import TurnService
from tests.conftest import free_port, loopback_config
from tests.interop.stun_support import (  # noqa: F401 (fixture)
    Coturn,
    coturn_fixture,
)

pytestmark = [pytest.mark.interop, pytest.mark.timeout(90)]

USER, PASSWORD, SECRET, REALM = "alice", "secret123", "s3cr3t", "crossroads.test"
LOST = re.compile(r"Total lost packets (\d+) \(([\d.]+)%\)")
TOTALS = re.compile(r"start_mclient: tot_send_msgs=(\d+), tot_recv_msgs=(\d+)")


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} missing: install the Debian coturn package (make install)")
    return path


def turn_service(runtime: Runtime) -> TurnService:
    service = runtime.services["turn"]
    assert isinstance(service, TurnService)
    return service


TurnRuntime = Callable[..., Awaitable[Runtime]]


@pytest.fixture
async def turn_runtime() -> AsyncIterator[TurnRuntime]:
    """Start crossroads (STUN + TURN) in-process on loopback, ephemeral ports."""
    started: list[Runtime] = []

    async def make(**overrides: Any) -> Runtime:
        values: dict[str, Any] = {
            "core__only": ["stun", "turn"],
            "turn__user": [f"{USER}:{PASSWORD}"],
            "turn__secret": [SECRET],
            "turn__realm": REALM,
            "turn__allow_loopback_peers": True,
        }
        values.update(overrides)
        runtime = await start(default_config(loopback_config(**values)))
        started.append(runtime)
        return runtime

    try:
        yield make
    finally:
        for runtime in started:
            await runtime.close()


@pytest.fixture
async def echo_peer() -> AsyncIterator[Callable[[str], Awaitable[int]]]:
    """coturn's turnutils_peer (a UDP echo server) on loopback."""
    processes: list[asyncio.subprocess.Process] = []

    async def run(*hosts: str) -> int:
        port = free_port(socket.SOCK_DGRAM)
        args = [a for host in hosts for a in ("-L", host)]
        process = await asyncio.create_subprocess_exec(
            tool("turnutils_peer"),
            *args,
            "-p",
            str(port),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        processes.append(process)
        await echoes(hosts[0], port, process)
        return port

    try:
        yield run  # type: ignore[misc]
    finally:
        for process in processes:
            if process.returncode is None:
                process.kill()
            await process.wait()


async def echoes(host: str, port: int, process: asyncio.subprocess.Process) -> None:
    """Wait (bounded) until the echo peer answers: a client started before it
    has bound its port would see its first datagrams refused."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.setblocking(False)
        probe.connect((host, port))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while loop.time() < deadline:
            assert process.returncode is None, "turnutils_peer exited"
            try:
                probe.send(b"ready?")
                async with asyncio.timeout(0.1):
                    if await loop.sock_recv(probe, 64) == b"ready?":
                        return
            except (TimeoutError, ConnectionRefusedError):
                await asyncio.sleep(0.05)
    raise AssertionError(f"turnutils_peer on {host}:{port} never echoed")


async def uclient(*args: str, timeout: float = 60) -> str:
    return await command_output(tool("turnutils_uclient"), *args, timeout=timeout)


async def command_output(*command: str, timeout: float = 60) -> str:
    """What ``command`` printed (stdout and stderr); killed at ``timeout``."""
    process = await asyncio.create_subprocess_exec(
        *command,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(process.communicate(), timeout)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    return out.decode(errors="replace")


def assert_no_loss(output: str) -> tuple[int, int]:
    lost = LOST.search(output)
    totals = TOTALS.findall(output)
    assert lost is not None and totals, output[-3000:]
    sent, received = (int(x) for x in totals[-1])
    assert lost.group(1) == "0", output[-3000:]
    assert sent > 0 and received == sent, output[-3000:]
    return sent, received


async def settle(service: TurnService) -> None:
    """Wait (bounded) for clients' final Refresh(0) to be processed."""
    for _ in range(100):
        if not service.core.allocations and not service.core.connections:
            return
        await asyncio.sleep(0.05)


def expire_everything(service: TurnService) -> None:
    """Run the service's timer two hours ahead: every allocation a client left
    behind expires (uclient does not delete its allocations), through the real
    relay sockets."""
    later = service.loop.time() + 7200
    deadline = service.core.get_timer()
    while deadline is not None and deadline <= later:
        service.core.handle_timer(later)
        service._process_events()
        deadline = service.core.get_timer()


def assert_released(service: TurnService) -> None:
    expire_everything(service)
    assert service.core.allocations == {}
    assert service.core.connections == {}
    assert service.relays == set()
    assert service.core.ports.in_use == set()
    assert service.core.user_allocations == {}


def base_args(port: int) -> list[str]:
    # -m 2 clients, -n 10 messages each, 10 ms apart: a few seconds per run.
    return ["-m", "2", "-n", "10", "-z", "10", "-l", "100", "-p", str(port)]


UCLIENT_CASES = {
    "udp-channels": ["-c", "-X"],
    "udp-send-indications": ["-s", "-c", "-X"],
    "udp-with-rtcp": ["-X"],
    "tcp-channels": ["-t", "-c"],
    "tcp-send-indications": ["-t", "-s", "-c"],
    "dont-fragment-padded": ["-g", "-D", "-c"],
}


@pytest.mark.parametrize("flags", list(UCLIENT_CASES.values()), ids=list(UCLIENT_CASES))
async def test_uclient_to_peer(
    turn_runtime: TurnRuntime,
    echo_peer: Callable[..., Awaitable[int]],
    flags: list[str],
) -> None:
    runtime = await turn_runtime()
    service = turn_service(runtime)
    _, port = service.stun.primary
    peer = await echo_peer("127.0.0.1")
    output = await uclient(
        *flags,
        "-e",
        "127.0.0.1",
        "-r",
        str(peer),
        "-u",
        USER,
        "-w",
        PASSWORD,
        *base_args(port),
        "127.0.0.1",
    )
    assert_no_loss(output)
    to_peer, _, to_client, _, _ = service.counters()
    assert to_peer >= 20 and to_client >= 20
    assert_released(service)


@pytest.mark.parametrize(
    "flags", [[], ["-s"], ["-t"]], ids=["udp", "udp-send-indications", "tcp"]
)
async def test_uclient_client_to_client(
    turn_runtime: TurnRuntime, flags: list[str]
) -> None:
    runtime = await turn_runtime()
    service = turn_service(runtime)
    _, port = service.stun.primary
    output = await uclient(
        "-y", *flags, "-u", USER, "-w", PASSWORD, *base_args(port), "127.0.0.1"
    )
    assert_no_loss(output)
    assert_released(service)


async def test_uclient_tcp_relay_rfc6062(turn_runtime: TurnRuntime) -> None:
    runtime = await turn_runtime()
    service = turn_service(runtime)
    _, port = service.stun.primary
    output = await uclient(
        "-T", "-u", USER, "-w", PASSWORD, *base_args(port), "127.0.0.1"
    )
    assert_no_loss(output)
    await settle(service)  # uclient closes its TCP connections at exit
    assert_released(service)
    assert service.peer_pipes == {} and service.client_pipes == {}


async def test_uclient_ipv6(
    turn_runtime: TurnRuntime, echo_peer: Callable[..., Awaitable[int]]
) -> None:
    if not socket.has_ipv6:
        pytest.fail("IPv6 loopback required")
    runtime = await turn_runtime(core__host="::1", turn__relay_ip6="::1")
    service = turn_service(runtime)
    _, port = service.stun.primary
    peer = await echo_peer("::1")
    output = await uclient(
        "-x", "-c", "-e", "::1", "-r", str(peer), "-u", USER, "-w", PASSWORD,
        *base_args(port), "::1",
    )  # fmt: skip
    assert_no_loss(output)
    assert_released(service)


async def test_uclient_time_limited_credentials(
    turn_runtime: TurnRuntime, echo_peer: Callable[..., Awaitable[int]]
) -> None:
    runtime = await turn_runtime(turn__user=[])
    service = turn_service(runtime)
    _, port = service.stun.primary
    peer = await echo_peer("127.0.0.1")
    # -W: uclient builds "<expiry>:<user>" and base64(HMAC-SHA1(secret, it)).
    output = await uclient(
        "-c", "-e", "127.0.0.1", "-r", str(peer), "-W", SECRET, "-u", "bob",
        *base_args(port), "127.0.0.1",
    )  # fmt: skip
    assert_no_loss(output)
    assert service.core.counters.allocations_created >= 2


async def test_uclient_dual_allocation(
    turn_runtime: TurnRuntime, echo_peer: Callable[..., Awaitable[int]]
) -> None:
    runtime = await turn_runtime(turn__relay_ip6="::1")
    service = turn_service(runtime)
    _, port = service.stun.primary
    peer = await echo_peer("127.0.0.1")
    output = await uclient(
        "-Z", "-e", "127.0.0.1", "-r", str(peer), "-u", USER, "-w", PASSWORD,
        *base_args(port), "127.0.0.1",
    )  # fmt: skip
    assert_no_loss(output)


async def test_uclient_wrong_password_gets_401(turn_runtime: TurnRuntime) -> None:
    runtime = await turn_runtime()
    service = turn_service(runtime)
    _, port = service.stun.primary
    output = await uclient(
        "-e", "127.0.0.1", "-u", USER, "-w", "wrong", "-m", "1", "-n", "1",
        "-p", str(port), "127.0.0.1", timeout=30,
    )  # fmt: skip
    assert "Cannot complete Allocation" in output
    counters = service.core.counters
    assert counters.drops.get("auth-bad-integrity", 0) >= 1
    assert counters.responses.get(("allocate", 401), 0) >= 2
    assert service.core.allocations == {}


# ------------------------------------------------------------------ coturn


async def udp_echo() -> tuple[socket.socket, asyncio.Task[None]]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    loop = asyncio.get_running_loop()

    async def serve() -> None:
        while True:
            data, addr = await loop.sock_recvfrom(sock, 4096)
            await loop.sock_sendto(sock, data, addr)

    return sock, asyncio.create_task(serve())


async def exercise(client: TurnClient, peer: tuple[str, int]) -> None:
    relayed = await client.allocate()
    assert relayed[0] == "127.0.0.1" and relayed[1] > 0
    await client.create_permission(peer[0])
    await client.send(b"send-indication", peer)
    assert await client.receive(timeout=5) == (b"send-indication", peer)
    await client.bind_channel(peer)
    await client.send(b"channel-data", peer)
    assert await client.receive(timeout=5) == (b"channel-data", peer)
    assert await client.refresh() > 0


async def coturn_with_user(coturn: Callable[..., Coturn], **options: Any) -> Coturn:
    """coturn on 127.0.0.1 with the static user USER:PASSWORD and loopback
    peers allowed; ``options`` go to the fixture (``tls=(cert, key)``)."""
    return await asyncio.to_thread(
        coturn,
        "-a",
        "-f",
        "--allow-loopback-peers",
        f"--user={USER}:{PASSWORD}",
        "--min-port=40000",
        "--max-port=49999",
        hosts=("127.0.0.1",),
        **options,
    )


@pytest.mark.parametrize("transport", ["udp", "tcp"])
async def test_crossroads_client_against_coturn(
    coturn: Callable[..., Coturn], transport: str
) -> None:
    server = await coturn_with_user(coturn)
    sock, task = await udp_echo()
    try:
        async with await TurnClient.connect(
            ("127.0.0.1", server.port),
            USER,
            PASSWORD,
            transport=transport,  # type: ignore[arg-type]
        ) as client:
            await exercise(client, sock.getsockname())
            assert not client.session.sha256  # coturn offers no SHA-256
        async with await TurnClient.connect(
            ("127.0.0.1", server.port),
            USER,
            "wrong",
            transport=transport,  # type: ignore[arg-type]
        ) as client:
            with pytest.raises(TurnClientError) as excinfo:
                await client.allocate()
            assert excinfo.value.code == 401
    finally:
        task.cancel()
        sock.close()


async def test_crossroads_client_against_coturn_rest_credentials(
    coturn: Callable[..., Coturn],
) -> None:
    server = await asyncio.to_thread(
        coturn,
        "--use-auth-secret",
        f"--static-auth-secret={SECRET}",
        "--allow-loopback-peers",
        "--min-port=40000",
        "--max-port=49999",
        hosts=("127.0.0.1",),
    )
    sock, task = await udp_echo()
    try:
        username, password = rest_credentials(SECRET, "carl", ttl=600)
        async with await TurnClient.connect(
            ("127.0.0.1", server.port), username, password
        ) as client:
            await exercise(client, sock.getsockname())
    finally:
        task.cancel()
        sock.close()


async def test_crossroads_client_against_crossroads_sha256(
    turn_runtime: TurnRuntime,
) -> None:
    runtime = await turn_runtime()
    service = turn_service(runtime)
    sock, task = await udp_echo()
    try:
        for transport in ("udp", "tcp"):
            async with await TurnClient.connect(
                service.stun.primary,
                USER,
                PASSWORD,
                transport=transport,  # type: ignore[arg-type]
            ) as client:
                await exercise(client, sock.getsockname())
                assert client.session.sha256  # RFC 8489 PASSWORD-ALGORITHMS
        await settle(service)
        assert service.core.allocations == {}
    finally:
        task.cancel()
        sock.close()


# ------------------------------------------------------------------ aioice


class Collector(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.queue: asyncio.Queue[tuple[bytes, Any]] = asyncio.Queue()

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.queue.put_nowait((data, addr))


@pytest.mark.parametrize("transport", ["udp", "tcp"])
async def test_aioice_client_against_crossroads(
    turn_runtime: TurnRuntime, transport: str
) -> None:
    runtime = await turn_runtime()
    service = turn_service(runtime)
    sock, task = await udp_echo()
    try:
        relay, protocol = await aioice.turn.create_turn_endpoint(
            Collector,
            server_addr=service.stun.primary,
            username=USER,
            password=PASSWORD,
            transport=transport,
        )
        try:
            relayed = relay.get_extra_info("sockname")
            assert relayed is not None and relayed[0] == "127.0.0.1"
            peer = sock.getsockname()
            for n in range(3):
                relay.sendto(b"ping %d" % n, peer)
                data, addr = await asyncio.wait_for(protocol.queue.get(), 5)
                assert data == b"ping %d" % n and tuple(addr) == peer
            assert service.core.channel_count == 1  # aioice binds a channel
        finally:
            relay.close()
        await settle(service)
        assert service.core.allocations == {}
    finally:
        task.cancel()
        sock.close()


def test_coturn_tools_present() -> None:
    for name in ("turnutils_uclient", "turnutils_peer", "turnserver"):
        tool(name)
    done = subprocess.run(
        [tool("turnutils_uclient")], capture_output=True, text=True, timeout=10
    )
    assert "Usage" in done.stdout + done.stderr


# ------------------------------------------------------------------ CLI, pure Python


@pytest.mark.parametrize("pure_python", [True, False], ids=["pure-python", "default"])
async def test_crossroads_serve_only_turn_cli(
    echo_peer: Callable[..., Awaitable[int]], pure_python: bool, tmp_path: Any
) -> None:
    """`crossroads serve --only turn` (no stun service): TURN starts the STUN
    listener itself; flags, env and the users file work; the pure-Python data
    plane passes the same uclient run as the C one."""
    import os
    import sys
    import time

    from tests.conftest import free_udp_tcp_port

    port = free_udp_tcp_port()
    users = tmp_path / "users"
    users.write_text(f"# test users\n{USER}:{PASSWORD}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CROSSROADS_")}
    env["CROSSROADS_ALLOW_LOOPBACK_PEERS"] = "true"
    env["CROSSROADS_TURN_REALM"] = REALM
    if pure_python:
        env["CROSSROADS_TURN_PURE_PYTHON"] = "1"
    log = tmp_path / "serve.log"
    command = [
        sys.executable, "-m", "crossroads", "serve", "--only", "turn",
        "--host", "127.0.0.1", "--http-port", "0", "--stun-port", str(port),
        "--stun-alt-port", "0", "--turn-users-file", str(users),
        "--relay-ports", "42000-42999",
    ]  # fmt: skip
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env
        )
    try:
        deadline = time.monotonic() + 20
        while "data plane" not in log.read_text(errors="replace"):
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            await asyncio.sleep(0.05)
        text = log.read_text()
        assert ("pure Python" in text) == pure_python
        assert f"udp 127.0.0.1:{port}" in text  # the STUN listener, started by TURN
        peer = await echo_peer("127.0.0.1")
        output = await uclient(
            "-c", "-e", "127.0.0.1", "-r", str(peer), "-u", USER, "-w", PASSWORD,
            *base_args(port), "127.0.0.1",
        )  # fmt: skip
        assert_no_loss(output)
        relayed = re.findall(r"relay addr: 127\.0\.0\.1:(\d+)", output)
        assert all(42000 <= int(p) <= 42999 for p in relayed)
    finally:
        process.send_signal(signal.SIGINT)  # at once: SIGTERM would drain
        process.wait(10)
