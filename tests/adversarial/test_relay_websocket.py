"""Hostile and odd WebSocket clients against the Unity relay's ws listener:
Unity's exact upgrade request, offered extensions and subprotocols, text,
oversized, unmasked and fragmented frames, slow handshakes, per-IP caps.

Frames and requests are written by hand from RFC 6455 (no crossroads code, no
WebSocket library), so what is checked is the bytes on the wire."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gc
import hashlib
import os
import socket
import ssl
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crossroads.proto.policy import AddressPolicy, Scope
from crossroads.proto.relay.server import RelayServer, RelayServerConfig
from crossroads.proto.relay.token import TokenSealer
from crossroads.runtime import Runtime
from crossroads.services.relay import RelayNode
from crossroads.transport.admission import ResourceBudget
from crossroads.transport.relay import RelayEndpoint
from crossroads.transport.relay_ws import (
    MAX_BUFFERED,
    RelayWebSocket,
    WebSocketListener,
)
from crossroads.transport.sockets import make_udp_socket
from crossroads.transport.tls import development_certificate
from tests.conftest import eventually
from tests.e2e.relay_support import (
    BIND_RECEIVED,
    RawPeer,
    allocate_pair,
    allocation_id,
    api,
    metric,
    raw_accepted,
    raw_bind,
    raw_connect,
    raw_ping,
    raw_relay,
    relay_runtime,
    server_endpoint,
)

pytestmark = pytest.mark.timeout(60)

#: RFC 6455 §1.3: the GUID the accept key is derived with.
WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def unity_request(host: str, port: int, key: bytes, *extra: str) -> bytes:
    """Unity Transport's upgrade request, header for header in its order
    (unity-secure-transports.md §2.2), plus ``extra`` header lines."""
    lines = [
        "GET / HTTP/1.1",
        "Upgrade: websocket",
        "Connection: Upgrade",
        "Sec-WebSocket-Version: 13",
        f"Sec-WebSocket-Key: {base64.b64encode(key).decode()}",
        f"Host: {host}:{port}",
        *extra,
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def frame(opcode: int, payload: bytes, *, fin: bool = True, mask: bool = True) -> bytes:
    """One client frame (RFC 6455 §5.2), masked unless told otherwise."""
    head = bytes([(0x80 if fin else 0) | opcode])
    size = len(payload)
    bit = 0x80 if mask else 0
    if size < 126:
        head += bytes([bit | size])
    elif size < 65536:
        head += bytes([bit | 126]) + struct.pack(">H", size)
    else:
        head += bytes([bit | 127]) + struct.pack(">Q", size)
    if not mask:
        return head + payload
    key = os.urandom(4)
    return head + key + bytes(b ^ key[i % 4] for i, b in enumerate(payload))


class RawWebSocket:
    """A TCP connection speaking WebSocket by hand."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer
        self.headers: dict[str, str] = {}
        self.status = ""

    async def handshake(self, host: str, port: int, *extra: str) -> None:
        key = os.urandom(16)
        self.writer.write(unity_request(host, port, key, *extra))
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), 5)
        status, *lines = head.decode().split("\r\n")
        self.status = status
        for line in lines:
            if line:
                name, _, value = line.partition(":")
                self.headers[name.strip().lower()] = value.strip()
        expected = base64.b64encode(
            hashlib.sha1(base64.b64encode(key) + WS_GUID).digest()
        ).decode()
        if status.startswith("HTTP/1.1 101"):
            assert self.headers["sec-websocket-accept"] == expected

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def recv_frame(self) -> tuple[int, bytes]:
        """The next server frame: (opcode, payload). Server frames are unmasked."""
        first, second = await asyncio.wait_for(self.reader.readexactly(2), 5)
        assert not second & 0x80, "a server frame must not be masked"
        size = second & 0x7F
        if size == 126:
            (size,) = struct.unpack(">H", await self.reader.readexactly(2))
        elif size == 127:
            (size,) = struct.unpack(">Q", await self.reader.readexactly(8))
        return first & 0x0F, await self.reader.readexactly(size)

    async def close_code(self) -> int:
        """The code of the server's close frame (other frames skipped)."""
        while True:
            opcode, payload = await self.recv_frame()
            if opcode == 8:
                return int(struct.unpack(">H", payload[:2])[0])

    async def closed_by_server(self) -> bool:
        """True once the server has closed the TCP connection."""
        try:
            rest = await asyncio.wait_for(self.reader.read(65536), 10)
            while rest:
                rest = await asyncio.wait_for(self.reader.read(65536), 10)
        except ConnectionResetError:
            pass
        return True

    def close(self) -> None:
        self.writer.close()


