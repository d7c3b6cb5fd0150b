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


async def test_timeouts_outside_raknets_range_start_nothing() -> None:
    # UDPForwarder::StartForwarding: 0 < timeoutOnNoDataMS <= 10 min, else
    # UDPFORWARDER_INVALID_PARAMETERS, no socket.
    admission = forwarder_table(ResourceBudget(fd_limit=1024), 10, 10)
    pool = ForwarderPool("127.0.0.1", admission)
    a1, a2 = ("127.0.0.1", 40001), ("127.0.0.1", 40002)
    try:
        for timeout_ms in (2**32 - 1, 600_001, 0):
            assert pool.start(a1, a2, timeout_ms) == (
                ForwarderResult.INVALID_PARAMETERS,
                0,
            )
        assert not pool.entries and admission.live == 0
        assert pool.start(a1, a2, 600_000)[0] == ForwarderResult.SUCCESS
    finally:
        await pool.close()
    assert admission.live == 0


async def test_the_budget_caps_forwarders_per_requester_and_in_all() -> None:
    """At ulimit -n 1024 the forwarders' share is the per-client socket pool
    (448 descriptors when they are its only table); one requester's IP holds
    at most an eighth of it, whatever is configured; over a cap: NO_SOCKETS,
    counted, no socket."""
    budget = ResourceBudget(fd_limit=1024)
    admission = forwarder_table(budget, 1000, 1000)
    assert admission.max_items == budget.relay_pool() == 448
    assert admission.max_per_source == 56
    pool = ForwarderPool("127.0.0.1", admission)
    target = ("127.0.0.1", 9)
    try:
        results = [
            pool.start(("127.0.0.2", 1000 + i), target, 5000)[0] for i in range(60)
        ]
        assert results.count(ForwarderResult.SUCCESS) == 56
        assert results[56:] == [ForwarderResult.NO_SOCKETS] * 4
        assert admission.refused == {"over-ip-limit": 4}
        # charged to the client that asked, not to the source it names
        result, _ = pool.start(
            ("127.0.0.2", 2000), target, 5000, requester=("127.0.0.3", 1)
        )
        assert result == ForwarderResult.SUCCESS and len(pool.entries) == 57
    finally:
        await pool.close()
    assert admission.live == 0 and admission.per_source == {}


async def test_a_client_leaving_ends_only_the_forwarders_nobody_used() -> None:
    admission = forwarder_table(ResourceBudget(fd_limit=1024), 80, 80)
    pool = ForwarderPool("127.0.0.1", admission)
    side1, side2, side3 = udp(), udp(), udp()
    try:
        a1, a2, a3 = side1.getsockname(), side2.getsockname(), side3.getsockname()
        result, used_port = pool.start(a1, a2, 600_000)
        assert result == ForwarderResult.SUCCESS
        assert pool.start(a1, a3, 600_000)[0] == ForwarderResult.SUCCESS
        assert pool.start(a3, ("127.0.0.1", 9), 600_000)[0] == (ForwarderResult.SUCCESS)
        side1.sendto(b"game", ("127.0.0.1", used_port))
        assert await recv(side2) == (b"game", ("127.0.0.1", used_port))
        # a1 leaves the coordinator: its unused forwarder ends; the one that
        # carries a game lives on until it is idle for its timeout (stock).
        assert pool.end_client(a1) == 1
        assert set(pool.entries) == {(a1, a2), (a3, ("127.0.0.1", 9))}
        assert pool.end_client(a3) == 1
        assert set(pool.entries) == {(a1, a2)}
        assert admission.live == 1 and admission.closes == {"client-left": 2}
        side1.sendto(b"still", ("127.0.0.1", used_port))
        assert await recv(side2) == (b"still", ("127.0.0.1", used_port))
    finally:
        await pool.close()
        for sock in (side1, side2, side3):
            sock.close()
    assert admission.live == 0
