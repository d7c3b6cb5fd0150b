"""End to end: real sockets, a real runtime, the Python client and raw Unity bytes."""

from __future__ import annotations

import asyncio
import base64
import os
from typing import Any

import httpx
import pytest

from crossroads.client.relay import (
    RelayApi,
    RelayConnection,
    RelayRejected,
)
from crossroads.proto.relay.client import RelayClientConfig
from crossroads.services.relay import RelayService
from tests.conftest import running_service
from tests.e2e.relay_support import (
    API_KEY,
    BIND_RECEIVED,
    RawPeer,
    allocate,
    allocate_pair,
    allocation_id,
    api,
    base_url,
    metric,
    raw_accepted,
    raw_bind,
    raw_connect,
    raw_error,
    raw_ping,
    raw_relay,
    relay_runtime,
)

pytestmark = pytest.mark.timeout(60)

FAST = RelayClientConfig(connect_retry=0.2, heartbeat=0.1, max_connect_time=5.0)


async def recv_all(
    connection: RelayConnection, count: int
) -> list[tuple[bytes, bytes]]:
    return [await connection.recv(timeout=5) for _ in range(count)]


async def test_host_and_several_clients_exchange_data() -> None:
    async with relay_runtime() as rt, RelayApi(base_url(rt), API_KEY) as relay_api:
        allocation = await relay_api.allocate(max_connections=4)
        code = await relay_api.join_code(allocation.allocation_id)
        host = await RelayConnection.open(allocation)
        await host.bind()
        players = []
        for _ in range(3):
            joined = await relay_api.join(code)
            assert joined.host_connection_data == allocation.connection_data
            player = await RelayConnection.open(joined)
            await player.bind()
            assert await player.connect() == allocation.allocation_id_bytes
            players.append(player)
        for index, player in enumerate(players):
            player.send(host.allocation_id, f"hello from {index}".encode())
        received = dict(await recv_all(host, 3))
        assert received == {
            p.allocation_id: f"hello from {i}".encode() for i, p in enumerate(players)
        }
        assert host.peers == {p.allocation_id for p in players}
        for player in players:
            host.send(player.allocation_id, b"welcome " + player.allocation_id)
        for player in players:
            assert await player.recv(timeout=5) == (
                host.allocation_id,
                b"welcome " + player.allocation_id,
            )
        # A burst both ways: order is not guaranteed by UDP, content is.
        for n in range(200):
            players[0].send(host.allocation_id, n.to_bytes(2, "big"))
        got = {payload for _, payload in await recv_all(host, 200)}
        assert got == {n.to_bytes(2, "big") for n in range(200)}
        for connection in (*players, host):
            await connection.close()


async def test_raw_unity_bytes_client_joins_a_python_host() -> None:
    async with relay_runtime() as rt, api(rt) as http:
        host_alloc, raw_alloc = await allocate_pair(http)
        endpoint = raw_alloc["serverEndpoints"][0]
        assert endpoint["connectionType"] == "udp"
        server = (endpoint["host"], endpoint["port"])

        # The host is the crossroads Python client ...
        async with RelayApi(base_url(rt), API_KEY):
            from crossroads.client.relay import Allocation

            host = await RelayConnection.open(Allocation.from_json(host_alloc))
            await host.bind()

        # ... the joiner is bytes written from the reference tables.
        peer = RawPeer(server)
        try:
            my_id = allocation_id(raw_alloc)
            host_id = allocation_id(host_alloc)
            assert await peer.request(raw_bind(raw_alloc, nonce=0)) == BIND_RECEIVED
            host_data = base64.b64decode(raw_alloc["hostConnectionData"])
            accepted = await peer.request(raw_connect(my_id, host_data))
            assert accepted == raw_accepted(host_id, my_id)
            peer.send(raw_relay(my_id, host_id, b"raw hello"))
            assert await host.recv(timeout=5) == (my_id, b"raw hello")
            host.send(my_id, b"python reply")
            assert await peer.recv() == raw_relay(host_id, my_id, b"python reply")
            # PING is echoed; a raw DISCONNECT reaches the host.
            assert await peer.request(raw_ping(my_id)) == raw_ping(my_id)
            peer.send(b"\xda\x72\x00\x09" + my_id + host_id)
            async with asyncio.timeout(5):
                while my_id in host.peers:
                    await asyncio.sleep(0.02)
        finally:
            peer.close()
            await host.close()


