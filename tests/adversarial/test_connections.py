"""Idle and half-open connections cannot exhaust the process.

Every TCP listener (HTTP with the p2p WebSocket, STUN/TURN over TCP, OpenTTD)
has per-IP and global caps from one admission helper, read deadlines, and a
share of the descriptor limit, so a flood of one listener leaves the others
working. docs/security.md, section "Connections, descriptors and read deadlines".
"""

from __future__ import annotations

import asyncio
import gc
import json
import resource
from typing import Any

import httpx
import pytest
import websockets

from crossroads.client.openttd import GcClient
from crossroads.client.turn import TurnClient
from crossroads.config import default_config
from crossroads.proto.openttd.coordinator import ClientListing, GcListing
from crossroads.proto.stun import Method, encode, request
from crossroads.runtime import Runtime, start
from crossroads.services.stun import StunService, TcpConnection
from crossroads.transport.admission import ResourceBudget
from tests.adversarial.connection_flood_support import (
    HALF_REQUEST,
    close_all,
    closed_by_server,
    loopback_sources,
    open_half_requests,
    serve_with_fd_limit,
)
from tests.conftest import eventually, loopback_config

TXID = bytes(range(12))


def _stun(runtime: Runtime) -> StunService:
    service = runtime.services["stun"]
    assert isinstance(service, StunService)
    return service


async def _start(**overrides: Any) -> Runtime:
    return await start(default_config(loopback_config(**overrides)))


async def _binding_over(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> bytes:
    writer.write(encode(request(Method.BINDING, TXID)))
    header = await asyncio.wait_for(reader.readexactly(20), 10)
    await asyncio.wait_for(reader.readexactly(int.from_bytes(header[2:4], "big")), 10)
    return header[:2]


def _http_live(runtime: Runtime) -> int:
    return runtime.resources.admissions["http"].live


# ------------------------------------------------------------------ HTTP


async def test_http_per_ip_cap_refuses_the_next_connection_with_503() -> None:
    runtime = await _start(core__only=["stun"], core__http_max_connections_per_ip=3)
    host, port = runtime.http_address
    held: list[asyncio.StreamWriter] = []
    try:
        for _ in range(3):
            _, writer = await asyncio.open_connection(host, port)
            held.append(writer)
        await eventually(
            lambda: _async(_http_live(runtime) == 3), "three connections admitted"
        )
        reader, writer = await asyncio.open_connection(host, port)
        held.append(writer)
        answer = await asyncio.wait_for(reader.read(), 10)  # closed after it
        assert answer.startswith(b"HTTP/1.1 503 ")
        body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
        assert body["code"] == "too_many_connections"
        # Another source address is not affected by the first one's cap.
        async with httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(local_address="127.0.0.2")
        ) as client:
            response = await client.get(f"http://{host}:{port}/healthz")
            assert response.status_code == 200
        metrics = (await _get(runtime, "/metrics", "127.0.0.3")).text
        assert (
            'crossroads_tcp_refused_total{listener="http",reason="over-ip-limit"} 1.0'
            in metrics
        )
        assert 'crossroads_tcp_connection_limit{listener="http"}' in metrics
        assert "crossroads_fd_limit " in metrics
    finally:
        close_all(held)
        await runtime.close()


async def test_http_slowloris_is_closed_after_the_request_deadline() -> None:
    runtime = await _start(core__only=["stun"], core__http_request_timeout=2.0)
    host, port = runtime.http_address
    try:
        # One sends nothing, one drips a header line per 200 ms, one sends half
        # a body: each is closed about two seconds after it started waiting.
        silent = await asyncio.open_connection(host, port)
        drip = await asyncio.open_connection(host, port)
        body = await asyncio.open_connection(host, port)
        body[1].write(
            b"POST /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"
        )
        drip[1].write(HALF_REQUEST)

        async def dripping() -> None:
            for i in range(100):
                drip[1].write(b"X-Drip-%d: 1\r\n" % i)
                await asyncio.sleep(0.2)

        dripper = asyncio.create_task(dripping())
        try:
            for reader in (silent[0], drip[0], body[0]):
                assert await closed_by_server(reader, 15)
        finally:
            dripper.cancel()
        # A keep-alive client that finishes each request in time is not cut
        # off, however long it stays: it makes requests for more than twice
        # the deadline on one connection (a close fails readuntil()).
        reader, writer = await asyncio.open_connection(host, port)
        try:
            loop = asyncio.get_running_loop()
            until = loop.time() + 5.0
            while loop.time() < until:
                writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                assert head.startswith(b"HTTP/1.1 200 ")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.lower().split(b"\r\n")
                    if line.startswith(b"content-length:")
                )
                await asyncio.wait_for(reader.readexactly(length), 10)
                await asyncio.sleep(0.2)
        finally:
            writer.close()
        metrics = (await _get(runtime, "/metrics")).text
        closed = [
            line
            for line in metrics.splitlines()
            if line.startswith(
                'crossroads_tcp_closed_total{listener="http",reason="request-timeout"}'
            )
        ]
        assert closed and float(closed[0].split()[-1]) == 3
        await eventually(lambda: _async(_http_live(runtime) <= 1), "back to baseline")
    finally:
        for _, writer in (silent, drip, body):
            writer.transport.abort()
        await runtime.close()


