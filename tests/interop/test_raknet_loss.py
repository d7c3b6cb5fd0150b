"""The real RakNet 4.081 peer against crossroads' RakNet core across a lossy
link, for a minute: two network namespaces joined by a veth pair, each
dropping 10 % of the UDP datagrams it receives. The connection must stay up
and carry every reliable ordered message, small and split, exactly once and in
order, both ways (the server echoes each one back).

Why nftables and not ``tc netem``: the issue asks for loss injected with
netem inside a namespace, but this kernel has no ``sch_netem`` (``tc qdisc add
dev X root netem loss 10%`` answers "Specified qdisc kind is unknown"), and
loading modules is not something a test may do. An nftables ``numgen random
mod 10 == 0 drop`` rule in each namespace's input hook drops the same share of
datagrams at random, as netem's ``loss 10%`` would; what it cannot add is
delay or reordering, which the in-memory property test of the reliability
layer (tests/proto/raknet/test_reliability.py) covers with duplication.

The minute (``LOSS_SECONDS``, 60 s by default, the issue's figure; six times
RakNet's 10 s dead-connection timeout, so a connection that only survives on
luck between keepalives is caught) is the one long test of the RakNet suite;
``CROSSROADS_TEST_RAKNET_LOSS_SECONDS`` shortens it for a quick local run."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import AsyncIterator, Iterator

import pytest

from crossroads.lab.netns import entered, socket_in
from crossroads.proto.raknet.peer import Disconnected, RakNetServer, ServerConfig
from tests.conftest import eventually
from tests.interop.raknet_support import ID, RakNetPeer
from tests.interop.test_raknet import EchoDriver

#: Seconds of traffic (see the module docstring).
LOSS_SECONDS = float(os.environ.get("CROSSROADS_TEST_RAKNET_LOSS_SECONDS", "60"))
#: One message every this many seconds: a stream, not a burst.
SEND_INTERVAL = 0.02

pytestmark = [pytest.mark.lab, pytest.mark.timeout(LOSS_SECONDS + 90)]

SERVER_IP = "198.51.100.1"
CLIENT_IP = "198.51.100.2"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def link() -> Iterator[tuple[str, str]]:
    """(server namespace, client namespace), joined by a lossy veth pair."""
    if os.geteuid() != 0:
        pytest.fail("the loss test needs root (network namespaces, nftables)")
    tag = f"rkl{os.getpid() % 100000}"
    server_ns, client_ns = f"{tag}s", f"{tag}c"
    try:
        ip("netns", "add", server_ns)
        ip("netns", "add", client_ns)
        ip(
            "link",
            "add",
            f"{tag}a",
            "netns",
            server_ns,
            "type",
            "veth",
            "peer",
            "name",
            f"{tag}b",
            "netns",
            client_ns,
        )
        for ns, dev, addr in (
            (server_ns, f"{tag}a", SERVER_IP),
            (client_ns, f"{tag}b", CLIENT_IP),
        ):
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
            for rule in (
                "add table inet loss",
                "add chain inet loss in { type filter hook input priority 0; }",
                "add rule inet loss in meta l4proto udp numgen random mod 10 == 0 drop",
            ):
                ip("netns", "exec", ns, "nft", rule)
        yield server_ns, client_ns
    finally:
        for ns in (server_ns, client_ns):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture
async def server(
    link: tuple[str, str],
) -> AsyncIterator[tuple[RakNetServer, EchoDriver]]:
    core = RakNetServer(ServerConfig())
    sock = socket_in(link[0], bind=(SERVER_IP, 61111))
    loop = asyncio.get_running_loop()
    transport, driver = await loop.create_datagram_endpoint(
        lambda: EchoDriver(core), sock=sock
    )
    try:
        yield core, driver
    finally:
        transport.close()


async def test_reliable_ordered_traffic_both_ways_survives_a_minute_of_loss(
    link: tuple[str, str], server: tuple[RakNetServer, EchoDriver]
) -> None:
    core, driver = server
    with entered(
        link[1]
    ):  # the wheel's socket and threads live in the client namespace
        client = RakNetPeer(host=CLIENT_IP)
    try:
        await client.connect(SERVER_IP, 61111)
        sent: list[bytes] = []
        loop = asyncio.get_running_loop()
        stop = loop.time() + LOSS_SECONDS
        i = 0
        while loop.time() < stop:
            size = 4000 if i % 10 == 0 else 20  # every tenth one is split
            payload = b"\x86" + i.to_bytes(4, "big") + bytes(size)
            client.send(payload)
            sent.append(payload)
            i += 1
            await asyncio.sleep(SEND_INTERVAL)
        echoed = [
            await client.expect(lambda d: d.startswith(b"\x86echo"), timeout=30)
            for _ in sent
        ]
        assert [e[5:] for e in echoed] == sent
        assert core.connected_count == 1
        assert not [e for e in driver.events if isinstance(e, Disconnected)]
        assert not [d for d, _ in client.backlog if d[0] == ID.ID_CONNECTION_LOST]
        resends = sum(c.layer.resends for c in core.connections.values())
        assert resends > 0  # the loss was real and the server repaired its side
    finally:
        client.close()
    await eventually(
        lambda: _false_if(core.connected_count), "the server sees the disconnection"
    )


async def _false_if(value: int) -> bool:
    return value == 0
