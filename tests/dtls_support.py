"""A DTLS echo server behind a DtlsListener, and client helpers, for the DTLS
tests (tests/transport/test_dtls.py, tests/adversarial/test_dtls_handshakes.py)."""

from __future__ import annotations

import asyncio
import socket
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from OpenSSL import SSL

from crossroads.proto.reflection import ReflectionBudget
from crossroads.transport.admission import ResourceBudget
from crossroads.transport.dtls import (
    DtlsConnection,
    DtlsListener,
    DtlsTables,
    client_context,
    dtls_connect,
    dtls_tables,
    open_dtls_listener,
)
from crossroads.transport.tls import Certificates, development_certificate
from tests.conftest import eventually


class EchoServer:
    """Echoes every decrypted datagram back through the session."""

    def __init__(self, listener: DtlsListener) -> None:
        self.listener = listener
        self.drops: Counter[str] = Counter()

    @property
    def port(self) -> int:
        return self.listener.local[1]

    async def counted(self, reason: str, count: int = 1) -> None:
        async def check() -> bool:
            return self.drops[reason] >= count

        await eventually(check, f"{count} {reason} counted")


MakeServer = Callable[..., Awaitable[EchoServer]]


def echo_tables(**limits: float) -> DtlsTables:
    """The DTLS tables of a test listener in a budget of its own (descriptors
    and memory plenty); ``limits`` are :func:`dtls_tables`' keywords."""
    budget = ResourceBudget(fd_limit=65_536, memory=1 << 30)
    return dtls_tables(budget, "test", **limits)  # type: ignore[arg-type]


@pytest.fixture(name="make_dtls_server")
async def make_dtls_server_fixture(tmp_path: Path) -> AsyncIterator[MakeServer]:
    """``make(certificates=None, tables=None, **listener_options)``; without
    certificates, a development one in ``tmp_path / "dev"``; without tables,
    :func:`echo_tables`' defaults."""
    servers: list[EchoServer] = []

    async def make(
        certificates: Certificates | None = None,
        tables: DtlsTables | None = None,
        **options: Any,
    ) -> EchoServer:
        if certificates is None:
            certificates = Certificates(*development_certificate(tmp_path / "dev"))

        def echo(data: bytes, client: tuple[str, int], listener: DtlsListener) -> None:
            listener.send(data, client)

        server: EchoServer | None = None

        def drop(reason: str) -> None:
            assert server is not None
            server.drops[reason] += 1

        listener = DtlsListener(
            certificates,
            echo,
            tables or echo_tables(),
            drop,
            ReflectionBudget(),
            **options,
        )
        server = EchoServer(listener)
        await open_dtls_listener("127.0.0.1", 0, False, listener)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.listener.close()


class Inbox:
    """What a DtlsConnection delivered."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes] = asyncio.Queue()
        self.closed = False

    def deliver(self, data: bytes) -> None:
        self.queue.put_nowait(data)

    def lost(self) -> None:
        self.closed = True

    async def get(self) -> bytes:
        return await asyncio.wait_for(self.queue.get(), 10)


async def connect(
    port: int, cafile: Path, local: tuple[str, int] | None = None
) -> tuple[DtlsConnection, Inbox]:
    inbox = Inbox()
    client = await dtls_connect(
        ("127.0.0.1", port),
        client_context(str(cafile)),
        inbox.deliver,
        inbox.lost,
        server_hostname="localhost",
        local=local,
    )
    return client, inbox


async def echo(client: DtlsConnection, inbox: Inbox, payload: bytes = b"ping") -> None:
    client.send(payload)
    assert await inbox.get() == payload


def raw_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(5)
    return sock


def memory_client() -> SSL.Connection:
    """A DTLS client on memory BIOs (no certificate check): its flights are
    sent by hand."""
    connection = SSL.Connection(SSL.Context(SSL.DTLS_CLIENT_METHOD))
    connection.set_connect_state()
    connection.set_ciphertext_mtu(1200)
    return connection


def flight(connection: SSL.Connection) -> bytes:
    """Advance ``connection``'s handshake; what it wants to send."""
    try:
        connection.do_handshake()
    except SSL.WantReadError:
        pass
    try:
        return connection.bio_read(65536)
    except SSL.WantReadError:
        return b""


async def served_serial(port: int, cafile: Path) -> int:
    """The serial number of the certificate a new DTLS handshake on
    127.0.0.1:``port`` gets (the client trusts ``cafile``)."""
    client, _ = await connect(port, cafile)
    try:
        peer = client.connection.get_peer_certificate()
        assert peer is not None
        return int(peer.get_serial_number())
    finally:
        client.close()
