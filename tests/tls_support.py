"""A TLS echo server behind a TlsAcceptor, and client helpers, for the TLS
tests (tests/transport/test_tls.py, tests/adversarial/test_tls_handshakes.py,
tests/interop/test_turn_tls.py)."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from crossroads.transport.admission import ResourceBudget
from crossroads.transport.tls import (
    Certificates,
    TlsAcceptor,
    TlsTables,
    development_certificate,
    tls_tables,
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


def echo_tables(**limits: float) -> TlsTables:
    """The TLS tables of a test listener in a budget of its own (descriptors
    and memory plenty): ``handshake_timeout``, ``max_handshakes``,
    ``max_handshakes_per_source``, ``max_connections``, ``max_per_source``."""
    budget = ResourceBudget(fd_limit=65_536, memory=1 << 30)
    return tls_tables(
        budget,
        "test",
        listener=None,
        max_connections=int(limits.pop("max_connections", 10_000)),
        max_per_source=int(limits.pop("max_per_source", 128)),
        **limits,  # type: ignore[arg-type]
    )


class Server:
    def __init__(self, certificates: Certificates, tables: TlsTables) -> None:
        self.certificates = certificates
        self.tables = tables
        self.drops: Counter[str] = Counter()
        self.server: asyncio.Server | None = None
        self.port = 0

    def drop(self, reason: str) -> None:
        self.drops[reason] += 1

    async def counted(self, reason: str) -> None:
        """Wait until one handshake was dropped for ``reason`` and its slot freed."""

        async def check() -> bool:
            return self.drops[reason] == 1 and self.tables.handshakes.live == 0

        await eventually(check, f"one {reason} counted")

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(
            lambda: TlsAcceptor(
                self.certificates.context, Echo, self.tables, self.drop
            ),
            "127.0.0.1",
            0,
        )
        self.port = self.server.sockets[0].getsockname()[1]


MakeServer = Callable[..., Awaitable[Server]]


@pytest.fixture(name="make_server")
async def make_server_fixture(tmp_path: Path) -> AsyncIterator[MakeServer]:
    """A TLS echo server behind a TlsAcceptor: ``make(certificates=None,
    **limits)`` (limits: :func:`echo_tables`); without certificates, a
    development one in ``tmp_path``."""
    servers: list[Server] = []

    async def make(certificates: Certificates | None = None, **limits: float) -> Server:
        if certificates is None:
            certificates = Certificates(*development_certificate(tmp_path / "dev"))
        server = Server(certificates, echo_tables(**limits))
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


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def write_certificates(
    directory: Path, name: str = "127.0.0.1"
) -> tuple[Path, Path, Path]:
    """A CA, and a server certificate for ``name`` (an IP address or a DNS
    name) signed by it: the paths of the CA, the certificate and its key."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "crossroads test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([_general_name(name)]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    ca_path, cert_path, key_path = (
        directory / n for n in ("ca.pem", "cert.pem", "key.pem")
    )
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return ca_path, cert_path, key_path


async def s_client(port: int, *args: str, stdin: bytes = b"") -> tuple[int, str]:
    """openssl s_client with ``args`` (``-tls1_2``, ``-dtls1_2``, ...) to
    127.0.0.1:``port``, ``stdin`` as its commands (``R``: renegotiate); its
    exit code and output."""
    process = await asyncio.create_subprocess_exec(
        "openssl", "s_client", *args, "-connect", f"127.0.0.1:{port}",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        out, _ = await asyncio.wait_for(process.communicate(stdin), 20)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    assert process.returncode is not None
    return process.returncode, out.decode(errors="replace")
