"""Two relay nodes and the allocations API sharing one real Redis.

Node A runs in this process with the API; node B is a separate ``crossroads
serve --relay-node-only`` process, killed with SIGKILL half way (no goodbye: its
registration must expire by itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from crossroads.client.relay import Allocation, RelayApi, RelayApiError, RelayConnection
from crossroads.services.relay import RelayService
from crossroads.services.relay_allocations import node_key
from tests.conftest import running_service, serve_command
from tests.e2e.relay_support import API_KEY, api, base_url, relay_runtime

pytestmark = [pytest.mark.redis, pytest.mark.timeout(90)]

# Registration TTL = 3 heartbeats = 3 s: short enough for the dead-node test,
# long enough that a loaded CI machine stalling the loop a second keeps nodes.
HEARTBEAT = 1.0


@contextlib.asynccontextmanager
async def step(
    what: str, seconds: float, log: Path | None = None
) -> AsyncIterator[None]:
    """Bound one step of the scenario, and say which one ran out of time."""
    try:
        async with asyncio.timeout(seconds):
            yield
    except TimeoutError:
        output = log.read_text() if log is not None and log.exists() else ""
        pytest.fail(f"{what}: no result within {seconds} s\n{output}")


def start_node_b(redis_url: str, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as output:  # the child keeps its own descriptor
        return subprocess.Popen(
            serve_command(
                "relay",
                "--store",
                redis_url,
                "--relay-port",
                "0",
                # Every port the OS's choice, as loopback_config() does in
                # process: the DTLS endpoint's default (7790) was taken once by
                # another process and node B did not start.
                "--relay-dtls-port",
                "0",
                "--relay-node-only",
                "--relay-node-id",
                "node-b",
                "--relay-region",
                "eu",
                "--relay-heartbeat",
                str(HEARTBEAT),
                "--relay-allow-private-peers",
            ),
            stdout=output,
            stderr=subprocess.STDOUT,
        )


async def test_two_nodes_share_load_and_a_dead_node_is_avoided(
    redis_url: str, tmp_path: Path
) -> None:
    log = tmp_path / "node-b.log"
    process = start_node_b(redis_url, log)
    try:
        async with (
            relay_runtime(
                core__store=redis_url,
                relay__node_id="node-a",
                relay__region="eu",
                relay__heartbeat=HEARTBEAT,
            ) as rt,
            api(rt) as http,
        ):
            raw_b = None
            async with step("node B registers", 40, log):
                while raw_b is None:
                    assert process.poll() is None, log.read_text()
                    raw_b = await rt.store.get(node_key("node-b"))
                    await asyncio.sleep(0.05)
            port_b = json.loads(raw_b)["port"]
            node_a = running_service(rt, "relay", RelayService).node
            port_a = node_a.info.port
            names = {port_a: "node-a", port_b: "node-b"}

            async def allocate() -> dict[str, Any]:
                response = await http.post("/v1/allocate", json={"maxConnections": 3})
                assert response.status_code == 201, response.text
                allocation: dict[str, Any] = response.json()["data"]["allocation"]
                return allocation

            # Six allocations: the least-loaded choice alternates between equals.
            spread = [await allocate() for _ in range(6)]
            counts = Counter(names[a["relayServer"]["port"]] for a in spread)
            assert counts == {"node-a": 3, "node-b": 3}

            # A whole session on node B, a process that shares only Redis with us.
            on_b = next(a for a in spread if a["relayServer"]["port"] == port_b)
            async with RelayApi(base_url(rt), API_KEY) as relay_api:
                async with step("a session on node B", 30, log):
                    host = await RelayConnection.open(Allocation.from_json(on_b))
                    await host.bind()
                    code = await relay_api.join_code(host.allocation.allocation_id)
                    joined = await relay_api.join(code)
                    assert joined.server == host.allocation.server
                    player = await RelayConnection.open(joined)
                    await player.bind()
                    await player.connect()
                    player.send(host.allocation_id, b"through node b")
                    assert await host.recv(timeout=5) == (
                        player.allocation_id,
                        b"through node b",
                    )
                    await player.close()
                    await host.close()

                # Kill node B outright; its registration expires with its TTL.
                process.kill()
                process.wait(10)
                async with step("node B's registration expires", 20):
                    while await rt.store.get(node_key("node-b")) is not None:
                        await asyncio.sleep(0.05)
                after = [await allocate() for _ in range(4)]
                assert {names[a["relayServer"]["port"]] for a in after} == {"node-a"}
                # Its sessions' join codes no longer lead anywhere.
                with pytest.raises(RelayApiError) as info:
                    await relay_api.join(code)
                assert info.value.status == 404
            regions = (await http.get("/v1/regions")).json()["data"]["regions"]
            assert [r["id"] for r in regions] == ["eu"]
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(10)


async def test_api_only_and_node_only_runtimes(redis_url: str) -> None:
    async with (
        relay_runtime(
            core__store=redis_url,
            relay__node_only=True,
            relay__region="us",
            relay__heartbeat=HEARTBEAT,
        ) as node_rt,
        relay_runtime(core__store=redis_url, relay__api_only=True) as api_rt,
    ):
        async with RelayApi(base_url(api_rt), API_KEY) as relay_api:
            assert await relay_api.regions() == [("us", "us")]
            allocation = await relay_api.allocate(2, "us")
            host = await RelayConnection.open(allocation)
            await host.bind()
            player = await RelayConnection.open(
                await relay_api.join(
                    await relay_api.join_code(allocation.allocation_id)
                )
            )
            await player.bind()
            await player.connect()
            host_node = running_service(node_rt, "relay", RelayService).node
            assert host_node.core.connections == 1
            await player.close()
            await host.close()
