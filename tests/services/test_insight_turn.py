"""A TURN allocation writes one connection-insight record when it ends, with
the bytes it relayed each way (read from the data plane's counters)."""

from __future__ import annotations

from typing import Any

import pytest

from crossroads.client.turn import TurnClient
from crossroads.insight import AttemptFilter
from crossroads.services.turn import TurnService
from tests.services.test_turn import (  # noqa: F401 (the fixture)
    PASSWORD,
    USER,
    Peer,
    eventually,
    turn_fixture,
)

pytestmark = pytest.mark.timeout(60)

DATAGRAMS = 100


async def test_allocation_record_counts_what_was_relayed(turn: Any) -> None:
    service: TurnService = await turn()
    peer = Peer()
    insight = service.ctx.insight
    try:
        async with await TurnClient.connect(service.stun.primary, USER, PASSWORD) as c:
            relayed = await c.allocate()
            await c.bind_channel(peer.address)
            sent_up = sent_down = 0
            for n in range(DATAGRAMS):
                payload = bytes([n % 256]) * 1000
                await c.send(payload, peer.address)
                assert await peer.recv() == payload
                sent_up += len(payload)
                reply = payload[:400]
                peer.sock.sendto(reply, relayed)
                assert (await c.receive(timeout=2))[0] == reply
                sent_down += len(reply)
        assert await eventually(lambda: bool(insight.ring))
    finally:
        peer.close()
    [record] = await insight.attempts(AttemptFilter(family="turn"))
    assert record.outcome == "relayed" and record.winner == "relay"
    assert record.game == f"{service.core.settings.realm}/{USER}"
    assert record.usage is not None
    # The payloads each way, within 1 % (nothing else crossed the relay).
    assert abs(record.usage.bytes_up - sent_up) <= sent_up / 100
    assert abs(record.usage.bytes_down - sent_down) <= sent_down / 100
    assert record.usage.packets_up == record.usage.packets_down == DATAGRAMS
    assert "127.0.0.1:" not in record.session.split("/", 1)[0]
    assert record.sides[0].id != "127.0.0.1"


async def test_tcp_allocation_record_carries_the_connections_round_trip(
    turn: Any,
) -> None:
    """TURN over TCP shows a round trip: the kernel's smoothed RTT of the
    client's connection (TCP_INFO), read when the allocation ends: on the
    side and in the usage. UDP shows none."""
    service: TurnService = await turn()
    peer = Peer()
    insight = service.ctx.insight
    try:
        for transport in ("tcp", "udp"):
            async with await TurnClient.connect(
                service.stun.primary, USER, PASSWORD, transport=transport
            ) as c:
                await c.allocate()
                await c.bind_channel(peer.address)
                await c.send(b"x" * 100, peer.address)
                assert await peer.recv() == b"x" * 100
        assert await eventually(lambda: len(insight.ring) == 2)
    finally:
        peer.close()
    udp, tcp = await insight.attempts(AttemptFilter(family="turn"))
    assert tcp.session.startswith("tcp/") and udp.session.startswith("udp/")
    assert tcp.usage is not None and tcp.usage.rtt_ms is not None
    # Loopback: a positive round trip well under a second.
    assert 0 < tcp.usage.rtt_ms < 1000
    assert tcp.sides[0].rtt_ms == tcp.usage.rtt_ms
    assert udp.usage is not None and udp.usage.rtt_ms is None


async def test_a_channel_refresh_keeps_what_its_route_counted(turn: Any) -> None:
    """A ChannelBind refresh (RFC 8656 §12.2, every few minutes of a call)
    keeps the channel's route and its counts: the record counts every
    datagram of the call, before the refresh too (the route was replaced by
    a fresh one, its counts lost, when TURN wrote its own routes)."""
    service: TurnService = await turn()
    peer = Peer()
    insight = service.ctx.insight
    try:
        async with await TurnClient.connect(service.stun.primary, USER, PASSWORD) as c:
            await c.allocate()
            number = await c.bind_channel(peer.address)
            for n in range(2 * 10):
                if n == 10:
                    assert await c.bind_channel(peer.address) == number
                await c.send(b"%d" % n, peer.address)
                assert await peer.recv() == b"%d" % n
        assert await eventually(lambda: bool(insight.ring))
    finally:
        peer.close()
    [record] = await insight.attempts(AttemptFilter(family="turn"))
    assert record.usage is not None and record.usage.packets_up == 2 * 10
