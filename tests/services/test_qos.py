"""The QoS service: answers the independent client (tests/qos_client.py), runs
beside every relay node, registers with the budget and the store, and the
discovery and estimate APIs built on it."""

from __future__ import annotations

import asyncio
import json
import tracemalloc
from typing import Any

import pytest

from crossroads.config import default_config
from crossroads.proto.admission import LocalTable
from crossroads.proto.qos.server import QosServer
from crossroads.runtime import Runtime, start
from crossroads.services.qos import SERVER_PREFIX, SOURCE_BYTES, SOURCES_TABLE
from crossroads.services.relay_allocations import node_key
from tests import qos_client
from tests.conftest import loopback_config
from tests.e2e.relay_support import api, relay_runtime

pytestmark = pytest.mark.timeout(60)


def qos_listeners(rt: Runtime) -> list[Any]:
    return [x for x in rt.resources.snapshot()["listeners"] if x["kind"] == "qos"]


async def measure(port: int, host: str = "127.0.0.1") -> qos_client.Result:
    (result,) = await asyncio.to_thread(qos_client.measure, [(host, port)])
    return result


async def test_only_qos_answers_the_unity_client_and_registers_itself() -> None:
    rt = await start(
        default_config(loopback_config(core__only="qos", qos__region="eu"))
    )
    try:
        (listener,) = qos_listeners(rt)
        assert listener["table"] == SOURCES_TABLE and listener["transport"] == "udp"
        result = await measure(listener["port"])
        assert len(result.latencies) == 5 and result.packet_loss == 0.0
        assert all(0 <= ms < 1000 for ms in result.latencies)
        assert result.flows == [0] * 5
        # 25-byte requests, 13-byte answers: never larger than the question.
        assert result.sizes == [13] * 5
        keys = await rt.store.keys(SERVER_PREFIX)
        assert len(keys) == 1
        record = json.loads(await rt.store.get(keys[0]) or b"{}")
        assert record["region"] == "eu" and record["port"] == listener["port"]
        store = rt.store
    finally:
        await rt.close()
    assert await store.keys(SERVER_PREFIX) == []


async def test_a_relay_node_alone_runs_its_own_qos_listener() -> None:
    async with relay_runtime(relay__node_id="n1", relay__region="ap") as rt:
        (listener,) = qos_listeners(rt)
        record = json.loads(await rt.store.get(node_key("n1")) or b"{}")
        assert record["qosPort"] == listener["port"]
        assert record["qosHost"] == "127.0.0.1"
        result = await measure(record["qosPort"])
        assert result.packet_loss == 0.0
        # Nothing registered on its own: the node's record carries it.
        assert await rt.store.keys(SERVER_PREFIX) == []
    assert SOURCES_TABLE not in {t["table"] for t in rt.resources.snapshot()["tables"]}


async def test_no_relay_qos_runs_no_listener() -> None:
    async with relay_runtime(relay__node_id="n3", relay__qos=False) as rt:
        assert qos_listeners(rt) == []
        record = json.loads(await rt.store.get(node_key("n3")) or b"{}")
        assert record["qosPort"] == 0


async def test_relay_and_qos_in_one_process_share_one_listener() -> None:
    async with relay_runtime(core__only="qos,relay", relay__node_id="n2") as rt:
        (listener,) = qos_listeners(rt)
        record = json.loads(await rt.store.get(node_key("n2")) or b"{}")
        assert record["qosPort"] == listener["port"]
        assert await rt.store.keys(SERVER_PREFIX) == []


async def test_a_flooding_source_is_throttled_and_gets_less_than_it_sent() -> None:
    async with relay_runtime(qos__rate=5) as rt:
        (listener,) = qos_listeners(rt)
        port = listener["port"]

        def flood() -> tuple[int, int, list[int]]:
            import socket

            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.settimeout(0.5)
            sent = received = 0
            flows = []
            try:
                for i in range(40):
                    data = qos_client.request(i % 5, 1, qos_client.now_ms())
                    sock.sendto(data, ("127.0.0.1", port))
                    sent += len(data)
                while True:
                    try:
                        answer = sock.recv(2048)
                    except TimeoutError:
                        break
                    received += len(answer)
                    flows.append(answer[1] & 0xF)
            finally:
                sock.close()
            return sent, received, flows

        sent, received, flows = await asyncio.to_thread(flood)
        assert received < sent
        assert len(flows) == 10  # 5 plain, 5 throttled, 30 dropped
        assert flows[:5] == [0] * 5 and all(f > 0 for f in flows[5:])


