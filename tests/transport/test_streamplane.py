"""Stream routes of the relay data plane, on real loopback TCP sockets."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from crossroads.transport.streamplane import (
    CLOSED,
    IDLE,
    RESET,
    SHUTDOWN,
    StreamPlane,
    StreamRoute,
)
from tests.conftest import eventually
from tests.transport.stream_support import tcp_pair

pytestmark = pytest.mark.timeout(60)


@dataclass
class Pair:
    """Two client sockets, each connected to a relay-side socket; the relay
    sides are what the plane joins."""

    left: socket.socket
    right: socket.socket
    relay_left: socket.socket
    relay_right: socket.socket
    ended: list[StreamRoute] = field(default_factory=list)

    def close(self) -> None:
        for sock in (self.left, self.right, self.relay_left, self.relay_right):
            sock.close()


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    left, relay_left = await tcp_pair()
    right, relay_right = await tcp_pair()
    made = Pair(left, right, relay_left, relay_right)
    try:
        yield made
    finally:
        made.close()


def join(plane: StreamPlane, pair: Pair, **heads: bytes) -> StreamRoute:
    route = plane.join(
        pair.relay_left, pair.relay_right, on_closed=pair.ended.append, **heads
    )
    assert route is not None
    return route


async def read_exactly(sock: socket.socket, size: int) -> bytes:
    loop = asyncio.get_running_loop()
    got = bytearray()
    while len(got) < size:
        chunk = await asyncio.wait_for(loop.sock_recv(sock, size - len(got)), 10)
        if not chunk:
            raise EOFError(f"end of stream after {len(got)} of {size} bytes")
        got += chunk
    return bytes(got)


async def read_eof(sock: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    assert await asyncio.wait_for(loop.sock_recv(sock, 1), 10) == b""


async def test_forwards_both_ways_after_the_heads(pair: Pair) -> None:
    plane = StreamPlane(idle_timeout=60, max_routes=4)
    loop = asyncio.get_running_loop()
    route = join(plane, pair, to_a=b"hello left", to_b=b"hello right")
    assert await read_exactly(pair.left, 10) == b"hello left"
    assert await read_exactly(pair.right, 11) == b"hello right"
    payload = os.urandom(2_000_000)
    send = asyncio.ensure_future(loop.sock_sendall(pair.left, payload))
    assert await read_exactly(pair.right, len(payload)) == payload
    await send
    await loop.sock_sendall(pair.right, b"pong")
    assert await read_exactly(pair.left, 4) == b"pong"
    assert route.a_to_b.octets == len(payload)
    assert route.b_to_a.octets == 4
    assert route.octets == len(payload) + 4
    plane.close()
    assert pair.ended == [route]
    assert route.reason == SHUTDOWN
    assert plane.routes == set()
    assert plane.forwarded_bytes == len(payload) + 4


async def test_a_half_close_keeps_the_other_way_flowing(pair: Pair) -> None:
    plane = StreamPlane(idle_timeout=60, max_routes=4)
    loop = asyncio.get_running_loop()
    route = join(plane, pair)
    await loop.sock_sendall(pair.left, b"bye")
    pair.left.shutdown(socket.SHUT_WR)
    assert await read_exactly(pair.right, 3) == b"bye"
    await read_eof(pair.right)
    assert not route.closed
    await loop.sock_sendall(pair.right, b"still here")
    assert await read_exactly(pair.left, 10) == b"still here"
    pair.right.shutdown(socket.SHUT_WR)
    await read_eof(pair.left)

    async def ended() -> bool:
        return route.closed

    await eventually(ended, "the route ends once both ways ended")
    assert route.reason == CLOSED
    assert plane.ended == {CLOSED: 1}


async def test_a_reader_that_stops_stalls_its_sender(pair: Pair) -> None:
    """Backpressure: the relay stops reading the sender while the receiver
    does not read, holding at most one pipe; nothing is lost when it resumes."""
    plane = StreamPlane(idle_timeout=60, max_routes=4)
    loop = asyncio.get_running_loop()
    route = join(plane, pair)
    pair.left.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
    sent = bytearray()
    chunk = os.urandom(64 * 1024)

    async def stalled() -> bool:
        # Fill whatever the kernel takes without blocking.
        try:
            while True:
                sent.extend(chunk[: pair.left.send(chunk)])
        except BlockingIOError:
            pass
        return route.a_to_b.writing and not route.a_to_b.reading

    await eventually(stalled, "the relay waits for the receiver, not reading")
    # Held by the relay: at most one pipe's worth.
    assert route.a_to_b.pending <= route.a_to_b.capacity
    in_flight = len(sent)
    received = await read_exactly(pair.right, in_flight)
    assert received == bytes(sent)
    await loop.sock_sendall(pair.left, b"after")
    assert await read_exactly(pair.right, 5) == b"after"
    assert route.a_to_b.reading
    plane.close()


async def test_a_reset_ends_the_route_and_closes_the_other_side(pair: Pair) -> None:
    plane = StreamPlane(idle_timeout=60, max_routes=4)
    loop = asyncio.get_running_loop()
    route = join(plane, pair)
    await loop.sock_sendall(pair.left, b"x")
    assert await read_exactly(pair.right, 1) == b"x"
    # SO_LINGER 0: close() sends RST instead of FIN.
    pair.left.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    pair.left.close()
    # The other way now hits the reset peer.
    for _ in range(3):
        # Sending may itself fail once the route closed the socket: fine.
        with contextlib.suppress(OSError):
            await loop.sock_sendall(pair.right, b"to a dead peer")

    async def ended() -> bool:
        return route.closed

    await eventually(ended, "the route ends on the reset")
    assert route.reason == RESET
    # Closed: a FIN, or a RST when the relay side had unread bytes from it.
    with contextlib.suppress(ConnectionResetError):
        await read_eof(pair.right)


async def test_idle_routes_are_closed_by_the_sweep(pair: Pair) -> None:
    plane = StreamPlane(idle_timeout=30, max_routes=4)
    loop = asyncio.get_running_loop()
    route = join(plane, pair)
    now = loop.time()
    plane.sweep(now + 10)
    await loop.sock_sendall(pair.left, b"alive")
    assert await read_exactly(pair.right, 5) == b"alive"
    plane.sweep(now + 35)  # bytes moved since the last sweep: not idle
    assert not route.closed
    plane.sweep(now + 66)
    assert route.closed and route.reason == IDLE
    assert plane.ended == {IDLE: 1}
    await read_eof(pair.left)
    await read_eof(pair.right)


async def test_the_plane_refuses_routes_beyond_its_cap(pair: Pair) -> None:
    plane = StreamPlane(idle_timeout=60, max_routes=1)
    join(plane, pair)
    extra_left, extra_relay_left = await tcp_pair()
    extra_right, extra_relay_right = await tcp_pair()
    try:
        refused = plane.join(
            extra_relay_left, extra_relay_right, on_closed=pair.ended.append
        )
        assert refused is None
        assert extra_relay_left.fileno() == -1  # the plane closed what it took
        await read_eof(extra_left)
    finally:
        for sock in (extra_left, extra_right, extra_relay_left, extra_relay_right):
            sock.close()
        plane.close()


def test_the_plane_needs_positive_bounds() -> None:
    async def make(idle: float, routes: int) -> None:
        StreamPlane(idle_timeout=idle, max_routes=routes)

    for idle, routes in ((0.0, 1), (1.0, 0)):
        with pytest.raises(ValueError):
            asyncio.run(make(idle, routes))


async def test_a_side_reset_before_the_join_ends_the_route_at_once(pair: Pair) -> None:
    """The head cannot go out: the route ends inside ``join`` and says so."""
    plane = StreamPlane(idle_timeout=60, max_routes=4)
    loop = asyncio.get_running_loop()
    pair.left.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    pair.left.close()

    async def reset_arrived() -> bool:
        # The relay side learns of the RST when it next reads or writes.
        try:
            return pair.relay_left.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:
            return False
        except ConnectionResetError:
            return True

    await eventually(reset_arrived, "the RST reached the relay side")
    route = join(plane, pair, to_a=b"TURN_CONNECTED", to_b=b"TURN_CONNECTED")
    assert route.closed and pair.ended == [route]
    assert route.reason == RESET
    assert plane.routes == set()
    # The other side is closed too (after its own head, which went first).
    with contextlib.suppress(ConnectionResetError):
        while await asyncio.wait_for(loop.sock_recv(pair.right, 100), 10):
            pass
