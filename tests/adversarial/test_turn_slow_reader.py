"""TURN over TCP and TLS: a client that stops reading for a while keeps its
allocation.

Relayed data is unreliable by contract (docs/security.md, "TURN clients that
stall"): while a TCP/TLS client's connection has more than 64 KiB unsent, the
ChannelData and Data indications for it are dropped and counted
(``crossroads_turn_dropped_total{reason="tcp-client-buffer-full"}``); the
connection and the allocation stay, and once the client reads again it gets
what its peers send next. Before, the connection was aborted at 64 KiB and the
allocation went with it (pion lost its allocation to a 1 MB burst).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from crossroads.client.turn import TurnClient
from crossroads.config import default_config
from crossroads.proto.stun import Class, Message, Method, encode
from crossroads.runtime import Runtime, start
from crossroads.services.stun import (
    TCP_CONTROL_ALLOWANCE,
    TCP_MAX_UNSENT,
    TCP_WRITE_STALL_TIMEOUT,
    TcpConnection,
)
from crossroads.services.turn import TurnService
from crossroads.transport.tls import development_certificate
from tests.conftest import loopback_config, until

pytestmark = pytest.mark.timeout(60)

USER, PASSWORD = "alice", "secret123"
#: The burst pion's client lost its allocation to: 1,000 datagrams of 1,000 bytes.
BURST = 1000
SIZE = 1000
#: Small kernel buffers on both ends, so the kernel cannot absorb the burst
#: and the server's write buffer fills as it does on a real link.
CLIENT_RCVBUF = 4096
SERVER_SNDBUF = 16384


@pytest.fixture(name="tls_runtime")
async def tls_runtime_fixture(tmp_path: Path) -> AsyncIterator[Runtime]:
    cert, key = development_certificate(tmp_path)
    runtime = await start(
        default_config(
            loopback_config(
                core__only=["stun", "turn"],
                core__tls_cert=str(cert),
                core__tls_key=str(key),
                turn__user=[f"{USER}:{PASSWORD}"],
                turn__allow_loopback_peers=True,
                # Binding answers unthrottled: the control bound is what
                # stops a client that never reads them.
                stun__rate_limit=0,
            )
        )
    )
    try:
        yield runtime
    finally:
        await runtime.close()


def turn_of(runtime: Runtime) -> TurnService:
    service = runtime.services["turn"]
    assert isinstance(service, TurnService)
    return service


async def tcp_client(service: TurnService) -> TurnClient:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, CLIENT_RCVBUF)
    sock.setblocking(False)
    server = service.stun.primary
    await asyncio.get_running_loop().sock_connect(sock, server)
    return await TurnClient.on_socket(sock, server, USER, PASSWORD, transport="tcp")


async def tls_client(service: TurnService, cafile: Path) -> TurnClient:
    trust = ssl.create_default_context(cafile=str(cafile))
    (address,) = service.stun.tls_addresses
    client = await TurnClient.connect(
        address, USER, PASSWORD, transport="tcp", tls=trust
    )
    assert client._tcp is not None
    raw = client._tcp.get_extra_info("socket")
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, CLIENT_RCVBUF)
    return client


def server_connection(service: TurnService) -> TcpConnection:
    (allocation,) = service.core.allocations.values()
    link = allocation.transport_data
    endpoint = getattr(link, "endpoint", None)
    assert isinstance(endpoint, TcpConnection)
    return endpoint


def narrow_link(conn: TcpConnection) -> None:
    """A real link's window closes when its reader stalls; on loopback the
    kernel would grow the server's send buffer to 4 MB and hide the stall, so
    the server's end gets a real link's size."""
    assert conn.stream is not None
    server_sock = conn.stream.get_extra_info("socket")
    server_sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SERVER_SNDBUF)


async def stall_and_burst(
    service: TurnService, client: TurnClient, peer: socket.socket
) -> tuple[TcpConnection, tuple[str, int]]:
    """Allocate, bind a channel to ``peer``, stop reading, and let ``peer``
    send the 1 MB burst (at the pace of a fast peer: the relay socket's 1 MiB
    receive buffer holds it; the client's link cannot)."""
    relayed = await client.allocate()
    await client.bind_channel(peer.getsockname())
    conn = server_connection(service)
    narrow_link(conn)
    assert client._tcp is not None
    client._tcp.pause_reading()
    payload = bytes(SIZE)
    for _ in range(BURST):
        peer.sendto(payload, relayed)
    return conn, relayed


def udp_peer() -> socket.socket:
    peer = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    peer.bind(("127.0.0.1", 0))
    peer.setblocking(False)
    return peer


async def burst_while_stalled(
    service: TurnService, connect: Callable[[], Awaitable[TurnClient]]
) -> None:
    peer = udp_peer()
    client = await connect()
    try:
        conn, relayed = await stall_and_burst(service, client, peer)
        assert conn.stream is not None
        admission = service.stun.admission
        assert client._tcp is not None
        await until(
            lambda: (
                service.stats.drops.get("tcp-client-buffer-full", 0) > 0
                or not service.core.allocations
            )
        )
        # The connection and the allocation stay; what is buffered for the
        # client is bounded and charged to the listener's table.
        assert len(service.core.allocations) == 1, "the stall cost the allocation"
        assert service.stats.drops.get("tcp-client-buffer-full", 0) > 0
        assert conn.stream is not None and not conn.stream.is_closing()
        unsent = conn.stream.get_write_buffer_size()
        assert unsent <= TCP_MAX_UNSENT
        assert admission.buffered > 0
        assert "tcp-slow-reader" not in service.stun.stats.drops
        # Reading again: later datagrams arrive (the queue drops what the
        # test does not read; the marker is what matters).
        client._tcp.resume_reading()
        marker = b"after the stall"
        found = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while not found and loop.time() < deadline:
            peer.sendto(marker, relayed)
            try:
                while True:
                    data, _ = await client.receive(timeout=0.2)
                    if data == marker:
                        found = True
                        break
            except TimeoutError:
                pass
        assert found, "no datagram reached the client after it read again"
        assert len(service.core.allocations) == 1
        # Drained: the buffered bytes go back to the budget.
        assert await until(lambda: admission.buffered == 0)
        metrics = service.ctx.metrics.get_sample_value(
            "crossroads_turn_dropped_total", {"reason": "tcp-client-buffer-full"}
        )
        assert metrics is not None and metrics > 0
    finally:
        await client.close()
        peer.close()
    assert await until(lambda: service.stun.admission.buffered == 0)


async def test_tcp_client_that_stalls_keeps_its_allocation(
    tls_runtime: Runtime,
) -> None:
    service = turn_of(tls_runtime)
    await burst_while_stalled(service, lambda: tcp_client(service))


async def test_tls_client_that_stalls_keeps_its_allocation(
    tls_runtime: Runtime, tmp_path: Path
) -> None:
    service = turn_of(tls_runtime)
    cafile = tmp_path / "dev-cert.pem"
    await burst_while_stalled(service, lambda: tls_client(service, cafile))


async def test_a_client_that_never_reads_again_is_closed_after_the_deadline(
    tls_runtime: Runtime,
) -> None:
    service = turn_of(tls_runtime)
    peer = udp_peer()
    client = await tcp_client(service)
    try:
        conn, _ = await stall_and_burst(service, client, peer)
        assert await until(
            lambda: service.stats.drops.get("tcp-client-buffer-full", 0) > 0
        )
        now = asyncio.get_running_loop().time()
        service.stun.sweep(now)
        service.stun.sweep(now + TCP_WRITE_STALL_TIMEOUT / 2)
        assert conn.stream is not None, "closed before the deadline"
        service.stun.sweep(now + TCP_WRITE_STALL_TIMEOUT + 1)
        assert service.stun.stats.drops.get("tcp-write-stall-timeout") == 1
        assert await until(lambda: not service.core.allocations)
        assert await until(lambda: service.stun.admission.buffered == 0)
    finally:
        await client.close()
        peer.close()


async def test_a_client_that_never_reads_its_answers_is_closed(
    tls_runtime: Runtime,
) -> None:
    """Answers to the client's own requests are never dropped; beyond the
    relayed bound plus a small allowance the client is cut off."""
    service = turn_of(tls_runtime)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, CLIENT_RCVBUF)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, service.stun.primary)
    try:
        request = encode(Message(Class.REQUEST, Method.BINDING, bytes(12)))
        await loop.sock_sendall(sock, request)
        assert await until(lambda: len(service.stun.connections) == 1)
        (conn,) = service.stun.connections
        narrow_link(conn)
        # Far more answers than the bound holds (~88 bytes each).
        count = 4 * (TCP_MAX_UNSENT + TCP_CONTROL_ALLOWANCE) // 80
        for _ in range(count // 100):
            try:
                await loop.sock_sendall(sock, request * 100)
            except OSError:
                break
        assert await until(
            lambda: service.stun.stats.drops.get("tcp-slow-reader", 0) == 1
        )
        assert await until(lambda: not service.stun.connections)
        assert service.stun.admission.buffered == 0
    finally:
        sock.close()
