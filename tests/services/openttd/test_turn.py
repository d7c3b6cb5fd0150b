"""The TURN relay: tickets, pairing, the byte pipe, and its bounds."""

from __future__ import annotations

import asyncio
import os

import pytest

from crossroads.client.openttd import PacketStream
from crossroads.proto.openttd.codes import make_ticket, split_ticket
from crossroads.proto.openttd.turn import TurnConnect, encode_turn_packet
from crossroads.runtime import Runtime
from crossroads.services.openttd.turn import relay_table
from crossroads.transport.admission import ResourceBudget
from tests.conftest import eventually
from tests.services.openttd.helpers import (
    metric_value,
    metrics,
    port_of,
    running,
    service,
    turn_connect,
    turn_connected,
    until_metric,
)

pytestmark = pytest.mark.timeout(60)


async def issue(rt: Runtime) -> str:
    """A ticket the coordinator would hand out (stored with its TTL)."""
    ticket = make_ticket(os.urandom(16))
    registry = service(rt).registry
    assert registry is not None
    parts = split_ticket(ticket)
    assert parts is not None
    await registry.put_ticket(*parts)
    return ticket


async def test_pairs_and_relays_both_ways(ottd: Runtime) -> None:
    ticket = await issue(ottd)
    a, _ = await turn_connect(ottd, ticket)
    await asyncio.sleep(0.1)
    b, _ = await turn_connect(ottd, ticket)
    try:
        assert await turn_connected(a) == "127.0.0.1"
        assert await turn_connected(b) == "127.0.0.1"
        payload = os.urandom(1 << 20)
        a.writer.write(payload)
        received = await b.reader.readexactly(len(payload))
        assert received == payload
        b.writer.write(b"pong")
        assert await a.reader.readexactly(4) == b"pong"
        # One side's end of stream reaches the other (a half-close: the other
        # way stays open until that side closes too, which ends the relay).
        await a.close()
        assert await b.at_eof(5)
        await b.close()
        await until_metric(ottd, "crossroads_openttd_turn_relays", 0)
        await until_metric(
            ottd, "crossroads_openttd_turn_bytes_total", len(payload) + 4
        )
        await until_metric(
            ottd, "crossroads_openttd_turn_sessions_total", 1, result="paired"
        )
    finally:
        await a.close()
        await b.close()


async def test_a_half_close_keeps_the_other_way_open(ottd: Runtime) -> None:
    """A side that shuts down its sending half still receives (splice plane:
    the FIN becomes shutdown(SHUT_WR) of the other side, nothing more)."""
    ticket = await issue(ottd)
    a, _ = await turn_connect(ottd, ticket)
    b, _ = await turn_connect(ottd, ticket)
    try:
        await turn_connected(a)
        await turn_connected(b)
        a.writer.write(b"last words")
        a.writer.write_eof()
        assert await b.reader.readexactly(10) == b"last words"
        assert await b.at_eof(5)
        payload = os.urandom(300_000)
        b.writer.write(payload)
        assert await a.reader.readexactly(len(payload)) == payload
        b.writer.write_eof()
        assert await a.at_eof(5)
        await until_metric(ottd, "crossroads_openttd_turn_relays", 0)
        await until_metric(
            ottd, "crossroads_openttd_turn_bytes_total", len(payload) + 10
        )
        await until_metric(
            ottd, "crossroads_openttd_turn_relays_ended_total", 1, reason="closed"
        )
    finally:
        await a.close()
        await b.close()


async def test_tickets_are_single_use(ottd: Runtime) -> None:
    ticket = await issue(ottd)
    a, _ = await turn_connect(ottd, ticket)
    b, _ = await turn_connect(ottd, ticket)
    await turn_connected(a)
    await turn_connected(b)
    await asyncio.sleep(0.2)
    c, _ = await turn_connect(ottd, ticket)
    try:
        assert await c.at_eof(5)
    finally:
        for stream in (a, b, c):
            await stream.close()


@pytest.mark.parametrize(
    "ticket",
    ["0123456789abcdef:0123456789abcdef", "not a ticket", "", "a" * 63],
)
async def test_unknown_tickets_are_closed_without_an_answer(
    ottd: Runtime, ticket: str
) -> None:
    stream, _ = await turn_connect(ottd, ticket)
    try:
        assert await stream.reader.read(100) == b""
    finally:
        await stream.close()
    text = await metrics(ottd)
    assert (
        metric_value(
            text, "crossroads_openttd_turn_sessions_total", result="invalid-ticket"
        )
        == 1
    )


