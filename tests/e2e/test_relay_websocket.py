"""End to end: the Unity relay over WebSockets (ws and wss), with the
``websockets`` client library and hand-written relay messages (no crossroads
client code), next to UDP clients on the same node."""

from __future__ import annotations

import base64
import os
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect

from crossroads.runtime import Runtime
from crossroads.transport.tls import development_certificate
from tests.e2e.relay_support import (
    BIND_RECEIVED,
    RawPeer,
    allocate_pair,
    allocation_id,
    api,
    raw_accepted,
    raw_bind,
    raw_connect,
    raw_ping,
    raw_relay,
    relay_runtime,
    server_endpoint,
)

pytestmark = pytest.mark.timeout(60)


@asynccontextmanager
async def ws_client(
    allocation: dict[str, Any], kind: str, cafile: Path | None = None
) -> AsyncIterator[ClientConnection]:
    """A WebSocket to the relay as Unity opens it: ``GET /``, no subprotocol,
    no extension (``compression=None``), relay messages as binary frames."""
    entry = server_endpoint(allocation, kind)
    scheme = "wss" if entry["secure"] else "ws"
    context = ssl.create_default_context(cafile=str(cafile)) if cafile else None
    async with connect(
        f"{scheme}://{entry['host']}:{entry['port']}/",
        compression=None,
        ssl=context,
        open_timeout=5,
    ) as ws:
        yield ws


async def recv(ws: ClientConnection) -> bytes:
    message = await ws.recv(decode=False)
    assert isinstance(message, bytes)
    return message


async def run_flow(
    host_send: Any, host_recv: Any, joiner_send: Any, joiner_recv: Any, allocs: Any
) -> None:
    """BIND both, CONNECT_REQUEST, RELAY both ways, PING: Unity's session."""
    host_alloc, join_alloc = allocs
    hid = allocation_id(host_alloc)
    jid = allocation_id(join_alloc)
    await host_send(raw_bind(host_alloc, nonce=0))
    assert await host_recv() == BIND_RECEIVED
    await joiner_send(raw_bind(join_alloc, nonce=0))
    assert await joiner_recv() == BIND_RECEIVED
    await joiner_send(
        raw_connect(jid, base64.b64decode(join_alloc["hostConnectionData"]))
    )
    assert await joiner_recv() == raw_accepted(hid, jid)
    for size in (0, 1, 700, 1386 - 38):
        payload = os.urandom(size)
        await joiner_send(raw_relay(jid, hid, payload))
        assert await host_recv() == raw_relay(jid, hid, payload)
        await host_send(raw_relay(hid, jid, payload))
        assert await joiner_recv() == raw_relay(hid, jid, payload)
    await host_send(raw_ping(hid))
    assert await host_recv() == raw_ping(hid)


def over_ws(ws: ClientConnection) -> tuple[Any, Any]:
    async def send(data: bytes) -> None:
        await ws.send(data)

    async def receive() -> bytes:
        return await recv(ws)

    return send, receive


def over_udp(peer: RawPeer) -> tuple[Any, Any]:
    async def send(data: bytes) -> None:
        peer.send(data)

    return send, peer.recv


async def test_endpoints_list_ws_only_when_enabled() -> None:
    async with relay_runtime() as rt, api(rt) as http:
        host, _ = await allocate_pair(http)
        assert [e["connectionType"] for e in host["serverEndpoints"]] == ["udp", "dtls"]
    async with relay_runtime(relay__websocket=True) as rt, api(rt) as http:
        host, _ = await allocate_pair(http)
        # No certificate: ws only, and Unity's values for it.
        assert [e["connectionType"] for e in host["serverEndpoints"]] == [
            "udp",
            "dtls",
            "ws",
        ]
        ws = server_endpoint(host, "ws")
        assert (ws["network"], ws["secure"], ws["reliable"]) == ("tcp", False, True)


async def test_host_and_joiner_over_ws() -> None:
    async with relay_runtime(relay__websocket=True) as rt, api(rt) as http:
        allocs = await allocate_pair(http)
        async with (
            ws_client(allocs[0], "ws") as host,
            ws_client(allocs[1], "ws") as joiner,
        ):
            await run_flow(*over_ws(host), *over_ws(joiner), allocs)


@asynccontextmanager
async def tls_relay(tmp_path: Path) -> AsyncIterator[tuple[Runtime, Path]]:
    cert, key = development_certificate(tmp_path)
    async with relay_runtime(
        relay__websocket=True,
        relay__wss_host="localhost",
        core__tls_cert=str(cert),
        core__tls_key=str(key),
    ) as rt:
        yield rt, cert


async def test_host_and_joiner_over_wss(tmp_path: Path) -> None:
    async with tls_relay(tmp_path) as (rt, cert), api(rt) as http:
        allocs = await allocate_pair(http)
        wss = server_endpoint(allocs[0], "wss")
        # RelayServerData(allocation, "wss") takes this entry: TLS (secure),
        # on TCP, for the certificate's name.
        assert (wss["network"], wss["secure"], wss["host"]) == (
            "tcp",
            True,
            "localhost",
        )
        async with (
            ws_client(allocs[0], "wss", cert) as host,
            ws_client(allocs[1], "wss", cert) as joiner,
        ):
            await run_flow(*over_ws(host), *over_ws(joiner), allocs)


async def test_udp_host_and_ws_joiner(tmp_path: Path) -> None:
    async with tls_relay(tmp_path) as (rt, cert), api(rt) as http:
        allocs = await allocate_pair(http)
        udp = server_endpoint(allocs[0], "udp")
        host = RawPeer((udp["host"], udp["port"]))
        try:
            async with ws_client(allocs[1], "wss", cert) as joiner:
                await run_flow(*over_udp(host), *over_ws(joiner), allocs)
        finally:
            host.close()
