"""Bad input, abuse and limits: answered or closed, counted, nobody else hurt."""

from __future__ import annotations

import asyncio

import pytest

from crossroads.client.openttd import GameInfoResponder, PacketStream
from crossroads.proto.openttd.coordinator import (
    ClientListing,
    ErrorType,
    GcError,
    GcListing,
    decode_gc_packet,
    encode_peer_packet,
)
from crossroads.proto.openttd.gameinfo import GameInfo, NewGRF
from crossroads.runtime import Runtime
from crossroads.services.openttd.conn import INBOX_PAUSE
from tests.services.openttd.helpers import (
    gc,
    metric_value,
    metrics,
    port_of,
    recv_until,
    register,
    running,
    service,
    until_listed,
    update,
)

pytestmark = pytest.mark.timeout(60)


async def raw(rt: Runtime, role: str = "coordinator") -> PacketStream:
    return await PacketStream.open("127.0.0.1", port_of(rt, role))


async def expect_error_then_close(stream: PacketStream, error: ErrorType) -> GcError:
    packet_type, payload = await stream.recv_packet(5)
    message = decode_gc_packet(packet_type, payload, 1)
    assert isinstance(message, GcError) and message.error is error
    assert await stream.at_eof(5)
    return message


async def still_serves(rt: Runtime) -> None:
    """A well-behaved client still gets its listing."""
    client = await gc(rt)
    try:
        await client.send_message(ClientListing(6, 6, "13.0", 0))
        assert isinstance(await recv_until(client, GcListing), GcListing)
    finally:
        await client.close()


def dropped(text: str, reason: str, listener: str = "coordinator") -> float:
    return metric_value(
        text, "crossroads_openttd_dropped_total", listener=listener, reason=reason
    )


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"\xff\xff\x01", "bad-size"),  # size above TCP_MTU
        (b"\x02\x00", "bad-size"),  # size below the header
        (b"\x04\x00\x01\x06", "short"),  # SERVER_REGISTER cut short
        (b"\x07\x00\x01\x07\x01\x00\x10", "version"),  # protocol 7
        (b"\x07\x00\x06\x01\x01\x00\x10", "version"),  # CLIENT_CONNECT at protocol 1
        (b"\x05\x00\x02\x06\x02", "bad-type"),  # a GC-only packet type
        (b"\x05\x00\x63\x06\x02", "bad-type"),  # no such type
        (b"\x0c\x00\x01\x06\x01\x10\x00\x00\x00\x00\x00\x00", "trailing-bytes"),
        (b"\x0c\x00\x04\x06\x06\xff\xfe\x00\x00\x00\x00\x00", "bad-utf8"),
    ],
)
async def test_malformed_packets_get_gc_error_and_close(
    ottd: Runtime, data: bytes, reason: str
) -> None:
    stream = await raw(ottd)
    await stream.send(data)
    await expect_error_then_close(stream, ErrorType.UNKNOWN)
    await stream.close()
    assert dropped(await metrics(ottd), reason) == 1
    await still_serves(ottd)


async def test_update_before_registration_is_refused(ottd: Runtime) -> None:
    from tests.proto.openttd.test_coordinator import GOLDEN_UPDATE

    stream = await raw(ottd)
    await stream.send(GOLDEN_UPDATE)
    await expect_error_then_close(stream, ErrorType.UNKNOWN)
    await stream.close()


async def test_local_game_type_is_refused(ottd: Runtime) -> None:
    stream = await raw(ottd)
    await stream.send(b"\x09\x00\x01\x06\x00\x95\x0f\x00\x00")  # game type LOCAL
    await expect_error_then_close(stream, ErrorType.REGISTRATION_FAILED)
    await stream.close()


async def test_registration_flood_from_one_address(
    game_server: GameInfoResponder,
) -> None:
    async with running(registrations_per_minute=3) as rt:
        servers = [await register(rt, game_server.port) for _ in range(3)]
        flood = await gc(rt)
        try:
            await flood.send(b"\x09\x00\x01\x06\x01\x95\x0f\x00\x00")
            reply = await flood.recv()
            assert reply == GcError(
                ErrorType.REGISTRATION_FAILED,
                "too many registrations from your address",
            )
            assert await flood.at_eof(5)
            text = await metrics(rt)
            assert (
                metric_value(
                    text,
                    "crossroads_openttd_registrations_total",
                    connection_type="none",
                    result="rate-limited",
                )
                == 1
            )
            # The servers that registered are unaffected.
            for server in servers:
                assert not server.client.reader.at_eof()
            await still_serves(rt)
        finally:
            for server in servers:
                await server.close()
            await flood.close()


