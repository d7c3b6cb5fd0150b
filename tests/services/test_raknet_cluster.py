"""``--raknet-proxy-relay-nodes``: two ``raknet`` instances sharing a real
Redis; a UDP proxy request that reaches instance A is served by instance B's
forwarder, chosen by the stock RakNet clients' pings when both can serve. The
clients are real RakNet 4.081 peers (PyPI ``raknet==0.3.0``) scripting
UDPProxyClient's messages (reference raknet-wire.md §5)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from crossroads.config import default_config
from crossroads.proto.raknet import messages as m
from crossroads.proto.raknet.bitstream import BitReader, BitWriter
from crossroads.proto.raknet.udpproxy import Sub
from crossroads.runtime import Runtime, start
from crossroads.services.raknet import RakNetService
from crossroads.services.raknet_nodes import NODE_PREFIX, node_key
from tests.conftest import eventually, loopback_config
from tests.interop.raknet_support import RakNetPeer
from tests.services.test_raknet import (
    answer_ping_round,
    guid_of,
    proxy_message,
    service_of,
)

pytestmark = pytest.mark.timeout(60)

Starter = Callable[..., Any]


@pytest.fixture
async def runtimes(redis_url: str) -> AsyncIterator[Starter]:
    started: list[Runtime] = []

    async def make(**overrides: Any) -> Runtime:
        config = loopback_config(
            core__only="raknet",
            core__store=redis_url,
            raknet__proxy_relay_nodes=True,
            **overrides,
        )
        runtime = await start(default_config(config))
        started.append(runtime)
        return runtime

    try:
        yield make
    finally:
        for runtime in started:
            await runtime.close()


async def knows_nodes(service: RakNetService, count: int) -> None:
    async def listed() -> bool:
        return len(service.node.proxy.relay_nodes) == count

    await eventually(listed, f"{count} relay nodes listed")


async def ask_forwarding(service: RakNetService, a: RakNetPeer, b: RakNetPeer) -> None:
    """a and b connect to ``service``; a asks to be relayed to b."""
    b.peer.max_incoming_connections = 4  # b hosts the game
    port = service.addresses[0][1]
    await a.connect("127.0.0.1", port)
    await b.connect("127.0.0.1", port)
    request = BitWriter()
    request.write_address(("0.0.0.0", 0))
    request.write_bool(False)
    request.write_u64(await guid_of(service, b))
    request.write_u32(5000)
    request.write_bool(False)
    a.send(proxy_message(Sub.FORWARDING_REQUEST_FROM_CLIENT_TO_COORDINATOR, request))


async def play_through(a: RakNetPeer, b: RakNetPeer) -> tuple[str, int]:
    """The forwarding answers reach both; they talk through the port."""
    succeeded = await a.expect(m.MessageId.UDP_PROXY_GENERAL)
    notified = await b.expect(m.MessageId.UDP_PROXY_GENERAL)
    assert succeeded[1] == Sub.FORWARDING_SUCCEEDED
    assert notified[1] == Sub.FORWARDING_NOTIFICATION
    reader = BitReader(succeeded, start_bits=16 + 7 * 8 * 2 + 64)
    proxy = (reader.read_rakstring().decode(), reader.read_u16())
    a.server = None
    await a.connect(*proxy)
    await b.expect(m.MessageId.NEW_INCOMING_CONNECTION)
    a.send(b"\x86through another instance")
    assert await b.expect(0x86) == b"\x86through another instance"
    return proxy


async def test_a_request_at_one_instance_is_forwarded_by_another(
    runtimes: Starter, peers: tuple[RakNetPeer, RakNetPeer]
) -> None:
    """A has no forwarder of its own: B's, found in the Store, does the work."""
    coordinator_runtime = await runtimes(raknet__proxy=False)
    coordinator = service_of(coordinator_runtime)
    node = service_of(await runtimes())
    assert coordinator.forwarders is None and node.forwarders is not None
    await knows_nodes(coordinator, 1)
    record = await _record(node)
    assert record["raknet"] == list(node.addresses[0])
    a, b = peers
    await ask_forwarding(coordinator, a, b)
    proxy = await play_through(a, b)
    assert proxy[1] in {e.port for e in node.forwarders.entries.values()}
    assert node.forwarders.packets() > 0
    assert coordinator.relay_nodes is not None and node.relay_nodes is not None
    assert coordinator.relay_nodes.dropped == {} and node.relay_nodes.dropped == {}
    # Garbage on an instance's channel is dropped and counted; it goes on.
    await coordinator.relay_nodes.store.publish(
        node_key(coordinator.relay_nodes.node_id), b'{"t": "forward"'
    )
    host, http_port = coordinator_runtime.http_address

    async def counted() -> bool:
        async with httpx.AsyncClient() as http:
            text = (await http.get(f"http://{host}:{http_port}/metrics")).text
        return (
            'crossroads_raknet_dropped_total{reason="relay-node-bad-json"} 1.0' in text
            and "crossroads_raknet_proxy_relay_nodes 1.0" in text
        )

    await eventually(counted, "the bad command is counted")


async def _record(service: RakNetService) -> dict[str, Any]:
    nodes = service.relay_nodes
    assert nodes is not None
    raw = await nodes.store.get(NODE_PREFIX + nodes.node_id)
    assert raw is not None
    record: dict[str, Any] = json.loads(raw)
    return record


async def test_the_clients_pings_choose_between_two_instances_forwarders(
    runtimes: Starter, peers: tuple[RakNetPeer, RakNetPeer]
) -> None:
    """Both instances can forward: RakNet's ping round (``5c 07``/``5c 08``)
    lists both; the clients really ping them and report; the other instance,
    reported nearer, forwards. Then B goes away and A serves by itself."""
    first = service_of(await runtimes())
    second_runtime = await runtimes()
    second = service_of(second_runtime)
    await knows_nodes(first, 2)
    a, b = peers
    await ask_forwarding(first, a, b)
    nodes = {first.addresses[0], second.addresses[0]}
    for client in (a, b):  # loopback pings are ~0 ms: say B is nearer
        _, listed, _ = await answer_ping_round(
            client, lambda server: 5 if server == second.addresses[0] else 200
        )
        assert set(listed) == nodes
    await play_through(a, b)
    assert second.forwarders is not None and second.forwarders.packets() > 0
    assert first.forwarders is not None and not first.forwarders.entries
    # B stops: its registration is deleted, A lists only itself again
    await second_runtime.close()
    await knows_nodes(first, 1)