async def test_raw_host_and_raw_joiner() -> None:
    async with relay_runtime() as rt, api(rt) as http:
        host_alloc = await allocate(http, 1)
        server = (host_alloc["relayServer"]["ipV4"], host_alloc["relayServer"]["port"])
        host, joiner = RawPeer(server), RawPeer(server)
        try:
            assert await host.request(raw_bind(host_alloc, nonce=0)) == BIND_RECEIVED
            code = (
                await http.post(
                    "/v1/joincode", json={"allocationId": host_alloc["allocationId"]}
                )
            ).json()["data"]["joinCode"]
            join_alloc = (await http.post("/v1/join", json={"joinCode": code})).json()[
                "data"
            ]["allocation"]
            hid = allocation_id(host_alloc)
            jid = allocation_id(join_alloc)
            assert await joiner.request(raw_bind(join_alloc, nonce=0)) == BIND_RECEIVED
            host_data = base64.b64decode(join_alloc["hostConnectionData"])
            assert await joiner.request(raw_connect(jid, host_data)) == (
                raw_accepted(hid, jid)
            )
            for size in (0, 1, 1200, 8000):
                payload = os.urandom(size)
                joiner.send(raw_relay(jid, hid, payload))
                assert await host.recv() == raw_relay(jid, hid, payload)
                host.send(raw_relay(hid, jid, payload))
                assert await joiner.recv() == raw_relay(hid, jid, payload)
            # CLOSE from the host ends the session; the joiner hears DISCONNECT.
            host.send(b"\xda\x72\x00\x0b" + hid)
            assert await joiner.recv() == b"\xda\x72\x00\x09" + hid + jid
            assert await host.request(raw_ping(hid)) == raw_error(hid, 4)
        finally:
            host.close()
            joiner.close()


async def test_max_connections_rejection() -> None:
    async with relay_runtime() as rt, RelayApi(base_url(rt), API_KEY) as relay_api:
        allocation = await relay_api.allocate(max_connections=2)
        code = await relay_api.join_code(allocation.allocation_id)
        host = await RelayConnection.open(allocation)
        await host.bind()
        # Three join allocations before anyone connects: the API cannot know yet.
        joins = [await relay_api.join(code) for _ in range(3)]
        players = [await RelayConnection.open(j, config=FAST) for j in joins]
        for player in players:
            await player.bind()
        await players[0].connect()
        await players[1].connect()
        with pytest.raises(RelayRejected):
            await players[2].connect()
        # Now that the relay counts two connections, the API refuses a fourth join.
        async with asyncio.timeout(5):
            while True:
                try:
                    await relay_api.join(code)
                except Exception as exc:
                    assert getattr(exc, "status", None) == 409
                    assert getattr(exc, "title", None) == "SessionFull"
                    break
                await asyncio.sleep(0.05)
        # One leaves: the rejected player gets the seat.
        players[0].disconnect(allocation.allocation_id_bytes)
        async with asyncio.timeout(5):
            while True:
                try:
                    await players[2].connect(timeout=1)
                    break
                except RelayRejected:
                    await asyncio.sleep(0.05)
        for connection in (*players, host):
            await connection.close()


