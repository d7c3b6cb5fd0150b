"""The STUN/TURN port engine: the Python slow path of relayed data is
transport -> proto -> transport, with no service code in between.

Each case drives one datagram through the port's own entry point (the relay
tap's fallback, a TCP connection's frame) under ``sys.setprofile`` and lists
the crossroads modules of every Python call it made, in order.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import AsyncIterator, Callable
from types import FrameType
from typing import Any

import pytest

from crossroads.client.turn import TurnClient
from crossroads.config import default_config
from crossroads.runtime import Runtime, start
from crossroads.services.turn import TurnService
from crossroads.transport.stunport import TcpConnection
from tests.conftest import loopback_config

pytestmark = pytest.mark.timeout(60)

USER, PASSWORD = "alice", "secret123"


@pytest.fixture(name="runtime")
async def runtime_fixture() -> AsyncIterator[Runtime]:
    runtime = await start(
        default_config(
            loopback_config(
                core__only=["stun", "turn"],
                turn__user=[f"{USER}:{PASSWORD}"],
                turn__allow_loopback_peers=True,
            )
        )
    )
    try:
        yield runtime
    finally:
        await runtime.close()


def _call_path(action: Callable[[], None]) -> list[str]:
    """The crossroads modules of the Python calls ``action`` makes, each run
    of calls in one module once, in order."""
    path: list[str] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        module = str(frame.f_globals.get("__name__", ""))
        if module.startswith("crossroads.") and (not path or path[-1] != module):
            path.append(module)

    sys.setprofile(profile)
    try:
        action()
    finally:
        sys.setprofile(None)
    return path


def _layers(path: list[str]) -> list[str]:
    """The layer of each module (transport, proto, services ...), runs merged."""
    layers: list[str] = []
    for module in path:
        layer = module.split(".")[1]
        if not layers or layers[-1] != layer:
            layers.append(layer)
    return layers


async def test_channel_data_slow_paths_go_transport_proto_transport(
    runtime: Runtime,
) -> None:
    service = runtime.services["turn"]
    assert isinstance(service, TurnService)
    peer = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    peer.bind(("127.0.0.1", 0))
    peer.setblocking(False)
    client = await TurnClient.connect(
        service.stun.primary, USER, PASSWORD, transport="tcp"
    )
    try:
        await client.allocate()
        number = await client.bind_channel(peer.getsockname())
        (relay,) = service.relays
        conn = next(iter(service.stun.connections))
        assert isinstance(conn, TcpConnection)

        # Peer -> client: a TCP client gets no route (framing), so the relay
        # tap's fallback takes it; the core frames it, the connection sends.
        down = _call_path(lambda: relay.from_peer(b"hello", peer.getsockname()))
        assert _layers(down) == ["transport", "proto", "transport"], down
        assert "crossroads.proto.turn.server" in down
        assert await client.receive(timeout=5) == (b"hello", peer.getsockname())

        # Client -> peer: a ChannelData frame on the TCP connection, routed
        # by the connection's table (its hand-fed tap, C or Python).
        frame = number.to_bytes(2, "big") + b"\x00\x04ping"
        up = _call_path(lambda: conn._frame(frame))
        assert "services" not in _layers(up), up
        assert _layers(up)[0] == "transport", up

        # Unbound channel: the core counts why; nothing else runs.
        other = (number + 1).to_bytes(2, "big") + b"\x00\x04ping"
        unrouted = _call_path(lambda: conn._frame(other))
        assert "services" not in _layers(unrouted), unrouted
        assert unrouted[-2:] == [
            "crossroads.transport.turnrelay",
            "crossroads.proto.turn.server",
        ], unrouted
        assert service.stats.drops.get("channel-unbound") == 1
    finally:
        await client.close()
        peer.close()
