"""Redis faults and instance crashes lose nothing that matters.

A real redis-server (``--save ''``, no persistence) is stopped and started
again, empty, on the same port. Before: the HTTP APIs answered 500 (a scan
against the dead Redis raised redis' own error) with a traceback per request;
``relay:secret`` was gone, so an instance started afterwards drew a new one and
its tokens failed on the running relay node; a bound host's join code never came
back (the node only re-EXPIREd it).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import signal
import subprocess
import uuid
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import httpx
import pytest

from crossroads.client.openttd import GameInfoResponder, GcClient
from crossroads.proto.openttd.coordinator import ClientConnect, ErrorType, GcError
from crossroads.proto.openttd.gameinfo import GameInfo
from crossroads.runtime import Runtime
from tests.adversarial.store_faults_support import (
    private_redis,
    redis_command,
    redis_get,
    redis_set,
)
from tests.conftest import RedisServer, eventually, free_port, serve_command
from tests.e2e.relay_support import (
    BIND_RECEIVED,
    RawPeer,
    api,
    base_url,
    raw_bind,
    raw_ping,
    relay_runtime,
)
from tests.services.openttd.helpers import (
    gc,
    register,
    start_openttd,
    until_listed,
    update,
)

pytestmark = pytest.mark.timeout(60)

#: Short heartbeats (default 5 s) so the test sees several within seconds; the
#: TTL is 3 beats, long enough that a loaded machine does not let a node lapse.
HEARTBEAT = 1.0


def relay_on(redis: RedisServer) -> AbstractAsyncContextManager[Runtime]:
    """A relay node and API on ``redis``, fast heartbeats, no request limits
    (the test polls /v1/join while the code is away)."""
    return relay_runtime(
        core__store=redis.url,
        relay__heartbeat=HEARTBEAT,
        relay__api_rate=0,
        core__guess_per_source=0,
        core__guess_global=0,
    )


async def allocate_and_bind(rt: Runtime) -> tuple[dict[str, object], RawPeer]:
    async with api(rt) as http:
        response = await http.post("/v1/allocate", json={"maxConnections": 4})
        assert response.status_code == 201, response.text
    allocation = response.json()["data"]["allocation"]
    server = (allocation["relayServer"]["ipV4"], allocation["relayServer"]["port"])
    peer = RawPeer(server)
    assert await peer.request(raw_bind(allocation, nonce=0)) == BIND_RECEIVED
    return allocation, peer


async def keep_alive(peer: RawPeer, allocation: dict[str, object]) -> None:
    """PING the relay as a Unity host does, so the allocation stays bound."""
    allocation_id = base64.b64decode(str(allocation["allocationIdBytes"]))
    while True:
        peer.send(raw_ping(allocation_id))
        await asyncio.sleep(0.5)


async def test_relay_survives_a_redis_restart_that_lost_everything(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="crossroads")
    with private_redis() as redis:
        async with relay_on(redis) as node:
            host, peer = await allocate_and_bind(node)
            pinger = asyncio.create_task(keep_alive(peer, host))
            try:
                async with api(node) as http:
                    code = (
                        await http.post(
                            "/v1/joincode", json={"allocationId": host["allocationId"]}
                        )
                    ).json()["data"]["joinCode"]
                    secret = redis_get(redis, "relay:secret")
                    assert secret
                    # What a node can re-create is what a heartbeat has seen.
                    relay_node = node.services["relay"].node  # type: ignore[attr-defined]
                    host_id = uuid.UUID(str(host["allocationId"]))

                    async def node_knows_code() -> bool:
                        return bool(relay_node.join_code_of(host_id) == code)

                    await eventually(node_knows_code, "a heartbeat saw the join code")

                    redis.stop()
                    # While the store is down every HTTP API says 503 with the
                    # error envelope: no 500, no dropped connection.
                    for method, path, body in (
                        ("GET", "/v1/regions", None),
                        ("POST", "/v1/join", {"joinCode": code}),
                        ("POST", "/v1/allocate", {"maxConnections": 2}),
                        ("GET", "/healthz", None),
                    ):
                        for _ in range(5):
                            response = await http.request(method, path, json=body)
                            assert response.status_code == 503, (path, response.text)
                            assert response.json()
                    caplog.clear()

                    restarted = RedisServer(port=redis.port)  # empty: --save ''
                    redis.process, redis.directory = (
                        restarted.process,
                        restarted.directory,
                    )

                    # The node re-publishes the secret and re-creates the host's
                    # records and join code: joins work again.
                    async def joinable() -> bool:
                        response = await http.post("/v1/join", json={"joinCode": code})
                        return response.status_code == 200

                    await eventually(
                        joinable, "the join code is back after the restart"
                    )

                    async def secret_back() -> bool:
                        return redis_get(redis, "relay:secret") == secret

                    await eventually(secret_back, "the node re-published the secret")

                # An instance started now (API only) shares the old secret: its
                # allocations bind on the running node.
                async with relay_runtime(
                    core__store=redis.url,
                    relay__api_only=True,
                    relay__heartbeat=HEARTBEAT,
                ) as late:
                    _, late_peer = await allocate_and_bind(late)
                    late_peer.close()
            finally:
                pinger.cancel()
                peer.close()
    store_lines = [
        r.getMessage() for r in caplog.records if r.name == "crossroads.store"
    ]
    assert sum("answers again" in line for line in store_lines) == 1, store_lines
    assert not [r for r in caplog.records if r.exc_info], "no tracebacks"


async def test_an_instance_whose_secret_lost_the_race_adopts_the_winner(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="crossroads")
    with private_redis() as redis:
        async with relay_on(redis) as node:
            before, before_peer = await allocate_and_bind(node)
            before_peer.close()
            # Redis came back empty and another instance published its own
            # secret first.
            redis.flush()
            winner = b"w" * 64
            redis_set(redis, "relay:secret", winner)

            async def adopted() -> bool:
                return any("adopted" in r.getMessage() for r in caplog.records)

            await eventually(adopted, "the node logs that it adopted the secret")
            assert redis_get(redis, "relay:secret") == winner
            # Tokens sealed with the winner's secret (by any instance) bind here,
            # and so does one this node sealed before it adopted.
            async with relay_runtime(
                core__store=redis.url, relay__api_only=True
            ) as other:
                _, peer = await allocate_and_bind(other)
                peer.close()
            old_token_peer = RawPeer(
                (before["relayServer"]["ipV4"], before["relayServer"]["port"])  # type: ignore[index]
            )
            try:
                reply = await old_token_peer.request(raw_bind(before, nonce=1))
                assert reply == BIND_RECEIVED
            finally:
                old_token_peer.close()


async def test_every_http_api_is_503_while_the_store_is_down() -> None:
    with private_redis() as redis:
        async with relay_runtime(
            core__store=redis.url, core__only="relay,p2p,openttd"
        ) as rt:
            redis.stop()
            async with httpx.AsyncClient(base_url=base_url(rt), timeout=20) as http:
                for method, path in (
                    ("GET", "/testServer?__gameId=g"),
                    ("POST", "/testServer"),
                    ("GET", "/openttd/servers/+abcdefg"),
                ):
                    body = b'{"__gameId": "g", "__timeoutSec": 60}'
                    response = await http.request(
                        method, path, content=body if method == "POST" else None
                    )
                    assert response.status_code == 503, (path, response.text)
                    assert set(response.json()) >= {"code", "message"}


# ------------------------------------------------ OpenTTD: an instance is killed

#: Liveness beats of the test's coordinators (default 10 s): a killed instance
#: is noticed after three of them.
INSTANCE_HEARTBEAT = 0.5


def start_coordinator(redis_url: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    """A second OpenTTD coordinator instance, as its own process (kill -9 able)."""
    with log.open("wb") as output:  # the child keeps its own descriptor
        return subprocess.Popen(
            serve_command(
                "openttd",
                "--store",
                redis_url,
                "--openttd-coordinator-port",
                str(port),
                "--openttd-stun-port",
                "0",
                "--openttd-turn-port",
                "0",
                "--openttd-instance-heartbeat",
                str(INSTANCE_HEARTBEAT),
            ),
            stdout=output,
            stderr=subprocess.STDOUT,
        )


async def connect_when_listening(
    port: int, process: subprocess.Popen[bytes], log: Path
) -> GcClient:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while True:
        assert process.poll() is None, log.read_text()
        try:
            return await GcClient.connect("127.0.0.1", port, 6)
        except OSError:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.1)


async def test_a_killed_coordinators_servers_stop_being_advertised(
    tmp_path: Path,
) -> None:
    log = tmp_path / "victim.log"
    with private_redis() as redis:
        survivor = await start_openttd(
            store=redis.url, instance_heartbeat=INSTANCE_HEARTBEAT
        )
        responder = GameInfoResponder()
        await responder.start()
        port = free_port()
        victim = start_coordinator(redis.url, port, log)
        try:
            client = await connect_when_listening(port, victim, log)
            server = await register(
                survivor, responder.port, client=client, stun_ok=False
            )
            await update(server, GameInfo(server_name="doomed", server_revision="13.0"))
            await until_listed(survivor, "doomed")

            victim.send_signal(signal.SIGKILL)  # no goodbye, no cleanup
            victim.wait(10)
            # Within a few heartbeats, not the record's 90 s: not listed, not
            # joinable through the survivor.
            await until_listed(survivor)
            joiner = await gc(survivor)
            try:
                await joiner.send_message(ClientConnect(6, server.code))
                assert await joiner.recv() == GcError(
                    ErrorType.INVALID_INVITE_CODE, server.code
                )
            finally:
                await joiner.close()
            await server.close()
        finally:
            if victim.poll() is None:
                victim.kill()
                victim.wait(10)
            await responder.close()
            await survivor.close()


async def test_openttd_records_and_secret_come_back_after_redis_lost_them() -> None:
    with private_redis() as redis:
        first = await start_openttd(
            store=redis.url, instance_heartbeat=INSTANCE_HEARTBEAT
        )
        responder = GameInfoResponder()
        await responder.start()
        try:
            server = await register(first, responder.port, stun_ok=False)
            await update(server, GameInfo(server_name="kept", server_revision="13.0"))
            await until_listed(first, "kept")
            secret = redis_get(redis, "openttd:secret")
            assert secret

            redis.flush()  # Redis came back empty (--save '')
            # The record is back within a heartbeat, not at the server's next
            # update (30 s); the shared key is back as it was.

            async def record_back() -> bool:
                found = redis_command(redis, "HEXISTS", "openttd:servers", server.code)
                return found == b"1"

            await eventually(record_back, "the server's record re-created")
            await until_listed(first, "kept")

            async def secret_back() -> bool:
                return redis_get(redis, "openttd:secret") == secret

            await eventually(secret_back, "openttd:secret re-published")

            # An instance started now honours the server's saved code and secret:
            # the server re-registering there keeps its invite code.
            second = await start_openttd(store=redis.url)
            try:
                again = await register(
                    second,
                    responder.port,
                    code=server.code,
                    secret=server.ack.invite_code_secret,
                    stun_ok=False,
                )
                assert again.code == server.code
                await again.close()
            finally:
                await second.close()
            await server.close()
        finally:
            await responder.close()
            await first.close()