@asynccontextmanager
async def raw_ws(address: tuple[str, int]) -> AsyncIterator[RawWebSocket]:
    reader, writer = await asyncio.open_connection(*address)
    ws = RawWebSocket(reader, writer)
    try:
        yield ws
    finally:
        ws.close()


def ws_address(rt: Runtime) -> tuple[str, int]:
    node = rt.services["relay"].node  # type: ignore[attr-defined]
    assert isinstance(node, RelayNode)
    return "127.0.0.1", node.info.ws_port


def listener_of(rt: Runtime) -> Any:
    node = rt.services["relay"].node  # type: ignore[attr-defined]
    assert isinstance(node, RelayNode)
    return node.websockets["ws"]


async def metrics(rt: Runtime) -> str:
    host, port = rt.http_address
    async with httpx.AsyncClient() as http:
        return (await http.get(f"http://{host}:{port}/metrics")).text


async def test_unitys_request_gets_a_bare_101() -> None:
    """Unity aborts on any Sec-WebSocket-Protocol or -Extensions header in the
    answer, even an empty one: offered ones are declined, and the connection
    still carries relay messages."""
    async with relay_runtime(relay__websocket=True) as rt, api(rt) as http:
        allocation, _ = await allocate_pair(http)
        host, port = ws_address(rt)
        for nonce, extra in enumerate(
            [
                (),
                (
                    "Sec-WebSocket-Extensions: permessage-deflate; client_max_window_bits",
                ),
                ("Sec-WebSocket-Protocol: unity, chat",),
            ]
        ):
            async with raw_ws((host, port)) as ws:
                await ws.handshake(host, port, *extra)
                assert ws.status.startswith("HTTP/1.1 101 ")
                assert len(ws.status) >= len("HTTP/1.1 101 ") + 1
                assert ws.headers["upgrade"].lower() == "websocket"
                assert "upgrade" in ws.headers["connection"].lower()
                assert "sec-websocket-extensions" not in ws.headers
                assert "sec-websocket-protocol" not in ws.headers
                ws.send(frame(2, raw_bind(allocation, nonce=nonce)))
                assert await ws.recv_frame() == (2, BIND_RECEIVED)


async def test_pings_are_answered() -> None:
    async with relay_runtime(relay__websocket=True) as rt:
        host, port = ws_address(rt)
        async with raw_ws((host, port)) as ws:
            await ws.handshake(host, port)
            # The native client's keep-alive is an empty ping (§2.3).
            ws.send(frame(9, b""))
            assert await ws.recv_frame() == (10, b"")
            ws.send(frame(9, b"abc"))
            assert await ws.recv_frame() == (10, b"abc")


@pytest.mark.parametrize(
    ("bad", "code", "reason"),
    [
        (frame(1, b"hello"), 1003, "text-frame"),
        (frame(2, b"\xda\x72" + bytes(1385)), 1009, "incoming-too-large"),
        (frame(2, b"\xda\x72\x00\x02" + bytes(18), mask=False), 1002, "protocol-error"),
    ],
    ids=["text", "oversized", "unmasked"],
)
async def test_bad_frames_close_the_connection(
    bad: bytes, code: int, reason: str
) -> None:
    async with relay_runtime(relay__websocket=True) as rt:
        host, port = ws_address(rt)
        async with raw_ws((host, port)) as ws:
            await ws.handshake(host, port)
            ws.send(bad)
            assert await ws.close_code() == code
            assert await ws.closed_by_server()
        page = await metrics(rt)
        assert (
            metric(
                page,
                "crossroads_relay_websocket_dropped_total",
                listener="ws",
                reason=reason,
            )
            == 1
        )


