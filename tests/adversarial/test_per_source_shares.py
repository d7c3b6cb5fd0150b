"""Per-source caps above the listener's share.

At ``ulimit -n 1024`` the HTTP port's descriptor share was 73 connections and
its per-IP cap 128: one IP with 110 half-sent requests made ``/healthz``, the
relay API and p2p answer 503 for everyone. The relay ws listener (share 73,
64 per IP) was two IPs' worth. Every per-source cap is now at most an eighth
of its table's global cap (crossroads.transport.admission), so one IP, or
two, leave the rest of a listener to everybody else.

Each test runs a real ``crossroads serve`` (every service, the relay's ws
listener on) under RLIMIT_NOFILE 1024 and attacks it from loopback sources.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator

import httpx
import pytest
import websockets

from tests.adversarial.connection_flood_support import (
    HALF_REQUEST,
    ServeProcess,
    close_all,
    serve_with_fd_limit,
)
from tests.adversarial.test_relay_websocket import RawWebSocket, frame
from tests.e2e.relay_support import allocate_pair, server_endpoint
from tests.services.test_p2p import hello

pytestmark = pytest.mark.timeout(120)

KEY = "per-source-key-0123456789"
ATTACKER, ATTACKER2, VICTIM = "127.0.1.1", "127.0.1.2", "127.0.1.3"


@contextlib.contextmanager
def _serve() -> ServeProcess:  # type: ignore[misc]
    with serve_with_fd_limit(
        1024, "--relay-websocket", "--api-key", KEY, "--relay-allow-private-peers"
    ) as server:
        yield server


async def _connect(
    port: int, source: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.wait_for(
        asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0)), 10
    )


async def _half_requests(
    port: int, source: str, count: int
) -> list[asyncio.StreamWriter]:
    writers = []
    for _ in range(count):
        try:
            _, writer = await _connect(port, source)
        except (OSError, TimeoutError):
            continue
        writers.append(writer)
        with contextlib.suppress(OSError):
            writer.write(HALF_REQUEST)
    await asyncio.sleep(0.5)  # let the server accept (or refuse) them all
    return writers


@contextlib.asynccontextmanager
async def _http(server: ServeProcess, source: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{server.http_port}",
        transport=httpx.AsyncHTTPTransport(local_address=source),
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=10,
    ) as client:
        yield client


async def _p2p_welcome(server: ServeProcess, source: str) -> dict[str, object]:
    sock = socket.create_connection(
        ("127.0.0.1", server.http_port), timeout=10, source_address=(source, 0)
    )
    url = f"ws://127.0.0.1:{server.http_port}/p2p/v1/ws"
    async with websockets.connect(url, sock=sock, open_timeout=10) as ws:
        await ws.send(hello())
        while True:
            message = json.loads(await asyncio.wait_for(ws.recv(), 10))
            if message["type"] in ("welcome", "error"):
                return dict(message)


async def test_one_ip_with_half_sent_requests_leaves_http_to_the_others() -> None:
    with _serve() as server:
        writers = await _half_requests(server.http_port, ATTACKER, 110)
        try:
            async with _http(server, VICTIM) as http:
                assert (await http.get("/healthz")).status_code == 200
                regions = await http.get("/v1/regions")
                assert regions.status_code == 200, regions.text
            assert (await _p2p_welcome(server, VICTIM))["type"] == "welcome"
        finally:
            close_all(writers)


async def _upgrades(port: int, source: str, count: int) -> list[RawWebSocket]:
    """Open up to ``count`` relay WebSockets from ``source``; those upgraded."""
    opened: list[RawWebSocket] = []
    for _ in range(count):
        try:
            reader, writer = await _connect(port, source)
        except (OSError, TimeoutError):
            continue
        ws = RawWebSocket(reader, writer)
        try:
            await ws.handshake("127.0.0.1", port)
        except (OSError, asyncio.IncompleteReadError, TimeoutError):
            ws.close()
            continue
        opened.append(ws)
    return opened


async def test_one_or_two_ips_leave_the_relay_websocket_to_the_others() -> None:
    with _serve() as server:
        async with _http(server, VICTIM) as http:
            host, _ = await allocate_pair(http)
        port = server_endpoint(host, "ws")["port"]
        held: list[RawWebSocket] = []
        try:
            held += await _upgrades(port, ATTACKER, 80)
            held += await _upgrades(port, ATTACKER2, 80)
            (victim,) = await _upgrades(port, VICTIM, 1)
            held.append(victim)
            victim.send(frame(9, b"alive?"))
            assert await victim.recv_frame() == (10, b"alive?")
        finally:
            for ws in held:
                ws.close()
