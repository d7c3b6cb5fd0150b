"""A TURN channel, permission or learned route to another allocation's relayed
address dies with that allocation.

Two clients both forced to relay talk through each other's relayed addresses
(allowed: :meth:`crossroads.proto.turn.server.TurnServer.peer_verdict`). When
one allocation is freed its port goes back to the kernel, and the relay range
overlaps the ephemeral range the server's other sockets draw from: a channel
that outlived its peer forwarded to whatever socket of the server took the
port next. Now every channel, learned Data indication route and Send approval
of other allocations whose peer is that relayed address stops at once; the
client's ChannelData is counted as ``channel-unbound``, a Send indication or a
datagram from the new socket as ``peer-loopback``.
"""

from __future__ import annotations

import os
import select
import socket
from collections.abc import AsyncIterator

import pytest

from crossroads.client.turn import TurnClient
from crossroads.config import default_config
from crossroads.proto.stun import Class, Data, Message, Method, XorPeerAddress, encode
from crossroads.runtime import Runtime, start
from crossroads.services.turn import TurnService
from tests.conftest import loopback_config, until

pytestmark = pytest.mark.timeout(60)

USER, PASSWORD = "alice", "secret123"


@pytest.fixture(name="service")
async def service_fixture() -> AsyncIterator[TurnService]:
    # No --allow-loopback-peers: loopback peers are refused, except the
    # relayed addresses of live allocations.
    runtime: Runtime = await start(
        default_config(
            loopback_config(
                core__only=["stun", "turn"], turn__user=[f"{USER}:{PASSWORD}"]
            )
        )
    )
    try:
        service = runtime.services["turn"]
        assert isinstance(service, TurnService)
        yield service
    finally:
        await runtime.close()


def take_port(address: tuple[str, int]) -> socket.socket:
    """A plain socket of this process on the freed relayed port (what any
    other socket of the server may draw from the ephemeral range)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.setblocking(False)
    return sock


def readable(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


def nothing_received(sock: socket.socket) -> bool:
    try:
        sock.recv(4096)
    except BlockingIOError:
        return True
    return False


def send_indication(peer: tuple[str, int], data: bytes) -> bytes:
    return encode(
        Message(
            Class.INDICATION,
            Method.SEND,
            os.urandom(12),
            (XorPeerAddress(*peer), Data(data)),
        )
    )


async def test_channel_to_a_freed_allocation_stops_forwarding(
    service: TurnService,
) -> None:
    server = service.stun.primary
    a = await TurnClient.connect(server, USER, PASSWORD)
    b = await TurnClient.connect(server, USER, PASSWORD)
    c = await TurnClient.connect(server, USER, PASSWORD)
    taken: socket.socket | None = None
    try:
        relayed_a = await a.allocate()
        relayed_b = await b.allocate()
        relayed_c = await c.allocate()
        await a.bind_channel(relayed_b)
        await b.create_permission(relayed_a, relayed_c)
        # C has a permission and no channel: B's datagrams reach it as Data
        # indications, the first in Python, the next by a learned route.
        await c.create_permission(relayed_b)
        for text in (b"first", b"learned"):
            await b.send(text, relayed_c)
            assert await c.receive(timeout=5) == (text, relayed_b)
        # Both ways through each other's relayed addresses.
        await a.send(b"over the channel", relayed_b)
        assert await b.receive(timeout=5) == (b"over the channel", relayed_a)
        a._write(send_indication(relayed_b, b"by Send indication"))
        assert await b.receive(timeout=5) == (b"by Send indication", relayed_a)
        await b.send(b"back", relayed_a)
        assert await a.receive(timeout=5) == (b"back", relayed_b)

        await b.close()
        assert await until(lambda: len(service.core.allocations) == 2)
        taken = take_port(relayed_b)
        drops = service.core.counters.drops
        stats = service.stats.drops

        # ChannelData on the channel: not forwarded, counted.
        await a.send(b"to the new socket", relayed_b)
        await until(lambda: stats.get("channel-unbound", 0) >= 1 or readable(taken))
        assert nothing_received(taken), "the channel outlived its peer"
        assert stats.get("channel-unbound", 0) >= 1

        # A Send indication within the data plane's approval second: refused.
        before = drops.get("peer-loopback", 0)
        a._write(send_indication(relayed_b, b"approved a moment ago"))
        await until(lambda: drops.get("peer-loopback", 0) > before or readable(taken))
        assert nothing_received(taken), "a Send approval outlived its peer"
        assert drops.get("peer-loopback", 0) > before

        # Nor C's, whose learned route from B's address went with it.
        before = drops.get("peer-loopback", 0)
        taken.sendto(b"from the new socket", relayed_c)
        assert await until(lambda: drops.get("peer-loopback", 0) > before)
        with pytest.raises(TimeoutError):
            await c.receive(timeout=0.2)

        # The new socket cannot reach A's client through the old permission.
        before = drops.get("peer-loopback", 0)
        taken.sendto(b"from the new socket", relayed_a)
        assert await until(lambda: drops.get("peer-loopback", 0) > before)
        with pytest.raises(TimeoutError):
            await a.receive(timeout=0.2)
    finally:
        if taken is not None:
            taken.close()
        for client in (a, b, c):
            await client.close()