async def test_servers_per_address_limit(game_server: GameInfoResponder) -> None:
    async with running(max_servers_per_address=2) as rt:
        servers = [await register(rt, game_server.port + i) for i in range(2)]
        extra = await gc(rt)
        try:
            await extra.send(b"\x09\x00\x01\x06\x01\x95\x0f\x00\x00")
            reply = await extra.recv()
            assert (
                isinstance(reply, GcError)
                and reply.error is ErrorType.REGISTRATION_FAILED
            )
        finally:
            for server in servers:
                await server.close()
            await extra.close()


async def test_slowloris_connections_are_dropped() -> None:
    async with running(packet_timeout=0.5) as rt:
        silent = await raw(rt)
        dribbler = await raw(rt)
        await dribbler.send(b"\x20\x00\x04\x06")  # a 32-byte packet, 4 bytes in
        try:
            for _ in range(3):  # keep dribbling, never finishing the packet
                await asyncio.sleep(0.2)
                await dribbler.send(b"\x06")
            await still_serves(rt)  # others are served meanwhile
            assert await silent.at_eof(10)
            assert await dribbler.at_eof(10)
            text = await metrics(rt)
            assert dropped(text, "no-packet") == 1
            assert dropped(text, "slow-packet") == 1
        finally:
            await silent.close()
            await dribbler.close()


async def test_idle_connections_are_dropped() -> None:
    async with running(idle_timeout=1.0) as rt:
        client = await gc(rt)
        try:
            await client.send_message(ClientListing(6, 6, "13.0", 0))
            await recv_until(client, GcListing)
            assert await client.at_eof(10)
            assert dropped(await metrics(rt), "idle") == 1
        finally:
            await client.close()


async def test_connections_per_address_limit() -> None:
    async with running(max_connections_per_address=2) as rt:
        first, second = await raw(rt), await raw(rt)
        third = await raw(rt)
        try:
            assert await third.at_eof(5)
            assert dropped(await metrics(rt), "over-address-limit") == 1
            await first.close()
            await asyncio.sleep(0.2)
            await still_serves(rt)
        finally:
            for stream in (first, second, third):
                await stream.close()


async def test_packet_flood_is_back_pressured_not_buffered(
    ottd: Runtime, game_server: GameInfoResponder
) -> None:
    """Tens of thousands of listing requests from a peer that never reads the
    answers: the coordinator answers until the peer's TCP window is full, then
    stops reading it (its backlog stays bounded), and keeps serving others."""
    server = await register(ottd, game_server.port)
    # 255 named NewGRFs: every listing with cursor 0 answers ~30 KB.
    grfs = tuple(
        NewGRF(i, i.to_bytes(16, "little"), f"NewGRF number {i} " + "n" * 60)
        for i in range(255)
    )
    await update(
        server, GameInfo(server_name="x" * 79, server_revision="13.0", newgrfs=grfs)
    )
    await until_listed(ottd, "x" * 79)
    stream = await raw(ottd)
    request = encode_peer_packet(ClientListing(6, 6, "13.0", 0))
    sent = 50_000
    stream.writer.write(request * sent)
    await asyncio.sleep(3)
    await still_serves(ottd)
    listener = service(ottd).listeners["coordinator"]
    [flooder] = [
        c
        for c in listener.connections
        if c.peer[1] == stream.writer.get_extra_info("sockname")[1]
    ]
    assert flooder.paused
    assert (
        flooder.splitter.pending <= INBOX_PAUSE + 1024 * 1024
    )  # one read chunk at most
    text = await metrics(ottd)
    answered = metric_value(text, "crossroads_openttd_listings_total")
    assert 100 < answered < sent / 2
    await stream.close()
    await server.close()


@pytest.mark.parametrize(
    "data",
    [b"\x05\x00\x00\x06\x00", b"\x08\x00\x00\x02tok\x00\x02", b"\x03\x00\x05"],
)
async def test_bad_stun_packets_are_closed(ottd: Runtime, data: bytes) -> None:
    stream = await raw(ottd, "stun")
    await stream.send(data)
    assert await stream.at_eof(5)
    await stream.close()
    text = await metrics(ottd)
    assert (
        sum(
            metric_value(
                text, "crossroads_openttd_dropped_total", listener="stun", reason=r
            )
            for r in ("unterminated", "version", "bad-type", "short")
        )
        + metric_value(
            text, "crossroads_openttd_stun_requests_total", result="unknown-token"
        )
        == 1
    )


async def test_round_trip_of_a_coordinator_connection(ottd: Runtime) -> None:
    """The kernel's TCP round trip of a server's coordinator connection: what the
    join ladder times GC_STUN_CONNECT with (proto/openttd/ladder.py)."""
    server = await register(ottd, 1)
    try:
        coordinator = service(ottd).coordinator
        assert coordinator is not None
        conn = coordinator.local_servers[server.code]
        rtt = conn.round_trip()
        assert rtt is not None and rtt > 0
        conn.close("test")
        assert conn.round_trip() is None
    finally:
        await server.close()
