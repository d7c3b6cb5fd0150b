"""Graceful drain with real clients and real ``crossroads serve`` processes.

- TURN: coturn's ``turnutils_uclient`` keeps relaying through a node drained by
  SIGTERM with no loss; a new Allocate there gets 300 Try Alternate naming the
  other node (both share a real Redis), and crossroads' own TURN client follows
  it; the drained node exits 0 when its last allocation ends.
- The Unity relay: a host allocated on node A before ``crossroads drain`` keeps
  relaying (and takes a new player through its join code); new hosts land on
  node B; node A exits when the session is closed.
- The drain timeout, and a second SIGTERM, end a drain with live sessions.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from crossroads.client.relay import Allocation, RelayApi, RelayConnection
from crossroads.client.turn import TurnClient, TurnClientError, allocate_following
from crossroads.services.relay import RelayService
from crossroads.services.relay_allocations import node_key as relay_node_key
from crossroads.services.turn_nodes import NODE_PREFIX as TURN_NODE_PREFIX
from tests.conftest import free_port, running_service, serve_command
from tests.e2e.relay_support import API_KEY, api, base_url, metric, relay_runtime
from tests.interop.test_turn import assert_no_loss, echoes, tool, uclient

pytestmark = [pytest.mark.timeout(120)]

USER, PASSWORD, TOKEN = "alice", "secret123", "drain-admin-token-0123456789"
_HTTP = re.compile(r" http: tcp 127\.0\.0\.1:(\d+)")
_UDP = re.compile(r" (?:turn|relay): udp 127\.0\.0\.1:(\d+)")


@dataclass
class Node:
    """A ``crossroads serve`` process started by a test."""

    process: subprocess.Popen[bytes]
    log: Path
    http: int
    udp: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    async def exit_code(self, seconds: float) -> int:
        """The exit code, waited for (bounded) without blocking the loop."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while (code := self.process.poll()) is None:
            assert loop.time() < deadline, f"still running:\n{self.output()}"
            await asyncio.sleep(0.05)
        return code


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[list[Node]]:
    """Processes started by :func:`start_node`, killed at the end if alive."""
    started: list[Node] = []
    yield started
    for node in started:
        if node.process.poll() is None:
            node.process.kill()
        node.process.wait(10)


async def start_node(nodes: list[Node], tmp_path: Path, only: str, *args: str) -> Node:
    name = f"node-{len(nodes)}"
    log = tmp_path / f"{name}.log"
    command = serve_command(
        only,
        "--state-dir", str(tmp_path / name),
        "--admin-token", TOKEN,
        *args,
    )  # fmt: skip
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while loop.time() < deadline:
        text = log.read_text(errors="replace")
        http, udp = _HTTP.search(text), _UDP.search(text)
        if http and udp:
            node = Node(process, log, int(http.group(1)), int(udp.group(1)))
            nodes.append(node)
            return node
        assert process.poll() is None, text
        await asyncio.sleep(0.05)
    process.kill()
    raise AssertionError(f"{name} did not start:\n{log.read_text()}")


def turn_args(redis_url: str, *extra: str) -> list[str]:
    return [
        "--store", redis_url, "--stun-port", "0", "--stun-alt-port", "0",
        "--turn-user", f"{USER}:{PASSWORD}", "--allow-loopback-peers",
        *extra,
    ]  # fmt: skip


async def sessions(node: Node, kind: str) -> int:
    async with httpx.AsyncClient(timeout=10) as http:
        answer = await http.get(
            node.url + "/console/api/admin/sessions",
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
    return len(answer.json().get(kind, []))


async def revoke_all(node: Node, kind: str) -> int:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=node.url, headers=headers) as http:
        listed = (await http.get("/console/api/admin/sessions")).json()[kind]
        for session in listed:
            answer = await http.post(
                "/console/api/admin/revoke", json={"kind": kind, "id": session["id"]}
            )
            assert answer.status_code == 200, answer.text
    return len(listed)


async def wait_for(
    what: str, check: Callable[[], Awaitable[bool]], seconds: float = 20.0
) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not await check():
        assert loop.time() < deadline, f"not within {seconds} s: {what}"
        await asyncio.sleep(0.05)


async def drain_cli(node: Node) -> str:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "crossroads", "drain", "--url", node.url,
        "--admin-token", TOKEN,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0, out.decode()
    return out.decode()


async def probe(node: Node) -> tuple[int, int, float]:
    """(/readyz status, /healthz status, crossroads_draining)."""
    async with httpx.AsyncClient(base_url=node.url, timeout=10) as http:
        ready = (await http.get("/readyz")).status_code
        health = (await http.get("/healthz")).status_code
        draining = metric((await http.get("/metrics")).text, "crossroads_draining")
    return ready, health, draining