async def test_timeouts_free_the_slot() -> None:
    async with (
        relay_runtime(relay__idle_timeout=0.6, relay__host_alone_timeout=1.5) as rt,
        RelayApi(base_url(rt), API_KEY) as relay_api,
    ):
        node = running_service(rt, "relay", RelayService).node
        allocation = await relay_api.allocate(max_connections=1)
        code = await relay_api.join_code(allocation.allocation_id)
        host = await RelayConnection.open(allocation, config=FAST)
        await host.bind()
        first_join, second_join = await relay_api.join(code), await relay_api.join(code)
        first = await RelayConnection.open(first_join, config=FAST)
        await first.bind()
        await first.connect()
        second = await RelayConnection.open(second_join, config=FAST)
        await second.bind()
        with pytest.raises(RelayRejected):
            await second.connect()
        # The first player vanishes without a word (its socket closes).
        assert first._transport is not None
        first._transport.close()
        first._transport = None
        async with asyncio.timeout(10):
            while first.allocation_id in node.core.allocations:
                await asyncio.sleep(0.05)
        assert await second.connect() == allocation.allocation_id_bytes
        second.send(host.allocation_id, b"my turn")
        assert await host.recv(timeout=5) == (second.allocation_id, b"my turn")
        assert node.core.ended_total.get("idle", 0) >= 1
        await second.close()
        await host.close()


async def test_bind_deadline_and_host_alone_timeout() -> None:
    async with (
        relay_runtime(
            relay__bind_timeout=0.3,
            relay__host_alone_timeout=0.5,
            relay__idle_timeout=0.5,
        ) as rt,
        api(rt) as http,
    ):
        late = (await http.post("/v1/allocate", json={"maxConnections": 1})).json()[
            "data"
        ]["allocation"]
        lonely = (await http.post("/v1/allocate", json={"maxConnections": 1})).json()[
            "data"
        ]["allocation"]
        server = (late["relayServer"]["ipV4"], late["relayServer"]["port"])
        a, b = RawPeer(server), RawPeer(server)
        try:
            assert await b.request(raw_bind(lonely, nonce=0)) == BIND_RECEIVED
            await asyncio.sleep(0.4)  # let the bind deadline of `late` pass
            late_id = allocation_id(late)
            assert await a.request(raw_bind(late, nonce=0)) == raw_error(late_id, 4)
            # The lonely host says nothing more: the relay times it out with ERROR 1.
            lonely_id = allocation_id(lonely)
            assert await b.recv(timeout=5) == raw_error(lonely_id, 1)
            # Its join code is gone with it.
            response = await http.post(
                "/v1/joincode", json={"allocationId": lonely["allocationId"]}
            )
            assert response.status_code == 404
        finally:
            a.close()
            b.close()


async def test_client_address_change_rebinds() -> None:
    async with relay_runtime() as rt, RelayApi(base_url(rt), API_KEY) as relay_api:
        allocation = await relay_api.allocate(max_connections=1)
        host = await RelayConnection.open(allocation, config=FAST)
        await host.bind()
        player = await RelayConnection.open(
            await relay_api.join(await relay_api.join_code(allocation.allocation_id)),
            config=FAST,
        )
        await player.bind()
        await player.connect()
        old = player.local_address
        await player.migrate()
        assert player.local_address != old
        # The first frame from the new port is refused with ERROR 3; the client
        # bumps its nonce, re-binds, and the next frames flow.
        player.send(host.allocation_id, b"lost")
        async with asyncio.timeout(5):
            while True:
                player.send(host.allocation_id, b"after move")
                try:
                    sender, payload = await host.recv(timeout=0.2)
                except TimeoutError:
                    continue
                if payload == b"after move":
                    break
        assert sender == player.allocation_id
        host.send(player.allocation_id, b"found you")
        async with asyncio.timeout(5):
            while (await player.recv())[1] != b"found you":
                pass
        await player.close()
        await host.close()


async def session(
    http: httpx.AsyncClient,
) -> tuple[RawPeer, RawPeer, bytes, bytes, dict[str, Any], dict[str, Any]]:
    host_alloc, join_alloc = await allocate_pair(http)
    server = (host_alloc["relayServer"]["ipV4"], host_alloc["relayServer"]["port"])
    host, joiner = RawPeer(server), RawPeer(server)
    hid, jid = allocation_id(host_alloc), allocation_id(join_alloc)
    assert await host.request(raw_bind(host_alloc, 0)) == BIND_RECEIVED
    assert await joiner.request(raw_bind(join_alloc, 0)) == BIND_RECEIVED
    host_data = base64.b64decode(join_alloc["hostConnectionData"])
    assert await joiner.request(raw_connect(jid, host_data)) == raw_accepted(hid, jid)
    return host, joiner, hid, jid, host_alloc, join_alloc


