"""The Python relay client: API wrapper, allocation parsing, connection failures."""

from __future__ import annotations

import asyncio
import base64
import socket
import uuid

import pytest

from crossroads.client.relay import (
    MAX_QUEUED_FRAMES,
    Allocation,
    RelayApi,
    RelayApiError,
    RelayConnection,
    RelayConnectionError,
)
from crossroads.proto.relay import messages as m
from crossroads.proto.relay.client import ClientState, RelayClientConfig
from tests.e2e.relay_support import API_KEY, base_url, relay_runtime

pytestmark = pytest.mark.timeout(30)

AID = uuid.UUID("bb018a10-54cc-4be8-a05b-e5699f210d69")


def allocation_json(**extra: object) -> dict[str, object]:
    body: dict[str, object] = {
        "allocationId": str(AID),
        "allocationIdBytes": base64.b64encode(AID.bytes).decode(),
        "key": base64.b64encode(bytes(64)).decode(),
        "connectionData": base64.b64encode(b"cd").decode(),
        "serverEndpoints": [
            {"connectionType": "dtls", "host": "192.0.2.1", "port": 1},
            {"connectionType": "udp", "host": "192.0.2.2", "port": 2},
        ],
        "relayServer": {"ipV4": "192.0.2.3", "port": 3},
        "region": "eu",
    }
    body.update(extra)
    return body


def test_allocation_prefers_the_udp_endpoint() -> None:
    allocation = Allocation.from_json(allocation_json())
    assert allocation.server == ("192.0.2.2", 2)
    assert allocation.allocation_id_bytes == AID.bytes
    assert allocation.host_connection_data is None
    fallback = Allocation.from_json(allocation_json(serverEndpoints=[]))
    assert fallback.server == ("192.0.2.3", 3)
    joined = Allocation.from_json(
        allocation_json(hostConnectionData=base64.b64encode(b"host").decode())
    )
    assert joined.host_connection_data == b"host"


async def test_api_errors_carry_unitys_fields() -> None:
    async with relay_runtime() as rt:
        async with RelayApi(base_url(rt), "wrong-key") as bad:
            with pytest.raises(RelayApiError) as info:
                await bad.regions()
            assert (info.value.status, info.value.code) == (401, 15401)
        async with RelayApi(base_url(rt), API_KEY) as api:
            with pytest.raises(RelayApiError) as info:
                await api.join("BCDFGH")
            assert info.value.title == "JoinCodeNotFound"
            with pytest.raises(RelayApiError) as info:
                await api.allocate(2, region="nowhere")
            assert info.value.code == 15007


async def test_bind_against_a_silent_server_fails() -> None:
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    silent.bind(("127.0.0.1", 0))
    try:
        allocation = Allocation.from_json(
            allocation_json(
                serverEndpoints=[],
                relayServer={"ipV4": "127.0.0.1", "port": silent.getsockname()[1]},
            )
        )
        fast = RelayClientConfig(connect_retry=0.05, max_connect_time=0.3)
        connection = await RelayConnection.open(allocation, config=fast)
        with pytest.raises(RelayConnectionError, match="no-answer"):
            await connection.bind(timeout=5)
        assert connection.state is ClientState.INVALID
        # It really tried: a BIND every retry interval, each with a new nonce.
        silent.setblocking(False)
        nonces = []
        while True:
            try:
                data = silent.recv(400)
            except BlockingIOError:
                break
            bind = m.decode(data)
            assert isinstance(bind, m.Bind)
            nonces.append(bind.nonce)
        assert len(nonces) >= 3 and nonces == sorted(set(nonces))
        await connection.close()
    finally:
        silent.close()


async def test_received_frames_are_bounded() -> None:
    async with relay_runtime() as rt, RelayApi(base_url(rt), API_KEY) as api:
        allocation = await api.allocate(1)
        host = await RelayConnection.open(allocation)
        await host.bind()
        player = await RelayConnection.open(
            await api.join(await api.join_code(allocation.allocation_id))
        )
        await player.bind()
        await player.connect()
        total = MAX_QUEUED_FRAMES + 500
        for n in range(total):
            player.send(host.allocation_id, n.to_bytes(4, "big"))
            if n % 200 == 0:
                await asyncio.sleep(0.01)
        # Nobody reads the host's frames: beyond the bound the oldest go.
        async with asyncio.timeout(10):
            while host.frames_dropped == 0:
                await asyncio.sleep(0.02)
        assert host._frames.qsize() <= MAX_QUEUED_FRAMES
        assert host.frames_dropped > 0
        await player.close()
        await host.close()