@pytest.mark.redis
@pytest.mark.interop
async def test_turn_drain_redirects_new_allocations_and_keeps_live_ones(
    redis_url: str, tmp_path: Path, nodes: list[Node]
) -> None:
    node_a = await start_node(nodes, tmp_path, "turn", *turn_args(redis_url))
    node_b = await start_node(nodes, tmp_path, "turn", *turn_args(redis_url))
    store = aioredis.from_url(redis_url)
    try:

        async def both_registered() -> bool:
            return len(await store.keys(TURN_NODE_PREFIX + "*")) == 2

        await wait_for("both TURN nodes register", both_registered)
        peer_port = free_port(socket.SOCK_DGRAM)
        peer = await asyncio.create_subprocess_exec(
            tool("turnutils_peer"), "-L", "127.0.0.1", "-p", str(peer_port),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        try:
            await echoes("127.0.0.1", peer_port, peer)
            # 200 messages 20 ms apart: ~4 s of relaying, the drain in between.
            relaying = asyncio.create_task(
                uclient(
                    "-c", "-e", "127.0.0.1", "-r", str(peer_port),
                    "-u", USER, "-w", PASSWORD,
                    "-m", "1", "-n", "200", "-z", "20", "-l", "100",
                    "-p", str(node_a.udp), "127.0.0.1",
                )
            )  # fmt: skip

            async def allocated() -> bool:
                assert not relaying.done(), relaying.result()
                return await sessions(node_a, "turn") > 0

            await wait_for("uclient allocates on node A", allocated)
            node_a.process.send_signal(signal.SIGTERM)

            async def draining() -> bool:
                return (await probe(node_a))[2] == 1.0

            await wait_for("node A drains", draining)
            assert await probe(node_a) == (503, 200, 1.0)
            assert await probe(node_b) == (200, 200, 0.0)

            # A new Allocate on node A: 300 + ALTERNATE-SERVER naming node B.
            async def redirected() -> bool:
                async with await TurnClient.connect(
                    ("127.0.0.1", node_a.udp), USER, PASSWORD
                ) as client:
                    try:
                        await client.allocate()
                    except TurnClientError as exc:
                        assert exc.code == 300, exc
                        return exc.alternate == ("127.0.0.1", node_b.udp)
                raise AssertionError("node A allocated while draining")

            await wait_for("300 names node B", redirected)
            # crossroads' client follows it and relays through node B.
            client = await allocate_following(("127.0.0.1", node_a.udp), USER, PASSWORD)
            async with client:
                assert client.server == ("127.0.0.1", node_b.udp)
                await client.bind_channel(("127.0.0.1", peer_port))
                await client.send(b"via node b", ("127.0.0.1", peer_port))
                assert await client.receive(timeout=5) == (
                    b"via node b",
                    ("127.0.0.1", peer_port),
                )
            # uclient relayed through the draining node to the end, no loss.
            assert_no_loss(await relaying)
            # uclient follows the 300 too: a new run against node A relays
            # through node B with no loss.
            second_run = await uclient(
                "-c", "-e", "127.0.0.1", "-r", str(peer_port),
                "-u", USER, "-w", PASSWORD,
                "-m", "1", "-n", "10", "-z", "20", "-l", "100",
                "-p", str(node_a.udp), "127.0.0.1",
            )  # fmt: skip
            assert "error 300 (Try Alternate)" in second_run
            assert_no_loss(second_run)
            async with httpx.AsyncClient() as http:
                text = (await http.get(node_b.url + "/metrics")).text
            # Node B allocated for crossroads' client and for uclient.
            assert metric(text, "crossroads_turn_allocations_created_total") == 2
            assert await sessions(node_a, "turn") == 1
            assert node_a.process.poll() is None  # its allocation still lives
            keys = {k.decode() for k in await store.keys(TURN_NODE_PREFIX + "*")}
            assert len(keys) == 1  # node A left the listing, node B stays
        finally:
            peer.kill()
            await peer.wait()
        # uclient leaves its allocation behind (it never deletes it, see
        # tests/interop/test_turn.py): the operator ends it, and with the last
        # allocation gone node A exits on its own, exit code 0.
        assert await revoke_all(node_a, "turn") == 1
        assert await node_a.exit_code(30) == 0
        assert "drained: no live session left" in node_a.output()
        assert node_b.process.poll() is None
    finally:
        await store.aclose()


async def test_drain_timeout_and_second_sigterm_end_live_sessions(
    tmp_path: Path, nodes: list[Node]
) -> None:
    memory = ["--stun-port", "0", "--stun-alt-port", "0",
              "--turn-user", f"{USER}:{PASSWORD}"]  # fmt: skip
    timed = await start_node(nodes, tmp_path, "turn", *memory, "--drain-timeout", "1")
    second = await start_node(nodes, tmp_path, "turn", *memory)
    held = [
        await allocate_following(("127.0.0.1", node.udp), USER, PASSWORD)
        for node in (timed, second)
    ]
    try:
        # --drain-timeout 1: exits 0 with the allocation still live.
        timed.process.send_signal(signal.SIGTERM)
        assert await timed.exit_code(20) == 0
        assert "drain timeout" in timed.output()
        # `crossroads drain` (the admin API) drains like SIGTERM ...
        assert "draining: 1 live session(s)" in await drain_cli(second)
        assert (await probe(second))[0] == 503
        assert second.process.poll() is None
        # ... and a SIGTERM then is the second one: it stops at once.
        second.process.send_signal(signal.SIGTERM)
        assert await second.exit_code(20) == 0
        assert "second SIGTERM" in second.output()
    finally:
        for client in held:
            await client.close()


@pytest.mark.redis
async def test_relay_drain_keeps_sessions_and_places_new_hosts_elsewhere(
    redis_url: str, tmp_path: Path, nodes: list[Node]
) -> None:
    node_a = await start_node(
        nodes, tmp_path, "relay",
        "--store", redis_url, "--relay-port", "0", "--relay-dtls-port", "0",
        "--relay-node-only", "--relay-node-id", "node-a", "--relay-region", "eu",
        "--relay-heartbeat", "1", "--relay-allow-private-peers",
    )  # fmt: skip
    async with (
        relay_runtime(
            core__store=redis_url,
            relay__node_id="node-b",
            relay__region="eu",
            relay__heartbeat=1.0,
        ) as rt,
        api(rt) as http,
        RelayApi(base_url(rt), API_KEY) as relay_api,
    ):

        async def a_registered() -> bool:
            return await rt.store.get(relay_node_key("node-a")) is not None

        await wait_for("node A registers", a_registered)
        port_b = running_service(rt, "relay", RelayService).node.info.port  # type: ignore[union-attr]

        async def allocate() -> Allocation:
            response = await http.post("/v1/allocate", json={"maxConnections": 3})
            assert response.status_code == 201, response.text
            return Allocation.from_json(response.json()["data"]["allocation"])

        # Equal nodes: the choice alternates; take the first host on node A.
        on_a = None
        for _ in range(20):
            candidate = await allocate()
            if candidate.server[1] == node_a.udp:
                on_a = candidate
                break
        assert on_a is not None, "no allocation landed on node A"
        host = await RelayConnection.open(on_a)
        await host.bind()
        code = await relay_api.join_code(host.allocation.allocation_id)
        player = await RelayConnection.open(await relay_api.join(code))
        await player.bind()
        await player.connect()
        player.send(host.allocation_id, b"before")
        assert await host.recv(timeout=5) == (player.allocation_id, b"before")

        assert "draining: 2 live session(s)" in await drain_cli(node_a)

        async def a_draining() -> bool:
            raw = await rt.store.get(relay_node_key("node-a"))
            return raw is not None and json.loads(raw).get("draining") is True

        await wait_for("node A registers as draining", a_draining)
        assert (await probe(node_a))[:2] == (503, 200)
        # New hosts land on node B; the listings no longer show node A.
        after = [await allocate() for _ in range(4)]
        assert {a.server[1] for a in after} == {port_b}
        status = (await http.get("/console/api/status")).json()
        assert [n["node"] for n in status["relay_nodes"]] == ["node-b"]
        # The live session goes on both ways, and takes a new player.
        player.send(host.allocation_id, b"during")
        assert await host.recv(timeout=5) == (player.allocation_id, b"during")
        host.send(player.allocation_id, b"back")
        assert await player.recv(timeout=5) == (host.allocation_id, b"back")
        late = await RelayConnection.open(await relay_api.join(code))
        assert late.allocation.server[1] == node_a.udp
        await late.bind()
        await late.connect()
        late.send(host.allocation_id, b"late")
        assert await host.recv(timeout=5) == (late.allocation_id, b"late")
        assert node_a.process.poll() is None
        for connection in (late, player, host):
            await connection.close()
        # The session is over: node A exits 0.
        assert await node_a.exit_code(30) == 0
        assert "drained: no live session left" in node_a.output()
