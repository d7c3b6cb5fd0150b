"""The p2p service over a real WebSocket and real UDP on loopback: bad input,
limits, and the server staying up through all of it."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import websockets

from crossroads.config import default_config
from crossroads.errors import ConfigError
from crossroads.proto.punch import signalling as sig
from crossroads.proto.punch.coordinator import RELAY_MAX_FRAME
from crossroads.proto.punch.rendezvous import Observed, Probe
from crossroads.runtime import Runtime, start
from crossroads.services.p2p import MAX_OUTBOUND_FRAMES, signalling_url
from crossroads.web.app import WS_MAX_MESSAGE_BYTES
from tests.conftest import loopback_config

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def rt() -> AsyncIterator[Runtime]:
    runtime = await start(
        default_config(loopback_config(core__only="p2p", p2p__max_connections_per_ip=8))
    )
    try:
        yield runtime
    finally:
        await runtime.close()


def ws_url(rt: Runtime) -> str:
    host, port = rt.http_address
    return f"ws://{host}:{port}/p2p/v1/ws"


def hello() -> str:
    return json.dumps(
        {"type": "hello", "v": 1, "key": base64.b64encode(os.urandom(32)).decode()}
    )


async def recv_type(ws: Any, kind: str, timeout: float = 5) -> dict[str, Any]:
    while True:
        frame = json.loads(await asyncio.wait_for(ws.recv(), timeout))
        if frame["type"] == kind:
            return dict(frame)


async def assert_alive(rt: Runtime) -> None:
    async with websockets.connect(ws_url(rt)) as ws:
        await ws.send(hello())
        assert (await recv_type(ws, "welcome"))["peer"]
    host, port = rt.http_address
    async with httpx.AsyncClient() as client:
        assert (await client.get(f"http://{host}:{port}/healthz")).status_code == 200


async def test_welcome_and_rendezvous_over_real_udp(rt: Runtime) -> None:
    async with websockets.connect(ws_url(rt)) as ws:
        await ws.send(hello())
        welcome = await recv_type(ws, "welcome")
        assert len(welcome["udp"]) == 3
        token = bytes.fromhex(welcome["token"])
        loop = asyncio.get_running_loop()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.bind(("127.0.0.1", 0))
            sock.setblocking(False)
            for index, (host, port) in enumerate(welcome["udp"]):
                sock.sendto(Probe(token, 0, index).encode(), (host, port))
                data = await asyncio.wait_for(loop.sock_recv(sock, 100), 2)
                observed = Observed.decode(data)
                assert (observed.host, observed.port) == sock.getsockname()
                assert observed.index == index
            # an unknown token gets no answer at all
            sock.sendto(Probe(bytes(16), 0, 9).encode(), tuple(welcome["udp"][0]))
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(loop.sock_recv(sock, 100), 0.3)


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        ("this is not json", "bad_json"),
        ('{"type": "teleport"}', "unknown_type"),
        ('{"type": "connect"}', "bad_message"),
        ('{"type": "connect", "peer": 5}', "bad_message"),
        (json.dumps({"type": "signal", "to": "x", "data": "a" * 15000}), "too_large"),
    ],
)
async def test_bad_frames_get_clear_errors(rt: Runtime, frame: str, code: str) -> None:
    async with websockets.connect(ws_url(rt)) as ws:
        await ws.send(hello())
        await recv_type(ws, "welcome")
        await ws.send(frame)
        error = await recv_type(ws, "error")
        assert error["code"] == code and error["message"]
        await ws.send(json.dumps({"type": "ping", "id": 5}))
        assert (await recv_type(ws, "pong"))["id"] == 5
    await assert_alive(rt)


def test_transport_cap_is_above_every_legitimate_frame() -> None:
    # Frames somewhat over the 16 KiB protocol limit get its clear error (4x
    # headroom) before the transport closes the connection.
    assert 4 * sig.MAX_FRAME_BYTES <= WS_MAX_MESSAGE_BYTES < 1024 * 1024
    assert RELAY_MAX_FRAME <= WS_MAX_MESSAGE_BYTES


@pytest.mark.parametrize("binary", [False, True])
async def test_oversized_frame_is_refused_and_the_connection_stays_usable(
    rt: Runtime, binary: bool
) -> None:
    # Above the 16 KiB protocol limit, within the transport cap: the protocol's
    # error, and the connection goes on.
    frame = "x" * (WS_MAX_MESSAGE_BYTES - 100)
    async with websockets.connect(ws_url(rt)) as ws:
        await ws.send(hello())
        await recv_type(ws, "welcome")
        await ws.send(frame.encode() if binary else frame)
        assert (await recv_type(ws, "error"))["code"] == "too_large"
        await ws.send(json.dumps({"type": "ping", "id": 7}))
        assert (await recv_type(ws, "pong"))["id"] == 7
    await assert_alive(rt)


@pytest.mark.parametrize("size", [WS_MAX_MESSAGE_BYTES + 1, 1_000_000])
async def test_frame_above_the_transport_cap_is_closed_1009(
    rt: Runtime, size: int
) -> None:
    # uvicorn refuses it from the frame header (close 1009) instead of buffering
    # it for the handler; the server serves the next connections.
    async with websockets.connect(ws_url(rt), max_size=None) as ws:
        await ws.send(hello())
        await recv_type(ws, "welcome")
        with pytest.raises(websockets.ConnectionClosed) as info:
            await ws.send("x" * size)
            while True:
                await asyncio.wait_for(ws.recv(), 5)
        assert info.value.rcvd is not None and info.value.rcvd.code == 1009
    await assert_alive(rt)


async def test_hello_required_first(rt: Runtime) -> None:
    async with websockets.connect(ws_url(rt)) as ws:
        await ws.send(json.dumps({"type": "host"}))
        assert (await recv_type(ws, "error"))["code"] == "hello_required"


async def test_flood_is_rate_limited_then_closed(rt: Runtime) -> None:
    async with websockets.connect(ws_url(rt)) as ws:
        await ws.send(hello())
        await recv_type(ws, "welcome")
        for i in range(400):
            await ws.send(json.dumps({"type": "ping", "id": i}))
        codes = []
        with pytest.raises(websockets.ConnectionClosed) as info:
            while True:
                frame = json.loads(await asyncio.wait_for(ws.recv(), 5))
                codes.append(frame.get("code"))
        assert info.value.rcvd is not None and info.value.rcvd.code == 1008
        assert "rate_limited" in codes
    await assert_alive(rt)


async def test_connections_per_ip_are_limited(rt: Runtime) -> None:
    sockets = [await websockets.connect(ws_url(rt)) for _ in range(8)]
    try:
        async with websockets.connect(ws_url(rt)) as extra:
            with pytest.raises(websockets.ConnectionClosed) as info:
                await asyncio.wait_for(extra.recv(), 5)
            assert info.value.rcvd is not None and info.value.rcvd.code == 1013
    finally:
        for ws in sockets:
            await ws.close()
    await assert_alive(rt)


async def test_binary_garbage_and_relay_without_route(rt: Runtime) -> None:
    async with websockets.connect(ws_url(rt)) as ws:
        await ws.send(hello())
        await recv_type(ws, "welcome")
        await ws.send(b"\x00\xff\xfe")
        assert (await recv_type(ws, "error"))["code"] == "bad_json"
        await ws.send(b"\x01" + bytes(8) + b"sealed")  # no such peer: dropped
        await ws.send(json.dumps({"type": "ping", "id": 1}))
        assert (await recv_type(ws, "pong"))["id"] == 1
    host, port = rt.http_address
    async with httpx.AsyncClient() as client:
        metrics = (await client.get(f"http://{host}:{port}/metrics")).text
    assert (
        'crossroads_p2p_frames_rejected_total{reason="relay-no-route"} 1.0' in metrics
    )
    assert 'crossroads_p2p_frames_rejected_total{reason="bad-json"} 1.0' in metrics


async def test_listing_is_mounted(rt: Runtime) -> None:
    host, port = rt.http_address
    async with httpx.AsyncClient(base_url=f"http://{host}:{port}") as client:
        r = await client.post("/testServer", json={"__gameId": "g", "__clientReqId": 1})
        assert r.json()["POST"]["__rowId"] == 0
        assert (await client.get("/testServer", params={"__gameId": "g"})).json()[
            "GET"
        ][0]["__addr"] == "127.0.0.1"


async def test_session_members_get_turn_rest_credentials() -> None:
    import hashlib
    import hmac
    import time

    runtime = await start(
        default_config(
            loopback_config(
                core__only="p2p",
                p2p__turn_secret="s3cret",
                p2p__turn_server="192.0.2.1:3478",
            )
        )
    )
    try:
        async with (
            websockets.connect(ws_url(runtime)) as ws,
            websockets.connect(ws_url(runtime)) as guest,
        ):
            await ws.send(hello())
            welcome = await recv_type(ws, "welcome")
            # Nothing for an anonymous socket (a free relay), nor for a
            # host alone in its session (nobody to relay to) ...
            assert welcome["turn"] is None
            await ws.send(json.dumps({"type": "host"}))
            hosted = await recv_type(ws, "hosted")
            assert hosted["turn"] is None
            # ... credentials come when there is somebody to relay to: the
            # joiner in join_start, the host pushed at the same time.
            await guest.send(hello())
            await recv_type(guest, "welcome")
            await guest.send(json.dumps({"type": "join", "code": hosted["code"]}))
            assert (await recv_type(guest, "join_start"))["turn"] is not None
            turn = (await recv_type(ws, "turn"))["turn"]
        assert turn["servers"] == [["192.0.2.1", 3478]]
        expires, peer = turn["username"].split(":")
        assert peer == welcome["peer"] and int(expires) == turn["expires"]
        assert 3500 < turn["expires"] - time.time() <= 3600
        digest = hmac.new(b"s3cret", turn["username"].encode(), hashlib.sha1).digest()
        assert base64.b64decode(turn["password"]) == digest
    finally:
        await runtime.close()


async def test_no_turn_without_a_secret(rt: Runtime) -> None:
    async with websockets.connect(ws_url(rt)) as ws:
        await ws.send(hello())
        assert (await recv_type(ws, "welcome"))["turn"] is None


def test_signalling_url_other_instances_hand_out() -> None:
    assert signalling_url("203.0.113.10", 8080) == "ws://203.0.113.10:8080/p2p/v1/ws"
    assert signalling_url("2001:db8::1", 8080) == "ws://[2001:db8::1]:8080/p2p/v1/ws"
    # A wildcard bind is no address to give out: the machine's name instead.
    for wildcard in ("0.0.0.0", "::", ""):
        assert (
            signalling_url(wildcard, 80) == f"ws://{socket.gethostname()}:80/p2p/v1/ws"
        )


async def test_public_url_setting_is_advertised() -> None:
    config = loopback_config(core__only="p2p", p2p__public_url="wss://p2p.example/ws")
    runtime = await start(default_config(config))
    try:
        service = runtime.services["p2p"]
        assert service.url == "wss://p2p.example/ws"  # type: ignore[attr-defined]
    finally:
        await runtime.close()
    with pytest.raises(ConfigError, match="public_url"):
        default_config(loopback_config(p2p__public_url="http://x/"))


# --------------------------------------------------- a member that stops reading

#: Relay frames the flood may send at most before the test gives up (about
#: 28 MB: the socket buffers of the path and the server's queue, many times).
FLOOD_MAX_FRAMES = 20_000
#: Frames sent between two checks of the metrics.
FLOOD_BATCH = 250


async def rejected(rt: Runtime, reason: str) -> float:
    """``crossroads_p2p_frames_rejected_total{reason=...}`` from ``/metrics``."""
    host, port = rt.http_address
    async with httpx.AsyncClient() as client:
        metrics = (await client.get(f"http://{host}:{port}/metrics")).text
    prefix = f'crossroads_p2p_frames_rejected_total{{reason="{reason}"}} '
    for line in metrics.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix) :])
    return 0.0


async def ping(ws: Any, ping_id: int) -> None:
    """A ping answered: everything sent before it has been handled."""
    await ws.send(json.dumps({"type": "ping", "id": ping_id}))
    assert (await recv_type(ws, "pong"))["id"] == ping_id


@pytest.fixture
async def fast_relay() -> AsyncIterator[Runtime]:
    # A relay budget far above the flood, so that the receiver's queue, not the
    # sender's rate limit, is what stops the frames.
    runtime = await start(
        default_config(
            loopback_config(core__only="p2p", p2p__relay_bytes_per_second=10**10)
        )
    )
    try:
        yield runtime
    finally:
        await runtime.close()


async def session_with_a_stalled_guest(
    rt: Runtime, stack: contextlib.AsyncExitStack
) -> tuple[Any, str, Any, str]:
    """A host and a guest in one session, the guest's socket no longer read.

    The guest's client keeps at most one message it was not asked for and its
    kernel buffer is small, so once the test stops calling ``recv()`` the
    server's writes towards it stall. Returns (host, host peer, guest, guest peer).
    """
    # No permessage-deflate: the relay's sealed datagrams do not compress, and
    # the bytes on the wire are then the bytes the flood sends.
    host = await stack.enter_async_context(
        websockets.connect(ws_url(rt), compression=None)
    )
    await host.send(hello())
    host_peer = (await recv_type(host, "welcome"))["peer"]
    await host.send(json.dumps({"type": "host"}))
    hosted = await recv_type(host, "hosted")

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, rt.http_address)
    guest = await stack.enter_async_context(
        websockets.connect(ws_url(rt), sock=sock, max_queue=1, compression=None)
    )
    await guest.send(hello())
    guest_peer = (await recv_type(guest, "welcome"))["peer"]
    # The verified join, the members' side of it reported as done.
    await guest.send(json.dumps({"type": "join", "code": hosted["code"]}))
    start = await recv_type(guest, "join_start")
    assert start["host"] == host_peer
    await guest.send(
        json.dumps(
            {
                "type": "join_result",
                "session": hosted["session"],
                "connected": [host_peer],
            }
        )
    )
    capable = await recv_type(host, "join_capable")
    assert capable["peer"] == guest_peer
    await host.send(
        json.dumps(
            {
                "type": "join_answer",
                "session": hosted["session"],
                "peer": guest_peer,
                "accept": True,
            }
        )
    )
    await recv_type(guest, "join_accepted")
    assert (await recv_type(host, "member_joined"))["member"]["peer"] == guest_peer
    return host, host_peer, guest, guest_peer


async def flood_until_dropped(rt: Runtime, host: Any, guest_peer: str) -> int:
    """Relay frames from ``host`` to the stalled guest until the server drops
    some for its full queue; returns how many it took (sent, not dropped)."""
    to_guest = b"\x01" + bytes.fromhex(guest_peer)
    before = await rejected(rt, "relay-queue-full")
    sent = 0
    while sent < FLOOD_MAX_FRAMES:
        for _ in range(FLOOD_BATCH):
            await host.send(to_guest + os.urandom(1400))
        sent += FLOOD_BATCH
        await ping(host, sent)  # the server has routed every frame sent so far
        dropped = await rejected(rt, "relay-queue-full") - before
        if dropped:
            return sent - int(dropped)
    pytest.fail(f"{sent} relay frames to a client that reads nothing, none dropped")


async def test_relay_to_a_member_that_stopped_reading_drops_and_keeps_it(
    fast_relay: Runtime,
) -> None:
    rt = fast_relay
    async with contextlib.AsyncExitStack() as stack:
        host, host_peer, guest, guest_peer = await session_with_a_stalled_guest(
            rt, stack
        )
        taken = await flood_until_dropped(rt, host, guest_peer)
        # The sender's connection goes on, and dropping relay frames closed
        # nobody.
        await ping(host, 1)
        assert await rejected(rt, "slow-consumer") == 0
        # The guest, reading again, gets every frame the server took, from the
        # host, and then its connection answers as before.
        received = 0
        while received < taken:
            message = await asyncio.wait_for(guest.recv(), 5)
            if isinstance(message, str):  # the server's own keepalive ping
                assert json.loads(message)["type"] == "ping"
                continue
            assert message[1:9] == bytes.fromhex(host_peer)
            received += 1
        await ping(guest, 2)
        # and the relay carries frames again now that the guest keeps up
        await host.send(b"\x01" + bytes.fromhex(guest_peer) + b"after the drops")
        message = await asyncio.wait_for(guest.recv(), 5)
        assert message == b"\x01" + bytes.fromhex(host_peer) + b"after the drops"
        assert await rejected(rt, "slow-consumer") == 0
    await assert_alive(rt)


async def test_signalling_to_a_member_that_stopped_reading_closes_it_1008(
    fast_relay: Runtime,
) -> None:
    rt = fast_relay
    async with contextlib.AsyncExitStack() as stack:
        host, _, guest, guest_peer = await session_with_a_stalled_guest(rt, stack)
        taken = await flood_until_dropped(rt, host, guest_peer)
        assert await rejected(rt, "slow-consumer") == 0
        # A signalling frame finds the guest's queue full: that client is
        # closed rather than sent a partial conversation.
        await host.send(json.dumps({"type": "signal", "to": guest_peer, "data": "hi"}))
        await ping(host, 1)
        assert await rejected(rt, "slow-consumer") == 1
        # Reading again, the guest gets what was already on its way and then
        # the close: the frames still queued were replaced by it.
        received = 0
        with pytest.raises(websockets.ConnectionClosed) as info:
            while True:
                message = await asyncio.wait_for(guest.recv(), 5)
                if isinstance(message, bytes):
                    received += 1
                else:  # never the refused signal, at most a keepalive ping
                    assert json.loads(message)["type"] == "ping"
        assert info.value.rcvd is not None and info.value.rcvd.code == 1008
        assert info.value.rcvd.reason == "not reading"
        assert received == taken - MAX_OUTBOUND_FRAMES
        # The host is told the guest left, and its own connection goes on.
        left = await recv_type(host, "member_left")
        assert left["peer"] == guest_peer
        await ping(host, 2)
    await assert_alive(rt)
