"""Several coordinator processes' worth of instances on one real Redis.

Each runtime is a full instance with its own listeners, sharing only the
store, exactly as separate processes would (the lead's e2e test does the same
with separate processes; see tests/interop/test_openttd.py for the real binary).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from crossroads.client.openttd import GameInfoResponder
from crossroads.proto.openttd.coordinator import (
    ClientConnect,
    ClientConnected,
    ClientListing,
    ConnectFailed,
    GcConnecting,
    GcDirectConnect,
    GcListing,
    GcStunConnect,
    GcStunRequest,
    GcTurnConnect,
)
from crossroads.proto.openttd.gameinfo import GameInfo
from crossroads.runtime import Runtime
from tests.services.openttd.helpers import (
    answer_stun_request,
    gc,
    http_get,
    metric_value,
    metrics,
    port_of,
    recv_until,
    register,
    start_openttd,
    turn_connect,
    turn_connected,
    until_listed,
    until_metric,
    update,
)

pytestmark = [pytest.mark.timeout(60), pytest.mark.redis]


@pytest.fixture
async def pair(redis_url: str) -> AsyncIterator[tuple[Runtime, Runtime]]:
    a = await start_openttd(store=redis_url)
    b = await start_openttd(store=redis_url)
    try:
        yield a, b
    finally:
        await a.close()
        await b.close()


async def test_server_on_one_is_joinable_directly_through_the_other(
    pair: tuple[Runtime, Runtime], game_server: GameInfoResponder
) -> None:
    a, b = pair
    server = await register(a, game_server.port)
    client = await gc(b)
    try:
        await client.send_message(ClientConnect(6, server.code))
        connecting = await client.recv()
        assert isinstance(connecting, GcConnecting)
        assert await client.recv() == GcDirectConnect(
            connecting.token, 1, "127.0.0.1", game_server.port
        )
    finally:
        await server.close()
        await client.close()


async def test_stun_and_turn_across_instances(pair: tuple[Runtime, Runtime]) -> None:
    """The join runs on B; the server's socket is on A. B's commands reach the
    server through A, the server's reports on A reach B, and A's STUN service
    reports what it saw to B."""
    a, b = pair
    server = await register(a, 1)  # not directly reachable
    client = await gc(b)
    streams = []
    try:
        await client.send_message(ClientConnect(6, server.code))
        connecting = await client.recv()
        client_request = await client.recv()
        assert client_request == GcStunRequest(connecting.token)
        server_request = await recv_until(server.client, GcStunRequest)
        # The server uses A's STUN service, the client B's.
        streams += await answer_stun_request(a, server.client, server_request.token)
        streams += await answer_stun_request(b, client, client_request.token)
        client_stun = await client.recv()
        server_stun = await recv_until(server.client, GcStunConnect)
        assert isinstance(client_stun, GcStunConnect)
        assert client_stun.port == streams[0].writer.get_extra_info("sockname")[1]
        assert server_stun.port == streams[1].writer.get_extra_info("sockname")[1]
        # The server's simultaneous open fails; it reports to A, A forwards to B.
        await server.client.send_message(
            ConnectFailed(6, server_stun.token, server_stun.tracking_number)
        )
        client_turn = await client.recv()
        server_turn = await recv_until(server.client, GcTurnConnect)
        assert isinstance(client_turn, GcTurnConnect)
        assert client_turn.ticket == server_turn.ticket
        assert client_turn.connection_string.endswith(f":{port_of(b, 'turn')}")
        relay_a, _ = await turn_connect(
            server_turn.connection_string, server_turn.ticket
        )
        relay_b, _ = await turn_connect(
            client_turn.connection_string, client_turn.ticket
        )
        streams += [relay_a, relay_b]
        await turn_connected(relay_a)
        await turn_connected(relay_b)
        await client.send_message(ClientConnected(6, client_turn.token))
        await until_metric(
            b, "crossroads_openttd_connects_total", 1, method="turn", result="ok"
        )
        assert (
            metric_value(await metrics(a), "crossroads_openttd_bus_published_total")
            >= 3
        )
    finally:
        for stream in streams:
            await stream.close()
        await server.close()
        await client.close()


async def test_listing_and_http_see_every_instance(
    pair: tuple[Runtime, Runtime], game_server: GameInfoResponder
) -> None:
    a, b = pair
    server = await register(a, game_server.port)
    await update(server, GameInfo(server_name="on A", server_revision="13.0"))
    await until_listed(b, "on A")
    lister = await gc(b)
    try:
        await lister.send_message(ClientListing(6, 6, "13.0", 0))
        listing = await recv_until(lister, GcListing)
        assert [e.info.server_name for e in listing.entries] == ["on A"]
        servers = (await http_get(b, "/openttd/servers")).json()
        assert [s["invite_code"] for s in servers] == [server.code]
    finally:
        await lister.close()
        await server.close()


async def test_reconnect_to_another_instance_keeps_the_code_and_drops_the_old_session(
    pair: tuple[Runtime, Runtime], game_server: GameInfoResponder
) -> None:
    a, b = pair
    first = await register(a, game_server.port)
    # The same server (same address and port) comes back through B before A
    # noticed its old connection died. The secret key is shared via Redis.
    second = await register(
        b, game_server.port, code=first.code, secret=first.ack.invite_code_secret
    )
    try:
        assert second.code == first.code
        assert await first.client.at_eof(5)
        record = (await http_get(a, f"/openttd/servers/{first.code}")).json()
        assert record["invite_code"] == first.code
        client = await gc(a)
        await client.send_message(ClientConnect(6, first.code))
        assert isinstance(await client.recv(), GcConnecting)
        await client.close()
    finally:
        await first.close()
        await second.close()


async def test_stopping_an_instance_removes_its_servers(
    redis_url: str, game_server: GameInfoResponder
) -> None:
    a = await start_openttd(store=redis_url)
    b = await start_openttd(store=redis_url)
    try:
        server = await register(a, game_server.port)
        await a.close()
        await server.close()
        assert (await http_get(b, f"/openttd/servers/{server.code}")).status_code == 404
    finally:
        await a.close()
        await b.close()