async def test_a_wrong_secret_for_a_waiting_ticket_is_refused(ottd: Runtime) -> None:
    ticket = await issue(ottd)
    left, _ = ticket.split(":")
    a, _ = await turn_connect(ottd, ticket)
    await asyncio.sleep(0.1)
    forged, _ = await turn_connect(ottd, f"{left}:{'0' * 16}")
    try:
        assert await forged.at_eof(5)
        b, _ = await turn_connect(ottd, ticket)
        assert await turn_connected(a) == "127.0.0.1"
        await b.close()
    finally:
        await a.close()
        await forged.close()


async def test_a_lone_side_is_dropped_after_the_wait() -> None:
    async with running(turn_wait=0.5) as rt:
        ticket = await issue(rt)
        a, _ = await turn_connect(rt, ticket)
        try:
            assert await a.at_eof(10)
            text = await metrics(rt)
            assert (
                metric_value(
                    text,
                    "crossroads_openttd_turn_sessions_total",
                    result="peer-never-came",
                )
                == 1
            )
        finally:
            await a.close()


async def test_data_before_pairing_is_refused(ottd: Runtime) -> None:
    ticket = await issue(ottd)
    a, _ = await turn_connect(ottd, ticket)
    await asyncio.sleep(0.1)
    await a.send(b"\x03\x00\x07")
    try:
        assert await a.at_eof(5)
    finally:
        await a.close()


async def test_game_bytes_sent_with_the_ticket_are_relayed(ottd: Runtime) -> None:
    ticket = await issue(ottd)
    a, _ = await turn_connect(ottd, ticket)
    await asyncio.sleep(0.1)
    # The second side pipelines a game packet right after SERCLI_CONNECT.
    b = await PacketStream.open("127.0.0.1", port_of(ottd, "turn"))
    await b.send(encode_turn_packet(TurnConnect(6, ticket)) + b"\x03\x00\x07")
    try:
        await turn_connected(a)
        assert await a.reader.readexactly(3) == b"\x03\x00\x07"
    finally:
        await a.close()
        await b.close()


async def test_idle_relays_are_closed() -> None:
    async with running(relay_idle_timeout=1.0) as rt:
        ticket = await issue(rt)
        a, _ = await turn_connect(rt, ticket)
        b, _ = await turn_connect(rt, ticket)
        try:
            await turn_connected(a)
            await turn_connected(b)
            turn = service(rt).turn
            assert turn is not None and turn.table is not None
            # The pair is one item of the budget's table, until it ends.
            assert turn.table.live == 1
            assert await a.at_eof(10)
            assert await b.at_eof(10)
            await eventually(lambda: _true(turn.table.live == 0), "pair released")
            await until_metric(
                rt, "crossroads_openttd_turn_relays_ended_total", 1, reason="idle"
            )
            await until_metric(
                rt,
                "crossroads_openttd_dropped_total",
                2,
                listener="turn",
                reason="relay-idle",
            )
        finally:
            await a.close()
            await b.close()


def test_relays_are_capped_by_connections_and_descriptors() -> None:
    # Six descriptors a route beyond the two accepted sockets, from the
    # budget's relay pool (docs/security.md, "Descriptors"): alone in it at
    # ulimit -n 1024, (1024 - 64 - 512) // 6 pairs.
    for fd_limit, connections, pairs in (
        (1024, 50000, 74),
        (1 << 20, 50000, 25000),
        (1 << 20, 1, 1),
    ):
        table = relay_table(ResourceBudget(fd_limit, memory=1 << 40), connections)
        assert table.max_items == pairs


async def test_waiting_sides_share_the_lobbys_one_timer(ottd: Runtime) -> None:
    """Each lone side's 20 s wait is a deadline in the TURN lobby under one
    timer (no event-loop timer per side); a side that leaves takes its
    deadline with it."""
    turn = service(ottd).turn
    assert turn is not None
    tickets = [await issue(ottd) for _ in range(3)]
    sides = [(await turn_connect(ottd, ticket))[0] for ticket in tickets]
    try:

        async def all_waiting() -> bool:
            return len(turn.lobby) == 3

        await eventually(all_waiting, "three sides waiting")
        first = turn.lobby.get_timer()
        assert first is not None and turn.timer.armed_at == first
        for side in sides:
            await side.close()

        async def none_waiting() -> bool:
            return len(turn.lobby) == 0 and turn.timer.armed_at is None

        await eventually(none_waiting, "the lobby empty and its timer disarmed")
    finally:
        for side in sides:
            await side.close()


async def _true(value: bool) -> bool:
    await asyncio.sleep(0)
    return value
