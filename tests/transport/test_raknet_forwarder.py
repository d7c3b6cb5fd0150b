"""The built-in RakNet UDP forwarder on real sockets: learning each side's
address, forwarding both ways, refusing strangers, the caps, the idle timeout."""

from __future__ import annotations

import asyncio
import socket

from crossroads.proto.raknet.udpproxy import ForwarderResult
from crossroads.transport.admission import ResourceBudget
from crossroads.transport.raknet_forwarder import ForwarderPool, forwarder_table
from tests.conftest import eventually


def udp() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    return sock


async def recv(
    sock: socket.socket, timeout: float = 5.0
) -> tuple[bytes, tuple[str, int]]:
    loop = asyncio.get_running_loop()
    data, addr = await asyncio.wait_for(loop.sock_recvfrom(sock, 2048), timeout)
    return data, addr


async def test_forwarding_both_ways_strangers_caps_and_idle_timeout() -> None:
    pool = ForwarderPool("127.0.0.1", forwarder_table(ResourceBudget(), 1, 1))
    side1, side2, stranger = udp(), udp(), udp()
    try:
        a1, a2 = side1.getsockname(), side2.getsockname()
        result, port = pool.start(a1, a2, 400)
        assert result == ForwarderResult.SUCCESS
        proxy = ("127.0.0.1", port)
        assert pool.start(a2, a1, 400) == (
            ForwarderResult.FORWARDING_ALREADY_EXISTS,
            port,
        )
        assert pool.start(a1, ("127.0.0.1", 9), 400)[0] == ForwarderResult.NO_SOCKETS
        side1.sendto(b"hello", proxy)
        assert await recv(side2) == (b"hello", proxy)
        side2.sendto(b"back", proxy)
        assert await recv(side1) == (b"back", proxy)
        # both sides confirmed: a third address (same IP) is not forwarded
        stranger.sendto(b"intruder", proxy)
        side1.sendto(b"again", proxy)
        assert await recv(side2) == (b"again", proxy)
        assert pool.packets() == 3

        async def released() -> bool:
            return not pool.entries

        await eventually(released, "the idle forwarder is closed")
        side1.sendto(b"late", proxy)
        try:
            await recv(side2, timeout=0.3)
            raise AssertionError("a closed forwarder still forwards")
        except TimeoutError:
            pass
    finally:
        await pool.close()
        for sock in (side1, side2, stranger):
            sock.close()


async def test_oversized_datagrams_are_dropped_not_truncated() -> None:
    # RakNet never sends more than MAXIMUM_MTU_SIZE (1500) bytes; a larger
    # datagram is not RakNet and is dropped whole (counted by the data plane).
    pool = ForwarderPool("127.0.0.1", forwarder_table(ResourceBudget(), 1, 1))
    side1, side2 = udp(), udp()
    try:
        result, port = pool.start(side1.getsockname(), side2.getsockname(), 5000)
        assert result == ForwarderResult.SUCCESS
        proxy = ("127.0.0.1", port)
        side1.sendto(b"x" * 1501, proxy)
        side1.sendto(b"y" * 1500, proxy)
        assert await recv(side2) == (b"y" * 1500, proxy)
        assert pool.packets() == 1
        assert pool.oversized() == 1
    finally:
        await pool.close()
        side1.close()
        side2.close()