async def test_fragmented_binary_message_is_one_relay_message() -> None:
    async with relay_runtime(relay__websocket=True) as rt, api(rt) as http:
        allocation, _ = await allocate_pair(http)
        host, port = ws_address(rt)
        bind = raw_bind(allocation, nonce=0)
        async with raw_ws((host, port)) as ws:
            await ws.handshake(host, port)
            ws.send(frame(2, bind[:100], fin=False))
            ws.send(frame(9, b"mid"))  # a control frame may come between
            ws.send(frame(0, bind[100:200], fin=False))
            ws.send(frame(0, bind[200:]))
            assert await ws.recv_frame() == (10, b"mid")
            assert await ws.recv_frame() == (2, BIND_RECEIVED)


async def test_frames_in_the_same_write_as_the_request() -> None:
    """A client may send its first frames right behind the upgrade request;
    they count, and nothing after a text frame does."""
    async with relay_runtime(relay__websocket=True) as rt, api(rt) as http:
        allocation, _ = await allocate_pair(http)
        host, port = ws_address(rt)
        async with raw_ws((host, port)) as ws:
            ws.send(
                unity_request(host, port, os.urandom(16))
                + frame(2, raw_bind(allocation, 0))
                + frame(1, b"text")
                + frame(2, raw_bind(allocation, 1))
            )
            await asyncio.wait_for(ws.reader.readuntil(b"\r\n\r\n"), 5)
            assert await ws.recv_frame() == (2, BIND_RECEIVED)
            assert await ws.close_code() == 1003
            assert await ws.closed_by_server()
        node = rt.services["relay"].node  # type: ignore[attr-defined]
        bound = node.core.allocations[allocation_id(allocation)]
        assert bound.last_nonce == 0  # the BIND after the text frame was not taken


async def test_a_slow_handshake_is_cut_and_counted() -> None:
    async with relay_runtime(relay__websocket=True) as rt:
        listener = listener_of(rt)
        listener.handshake_timeout = 0.3
        host, port = ws_address(rt)
        async with raw_ws((host, port)) as ws:
            ws.send(unity_request(host, port, os.urandom(16))[:40])  # never finished
            assert await ws.closed_by_server()
        assert listener.drops == {"handshake-timeout": 1}
        assert listener.admission.live == 0


async def test_garbage_instead_of_a_request_is_refused() -> None:
    async with relay_runtime(relay__websocket=True) as rt:
        host, port = ws_address(rt)
        junks = (
            b"\x16\x03\x01\x02\x00" + bytes(range(1, 64)) + b"\r\n",  # TLS
            b"GET / HTTP/1.1\r\n\r\n",  # no upgrade: 426
            b"GET /" + b"a" * 9000,  # a request line over the parser's limit
        )
        for junk in junks:
            async with raw_ws((host, port)) as ws:
                ws.send(junk)
                assert await ws.closed_by_server()
        listener = listener_of(rt)
        await eventually(
            lambda: _true(listener.drops.get("bad-handshake") == 3), "3 counted"
        )
        assert listener.admission.live == 0


async def test_an_idle_connection_is_closed() -> None:
    async with relay_runtime(relay__websocket=True, relay__idle_timeout=0.5) as rt:
        host, port = ws_address(rt)
        async with raw_ws((host, port)) as ws:
            await ws.handshake(host, port)
            assert await ws.close_code() == 1001
            assert await ws.closed_by_server()
        listener = listener_of(rt)
        assert listener.drops == {"idle-timeout": 1}
        assert listener.admission.live == 0


async def _true(value: bool) -> bool:
    return value