async def assert_relays(host: RawPeer, joiner: RawPeer, hid: bytes, jid: bytes) -> None:
    joiner.send(raw_relay(jid, hid, b"ping?"))
    assert await host.recv() == raw_relay(jid, hid, b"ping?")
    host.send(raw_relay(hid, jid, b"pong!"))
    assert await joiner.recv() == raw_relay(hid, jid, b"pong!")


async def test_bad_input_is_refused_and_counted_without_harm() -> None:
    async with relay_runtime() as rt, api(rt) as http:
        host, joiner, hid, jid, host_alloc, join_alloc = await session(http)
        server = host.server
        evil = RawPeer(server)
        try:
            # Wrong HMAC: silently dropped.
            evil.send(raw_bind(join_alloc, nonce=9, key=bytes(64)))
            assert await evil.silent()
            # Replayed nonce (the joiner's own BIND, from elsewhere): dropped, and
            # the joiner keeps its binding.
            evil.send(raw_bind(join_alloc, nonce=0))
            assert await evil.silent()
            # Unknown allocation ID: ERROR 4.
            stranger = os.urandom(16)
            assert await evil.request(raw_ping(stranger)) == raw_error(stranger, 4)
            # Spoofed source (someone else's allocation ID): ERROR 3, nothing relayed.
            assert await evil.request(raw_relay(jid, hid, b"spoof")) == raw_error(
                jid, 3
            )
            assert await host.silent()
            # Wrong sizes: dropped.
            for bad in (
                raw_ping(jid)[:-1],
                raw_bind(join_alloc, 1)[:-1],
                raw_relay(jid, hid, b"abc")[:-1],
                b"\xda\x72\x00\x03" + jid,
            ):
                joiner.send(bad)
            assert await joiner.silent()
            assert await host.silent(0.05)
            # RELAY to an unknown peer: ERROR 5.
            assert await joiner.request(raw_relay(jid, stranger, b"?")) == raw_error(
                jid, 5
            )
            # A flood of junk and of forged frames from another socket.
            for index in range(3000):
                evil.send(os.urandom(index % 300))
                evil.send(raw_relay(jid, hid, b"x" * 10))
            await asyncio.sleep(0.2)
            # The session is untouched.
            while not await evil.silent(0.05):
                pass
            await assert_relays(host, joiner, hid, jid)
            metrics = (await http.get("/metrics")).text
            dropped = "crossroads_relay_dropped_datagrams_total"
            assert metric(metrics, dropped, reason="bad-hmac") == 1
            assert metric(metrics, dropped, reason="replayed-nonce") == 1
            assert metric(metrics, dropped, reason="unknown-allocation") >= 1
            assert metric(metrics, dropped, reason="bad-size") >= 3
            assert metric(metrics, dropped, reason="bad-length") >= 1
            assert metric(metrics, dropped, reason="address-mismatch") >= 1
            assert metric(metrics, dropped, reason="rate-limited") >= 1
            assert metric(metrics, "crossroads_relay_errors_sent_total", code="3") >= 1
            assert metric(metrics, "crossroads_relay_relayed_packets_total") >= 2
        finally:
            for peer in (host, joiner, evil):
                peer.close()


async def test_other_sessions_unaffected_by_a_misbehaving_one() -> None:
    async with relay_runtime() as rt, api(rt) as http:
        a = await session(http)
        b = await session(http)
        try:
            # Session a's host floods its joiner, closes and re-binds with stale nonces.
            host, joiner, hid, jid, host_alloc, _ = a
            for _ in range(500):
                host.send(raw_relay(hid, jid, b"z" * 100))
            host.send(raw_bind(host_alloc, 0))  # replay
            host.send(b"\xda\x72\x00\x0b" + hid)  # CLOSE
            await asyncio.sleep(0.1)
            await assert_relays(b[0], b[1], b[2], b[3])
        finally:
            for peer in (*a[:2], *b[:2]):
                peer.close()
