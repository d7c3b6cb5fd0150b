"""The SDK with crossroads' own TURN client: credentials from ``hosted`` / ``join_start`` (coturn's
REST-API scheme), a real coturn as the TURN server, relay step over TURN."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from crossroads.client.p2p import P2PClient, _TurnTransport
from crossroads.config import default_config
from crossroads.runtime import start
from crossroads.types import Address
from tests.client.turn_adapters import SECRET, coturn
from tests.conftest import loopback_config

pytest.importorskip(
    "crossroads.client.turn", reason="the TURN client is not merged yet"
)

pytestmark = [pytest.mark.interop, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def turn_server() -> Iterator[Address]:
    with coturn(rest=True) as address:
        yield address


async def test_relay_over_turn_with_session_credentials(turn_server: Address) -> None:
    rt = await start(
        default_config(
            loopback_config(
                core__only="p2p",
                p2p__turn_secret=SECRET,
                p2p__turn_server=f"{turn_server[0]}:{turn_server[1]}",
            )
        )
    )
    host, port = rt.http_address
    url = f"ws://{host}:{port}/p2p/v1/ws"
    a = P2PClient(url, bind=("127.0.0.1", 0), relay="force")
    b = P2PClient(url, bind=("127.0.0.1", 0), relay="force")
    try:
        await a.start()
        await b.start()
        # No credentials before a session (a free relay): hosting and
        # joining bring them, and the SDK allocates then.
        assert a.turn is None and b.turn is None
        await b.join(await a.host())
        assert a.turn is not None and b.turn is not None
        link = b.links[a.peer_id]
        assert link.step == "relay" and isinstance(link.via, _TurnTransport)
        assert link.addr == a.turn.relayed
        b.send(a.peer_id, b"through crossroads' TURN client")
        assert await asyncio.wait_for(a.recv(), 5) == (
            b.peer_id,
            b"through crossroads' TURN client",
        )
    finally:
        await a.close()
        await b.close()
        await rt.close()
