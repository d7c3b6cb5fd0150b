"""Transport routes of the stream plane (a TLS connection joined to a TCP
socket, as an RFC 6062 data connection over TURN-TLS is) and held sockets, on
real loopback connections."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import pytest

from crossroads.transport.streamplane import (
    CHUNK,
    CLOSED,
    MAX_TRANSPORT_READ,
    HeldStream,
    StreamPlane,
    TransportRoute,
)
from crossroads.transport.tls import development_certificate, server_context
from tests.conftest import eventually
from tests.transport.stream_support import tcp_pair

pytestmark = pytest.mark.timeout(60)


class _Accepted(asyncio.Protocol):
    """The server side of a TLS connection until the plane takes it."""

    def __init__(self, made: asyncio.Future[asyncio.Transport]) -> None:
        self.made = made

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        tls = cast(asyncio.Transport, transport)
        tls.pause_reading()
        self.made.set_result(tls)


@dataclass
class TlsPair:
    """A TLS client and the relay's side of it, a TCP peer and the relay's
    side of it; the relay sides are what the plane joins."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    tls: asyncio.Transport
    peer: socket.socket
    relay_peer: socket.socket
    ended: list[TransportRoute] = field(default_factory=list)


@pytest.fixture
async def tls_pair(tmp_path: Path) -> AsyncIterator[TlsPair]:
    loop = asyncio.get_running_loop()
    cert, key = development_certificate(tmp_path)
    made: asyncio.Future[asyncio.Transport] = loop.create_future()
    server = await loop.create_server(
        lambda: _Accepted(made), "127.0.0.1", 0, ssl=server_context(cert, key)
    )
    client_context = ssl.create_default_context(cafile=str(cert))
    reader, writer = await asyncio.open_connection(
        "127.0.0.1",
        server.sockets[0].getsockname()[1],
        ssl=client_context,
        server_hostname="127.0.0.1",
    )
    tls = await asyncio.wait_for(made, 10)
    peer, relay_peer = await tcp_pair()
    pair = TlsPair(reader, writer, tls, peer, relay_peer)
    try:
        yield pair
    finally:
        writer.transport.abort()
        tls.abort()
        peer.close()
        relay_peer.close()
        server.close()


def join(plane: StreamPlane, pair: TlsPair, **heads: bytes) -> TransportRoute:
    route = plane.join_transport(
        pair.relay_peer,
        pair.tls,
        on_closed=pair.ended.append,
        half_close=False,
        **heads,
    )
    assert route is not None
    return route


def small_buffers(*settings: tuple[socket.socket, int]) -> None:
    """Kernel buffers of 64 KiB, so that a stall shows within a few MiB (on
    loopback they grow to several MiB each)."""
    for sock, option in settings:
        sock.setsockopt(socket.SOL_SOCKET, option, 64 * 1024)


def ended(pair: TlsPair) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return bool(pair.ended)

    return check


async def read_exactly(sock: socket.socket, size: int) -> bytes:
    loop = asyncio.get_running_loop()
    got = bytearray()
    while len(got) < size:
        chunk = await asyncio.wait_for(loop.sock_recv(sock, size - len(got)), 10)
        if not chunk:
            raise EOFError(f"end of stream after {len(got)} of {size} bytes")
        got += chunk
    return bytes(got)


async def test_tls_and_tcp_forward_both_ways_after_the_heads(
    tls_pair: TlsPair,
) -> None:
    loop = asyncio.get_running_loop()
    plane = StreamPlane(idle_timeout=None, max_routes=4)
    route = join(plane, tls_pair, to_a=b"to-peer:", to_b=b"to-client:")
    up, down = os.urandom(1 << 20), os.urandom(1 << 20)
    tls_pair.writer.write(up)
    sending = loop.create_task(loop.sock_sendall(tls_pair.peer, down))
    at_peer = await read_exactly(tls_pair.peer, 8 + len(up))
    at_client = await asyncio.wait_for(tls_pair.reader.readexactly(10 + len(down)), 10)
    await sending
    assert at_peer == b"to-peer:" + up
    assert at_client == b"to-client:" + down
    # Heads are not counted; every byte read is.
    assert route.b_to_a.octets == len(up) and route.a_to_b.octets == len(down)
    assert route.a_to_b.chunks >= 1 and route.b_to_a.chunks >= 1
    plane.close()


async def test_a_peer_that_stops_reading_stops_the_tls_side_being_read(
    tls_pair: TlsPair,
) -> None:
    """Backpressure on a TLS data connection: while the peer does not read,
    the relay stops reading the TLS client (its TCP window fills) and holds
    at most one read of the TLS transport; nothing is lost when it resumes."""
    plane = StreamPlane(idle_timeout=None, max_routes=4)
    route = join(plane, tls_pair)
    small_buffers(
        (tls_pair.peer, socket.SO_RCVBUF),
        (tls_pair.relay_peer, socket.SO_SNDBUF),
        (tls_pair.tls.get_extra_info("socket"), socket.SO_RCVBUF),
        (tls_pair.writer.get_extra_info("socket"), socket.SO_SNDBUF),
    )
    payload = os.urandom(8 << 20)
    tls_pair.writer.write(payload)
    most = 0

    async def stalled() -> bool:
        nonlocal most
        most = max(most, route.buffered)
        return route.writing and not route.b.is_reading()

    await eventually(stalled, "the relay stops reading the TLS client")
    taken = route.b_to_a.octets
    for _ in range(20):  # it stays stalled: nothing more is read or held
        await asyncio.sleep(0.01)
        most = max(most, route.buffered)
    assert not route.b.is_reading() and route.b_to_a.octets == taken
    assert taken < len(payload)
    assert 0 < most <= MAX_TRANSPORT_READ
    received = await read_exactly(tls_pair.peer, len(payload))
    assert received == payload
    assert route.b.is_reading() and not route.writing
    plane.close()