async def test_per_ip_cap() -> None:
    async with relay_runtime(
        relay__websocket=True, relay__ws_max_connections_per_ip=2
    ) as rt:
        host, port = ws_address(rt)
        async with raw_ws((host, port)) as first, raw_ws((host, port)) as second:
            await first.handshake(host, port)
            await second.handshake(host, port)
            async with raw_ws((host, port)) as third:
                assert await third.closed_by_server()
            page = await metrics(rt)
            assert (
                metric(
                    page,
                    "crossroads_tcp_refused_total",
                    listener="relay-ws",
                    reason="over-ip-limit",
                )
                == 1
            )
            # The two admitted ones still work.
            first.send(frame(9, b""))
            assert await first.recv_frame() == (10, b"")


@asynccontextmanager
async def udp_host_and_ws_joiner(
    rt: Runtime, http: httpx.AsyncClient, receive_buffer: int = 0
) -> AsyncIterator[tuple[RawPeer, RawWebSocket, bytes, bytes]]:
    """A host on UDP and a joiner over ws, bound and connected: (host, joiner,
    host id, joiner id). ``receive_buffer`` shrinks the joiner's SO_RCVBUF."""
    host_alloc, join_alloc = await allocate_pair(http)
    udp = server_endpoint(host_alloc, "udp")
    hid = allocation_id(host_alloc)
    jid = allocation_id(join_alloc)
    host = RawPeer((udp["host"], udp["port"]))
    address = ws_address(rt)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, address)
        reader, writer = await asyncio.open_connection(sock=sock)
    except BaseException:
        sock.close()
        host.close()
        raise
    joiner = RawWebSocket(reader, writer)
    try:
        assert await host.request(raw_bind(host_alloc, 0)) == BIND_RECEIVED
        await joiner.handshake(*address)
        joiner.send(frame(2, raw_bind(join_alloc, 0)))
        assert await joiner.recv_frame() == (2, BIND_RECEIVED)
        host_data = base64.b64decode(join_alloc["hostConnectionData"])
        joiner.send(frame(2, raw_connect(jid, host_data)))
        assert await joiner.recv_frame() == (2, raw_accepted(hid, jid))
        yield host, joiner, hid, jid
    finally:
        host.close()
        joiner.close()


async def test_a_client_that_does_not_read_loses_frames_not_server_memory() -> None:
    """A WebSocket joiner that stops reading while a UDP host keeps sending:
    beyond MAX_BUFFERED bytes waiting, frames are dropped and counted."""
    async with (
        relay_runtime(relay__websocket=True) as rt,
        api(rt) as http,
        udp_host_and_ws_joiner(rt, http, receive_buffer=4096) as (host, _, hid, jid),
    ):
        listener = listener_of(rt)
        # The joiner reads nothing more; the host sends until frames drop.
        # The kernel's send buffer takes up to 4 MB first (tcp_wmem), then
        # the transport's MAX_BUFFERED: bounded at 10,000 x 1.3 KB.
        frame_bytes = raw_relay(hid, jid, bytes(1300))
        for _burst in range(200):
            for _ in range(50):
                host.send(frame_bytes)
            await asyncio.sleep(0)  # let the relay (same loop) forward them
            if listener.drops.get("slow-reader"):
                break
        await eventually(
            lambda: _true(listener.drops.get("slow-reader", 0) > 0),
            "frames dropped for the slow reader",
        )


async def test_udp_frame_too_large_for_a_websocket_is_dropped_not_fatal() -> None:
    """A UDP host may send a RELAY a WebSocket joiner could not take (Unity
    aborts above 1386 bytes): it is dropped and counted, the session lives.
    Once the joiner is gone, frames to it are counted, not sent."""
    async with relay_runtime(relay__websocket=True) as rt, api(rt) as http:
        async with udp_host_and_ws_joiner(rt, http) as (host, joiner, hid, jid):
            host.send(raw_relay(hid, jid, bytes(1400)))
            host.send(raw_relay(hid, jid, b"small"))
            assert await joiner.recv_frame() == (2, raw_relay(hid, jid, b"small"))
            assert listener_of(rt).drops == {"outgoing-too-large": 1}
            joiner.close()
            node = rt.services["relay"].node  # type: ignore[attr-defined]

            async def detached() -> bool:
                return not node.endpoint.has_stream_from("127.0.0.1")

            await eventually(detached, "the closed connection detached")
            host.send(raw_relay(hid, jid, b"anyone?"))

            async def counted() -> bool:
                page = await metrics(rt)
                return metric(page, "crossroads_relay_websocket_gone_total") == 1

            await eventually(counted, "the frame for a closed connection counted")


