"""The natneg relay pool on loopback: learning, forwarding, strangers, release."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import AsyncIterator

import pytest

from crossroads.proto.natneg.packets import ConnectPing
from crossroads.proto.natneg.server import SessionId
from crossroads.proto.policy import AddressPolicy, Verdict
from crossroads.transport.natneg_relay import RelayPool
from tests.conftest import free_port

pytestmark = pytest.mark.timeout(30)

LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"),)


def udp(ip: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    sock.bind((ip, 0))
    return sock


async def recv(
    sock: socket.socket, timeout: float = 1.0
) -> tuple[bytes, tuple[str, int]] | None:
    loop = asyncio.get_running_loop()
    try:
        data, addr = await asyncio.wait_for(loop.sock_recvfrom(sock, 4096), timeout)
    except TimeoutError:
        return None
    return data, (addr[0], addr[1])


@pytest.fixture
async def pool() -> AsyncIterator[RelayPool]:
    relay = RelayPool(
        bind_host="127.0.0.1",
        advertise_host="127.0.0.1",
        port_range=None,
        idle_timeout=30.0,
        max_pairs=2,
        policy=AddressPolicy(allow=LOOPBACK),
    )
    try:
        yield relay
    finally:
        await relay.close()


def ping(cookie: int) -> bytes:
    return ConnectPing(4, cookie, "127.0.0.1", 1, 0, 0).encode()


async def test_learns_from_cookie_ping_and_forwards_both_ways(pool: RelayPool) -> None:
    pair = pool.allocate(SessionId(77, 1), ("127.0.0.1", "127.0.0.5"))
    assert pair is not None
    side0, side1 = pair
    a, b, stranger = udp("127.0.0.1"), udp("127.0.0.5"), udp("127.0.0.9")
    try:
        # Not a ping with the cookie: not learned, nothing forwarded.
        a.sendto(b"hello", side0)
        a.sendto(ping(78), side0)
        # The right ping, before the partner is known: learned, dropped.
        a.sendto(ping(77), side0)
        await asyncio.sleep(0.05)
        b.sendto(ping(77), side1)
        assert await recv(a) == (ping(77), side0)
        a.sendto(b"game data", side0)
        assert await recv(b) == (b"game data", side1)
        # A stranger (right cookie, wrong IP) on either side is ignored.
        stranger.sendto(ping(77), side0)
        stranger.sendto(b"x", side1)
        b.sendto(b"reply", side1)
        assert await recv(a) == (b"reply", side0)
        assert await recv(a, 0.2) is None
        assert await recv(b, 0.2) is None
        assert pool.packets() == 3
    finally:
        for sock in (a, b, stranger):
            sock.close()


async def test_idle_pairs_are_released(pool: RelayPool) -> None:
    pair = pool.allocate(SessionId(1, 1), ("127.0.0.1", "127.0.0.5"))
    assert pair is not None and pool.active == 1
    now = asyncio.get_running_loop().time()
    pool.sweep(now + 10)
    assert pool.active == 1
    pool.sweep(now + 31)
    assert pool.active == 0
    # Its sockets are closed: nothing listens there any more.
    probe = udp("127.0.0.1")
    try:
        probe.sendto(b"x", pair[0])
        await asyncio.sleep(0.05)
        with pytest.raises(OSError):
            probe.recvfrom(10)  # ICMP port unreachable surfaces as ECONNREFUSED
    finally:
        probe.close()


async def test_limits_and_private_peers() -> None:
    relay = RelayPool(
        bind_host="127.0.0.1",
        advertise_host="127.0.0.1",
        port_range=None,
        idle_timeout=30.0,
        max_pairs=1,
        policy=AddressPolicy(),
    )
    try:
        assert relay.allocate(SessionId(1, 1), ("127.0.0.1", "198.51.100.1")) is None
        assert relay.stats.refused == 1
        assert relay.stats.refused_by == {Verdict.LOOPBACK.reason: 1}
        relay.policy = AddressPolicy(allow=LOOPBACK)
        assert relay.allocate(SessionId(1, 1), ("127.0.0.1", "127.0.0.2")) is not None
        assert relay.allocate(SessionId(2, 2), ("127.0.0.1", "127.0.0.2")) is None
        assert relay.stats.failed == 1
    finally:
        await relay.close()


async def test_port_range_exhausted_releases_what_it_bound() -> None:
    port = free_port(socket.SOCK_DGRAM)
    relay = RelayPool(
        bind_host="127.0.0.1",
        advertise_host="127.0.0.1",
        port_range=(port, port),
        idle_timeout=30.0,
        max_pairs=4,
        policy=AddressPolicy(allow=LOOPBACK),
    )
    try:
        # One port cannot hold a pair: the first socket is closed again.
        assert relay.allocate(SessionId(1, 1), ("127.0.0.1", "127.0.0.2")) is None
        assert relay.stats.failed == 1
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.bind(("127.0.0.1", port))
    finally:
        await relay.close()


async def test_a_reused_cookie_gets_its_own_pair(pool: RelayPool) -> None:
    """Games reuse cookies: a second negotiation on cookie 666 gets a pair even
    while the first one's pair lives, and releasing the old one leaves it alone."""
    ips = ("127.0.0.1", "127.0.0.5")
    first, second = SessionId(666, 1), SessionId(666, 2)
    old = pool.allocate(first, ips)
    new = pool.allocate(second, ips)
    assert old is not None and new is not None and old != new
    assert pool.stats.failed == 0 and pool.active == 2
    a, b = udp("127.0.0.1"), udp("127.0.0.5")
    try:
        assert not pool.in_use(second)
        a.sendto(ping(666), new[0])
        b.sendto(ping(666), new[1])
        assert await recv(a) == (ping(666), new[0])
        assert pool.in_use(second) and not pool.in_use(first)
        pool.release(first)
        assert pool.active == 1
        a.sendto(b"game data", new[0])
        assert await recv(b) == (b"game data", new[1])
    finally:
        a.close()
        b.close()
