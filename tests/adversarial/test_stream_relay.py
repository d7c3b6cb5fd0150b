"""Hostile peers on a stream route of the relay data plane (OpenTTD TURN).

Random sequences of what a peer can do to a relayed TCP connection: send,
stop reading while the other side sends, half-close, reset. Whatever the
order, each side receives exactly what the other sent (a prefix, once a reset
destroyed bytes in flight), ends of stream are propagated, the route ends, and
no descriptor is left behind. Runs on asyncio's loop and on uvloop (what
``crossroads serve`` uses).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from crossroads.transport.streamplane import CLOSED, RESET, StreamPlane, StreamRoute
from tests.transport.stream_support import tcp_pair

pytestmark = pytest.mark.timeout(300)

LEFT, RIGHT = 0, 1
#: Seconds any one wait may take on a loaded machine (a bound, not a timing).
WAIT = 20.0

Action = tuple[str, int, int]
actions = st.lists(
    st.one_of(
        st.tuples(
            st.just("send"),
            st.sampled_from((LEFT, RIGHT)),
            st.one_of(st.integers(1, 2000), st.sampled_from((65536, 400_000))),
        ),
        st.tuples(
            st.just("stall"),
            st.sampled_from((LEFT, RIGHT)),
            st.sampled_from((1000, 300_000, 3_000_000)),
        ),
        st.tuples(st.just("half-close"), st.sampled_from((LEFT, RIGHT)), st.just(0)),
        st.tuples(st.just("reset"), st.sampled_from((LEFT, RIGHT)), st.just(0)),
    ),
    max_size=8,
)


def loop_factories() -> list[Callable[[], asyncio.AbstractEventLoop]]:
    factories: list[Callable[[], asyncio.AbstractEventLoop]] = [asyncio.new_event_loop]
    with contextlib.suppress(ImportError):
        import uvloop

        factories.append(uvloop.new_event_loop)
    return factories


@dataclass
class Side:
    """One client socket of the pair and what it has received."""

    sock: socket.socket
    received: bytearray = field(default_factory=bytearray)
    reading: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    sent: bytearray = field(default_factory=bytearray)
    shut: bool = False
    reset: bool = False

    async def read_forever(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                await self.reading.wait()
                chunk = await loop.sock_recv(self.sock, 1 << 16)
                if not chunk:
                    return
                self.received += chunk
        except OSError:
            return  # reset, or our own socket closed
        finally:
            self.ended.set()


async def play(script: list[Action]) -> None:
    loop = asyncio.get_running_loop()
    left, relay_left = await tcp_pair()
    right, relay_right = await tcp_pair()
    sides = (Side(left), Side(right))
    for side in sides:
        side.reading.set()
    ended: list[StreamRoute] = []
    plane = StreamPlane(idle_timeout=60, max_routes=1)
    route = plane.join(relay_left, relay_right, on_closed=ended.append)
    assert route is not None
    readers = [asyncio.ensure_future(side.read_forever()) for side in sides]
    try:
        for kind, who, size in script:
            me, other = sides[who], sides[1 - who]
            if me.reset or other.reset:
                break
            if kind == "send" and not me.shut:
                data = os.urandom(size)
                me.sent += data
                await asyncio.wait_for(loop.sock_sendall(me.sock, data), WAIT)
            elif kind == "stall" and not other.shut:
                # ``me`` stops reading while the other side sends ``size``.
                me.reading.clear()
                data = os.urandom(size)
                other.sent += data
                sending = asyncio.ensure_future(loop.sock_sendall(other.sock, data))
                await asyncio.sleep(0)
                me.reading.set()
                await asyncio.wait_for(sending, WAIT)
            elif kind == "half-close" and not me.shut:
                me.shut = True
                me.sock.shutdown(socket.SHUT_WR)
            elif kind == "reset":
                me.reset = True
                me.sock.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
                readers[who].cancel()
                me.sock.close()
        # The survivors end their streams, as a peer does once the other
        # went away (a relay cannot tell a silent peer from a reset one it
        # neither reads nor writes: that is the idle timeout's case).
        for side in sides:
            if not side.shut and not side.reset:
                side.shut = True
                side.sock.shutdown(socket.SHUT_WR)
        survivors = [i for i, side in enumerate(sides) if not side.reset]
        for i in survivors:
            await asyncio.wait_for(sides[i].ended.wait(), WAIT)
        deadline = loop.time() + WAIT
        while not route.closed:
            assert loop.time() < deadline, "the route did not end"
            await asyncio.sleep(0.02)
        assert ended == [route]
        if any(side.reset for side in sides):
            assert route.reason in (RESET, CLOSED)
            for i in survivors:
                sent = sides[1 - i].sent
                assert sent.startswith(sides[i].received)
        else:
            assert route.reason == CLOSED
            assert sides[LEFT].received == sides[RIGHT].sent
            assert sides[RIGHT].received == sides[LEFT].sent
            assert route.a_to_b.octets == len(sides[LEFT].sent)
            assert route.b_to_a.octets == len(sides[RIGHT].sent)
        assert plane.routes == set()
    finally:
        for reader in readers:
            reader.cancel()
        plane.close()
        for sock in (left, right, relay_left, relay_right):
            sock.close()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("make_loop", loop_factories(), ids=lambda f: f.__module__)
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(script=actions)
# A reset met while its socket was watched for reading: uvloop stops watching
# a descriptor that reports EPOLLERR without calling its reader, so the plane
# watches its sockets through an epoll set of its own (the route used to wait
# for the idle timeout here, on uvloop only).
@example(
    script=[("stall", LEFT, 3_000_000), ("stall", LEFT, 3_000_000), ("reset", RIGHT, 0)]
)
@example(
    script=[
        ("stall", RIGHT, 3_000_000),
        ("stall", RIGHT, 3_000_000),
        ("reset", LEFT, 0),
    ]
)
def test_any_peer_behaviour_keeps_the_streams_whole(
    make_loop: Callable[[], asyncio.AbstractEventLoop], script: list[Action]
) -> None:
    with asyncio.Runner(loop_factory=make_loop) as runner:
        runner.run(play_and_count(script))


async def play_and_count(script: list[Action]) -> None:
    # Counted inside the loop: an event loop's own descriptors (uvloop opens
    # some lazily, on first use) are not the plane's.
    before = open_fds()
    await play(script)
    assert open_fds() == before, "descriptors left behind"
