"""The Unity flow "allocate without a region" against two regions: discovery,
a QoS round (the independent client of tests/qos_client.py), allocate with
``region`` null and the measurements, then BIND, CONNECT and RELAY in raw
Unity bytes. One region's QoS server is reached through a UDP delay line
(40 ms each way on loopback), so the regions measure differently."""

from __future__ import annotations

import asyncio
import base64
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from crossroads.client.qos import RegionResult
from crossroads.client.relay import RelayApi
from crossroads.config import default_config
from crossroads.runtime import Runtime, start
from crossroads.store.memory import MemoryStore
from tests import qos_client
from tests.e2e.relay_support import (
    API_KEY,
    BIND_RECEIVED,
    RawPeer,
    allocation_id,
    api,
    base_url,
    raw_accepted,
    raw_bind,
    raw_connect,
    raw_relay,
    relay_overrides,
)
from tests.qos_client import UdpDelay

pytestmark = pytest.mark.timeout(60)

#: One-way delay of the far region's line (ms): far beyond loopback jitter.
DELAY = 0.040


def qos_port(rt: Runtime) -> int:
    (row,) = [x for x in rt.resources.snapshot()["listeners"] if x["kind"] == "qos"]
    return int(row["port"])


@asynccontextmanager
async def two_regions() -> AsyncIterator[tuple[Runtime, Runtime]]:
    """Region "a-far" (its QoS server behind the delay line) and "b-near"
    (the allocations API runs there), sharing one store. Named so that the
    far region sorts first: picking the first listed would be wrong."""
    loop = asyncio.get_running_loop()
    line_transport, line = await loop.create_datagram_endpoint(
        UdpDelay.factory(DELAY), local_addr=("127.0.0.1", 0)
    )
    line_port = line_transport.get_extra_info("sockname")[1]
    store = MemoryStore()
    far = await start(
        default_config(
            relay_overrides(
                relay__region="a-far",
                relay__node_only=True,
                qos__public_port=line_port,
            )
        ),
        store=store,
    )
    line.target = ("127.0.0.1", qos_port(far))
    near = await start(
        default_config(relay_overrides(relay__region="b-near")), store=store
    )
    try:
        yield far, near
    finally:
        await near.close()
        await far.close()
        line_transport.close()


async def unity_qos_round(servers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What Unity's QoS SDK reports per region: its best server's average
    latency and loss."""
    endpoints = []
    for server in servers:
        host, _, port = server["endpoints"][0].rpartition(":")
        endpoints.append((host, int(port)))
    results = await asyncio.to_thread(qos_client.measure, endpoints)
    best: dict[str, qos_client.Result] = {}
    for server, result in zip(servers, results, strict=True):
        held = best.get(server["region"])
        if held is None or result.latency_ms < held.latency_ms:
            best[server["region"]] = result
    return [
        {"region": region, "latency": r.latency_ms, "packetLoss": r.packet_loss}
        for region, r in sorted(best.items(), key=lambda kv: kv[1].latency_ms)
    ]


async def test_allocate_without_region_lands_in_the_measured_best_and_relays() -> None:
    async with two_regions() as (far, near), api(near) as http:
        servers = (await http.get("/v1/services/relay/servers")).json()["data"][
            "servers"
        ]
        assert {s["region"] for s in servers} == {"a-far", "b-near"}
        measured = await unity_qos_round(servers)
        by_region = {m["region"]: m for m in measured}
        assert by_region["a-far"]["latency"] >= 2 * DELAY * 1000
        assert by_region["b-near"]["latency"] < 2 * DELAY * 1000
        assert measured[0]["region"] == "b-near"
        assert all(m["packetLoss"] == 0.0 for m in measured)

        async def allocate_unity_style() -> dict[str, Any]:
            body = {"maxConnections": 1, "region": None, "qosResults": measured}
            answer = await http.post("/v1/allocate", json=body)
            assert answer.status_code == 201, answer.text
            allocation: dict[str, Any] = answer.json()["data"]["allocation"]
            return allocation

        for _ in range(3):  # not a coin toss between two equally loaded nodes
            assert (await allocate_unity_style())["region"] == "b-near"
        host_alloc = await allocate_unity_style()
        relay = (host_alloc["relayServer"]["ipV4"], host_alloc["relayServer"]["port"])
        near_node = near.services["relay"].describe()[0]
        assert f":{relay[1]} " in near_node
        host, joiner = RawPeer(relay), RawPeer(relay)
        try:
            assert await host.request(raw_bind(host_alloc, nonce=0)) == BIND_RECEIVED
            body = {"allocationId": host_alloc["allocationId"]}
            code = (await http.post("/v1/joincode", json=body)).json()["data"][
                "joinCode"
            ]
            join_alloc = (await http.post("/v1/join", json={"joinCode": code})).json()[
                "data"
            ]["allocation"]
            assert join_alloc["region"] == "b-near"
            hid, jid = allocation_id(host_alloc), allocation_id(join_alloc)
            assert await joiner.request(raw_bind(join_alloc, nonce=0)) == BIND_RECEIVED
            host_data = base64.b64decode(join_alloc["hostConnectionData"])
            assert await joiner.request(raw_connect(jid, host_data)) == raw_accepted(
                hid, jid
            )
            payload = os.urandom(600)
            joiner.send(raw_relay(jid, hid, payload))
            assert await host.recv() == raw_relay(jid, hid, payload)
            host.send(raw_relay(hid, jid, payload))
            assert await joiner.recv() == raw_relay(hid, jid, payload)
        finally:
            host.close()
            joiner.close()


async def test_the_sdk_measures_and_allocates_in_the_best_region() -> None:
    async with two_regions() as (_, near):
        async with RelayApi(base_url(near), API_KEY) as sdk:
            measured = await sdk.measure()
            assert [r.region for r in measured] == ["b-near", "a-far"]
            allocation = await sdk.allocate_measured(1)
            assert allocation.region == "b-near"
            # The server ranks what it is told (latency and loss), and skips
            # a measured region with no live node for the next best.
            told = [
                RegionResult("nowhere", 1.0, 1.0, 0.0),
                RegionResult("a-far", 2.0, 2.0, 0.0),
                RegionResult("b-near", 1.5, 1.5, 0.6),  # lossy: 3.75 ms
            ]
            allocation = await sdk.allocate(1, qos_results=told)
            assert allocation.region == "a-far"