def test_bytes_per_source_is_measured() -> None:
    """SOURCE_BYTES covers what one source's rate state costs (the core's
    dict entry and list slot, and the table's count)."""
    table = LocalTable()
    core = QosServer(admission=table)
    request = qos_client.request(0, 1, 0)
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for i in range(10_000):
            core.receive_datagram(request, (f"10.{i // 250}.{i % 250}.1", 1), 0.0)
            core.datagrams_to_send(0.0)
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
    assert core.sources == 10_000
    per_source = grown / 10_000
    print(f"bytes per source: {per_source:.0f}")
    assert 50 < per_source <= SOURCE_BYTES, per_source


async def test_discovery_lists_nodes_with_room_in_unity_shape() -> None:
    """The two paths of Unity's QoS discovery (Unity.Services.Qos
    GetServiceServersRequest and GetServersRequest): the SDK's relay QoS asks
    ``/v1/services/relay/servers``, with ``region`` repeated to filter."""
    async with relay_runtime(relay__region="eu", relay__node_id="eu-1") as rt:
        async with api(rt) as http:
            body = (await http.get("/v1/services/relay/servers")).json()
            (server,) = body["data"]["servers"]
            (listener,) = qos_listeners(rt)
            endpoint = f"127.0.0.1:{listener['port']}"
            assert server == {"endpoints": [endpoint], "region": "eu"}
            listed = (await http.get("/v1/servers?service=relay")).json()
            assert listed["data"]["servers"] == [
                {"endpoints": [endpoint], "region": "eu", "services": ["relay"]}
            ]
            filtered = await http.get("/v1/services/relay/servers?region=us&region=eu")
            assert filtered.json()["data"]["servers"] == [server]
            none = await http.get("/v1/services/relay/servers?region=us")
            assert none.json()["data"]["servers"] == []
            for bad in (
                "/v1/servers?service=multiplay",
                "/v1/services/multiplay/servers",
            ):
                assert (await http.get(bad)).status_code == 400, bad
            # A full node is not listed (its record says so).
            raw = json.loads(await rt.store.get(node_key("eu-1")) or b"{}")
            raw["load"] = raw["capacity"]
            await rt.store.set(node_key("eu-1"), json.dumps(raw).encode(), ttl=60)
            full = await http.get("/v1/services/relay/servers")
            assert full.json()["data"]["servers"] == []
            # A dead node (its record gone) is not listed either.
            await rt.store.delete(node_key("eu-1"))
            gone = await http.get("/v1/services/relay/servers")
            assert gone.json()["data"]["servers"] == []


async def test_a_standalone_qos_server_is_listed_while_its_region_has_room() -> None:
    rt = await start(
        default_config(
            loopback_config(
                core__only="qos,relay",
                relay__api_keys="test-key-0123456789",
                relay__api_only=True,
                qos__region="us",
            )
        )
    )
    try:
        (listener,) = qos_listeners(rt)
        async with api(rt) as http:
            empty = await http.get("/v1/services/relay/servers")
            assert empty.json()["data"]["servers"] == []  # no relay node in "us"
            node = {
                "id": "us-1", "region": "us", "description": "us", "host": "192.0.2.5",
                "port": 7780, "capacity": 10, "load": 0,
            }  # fmt: skip
            await rt.store.set(node_key("us-1"), json.dumps(node).encode(), ttl=60)
            listed = await http.get("/v1/services/relay/servers")
            assert listed.json()["data"]["servers"] == [
                {"endpoints": [f"127.0.0.1:{listener['port']}"], "region": "us"}
            ]
    finally:
        await rt.close()


async def test_ping_estimate_api() -> None:
    async with relay_runtime(relay__region="eu") as rt, api(rt) as http:
        answer = await http.post(
            "/v1/ping/estimate",
            json={"locations": ["eu=10,us=90", "eu=30,us=70.5"]},
        )
        assert answer.status_code == 200, answer.text
        data = answer.json()["data"]
        # Only "eu" has a live node: "us" is not offered.
        assert data["bestRegion"] == "eu"
        ((region),) = data["regions"]
        assert region["pairs"] == [{"a": 0, "b": 1, "rttMs": 40.4}]
        (direct,) = data["direct"]
        assert (direct["lowMs"], direct["highMs"]) == (20.0, 40.0)
        bad = await http.post("/v1/ping/estimate", json={"locations": ["eu=x", "a=1"]})
        assert bad.status_code == 400
        one = await http.post("/v1/ping/estimate", json={"locations": ["eu=1"]})
        assert one.status_code == 400
