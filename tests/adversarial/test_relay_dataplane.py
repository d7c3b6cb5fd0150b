"""Hostile traffic at the relay data plane's sockets (natneg relay, RakNet proxy).

Once a route exists, only its exact source is forwarded: floods of random bytes
from strangers, from another port of a client's own IP, and oversized datagrams
are dropped without disturbing the legitimate flow or its counters. Runs with
whichever data plane is active (C, or the Python twin under
``CROSSROADS_TURN_PURE_PYTHON=1``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import random
import socket

import pytest

from crossroads.proto.natneg.packets import ConnectPing
from crossroads.proto.natneg.server import SessionId
from crossroads.proto.policy import AddressPolicy
from crossroads.proto.raknet.udpproxy import ForwarderResult
from crossroads.transport.admission import ResourceBudget
from crossroads.transport.natneg_relay import RelayPool
from crossroads.transport.raknet_forwarder import ForwarderPool, forwarder_table

pytestmark = pytest.mark.timeout(60)

#: Datagrams in each hostile burst: enough to fill several recvmmsg batches
#: (32 each), few enough (~200 KB with the kernel's per-datagram overhead) for
#: a default 208 KiB receive buffer to hold them all.
FLOOD = 200


def udp(ip: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    sock.bind((ip, 0))
    return sock


async def recv_all(sock: socket.socket, quiet: float = 0.3) -> list[bytes]:
    """Everything that arrives until ``quiet`` seconds pass without a datagram."""
    loop = asyncio.get_running_loop()
    got: list[bytes] = []
    while True:
        try:
            data, _ = await asyncio.wait_for(loop.sock_recvfrom(sock, 70000), quiet)
        except TimeoutError:
            return got
        got.append(data)


def flood(rng: random.Random, sender: socket.socket, target: tuple[str, int]) -> None:
    for _ in range(FLOOD):
        size = rng.choice((0, 1, 12, 36, 38, 100, 1400, rng.randrange(2000)))
        sender.sendto(rng.randbytes(size), target)


async def test_natneg_pair_forwards_only_its_learned_clients_under_a_flood() -> None:
    rng = random.Random(17)
    pool = RelayPool(
        bind_host="127.0.0.1",
        advertise_host="127.0.0.1",
        port_range=None,
        idle_timeout=30.0,
        max_pairs=1,
        policy=AddressPolicy(allow=(ipaddress.ip_network("127.0.0.0/8"),)),
    )
    a, b = udp("127.0.0.1"), udp("127.0.0.5")
    same_ip, stranger = udp("127.0.0.1"), udp("127.0.0.9")
    try:
        pair = pool.allocate(SessionId(4242, 1), ("127.0.0.1", "127.0.0.5"))
        assert pair is not None
        side0, side1 = pair
        # Before anyone is learned: noise from the right IPs teaches nothing.
        flood(rng, same_ip, side0)
        flood(rng, stranger, side1)
        ping = ConnectPing(3, 4242, "127.0.0.1", 1, 0, 0).encode()
        a.sendto(ping, side0)
        b.sendto(ping, side1)
        assert await recv_all(a) == [ping]
        # Learned: now floods from every other source, both sides.
        for sender in (same_ip, stranger):
            flood(rng, sender, side0)
            flood(rng, sender, side1)
            # A marker queued behind each flood: once it is through, the flood
            # has been read (socket buffers never hold more than one flood).
            a.sendto(b"marker", side0)
            assert await recv_all(b) == [b"marker"]
        for n in range(50):
            a.sendto(b"to b %d" % n, side0)
            b.sendto(b"to a %d" % n, side1)
        assert sorted(await recv_all(b)) == sorted(b"to b %d" % n for n in range(50))
        assert sorted(await recv_all(a)) == sorted(b"to a %d" % n for n in range(50))
        assert await recv_all(same_ip, 0.05) == []
        assert await recv_all(stranger, 0.05) == []
        # 100, 2 markers, and b's ping forwarded to a on learning.
        assert pool.packets() == 103
    finally:
        await pool.close()
        for sock in (a, b, same_ip, stranger):
            sock.close()


async def test_raknet_forwarder_forwards_only_confirmed_sides_under_a_flood() -> None:
    rng = random.Random(23)
    pool = ForwarderPool("127.0.0.1", forwarder_table(ResourceBudget(), 1, 1))
    side1, side2, stranger = udp("127.0.0.1"), udp("127.0.0.5"), udp("127.0.0.9")
    try:
        result, port = pool.start(side1.getsockname(), side2.getsockname(), 30_000)
        assert result == ForwarderResult.SUCCESS
        proxy = ("127.0.0.1", port)
        side1.sendto(b"hello", proxy)
        side2.sendto(b"back", proxy)
        assert await recv_all(side2) == [b"hello"]
        assert await recv_all(side1) == [b"back"]
        # Both confirmed: a stranger's flood and oversized datagrams from the
        # confirmed sides themselves go nowhere.
        flood(rng, stranger, proxy)
        side1.sendto(b"marker", proxy)  # through: the flood has been read
        assert await recv_all(side2) == [b"marker"]
        side1.sendto(b"x" * 1501, proxy)
        side2.sendto(b"y" * 4000, proxy)
        for n in range(50):
            side1.sendto(b"1:%d" % n, proxy)
            side2.sendto(b"2:%d" % n, proxy)
        assert sorted(await recv_all(side2)) == sorted(b"1:%d" % n for n in range(50))
        assert sorted(await recv_all(side1)) == sorted(b"2:%d" % n for n in range(50))
        assert await recv_all(stranger, 0.05) == []
        assert pool.packets() == 103
        assert pool.oversized() >= 2  # and the stranger's, whichever were oversized
    finally:
        await pool.close()
        for sock in (side1, side2, stranger):
            sock.close()