# ------------------------------------------------------------------ fuzzing


class RecordingTransport(asyncio.Transport):
    """The bytes a connection writes, in memory (the fuzz drives
    :class:`RelayWebSocket` directly, thousands of inputs per second)."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_write_buffer_size(self) -> int:
        return 0

    def set_write_buffer_limits(
        self, high: int | None = None, low: int | None = None
    ) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("192.0.2.7", 40000) if name == "peername" else default


HANDSHAKE = unity_request("192.0.2.1", 7781, bytes(16))


@settings(max_examples=300, deadline=None)
@given(
    upgrade=st.booleans(),
    chunks=st.lists(
        st.one_of(
            st.binary(max_size=200),
            st.builds(
                frame,
                st.sampled_from([0, 1, 2, 8, 9, 10, 3, 15]),
                st.binary(max_size=1500),
                fin=st.booleans(),
                mask=st.booleans(),
            ),
        ),
        max_size=8,
    ),
)
def test_random_input_never_escapes_and_frees_everything(
    upgrade: bool, chunks: list[bytes]
) -> None:
    """Any bytes, before or after a valid upgrade: no exception, a bounded
    answer (never more than the input plus the handshake and a close), and
    after the connection ends its admission and client address are gone."""

    async def run() -> None:
        core = RelayServer(
            RelayServerConfig(
                node_id="fuzz", policy=AddressPolicy(admitted=frozenset(Scope))
            ),
            TokenSealer(b"f" * 32, os.urandom),
        )
        endpoint = RelayEndpoint(core, make_udp_socket("127.0.0.1", 0))
        budget = ResourceBudget(fd_limit=4096)
        listener = WebSocketListener(endpoint, budget.listener("ws", 10, 10), 10.0)
        connection = listener.connection()
        transport = RecordingTransport()
        try:
            connection.connection_made(transport)
            sent = 0
            for chunk in ([HANDSHAKE] if upgrade else []) + chunks:
                if transport.closed:
                    break
                connection.data_received(chunk)
                sent += len(chunk)
            assert len(transport.written) <= sent + 512
            connection.connection_lost(None)
            assert listener.admission.live == 0
            assert connection.address is None
        finally:
            endpoint.close()

    asyncio.run(run())


# ------------------------------------------------- pings from a non-reader

#: Pings a client sends without reading a byte: more than the kernel's socket
#: buffers take on loopback (tcp_wmem's 4 MiB), so what is left waits in the
#: server's own write buffer unless the server stops reading.
PING_FLOOD_BYTES = 24 << 20
#: What the server may hold for one connection: MAX_BUFFERED, plus the pongs
#: for one read (asyncio reads at most 256 KiB at a time) before reading stops.
PONG_BOUND = MAX_BUFFERED + 256 * 1024 + 64 * 1024


def _server_side(listener: WebSocketListener) -> list[RelayWebSocket]:
    return [
        o
        for o in gc.get_objects()
        if isinstance(o, RelayWebSocket)
        and o.listener is listener
        and o.transport is not None
    ]


async def _ping_without_reading(
    listener: WebSocketListener,
    address: tuple[str, int],
    context: ssl.SSLContext | None = None,
) -> tuple[int, bool]:
    """Open a WebSocket with a tiny receive buffer, send PING_FLOOD_BYTES of
    125-byte pings and read nothing; return the largest write buffer the
    server's connection had and whether the server closed the connection."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, address)
    reader, writer = await asyncio.open_connection(
        sock=sock,
        ssl=context,
        server_hostname="localhost" if context is not None else None,
    )
    ws = RawWebSocket(reader, writer)
    try:
        await ws.handshake(*address)
        (server,) = _server_side(listener)
        ping = frame(9, bytes(125))
        writer.write(ping * (PING_FLOOD_BYTES // len(ping)))
        peak = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while server.transport is not None and loop.time() < deadline:
            peak = max(peak, server.transport.get_write_buffer_size())
            if peak > PONG_BOUND:
                break  # the old code: no need to watch it reach megabytes
            await asyncio.sleep(0.02)
        return peak, server.transport is None
    finally:
        writer.transport.abort()


@pytest.mark.parametrize("scheme", ["ws", "wss"])
async def test_pings_from_a_client_that_never_reads_are_bounded(
    scheme: str, tmp_path: Path
) -> None:
    """Pongs to a client that pings and never reads
    were buffered without bound (52 MB of pings: +61 MB RSS on ws, +116 MB on
    wss). Now every server write counts against MAX_BUFFERED: over it the
    server stops reading (the pings wait in the client's own socket), and a
    connection that carries no relay message for the idle timeout is closed,
    pings or not."""
    cert, key = development_certificate(tmp_path)
    async with relay_runtime(
        relay__websocket=True,
        relay__idle_timeout=2.0,
        core__tls_cert=str(cert),
        core__tls_key=str(key),
    ) as rt:
        node = rt.services["relay"].node  # type: ignore[attr-defined]
        port = node.info.ws_port if scheme == "ws" else node.info.wss_port
        context = None
        if scheme == "wss":
            context = ssl.create_default_context(cafile=str(cert))
        listener = node.websockets[scheme]
        peak, closed = await _ping_without_reading(
            listener, ("127.0.0.1", port), context
        )
        assert peak <= PONG_BOUND, f"{peak} bytes buffered for one connection"
        assert closed, "the pinging connection outlived the idle timeout"
        assert listener.read_pauses >= 1
        assert listener.drops.get("idle-timeout") == 1
        await eventually(
            lambda: _true(listener.admission.live == 0), "the slot given back"
        )


# ---------------------------------------------------- upgraded but never bound

#: RFC 6455 §7.4.1: the server ends a connection that broke its policy.
CLOSE_POLICY_VIOLATION = 1008


async def _close_code_while_sending(
    ws: RawWebSocket, junk: bytes, seconds: float
) -> int | None:
    """Send ``junk`` as a binary frame every 100 ms for up to ``seconds``,
    reading what the server sends; the server's close code, or None if it
    never closed."""

    async def sender() -> None:
        while True:
            ws.send(frame(2, junk))
            await asyncio.sleep(0.1)

    task = asyncio.create_task(sender())
    try:
        return await asyncio.wait_for(ws.close_code(), seconds)
    except TimeoutError:
        return None
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _junk(kind: str) -> bytes:
    if kind == "random":
        return os.urandom(64)
    if kind == "ping":  # a well-formed relay PING naming no allocation
        return raw_ping(os.urandom(16))
    # A BIND the node cannot open: a token it never sealed.
    return raw_bind(
        {"connectionData": base64.b64encode(os.urandom(255)).decode()},
        0,
        key=os.urandom(64),
    )


@pytest.mark.parametrize(
    ("scheme", "kind"),
    [("ws", "random"), ("ws", "ping"), ("ws", "bad-bind"), ("wss", "random")],
)
async def test_a_connection_that_never_binds_is_closed_and_counted(
    scheme: str, kind: str, tmp_path: Path
) -> None:
    """A connection that upgrades and then sends junk binary frames (or relay
    messages other than a valid BIND) kept its relay-ws/relay-wss slot for
    ever: the idle rule counts any relay message. Unauthenticated state has a
    deadline now: no allocation bound within the bind timeout of the upgrade,
    and the connection is closed (1008) and counted."""
    cert, key = development_certificate(tmp_path)
    async with relay_runtime(
        relay__websocket=True, core__tls_cert=str(cert), core__tls_key=str(key)
    ) as rt:
        node = rt.services["relay"].node  # type: ignore[attr-defined]
        listener = node.websockets[scheme]
        listener.bind_timeout = 0.5
        port = node.info.ws_port if scheme == "ws" else node.info.wss_port
        context = None
        if scheme == "wss":
            context = ssl.create_default_context(cafile=str(cert))
        reader, writer = await asyncio.open_connection(
            "127.0.0.1",
            port,
            ssl=context,
            server_hostname="localhost" if context is not None else None,
        )
        ws = RawWebSocket(reader, writer)
        try:
            await ws.handshake("127.0.0.1", port)
            assert ws.status.startswith("HTTP/1.1 101")
            # Six times the deadline: the old code never closed it.
            code = await _close_code_while_sending(ws, _junk(kind), 3.0)
            assert code == CLOSE_POLICY_VIOLATION, "the unbound connection lived on"
            assert await ws.closed_by_server()
        finally:
            writer.transport.abort()
        assert listener.drops.get("bind-timeout") == 1
        await eventually(
            lambda: _true(listener.admission.live == 0), "the slot given back"
        )
        page = await metrics(rt)
        assert (
            metric(
                page,
                "crossroads_relay_websocket_dropped_total",
                listener=scheme,
                reason="bind-timeout",
            )
            == 1
        )
        closed = {t["table"]: t for t in rt.resources.snapshot()["tables"]}[
            f"relay-{scheme}"
        ]
        assert closed["closed"].get("bind-timeout") == 1


async def test_a_bound_connection_outlives_the_bind_deadline_until_it_unbinds() -> None:
    """The Unity flow (BIND right after the upgrade) is not touched by the
    bind deadline however long it lasts; once the connection's allocation has
    ended (its CLOSE), it holds nothing again and the deadline applies."""
    async with relay_runtime(relay__websocket=True) as rt, api(rt) as http:
        listener = listener_of(rt)
        listener.bind_timeout = 0.5
        async with udp_host_and_ws_joiner(rt, http) as (host, joiner, hid, jid):
            for n in range(15):  # 1.5 s: three bind deadlines
                joiner.send(frame(2, raw_relay(jid, hid, bytes([n]))))
                assert await host.recv() == raw_relay(jid, hid, bytes([n]))
                await asyncio.sleep(0.1)
            assert "bind-timeout" not in listener.drops
            joiner.send(frame(2, b"\xda\x72\x00\x0b" + jid))  # CLOSE
            code = await _close_code_while_sending(joiner, raw_ping(jid), 3.0)
            assert code == CLOSE_POLICY_VIOLATION
        assert listener.drops.get("bind-timeout") == 1


async def test_a_connection_whose_allocation_moved_away_is_unbound_again() -> None:
    """An allocation bound over ws and then re-bound from a UDP address (a
    higher nonce) is no longer at the connection: the connection holds
    nothing, and the bind deadline applies to it again."""
    async with relay_runtime(relay__websocket=True) as rt, api(rt) as http:
        listener = listener_of(rt)
        listener.bind_timeout = 0.5
        host_alloc, join_alloc = await allocate_pair(http)
        jid = allocation_id(join_alloc)
        address = ws_address(rt)
        udp = server_endpoint(host_alloc, "udp")
        async with raw_ws(address) as ws:
            await ws.handshake(*address)
            ws.send(frame(2, raw_bind(join_alloc, 0)))
            assert await ws.recv_frame() == (2, BIND_RECEIVED)
            await asyncio.sleep(1.0)  # twice the deadline: still open
            assert "bind-timeout" not in listener.drops
            moved = RawPeer((udp["host"], udp["port"]))
            try:
                assert await moved.request(raw_bind(join_alloc, 1)) == BIND_RECEIVED
            finally:
                moved.close()
            code = await _close_code_while_sending(ws, raw_ping(jid), 3.0)
            assert code == CLOSE_POLICY_VIOLATION
        assert listener.drops.get("bind-timeout") == 1
