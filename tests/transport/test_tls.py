"""TLS certificates, reload and bounded handshakes (crossroads.transport.tls),
with real TLS connections on loopback."""

from __future__ import annotations

import asyncio
import datetime
import shutil
import ssl
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from cryptography import x509

from crossroads.errors import ConfigError
from crossroads.transport.tls import (
    DEV_CERT_LIFETIME,
    Certificates,
    HandshakeLimits,
    TlsAcceptor,
    certificates_for,
    development_certificate,
)
from tests.conftest import eventually

NOW = datetime.datetime.now(datetime.UTC)


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


@pytest.fixture
async def make_server(tmp_path: Path) -> AsyncIterator[MakeServer]:
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


# ------------------------------------------------------------ certificates


def test_development_certificate_is_made_once_and_renewed_near_expiry(
    tmp_path: Path,
) -> None:
    cert, key = development_certificate(tmp_path, now=NOW)
    assert key.stat().st_mode & 0o777 == 0o600
    first = serial(cert)
    names = (
        x509.load_pem_x509_certificate(cert.read_bytes())
        .extensions.get_extension_for_class(x509.SubjectAlternativeName)
        .value
    )
    assert names.get_values_for_type(x509.DNSName) == ["localhost"]
    assert {str(a) for a in names.get_values_for_type(x509.IPAddress)} == {
        "127.0.0.1",
        "::1",
    }
    assert development_certificate(tmp_path, now=NOW)[0] == cert
    assert serial(cert) == first  # reused
    near_expiry = NOW + DEV_CERT_LIFETIME - datetime.timedelta(days=1)
    development_certificate(tmp_path, now=near_expiry)
    assert serial(cert) != first  # made anew


def test_certificates_for_chooses_given_then_dev_on_loopback_only(
    tmp_path: Path,
) -> None:
    assert certificates_for("", "", host="127.0.0.1", dev_dir="") is None
    assert certificates_for("", "", host="0.0.0.0", dev_dir=str(tmp_path)) is None
    assert certificates_for("", "", host="192.0.2.1", dev_dir=str(tmp_path)) is None
    dev = certificates_for("", "", host="::1", dev_dir=str(tmp_path))
    assert dev is not None and dev.cert == tmp_path / "dev-cert.pem"
    given = certificates_for(str(dev.cert), str(dev.key), host="0.0.0.0", dev_dir="")
    assert given is not None and given.cert == dev.cert


def test_expired_or_broken_certificate_is_refused(tmp_path: Path) -> None:
    old = NOW - DEV_CERT_LIFETIME - datetime.timedelta(days=2)
    cert, key = development_certificate(tmp_path, now=old)
    with pytest.raises(ConfigError, match="expired"):
        Certificates(cert, key)
    cert.write_text("not a certificate")
    with pytest.raises(ConfigError, match="tls_cert"):
        Certificates(cert, key)


async def test_reload_serves_new_chain_and_keeps_live_connections(
    tmp_path: Path, make_server: MakeServer
) -> None:
    first_cert, first_key = development_certificate(tmp_path / "a")
    second_cert, second_key = development_certificate(tmp_path / "b")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    shutil.copy(first_cert, cert)
    shutil.copy(first_key, key)
    certificates = Certificates(cert, key)
    server = await make_server(certificates)
    reader, writer, served = await echo_once(server.port, first_cert)
    assert served == serial(first_cert)

    shutil.copy(second_cert, cert)
    shutil.copy(second_key, key)
    assert certificates.reload()
    _, writer2, served2 = await echo_once(server.port, second_cert)
    assert served2 == serial(second_cert)
    # The connection made before the reload is still up and working.
    writer.write(b"still here")
    assert await reader.readexactly(10) == b"still here"

    # An expired replacement is refused and the current chain stays.
    expired_cert, expired_key = development_certificate(
        tmp_path / "c", now=NOW - DEV_CERT_LIFETIME - datetime.timedelta(days=2)
    )
    shutil.copy(expired_cert, cert)
    shutil.copy(expired_key, key)
    assert not certificates.reload()
    assert certificates.failed_reloads == 1
    _, writer3, served3 = await echo_once(server.port, second_cert)
    assert served3 == serial(second_cert)
    for w in (writer, writer2, writer3):
        w.close()


# ------------------------------------------------------------ hostile handshakes


async def test_slow_handshakes_are_cut_and_counted(
    make_server: MakeServer,
) -> None:
    server = await make_server(handshake_timeout=0.5)
    # Connects and sends half a ClientHello record header, then nothing.
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"\x16\x03\x01")
    assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the server

    await server.counted("tls-handshake-timeout")
    writer.close()


@pytest.mark.parametrize(
    "garbage",
    [b"GET / HTTP/1.1\r\n\r\n", b"\x16\x03\x01\x00\x10" + b"\x01\x00\x00\x0c"],
    ids=["plaintext", "truncated-record"],
)
async def test_garbage_and_truncated_records_fail_and_are_counted(
    tmp_path: Path, make_server: MakeServer, garbage: bytes
) -> None:
    server = await make_server()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(garbage)
    writer.write_eof()
    await asyncio.wait_for(reader.read(), 10)

    await server.counted("tls-handshake-failed")
    writer.close()
    # The listener still serves real clients.
    _, good, _ = await echo_once(server.port, server.certificates.cert)
    good.close()


async def test_handshake_flood_from_one_address_is_capped(
    make_server: MakeServer,
) -> None:
    server = await make_server(max_handshakes_per_ip=3, handshake_timeout=30)
    idle = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(3)]

    async def admitted() -> bool:
        return server.limits.pending == 3

    await eventually(admitted, "three handshakes pending")
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    with pytest.raises(ConnectionResetError):  # aborted at once: RST
        assert await asyncio.wait_for(reader.read(), 10) == b""
        raise ConnectionResetError
    assert server.drops["tls-handshake-ip-limit"] == 1
    for _, w in idle:
        w.close()
    writer.close()

    async def released() -> bool:
        return server.limits.pending == 0 and not server.limits.pending_by_ip

    await eventually(released, "slots released when the clients left")
    _, good, _ = await echo_once(server.port, server.certificates.cert)
    good.close()


async def s_client(port: int, version: str, stdin: bytes) -> tuple[int, str]:
    """openssl s_client with ``version`` (``-tls1_2``), ``stdin`` as its
    commands (``R``: renegotiate); its exit code and output."""
    process = await asyncio.create_subprocess_exec(
        "openssl", "s_client", version, "-connect", f"127.0.0.1:{port}",
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


async def test_tls_below_1_2_is_refused(make_server: MakeServer) -> None:
    server = await make_server()
    code, _ = await s_client(server.port, "-tls1_1", b"")
    assert code != 0
    await server.counted("tls-handshake-failed")


async def test_renegotiation_is_refused(make_server: MakeServer) -> None:
    """A TLS 1.2 client asking to renegotiate (openssl s_client's ``R``) gets
    no second handshake: the server answers no_renegotiation (OP_NO_RENEGOTIATION;
    OpenSSL 3 also refuses client-initiated renegotiation by default)."""
    server = await make_server()
    _, text = await s_client(server.port, "-tls1_2", b"R\n")
    assert "RENEGOTIATING" in text, text
    assert "no renegotiation" in text, text
