"""The SDK's relay step through a real TURN server (coturn) with a real RFC 8656
client: TURN is preferred to the WebSocket relay, payload stays sealed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest

from crossroads.client.p2p import P2PClient, _TurnTransport
from crossroads.config import default_config
from crossroads.runtime import start
from crossroads.types import Address
from tests.client.turn_adapters import AioiceTurn, coturn
from tests.conftest import loopback_config

pytestmark = [pytest.mark.interop, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def turn_server() -> Iterator[Address]:
    with coturn() as address:
        yield address


@pytest.fixture
async def url() -> AsyncIterator[str]:
    rt = await start(default_config(loopback_config(core__only="p2p")))
    host, port = rt.http_address
    try:
        yield f"ws://{host}:{port}/p2p/v1/ws"
    finally:
        await rt.close()


async def test_relay_step_prefers_turn(url: str, turn_server: Address) -> None:
    def factory() -> object:
        return AioiceTurn.open(turn_server)

    a = P2PClient(url, bind=("127.0.0.1", 0), relay="force", turn=factory)  # type: ignore[arg-type]
    b = P2PClient(url, bind=("127.0.0.1", 0), relay="force", turn=factory)  # type: ignore[arg-type]
    try:
        await a.start()
        await b.start()
        assert a.turn is not None and b.turn is not None
        await b.join(await a.host())
        link = b.links[a.peer_id]
        assert link.step == "relay"
        assert isinstance(link.via, _TurnTransport)
        # relay to relay: neither peer sends to the other's own address
        assert link.addr == a.turn.relayed
        b.send(a.peer_id, b"over TURN")
        assert await asyncio.wait_for(a.recv(), 5) == (b.peer_id, b"over TURN")
        a.send(b.peer_id, b"and back")
        assert await asyncio.wait_for(b.recv(), 5) == (a.peer_id, b"and back")
        assert isinstance(a.links[b.peer_id].via, _TurnTransport)
    finally:
        await a.close()
        await b.close()


async def test_without_turn_the_websocket_relay_is_used(url: str) -> None:
    a = P2PClient(url, bind=("127.0.0.1", 0), relay="force")
    b = P2PClient(url, bind=("127.0.0.1", 0), relay="force")
    try:
        await a.start()
        await b.start()
        await b.join(await a.host())
        assert b.links[a.peer_id].addr[0].startswith("relay:")
    finally:
        await a.close()
        await b.close()