async def test_a_tls_client_that_stops_reading_stops_the_peer_being_read(
    tls_pair: TlsPair,
) -> None:
    """The other way: the peer is read only while the TLS transport's write
    buffer is under its high-water mark."""
    loop = asyncio.get_running_loop()
    plane = StreamPlane(idle_timeout=None, max_routes=4)
    route = join(plane, tls_pair)
    small_buffers(
        (tls_pair.peer, socket.SO_SNDBUF),
        (tls_pair.relay_peer, socket.SO_RCVBUF),
        (tls_pair.tls.get_extra_info("socket"), socket.SO_SNDBUF),
        (tls_pair.writer.get_extra_info("socket"), socket.SO_RCVBUF),
    )
    payload = os.urandom(8 << 20)
    sending = loop.create_task(loop.sock_sendall(tls_pair.peer, payload))
    most = 0

    async def stalled() -> bool:
        nonlocal most
        most = max(most, route.buffered)
        return route.b_full and not route.reading

    await eventually(stalled, "the relay stops reading the peer")
    taken = route.a_to_b.octets
    for _ in range(20):  # it stays stalled: nothing more is read or held
        await asyncio.sleep(0.01)
        most = max(most, route.buffered)
    assert not route.reading and route.a_to_b.octets == taken < len(payload)
    # The transport's own high-water mark (512 KiB for asyncio's TLS), and
    # at most one chunk read before it said so.
    assert most <= route.high_water + CHUNK
    received = await asyncio.wait_for(tls_pair.reader.readexactly(len(payload)), 20)
    await sending
    assert received == payload
    plane.close()


async def test_a_peer_fin_closes_the_tls_side_after_its_bytes(
    tls_pair: TlsPair,
) -> None:
    """RFC 6062 §5.5 (no half-close): the peer's FIN ends the route once what
    it sent is delivered, and the client sees the end."""
    loop = asyncio.get_running_loop()
    plane = StreamPlane(idle_timeout=None, max_routes=4)
    join(plane, tls_pair)
    await loop.sock_sendall(tls_pair.peer, b"last words")
    tls_pair.peer.shutdown(socket.SHUT_WR)
    assert await asyncio.wait_for(tls_pair.reader.read(), 10) == b"last words"
    await eventually(ended(tls_pair), "the route ends")
    assert tls_pair.ended[0].reason == CLOSED
    assert await asyncio.wait_for(loop.sock_recv(tls_pair.peer, 1), 10) == b""
    assert plane.routes == set()
    plane.close()


async def test_a_tls_client_close_reaches_the_peer_after_its_bytes(
    tls_pair: TlsPair,
) -> None:
    plane = StreamPlane(idle_timeout=None, max_routes=4)
    join(plane, tls_pair)
    tls_pair.writer.write(b"bye")
    await tls_pair.writer.drain()
    tls_pair.writer.close()
    assert await read_exactly(tls_pair.peer, 3) == b"bye"
    loop = asyncio.get_running_loop()
    assert await asyncio.wait_for(loop.sock_recv(tls_pair.peer, 1), 10) == b""
    await eventually(ended(tls_pair), "the route ends")
    assert tls_pair.ended[0].reason == CLOSED
    plane.close()


async def test_a_held_socket_reads_up_to_its_limit_then_waits() -> None:
    loop = asyncio.get_running_loop()
    plane = StreamPlane(idle_timeout=None, max_routes=4)
    sender, relay_side = await tcp_pair()
    ended: list[HeldStream] = []
    held = plane.hold(relay_side, limit=1000, on_closed=ended.append)
    await loop.sock_sendall(sender, b"x" * 1500)

    async def waiting() -> bool:
        return not held.reading

    await eventually(waiting, "the held socket stops being read")
    assert len(held.buffered) == 1000
    sock, head = held.release()
    assert head == b"x" * 1000 and plane.held == set() and ended == []
    assert await read_exactly(sock, 500) == b"x" * 500
    sock.close()
    sender.close()
    plane.close()


async def test_a_held_socket_that_ends_is_closed_and_reported() -> None:
    plane = StreamPlane(idle_timeout=None, max_routes=4)
    sender, relay_side = await tcp_pair()
    ended: list[HeldStream] = []
    held = plane.hold(relay_side, limit=1000, on_closed=ended.append)
    sender.close()

    async def reported() -> bool:
        return ended == [held]

    await eventually(reported, "the held socket is reported")
    assert relay_side.fileno() == -1 and plane.held == set()
    plane.close()
