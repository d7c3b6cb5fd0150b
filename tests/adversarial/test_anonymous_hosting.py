"""Anonymous relay through p2p hosting.

``welcome`` carried no TURN credentials any more, but ``{"type": "host"}``
needs no account: three hosted sessions from one IP gave three credentials
and 190 allocations in 4.3 s, the whole TURN quota at ``ulimit -n 1024``, and
the next client from another IP got 486. Now credentials come only once a
session has somebody to relay to, hosted sessions are a budget table with a
per-source cap that is a fraction of the total, and TURN's per-IP quota is
never more than a fraction of its total."""

from __future__ import annotations

import json
import socket
from typing import Any

import pytest
import websockets

from crossroads.client.turn import rest_credentials
from crossroads.services.turn import TurnService
from tests.adversarial.test_free_relay import _until
from tests.adversarial.turn_quota_support import DirectClient, p2p_with_turn
from tests.services.test_p2p import hello, ws_url
from tests.services.test_turn import SECRET

pytestmark = pytest.mark.timeout(60)


async def _hello(ws: Any) -> dict[str, Any]:
    await ws.send(hello())
    return await _until(ws, "welcome")


async def test_hosting_alone_gives_no_turn_credentials() -> None:
    async with p2p_with_turn() as rt:
        url = ws_url(rt)
        async with (
            websockets.connect(url) as a,
            websockets.connect(url) as b,
            websockets.connect(url) as c,
        ):
            for ws in (a, b, c):
                await _hello(ws)
                await ws.send(json.dumps({"type": "host"}))
                hosted = await _until(ws, "hosted")
                assert hosted["type"] == "hosted" and hosted["turn"] is None
                await ws.send(json.dumps({"type": "turn_refresh"}))
                refused = await _until(ws, "turn")
                assert refused["type"] == "error"
                assert refused["code"] == "not_in_session"


async def test_hosted_sessions_per_source_are_a_fraction_of_the_total() -> None:
    # 16 sessions in all: one source may hold 16 / 8 = 2 of them, whatever
    # --p2p-max-sessions-per-ip says.
    async with p2p_with_turn(p2p__max_sessions=16, p2p__max_sessions_per_ip=16) as rt:
        table = rt.resources.admissions["p2p-sessions"]
        assert (table.max_items, table.max_per_source) == (16, 2)
        url = ws_url(rt)
        async with websockets.connect(url) as one:
            await _hello(one)
            for _ in range(2):
                await one.send(json.dumps({"type": "host"}))
                assert (await _until(one, "hosted"))["type"] == "hosted"
            await one.send(json.dumps({"type": "host"}))
            refused = await _until(one, "hosted")
            assert (refused["type"], refused["code"]) == ("error", "limit")
            assert table.refused == {"over-ip-limit": 1}
            # Another address still hosts.
            sock = socket.create_connection(
                rt.http_address, source_address=("127.0.0.2", 0)
            )
            async with websockets.connect(url, sock=sock) as other:
                await _hello(other)
                await other.send(json.dumps({"type": "host"}))
                assert (await _until(other, "hosted"))["type"] == "hosted"
                assert table.live == 3
        await _until_closed(table)


async def _until_closed(table: Any) -> None:
    from tests.conftest import eventually

    async def released() -> bool:
        return bool(table.live == 0)

    await eventually(released, "sessions released when their hosts left")


def _client_from(
    service: TurnService, host: str, username: str, password: str
) -> DirectClient:
    client = DirectClient(service, username, password)
    client.sink.close()
    client.sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client.sink.bind((host, 0))
    client.sink.setblocking(False)
    client.address = client.sink.getsockname()
    return client


async def test_one_ip_with_p2p_credentials_cannot_take_the_turn_quota() -> None:
    """The finding's attack at ``ulimit -n 1024`` (TURN total 192): one IP
    hosts, joins its own session from a second socket, and allocates with
    both credentials until refused; a client of another IP then allocates."""
    async with p2p_with_turn(
        turn__total_quota=192, turn__unauthenticated_rate=100000
    ) as rt:
        turn = rt.services["turn"]
        assert isinstance(turn, TurnService)
        url = ws_url(rt)
        async with websockets.connect(url) as host, websockets.connect(url) as guest:
            await _hello(host)
            await host.send(json.dumps({"type": "host"}))
            hosted = await _until(host, "hosted")
            await _hello(guest)
            await guest.send(json.dumps({"type": "join", "code": hosted["code"]}))
            credentials = [
                (await _until(guest, "join_start"))["turn"],
                # (The code before the fix gave them in hosted.)
                hosted["turn"] or (await _until(host, "turn"))["turn"],
            ]
        clients: list[DirectClient] = []
        try:
            granted = 0
            for info in credentials:
                for _ in range(130):
                    client = _client_from(
                        turn, "127.0.0.1", info["username"], info["password"]
                    )
                    clients.append(client)
                    if client.allocate() is not None:
                        break
                    granted += 1
            username, password = rest_credentials(SECRET, "someone-else")
            other = _client_from(turn, "127.0.0.2", username, password)
            clients.append(other)
            assert (granted, other.allocate()) == (192 // 8, None)
            assert turn.allocation_table.max_per_source == 192 // 8
        finally:
            for client in clients:
                client.release()
                client.close()
