"""The shared TLS port's sorter (transport/tls_sort.py): which first bytes go
where, and a client that never says anything is cut and counted."""

from __future__ import annotations

import asyncio
import ssl
from collections import Counter
from pathlib import Path

from crossroads.proto.stun.constants import Method
from crossroads.proto.stun.message import encode, request
from crossroads.transport.tls import (
    Certificates,
    TlsAcceptor,
    development_certificate,
)
from crossroads.transport.tls_sort import ALPN, Application, TlsSorter, classify
from tests.conftest import eventually
from tests.tls_support import echo_tables

#: RFC 9110 §9.3 and RFC 5789: every request method a client may start with.
HTTP_METHODS = [
    b"GET",
    b"HEAD",
    b"POST",
    b"PUT",
    b"DELETE",
    b"CONNECT",
    b"OPTIONS",
    b"TRACE",
    b"PATCH",
]


def test_first_bytes() -> None:
    binding = encode(request(Method.BINDING, bytes(12)))
    allocate = encode(request(Method.ALLOCATE, bytes(12)))
    assert classify(binding[0]) is Application.TURN
    assert classify(allocate[0]) is Application.TURN
    for method in HTTP_METHODS:
        assert classify(method[0]) is Application.HTTP, method
    # The HTTP/2 preface ("PRI * HTTP/2.0") goes to HTTP, which refuses it.
    assert classify(b"PRI"[0]) is Application.HTTP
    # Neither: a nested TLS record, ChannelData before any allocation, junk.
    for first in (0x16, 0x40, 0x4E, 0x80, 0xFF, ord("x")):
        assert classify(first) is None, first


def test_alpn_names() -> None:
    # RFC 7443 registers "stun.turn"; "h2" is not offered (HTTP/1.1 server).
    assert ALPN == {"stun.turn": Application.TURN, "http/1.1": Application.HTTP}


class Tag(asyncio.Protocol):
    """Answers every read with its name, so the test sees where it landed."""

    def __init__(self, name: bytes) -> None:
        self.name = name

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        assert isinstance(self.transport, asyncio.Transport)
        self.transport.write(self.name + b":" + data)


async def test_sorting_and_a_silent_client(tmp_path: Path) -> None:
    certificates = Certificates(*development_certificate(tmp_path))
    context = certificates.context_with_alpn(list(ALPN))
    drops: Counter[str] = Counter()

    def count(reason: str) -> None:
        drops[reason] += 1

    factories = {
        Application.TURN: lambda: Tag(b"turn"),
        Application.HTTP: lambda: Tag(b"http"),
    }
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: TlsAcceptor(
            context,
            lambda: TlsSorter(factories, count, timeout=0.3),
            echo_tables(),
            count,
        ),
        "127.0.0.1",
        0,
    )
    port = server.sockets[0].getsockname()[1]
    client = ssl.create_default_context(cafile=str(tmp_path / "dev-cert.pem"))
    try:
        for first, expected in ((b"\x00\x03rest", b"turn:"), (b"GET /", b"http:")):
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, ssl=client, server_hostname="localhost"
            )
            writer.write(first)
            answer = await asyncio.wait_for(reader.read(100), 5)
            # The whole first read reaches the chosen protocol.
            assert answer == expected + first
            writer.close()
        # ALPN decides before any byte.
        turn = ssl.create_default_context(cafile=str(tmp_path / "dev-cert.pem"))
        turn.set_alpn_protocols(["stun.turn"])
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=turn, server_hostname="localhost"
        )
        writer.write(b"GET / looks like HTTP")
        assert (await asyncio.wait_for(reader.read(100), 5)).startswith(b"turn:")
        writer.close()
        # Silent after the handshake: cut after the timeout, counted.
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=client, server_hostname="localhost"
        )
        assert await asyncio.wait_for(reader.read(100), 5) == b""
        writer.close()

        async def counted() -> bool:
            return drops["tls-sort-timeout"] == 1

        await eventually(counted, "the silent client counted")
    finally:
        server.close()
