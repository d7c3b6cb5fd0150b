"""crossroads' RakNet core on a real UDP socket against the real RakNet 4.081
C++ peer (PyPI ``raknet==0.3.0``): handshake, reliable ordered traffic both
ways, split messages above the MTU both ways, disconnection, version
mismatch, unconnected ping, staying connected while idle.

The server side is the core with a test application that echoes every
message back, run by the project's UDP driver. If the wheel is missing the
import fails: these tests never skip.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

import raknet
from crossroads.proto.raknet.peer import (
    Connected,
    Disconnected,
    Event,
    MessageReceived,
    RakNetServer,
    ServerConfig,
)
from crossroads.proto.raknet.reliability import decode_frames
from crossroads.transport.driver import DatagramDriver
from crossroads.transport.sockets import make_udp_socket
from tests.conftest import eventually
from tests.interop.raknet_support import ID, RakNetPeer

pytestmark = pytest.mark.timeout(60)


class EchoDriver(DatagramDriver):
    """The project's UDP driver plus a test application: echo every message."""

    def __init__(self, core: RakNetServer) -> None:
        super().__init__(core)
        self.server = core
        self.events: list[Event] = []

    def transmit(self, now: float | None = None) -> None:
        loop_now = asyncio.get_running_loop().time() if now is None else now
        for event in self.server.pop_events():
            self.events.append(event)
            if isinstance(event, MessageReceived):
                self.server.send(
                    event.address, b"\x86echo" + event.payload, now=loop_now
                )
        super().transmit(now)


@dataclass
class Harness:
    core: RakNetServer
    driver: EchoDriver
    port: int


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    core = RakNetServer(ServerConfig(timeout_ms=3000))
    sock = make_udp_socket("127.0.0.1", 0)
    loop = asyncio.get_running_loop()
    transport, driver = await loop.create_datagram_endpoint(
        lambda: EchoDriver(core), sock=sock
    )
    try:
        yield Harness(core, driver, sock.getsockname()[1])
    finally:
        transport.close()


@pytest.fixture
def client() -> AsyncIterator[RakNetPeer]:
    peer = RakNetPeer()
    yield peer
    peer.close()


async def test_connect_exchange_ordered_and_split_messages_then_disconnect(
    harness: Harness, client: RakNetPeer
) -> None:
    accepted = await client.connect("127.0.0.1", harness.port)
    assert accepted[0] == ID.ID_CONNECTION_REQUEST_ACCEPTED
    await eventually(
        lambda: _async(any(isinstance(e, Connected) for e in harness.driver.events)),
        "the server sees the connection",
    )
    # reliable ordered, both ways, on two channels
    sent = []
    for i in range(200):
        payload = b"\x86" + i.to_bytes(2, "big") + bytes([i % 2])
        client.send(payload, channel=i % 2)
        sent.append(payload)
    echoed = [await client.expect(lambda d: d.startswith(b"\x86echo")) for _ in sent]
    # the server echoes on channel 0, in the order it delivered
    by_channel = {0: [p for p in sent if p[3] == 0], 1: [p for p in sent if p[3] == 1]}
    got = [e[5:] for e in echoed]
    for channel, expected in by_channel.items():
        assert [p for p in got if p[3] == channel] == expected
    # a split message above the MTU, both ways
    big = b"\x86" + bytes(range(256)) * 200  # 51 201 bytes, ~36 datagrams
    client.send(big)
    assert await client.expect(lambda d: d[5:6] == b"\x86" and len(d) > 50_000) == (
        b"\x86echo" + big
    )
    assert harness.core.split_bytes == 0
    # disconnect: the server sees DISCONNECTION_NOTIFICATION
    client.peer.shutdown(0.5)
    await eventually(
        lambda: _async(
            any(
                isinstance(e, Disconnected) and e.reason == "closed"
                for e in harness.driver.events
            )
        ),
        "the server sees the disconnection",
    )
    assert not harness.core.connections


async def test_other_protocol_versions_are_told_so(harness: Harness) -> None:
    old = RakNetPeer(protocol_version=5)
    try:
        old.peer.connect("127.0.0.1", harness.port)
        await old.expect(ID.ID_INCOMPATIBLE_PROTOCOL_VERSION)
    finally:
        old.close()
    assert harness.core.stats.dropped["protocol-version"] >= 1


async def test_unconnected_ping_gets_a_pong(
    harness: Harness, client: RakNetPeer
) -> None:
    assert client.peer.ping("127.0.0.1", harness.port)
    await client.expect(ID.ID_UNCONNECTED_PONG)


async def test_an_idle_connection_stays_up_past_the_timeout(
    harness: Harness, client: RakNetPeer
) -> None:
    """The server's timeout is 3 s here: 7 s of silence from the application
    must not end it (pings and ACKs keep it alive both ways)."""
    await client.connect("127.0.0.1", harness.port)
    await asyncio.sleep(7)  # the behaviour under test is "nothing happens"
    assert harness.core.connected_count == 1
    assert not [e for e in harness.driver.events if isinstance(e, Disconnected)]
    client.send(b"\x86still")
    assert (
        await client.expect(lambda d: d.startswith(b"\x86echo")) == b"\x86echo\x86still"
    )
    lost = [d for d, _ in client.backlog if d[0] == ID.ID_CONNECTION_LOST]
    assert not lost


async def _async(value: bool) -> bool:
    return value


def test_the_wheel_is_raknet_4081_with_protocol_6() -> None:
    peer = raknet.RakPeer()
    peer.startup(port=0, protocol_version=6)
    peer.shutdown(0)


class FirstFragmentLost(EchoDriver):
    """Drops the first datagram carrying fragment 0 of a split message."""

    def __init__(self, core: RakNetServer) -> None:
        super().__init__(core)
        self.dropped = 0

    def transmit(self, now: float | None = None) -> None:
        send = self.server.datagrams_to_send

        def lossy(at: float) -> list[tuple[bytes, tuple[str, int]]]:
            kept = []
            for data, addr in send(at):
                if data[0] == 0x84 and not self.dropped:
                    frames = decode_frames(data, 4)
                    if any(f.split_count and f.split_index == 0 for f in frames):
                        self.dropped += 1
                        continue
                kept.append((data, addr))
            return kept

        self.server.datagrams_to_send = lossy  # type: ignore[method-assign]
        try:
            super().transmit(now)
        finally:
            del self.server.datagrams_to_send


async def test_a_split_message_whose_first_fragment_is_lost_arrives_intact(
    client: RakNetPeer,
) -> None:
    """RakNet 4.081 joins fragments in arrival order: a resent fragment 0
    arriving after fragment 1 scrambled the message (measured). The server
    sends a split message's fragments one at a time to keep them in order."""
    core = RakNetServer()
    sock = make_udp_socket("127.0.0.1", 0)
    loop = asyncio.get_running_loop()
    transport, driver = await loop.create_datagram_endpoint(
        lambda: FirstFragmentLost(core), sock=sock
    )
    try:
        await client.connect("127.0.0.1", sock.getsockname()[1])
        big = b"\x86" + bytes(range(256)) * 16
        client.send(big)
        client.send(b"\x86after")
        assert await client.expect(lambda d: len(d) > 1000) == b"\x86echo" + big
        assert (
            await client.expect(lambda d: d.endswith(b"after")) == b"\x86echo\x86after"
        )
        assert driver.dropped == 1
    finally:
        transport.close()