async def test_http_headers_over_16_kib_are_refused() -> None:
    runtime = await _start(core__only=["stun"])
    host, port = runtime.http_address
    try:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(HALF_REQUEST + b"X-Big: " + b"a" * 20_000 + b"\r\n")
        answer = await asyncio.wait_for(reader.read(), 10)
        assert answer.startswith(b"HTTP/1.1 400 ")
        writer.close()
    finally:
        await runtime.close()


async def test_websocket_counts_against_the_http_caps_until_it_closes() -> None:
    runtime = await _start(core__only=["p2p"], core__http_max_connections_per_ip=2)
    host, port = runtime.http_address
    url = f"ws://{host}:{port}/p2p/v1/ws"
    try:
        async with asyncio.timeout(30):
            # connect() returns once the server answered 101: both upgraded.
            async with websockets.connect(url), websockets.connect(url):
                await eventually(lambda: _async(_http_live(runtime) == 2), "admitted")
                with pytest.raises(websockets.InvalidStatus) as refused:
                    await websockets.connect(url)
                assert refused.value.response.status_code == 503
            await eventually(lambda: _async(_http_live(runtime) == 0), "released")
            async with websockets.connect(url):
                assert _http_live(runtime) == 1
    finally:
        await runtime.close()


# ------------------------------------------------------------------ STUN/TURN TCP


async def test_stun_tcp_per_ip_cap_refuses_the_next_connection() -> None:
    runtime = await _start(core__only=["stun"], stun__tcp_max_connections_per_ip=3)
    host, port = _stun(runtime).primary
    held: list[asyncio.StreamWriter] = []
    try:
        streams = [await asyncio.open_connection(host, port) for _ in range(3)]
        held += [w for _, w in streams]
        await eventually(
            lambda: _async(len(_stun(runtime).connections) == 3), "three admitted"
        )
        reader, writer = await asyncio.open_connection(host, port)
        held.append(writer)
        assert await closed_by_server(reader, 10)
        for stream in streams:
            assert await _binding_over(*stream) == b"\x01\x01"
        other = await asyncio.open_connection(host, port, local_addr=("127.0.0.2", 0))
        held.append(other[1])
        assert await _binding_over(*other) == b"\x01\x01"
        assert _stun(runtime).stats.drops.get("tcp-ip-connection-limit") == 1
    finally:
        close_all(held)
        await runtime.close()


async def test_stun_tcp_slowloris_and_silent_connections_are_closed() -> None:
    runtime = await _start(core__only=["stun"], stun__tcp_message_timeout=1.0)
    host, port = _stun(runtime).primary
    held: list[asyncio.StreamWriter] = []
    try:
        good = await asyncio.open_connection(host, port)
        held.append(good[1])
        assert await _binding_over(*good) == b"\x01\x01"
        silent = await asyncio.open_connection(host, port)
        partial = await asyncio.open_connection(host, port)
        held += [silent[1], partial[1]]
        # A STUN header announcing 60 KiB of attributes, then nothing more.
        partial[1].write(encode(request(Method.BINDING, TXID))[:2] + b"\xf0\x00")
        assert await closed_by_server(silent[0], 15)
        assert await closed_by_server(partial[0], 15)
        drops = _stun(runtime).stats.drops
        assert drops.get("tcp-first-message-timeout") == 1
        assert drops.get("tcp-partial-message-timeout") == 1
        # The client that sent whole messages is still served.
        assert await _binding_over(*good) == b"\x01\x01"
    finally:
        close_all(held)
        await runtime.close()


