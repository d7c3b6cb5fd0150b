"""A TLS echo server behind a TlsAcceptor, and client helpers, for the TLS
tests (tests/transport/test_tls.py, tests/adversarial/test_tls_handshakes.py,
tests/interop/test_turn_tls.py)."""

from __future__ import annotations

import asyncio
import ssl
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from cryptography import x509

from crossroads.transport.tls import (
    Certificates,
    HandshakeLimits,
    TlsAcceptor,
    development_certificate,
)
from tests.conftest import eventually


def serial(cert: Path) -> int:
    return x509.load_pem_x509_certificate(cert.read_bytes()).serial_number


def client_context(cafile: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cafile))


class Echo(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        assert isinstance(transport, asyncio.Transport)

    def data_received(self, data: bytes) -> None:
        assert isinstance(self.transport, asyncio.Transport)
        self.transport.write(data)


class Server:
    def __init__(self, certificates: Certificates, limits: HandshakeLimits) -> None:
        self.certificates = certificates
        self.limits = limits
        self.drops: Counter[str] = Counter()
        self.server: asyncio.Server | None = None
        self.port = 0

    def drop(self, reason: str) -> None:
        self.drops[reason] += 1

    async def counted(self, reason: str) -> None:
        """Wait until one handshake was dropped for ``reason`` and its slot freed."""

        async def check() -> bool:
            return self.drops[reason] == 1 and self.limits.pending == 0

        await eventually(check, f"one {reason} counted")

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(
            lambda: TlsAcceptor(
                self.certificates.context, Echo, self.limits, self.drop
            ),
            "127.0.0.1",
            0,
        )
        self.port = self.server.sockets[0].getsockname()[1]


MakeServer = Callable[..., Awaitable[Server]]


@pytest.fixture(name="make_server")
async def make_server_fixture(tmp_path: Path) -> AsyncIterator[MakeServer]:
    """A TLS echo server behind a TlsAcceptor: ``make(certificates=None,
    **limits)``; without certificates, a development one in ``tmp_path``."""
    servers: list[Server] = []

    async def make(certificates: Certificates | None = None, **limits: float) -> Server:
        if certificates is None:
            certificates = Certificates(*development_certificate(tmp_path / "dev"))
        server = Server(certificates, HandshakeLimits(**limits))  # type: ignore[arg-type]
        await server.start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        assert server.server is not None
        server.server.close()


async def echo_once(
    port: int, cafile: Path, payload: bytes = b"ping"
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, int]:
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=client_context(cafile), server_hostname="localhost"
    )
    writer.write(payload)
    assert await reader.readexactly(len(payload)) == payload
    sslobj = writer.get_extra_info("ssl_object")
    der = sslobj.getpeercert(binary_form=True)
    return reader, writer, x509.load_der_x509_certificate(der).serial_number
