"""The one driver: a core on a real loopback socket, and the single core timer."""

from __future__ import annotations

import asyncio
import socket

import pytest

from crossroads.transport.driver import CoreTimer, DatagramDriver, SocketSetDriver
from crossroads.transport.sockets import bound_address, make_udp_socket
from crossroads.types import Address

pytestmark = pytest.mark.timeout(30)

#: How long after a datagram the test core sends its "tick" (seconds).
TICK_DELAY = 0.05


class EchoCore:
    """A minimal datagram core: echoes each datagram, then sends ``tick`` to the
    same sender when its timer fires; reports each datagram as an event."""

    def __init__(self) -> None:
        self.outbox: list[tuple[bytes, Address]] = []
        self.events: list[bytes] = []
        self.tick_at: float | None = None
        self.tick_to: Address | None = None
        self.timer_calls = 0

    def receive_datagram(self, data: bytes, addr: Address, now: float) -> None:
        self.outbox.append((b"echo:" + data, addr))
        self.events.append(data)
        self.tick_at, self.tick_to = now + TICK_DELAY, addr

    def datagrams_to_send(self, now: float) -> list[tuple[bytes, Address]]:
        out, self.outbox = self.outbox, []
        return out

    def pop_events(self) -> list[bytes]:
        out, self.events = self.events, []
        return out

    def get_timer(self) -> float | None:
        return self.tick_at

    def handle_timer(self, now: float) -> None:
        self.timer_calls += 1
        if self.tick_at is not None and now >= self.tick_at:
            assert self.tick_to is not None
            self.outbox.append((b"tick", self.tick_to))
            self.tick_at = None


async def _receive(sock: socket.socket) -> bytes:
    loop = asyncio.get_running_loop()
    return await asyncio.wait_for(loop.sock_recv(sock, 2048), 5)


@pytest.mark.parametrize("server_host", ["127.0.0.1", "::"])
async def test_the_driver_feeds_sends_dispatches_and_fires_the_timer(
    server_host: str,
) -> None:
    loop = asyncio.get_running_loop()
    core = EchoCore()
    seen: list[bytes] = []
    server = make_udp_socket(server_host, 0)
    transport, driver = await loop.create_datagram_endpoint(
        lambda: DatagramDriver(core, seen.extend), sock=server
    )
    client = make_udp_socket("127.0.0.1", 0)
    try:
        client.sendto(b"hello", ("127.0.0.1", bound_address(server)[1]))
        # On a dual-stack "::" socket the reply to an IPv4 client must go to
        # the mapped address: the driver does that, the core never knows.
        assert await _receive(client) == b"echo:hello"
        assert seen == [b"hello"]
        assert driver.timer.armed_at == core.tick_at is not None
        assert await _receive(client) == b"tick"
        assert core.timer_calls == 1
        assert driver.timer.armed_at is None
    finally:
        transport.close()
        client.close()


async def test_an_unchanged_deadline_keeps_the_armed_timer() -> None:
    loop = asyncio.get_running_loop()
    deadline: list[float | None] = [loop.time() + 60]
    fired: list[float] = []
    timer = CoreTimer(loop, lambda: deadline[0], fired.append)
    timer.rearm()
    armed = timer.armed_at
    timer.rearm()
    assert timer.armed_at == armed == deadline[0]
    deadline[0] = None
    timer.rearm()
    assert timer.armed_at is None
    timer.close()
    assert fired == []


async def test_the_timer_fires_once_and_rearms_from_the_new_deadline() -> None:
    loop = asyncio.get_running_loop()
    deadlines: list[float | None] = [loop.time(), loop.time() + 0.01, None]
    fired: list[float] = []

    def fire(now: float) -> None:
        fired.append(now)
        deadlines.pop(0)

    timer = CoreTimer(loop, lambda: deadlines[0], fire)
    timer.rearm()
    for _ in range(200):
        if len(fired) == 2:
            break
        await asyncio.sleep(0.01)
    assert len(fired) == 2 and fired[0] <= fired[1]
    assert timer.armed_at is None


async def test_a_closed_timer_never_fires_nor_rearms() -> None:
    loop = asyncio.get_running_loop()
    fired: list[float] = []
    timer = CoreTimer(loop, loop.time, fired.append)
    timer.rearm()
    timer.close()
    timer.rearm()
    assert timer.armed_at is None
    # Let the loop run past the cancelled deadline.
    for _ in range(3):
        await asyncio.sleep(0)
    assert fired == []


class CrossCore:
    """A two-socket core: what arrives on socket "a" is answered from socket
    "b" and from "alias" (which has no socket of its own), with an event."""

    def __init__(self) -> None:
        self.outbox: list[tuple[bytes, Address, str]] = []
        self.events: list[str] = []

    def receive_datagram(
        self, data: bytes, addr: Address, now: float, socket: str
    ) -> None:
        self.events.append(socket)
        self.outbox.append((b"from-b:" + data, addr, "b"))
        self.outbox.append((b"from-alias:" + data, addr, "alias"))

    def datagrams_to_send(self, now: float) -> list[tuple[bytes, Address, str]]:
        out, self.outbox = self.outbox, []
        return out

    def pop_events(self) -> list[str]:
        out, self.events = self.events, []
        return out

    def get_timer(self) -> float | None:
        return None

    def handle_timer(self, now: float) -> None:
        pass


async def test_the_socket_set_driver_sends_from_the_socket_the_core_names() -> None:
    core = CrossCore()
    seen: list[list[str]] = []
    driver = SocketSetDriver(core, lambda events, now: seen.append(events))
    a, b = make_udp_socket("127.0.0.1", 0), make_udp_socket("127.0.0.1", 0)
    await driver.open("a", a)
    await driver.open("b", b)
    driver.share("alias", "a")
    driver.share("b", "a")  # "b" has its own socket: sharing changes nothing
    client = make_udp_socket("127.0.0.1", 0)
    loop = asyncio.get_running_loop()
    try:
        client.sendto(b"hi", bound_address(a))
        replies = set()
        for _ in range(2):
            data, source = await asyncio.wait_for(loop.sock_recvfrom(client, 100), 5)
            replies.add((data, source[1]))
        assert replies == {
            (b"from-b:hi", bound_address(b)[1]),
            (b"from-alias:hi", bound_address(a)[1]),
        }
        assert seen == [["a"]]
        assert sorted(driver.sockets) == ["a", "b"]
    finally:
        driver.close()
        client.close()
    assert driver.sockets == []
