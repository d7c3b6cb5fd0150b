"""RFC 6062 data connections through the TURN service, TCP and TLS: a client
Connects to a peer, binds a new connection (ConnectionBind) and the two are
one route of the stream plane: spliced for TCP, a transport route for TLS.
Bytes arrive exact both ways, a peer that stops reading stops the client being
read (holding at most one pipe / one transport read), a close takes the pair
and gives the budget's place back."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest

from crossroads.client.turn import TurnClient
from crossroads.proto.stun import Method, RequestedTransport, XorPeerAddress
from crossroads.proto.stun.attributes import ConnectionId
from crossroads.runtime import Runtime
from crossroads.services.turn import TurnService
from crossroads.transport.streamplane import (
    MAX_TRANSPORT_READ,
    StreamRoute,
    TransportRoute,
)
from crossroads.transport.tls import development_certificate
from tests.adversarial.peer_policy_support import PASSWORD, USER, turn_runtime
from tests.conftest import eventually

pytestmark = pytest.mark.timeout(60)


class _Raw(asyncio.Protocol):
    """The client's data connection once bound: raw application bytes."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.more = asyncio.Event()
        self.lost = asyncio.Event()

    def data_received(self, data: bytes) -> None:
        self.data += data
        self.more.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost.set()
        self.more.set()

    async def read_exactly(self, size: int) -> bytes:
        while len(self.data) < size and not self.lost.is_set():
            self.more.clear()
            await asyncio.wait_for(self.more.wait(), 10)
        got = bytes(self.data[:size])
        del self.data[:size]
        return got


@dataclass
class DataConnection:
    service: TurnService
    cid: int
    client: asyncio.Transport
    raw: _Raw
    peer: socket.socket


@asynccontextmanager
async def data_connection(kind: str, directory: Path) -> AsyncIterator[DataConnection]:
    """A bound RFC 6062 data connection between a client (over ``kind``:
    "tcp" or "tls") and a loopback peer the client Connected to."""
    loop = asyncio.get_running_loop()
    extra: dict[str, Any] = {"turn__allow_loopback_peers": True}
    context: ssl.SSLContext | None = None
    if kind == "tls":
        cert, key = development_certificate(directory)
        extra |= {"core__tls_cert": str(cert), "core__tls_key": str(key)}
        context = ssl.create_default_context(cafile=str(cert))
    async with turn_runtime(**extra) as runtime:
        service = runtime.services["turn"]
        assert isinstance(service, TurnService)
        address = _address(runtime, service, kind)
        listener = socket.create_server(("127.0.0.1", 0))
        listener.setblocking(False)
        control = await TurnClient.connect(
            address, USER, PASSWORD, transport="tcp", tls=context, timeout=5
        )
        data = await TurnClient.connect(
            address, USER, PASSWORD, transport="tcp", tls=context, timeout=5
        )
        peer: socket.socket | None = None
        try:
            await control.request(Method.ALLOCATE, [RequestedTransport(6)])
            answer = await control.request(
                Method.CONNECT, [XorPeerAddress(*listener.getsockname())]
            )
            peer, _ = await loop.sock_accept(listener)
            peer.setblocking(False)
            connection_id = answer.get(ConnectionId)
            assert connection_id is not None
            cid = connection_id.value
            await data.request(Method.CONNECTION_BIND, [ConnectionId(cid)])
            raw = _Raw()
            client = cast(asyncio.Transport, data._tcp)
            client.set_protocol(raw)

            async def joined() -> bool:
                return cid in service.client_pipes

            await eventually(joined, "the data connection is joined")
            yield DataConnection(service, cid, client, raw, peer)
        finally:
            if peer is not None:
                peer.close()
            listener.close()
            await data.close()
            await control.close()


def _address(runtime: Runtime, service: TurnService, kind: str) -> tuple[str, int]:
    if kind == "tls":
        (address,) = service.stun.tls_addresses
        return address[0], address[1]
    return service.stun.primary


async def read_exactly(sock: socket.socket, size: int) -> bytes:
    loop = asyncio.get_running_loop()
    got = bytearray()
    while len(got) < size:
        chunk = await asyncio.wait_for(loop.sock_recv(sock, size - len(got)), 10)
        if not chunk:
            raise EOFError(f"end of stream after {len(got)} of {size} bytes")
        got += chunk
    return bytes(got)


@pytest.mark.parametrize("kind", ["tcp", "tls"])
async def test_a_data_connection_is_one_route_of_the_stream_plane(
    kind: str, tmp_path: Path
) -> None:
    loop = asyncio.get_running_loop()
    async with data_connection(kind, tmp_path) as conn:
        route = conn.service.client_pipes[conn.cid]
        # TCP is spliced; TLS goes through the transport route.
        assert isinstance(route, StreamRoute if kind == "tcp" else TransportRoute)
        assert conn.service.peer_pipes == {}
        before = conn.service.counters()
        up, down = os.urandom(1 << 20), os.urandom(1 << 20)
        conn.client.write(up)
        sending = loop.create_task(loop.sock_sendall(conn.peer, down))
        assert await read_exactly(conn.peer, len(up)) == up
        assert await conn.raw.read_exactly(len(down)) == down
        await sending
        after = conn.service.counters()
        assert after[1] - before[1] == len(up)  # to-peer bytes
        assert after[3] - before[3] == len(down)  # to-client bytes
        # RFC 6062 §5.5: the peer's close takes the client connection with it,
        # after what the peer sent.
        await loop.sock_sendall(conn.peer, b"last")
        conn.peer.shutdown(socket.SHUT_WR)
        assert await conn.raw.read_exactly(4) == b"last"
        await asyncio.wait_for(conn.raw.lost.wait(), 10)

        async def released() -> bool:
            return (
                conn.service.client_pipes == {}
                and conn.service.peer_connection_table.live == 0
                and conn.cid not in conn.service.core.connections
            )

        await eventually(released, "the connection and its budget place go")
        assert conn.service.plane.streams.routes == set()


@pytest.mark.parametrize("kind", ["tcp", "tls"])
async def test_a_peer_that_stops_reading_stops_the_client_being_read(
    kind: str, tmp_path: Path
) -> None:
    async with data_connection(kind, tmp_path) as conn:
        route = conn.service.client_pipes[conn.cid]
        conn.peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        payload = os.urandom(16 << 20)
        conn.client.write(payload)

        def held() -> int:
            if isinstance(route, TransportRoute):
                return route.buffered
            return route.b_to_a.pending

        def stalled() -> bool:
            if isinstance(route, TransportRoute):
                return route.writing and not route.b.is_reading()
            way = route.b_to_a
            return way.writing and not way.reading

        async def check() -> bool:
            return stalled()

        await eventually(check, "the relay stops reading the client")
        taken = route.b_to_a.octets
        most = 0
        for _ in range(20):  # it stays stalled, holding at most one read
            await asyncio.sleep(0.01)
            most = max(most, held())
        assert stalled() and route.b_to_a.octets == taken < len(payload)
        if isinstance(route, TransportRoute):
            assert most <= MAX_TRANSPORT_READ
        else:
            assert most <= route.b_to_a.capacity  # one pipe
        assert await read_exactly(conn.peer, len(payload)) == payload