async def test_stun_tcp_buffers_are_returned_after_a_partial_message_flood() -> None:
    """200 connections each holding ~60 KiB of an unfinished message: all are
    closed by the partial-message deadline and no connection object, buffer
    or admission count is left behind."""
    runtime = await _start(core__only=["stun"], stun__tcp_message_timeout=1.0)
    host, port = _stun(runtime).primary
    service = _stun(runtime)
    gc.collect()
    baseline = sum(isinstance(o, TcpConnection) for o in gc.get_objects())
    header = (
        encode(request(Method.BINDING, TXID))[:2] + b"\xff\xfc" + b"\x21\x12\xa4\x42"
    )
    partial = header + TXID + bytes(60 * 1024)
    writers = await open_half_requests(port, loopback_sources(20), 10, partial)
    try:
        assert len(writers) == 200
        await eventually(
            lambda: _async(
                service.stats.drops.get("tcp-partial-message-timeout", 0) == 200
            ),
            "every partial message timed out",
            timeout=30,
        )
        await eventually(
            lambda: _async(not service.connections and service.admission.live == 0),
            "connections forgotten",
        )
        assert service.admission.per_source == {}
        gc.collect()
        left = sum(isinstance(o, TcpConnection) for o in gc.get_objects())
        assert left <= baseline
    finally:
        close_all(writers)
        await runtime.close()


# ------------------------------------------------------------------ descriptors


def test_descriptor_shares_leave_room_for_every_listener() -> None:
    budget = ResourceBudget(1024)
    http = budget.listener("http", 10_000, 10_000)
    others = [budget.listener(name, 10_000, 10_000) for name in ("stun", "a", "b")]
    # Half the limit for listeners, split four ways.
    assert http.max_items == 128
    admitted = sum(http.admit(f"192.0.2.{i % 250}") is None for i in range(1000))
    assert admitted == 128
    for admission in others:
        assert admission.admit("198.51.100.1") is None


def test_soft_descriptor_limit_is_raised_to_the_hard_one() -> None:
    script = (
        "import resource; from crossroads.transport.admission import raise_fd_limit;"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, 2048));"
        "print(raise_fd_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
    )
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["2048", "2048"]


async def test_http_flood_under_ulimit_leaves_turn_and_openttd_working() -> None:
    """`ulimit -n 512`, then 600 half-sent HTTP requests from 100 loopback
    addresses (under the per-IP cap): HTTP stops at its descriptor share and
    TURN allocations and the OpenTTD coordinator keep working."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2048:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    with serve_with_fd_limit(
        512,
        "--only",
        "stun,turn,openttd",
        "--turn-user",
        "alice:secret",
    ) as server:
        writers = await open_half_requests(server.http_port, loopback_sources(100), 6)
        try:
            assert len(writers) >= 500
            async with await TurnClient.connect(
                ("127.0.0.1", server.stun_port), "alice", "secret", timeout=10
            ) as turn:
                relayed = await turn.allocate()
                assert relayed[0] == "127.0.0.1"
            client = await GcClient.connect("127.0.0.1", server.coordinator_port)
            try:
                await client.send_message(ClientListing(6, 6, "13.0", 0))
                for _ in range(20):
                    if isinstance(await client.recv(10), GcListing):
                        break
                else:
                    raise AssertionError("no listing")
            finally:
                await client.close()
        finally:
            close_all(writers)

        # Once the flood is gone, HTTP answers again and holds only the
        # connection of the scrape itself.
        async def released() -> bool:
            text = await asyncio.to_thread(server.metrics)
            return 'crossroads_tcp_connections{listener="http"} 1.0' in text

        await eventually(released, "flood connections released")
        metrics = await asyncio.to_thread(server.metrics)
        assert 'crossroads_tcp_refused_total{listener="http",reason="over-limit"}' in (
            metrics
        )
        assert "Too many open files" not in server.output()


# ------------------------------------------------------------------ helpers


async def _async(value: bool) -> bool:
    return value


async def _get(
    runtime: Runtime, path: str, source: str = "127.0.0.1"
) -> httpx.Response:
    host, port = runtime.http_address
    async with httpx.AsyncClient(
        transport=httpx.AsyncHTTPTransport(local_address=source)
    ) as client:
        return await client.get(f"http://{host}:{port}{path}")
