"""TLS to Redis (``rediss://``) against a real redis-server listening on TLS only,
with a certificate from a CA made for the test: the store works when given the
CA, and refuses a server it cannot verify or a plain-text connection."""

from __future__ import annotations

import datetime
import ipaddress
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from crossroads.errors import StoreError
from crossroads.store.redis import RedisStore
from tests.conftest import free_port

pytestmark = pytest.mark.timeout(60)


def write_certificates(directory: Path) -> tuple[Path, Path, Path]:
    """A CA, and a server certificate for 127.0.0.1 signed by it."""
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
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
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


@pytest.fixture
def tls_redis() -> Iterator[tuple[int, Path]]:
    """redis-server with TLS only (no plain port); yields (port, CA file)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server missing: make install")
    directory = Path(tempfile.mkdtemp(prefix="crossroads-redis-tls-"))
    ca, cert, key = write_certificates(directory)
    port = free_port()
    process = subprocess.Popen(
        [
            binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
            "--tls-cert-file", str(cert), "--tls-key-file", str(key),
            "--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no",
            "--save", "", "--appendonly", "no", "--dir", str(directory),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while True:
            assert process.poll() is None, "redis-server (TLS) exited"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "redis-server (TLS) never listened"
                time.sleep(0.05)
        yield port, ca
    finally:
        process.terminate()
        process.wait(10)
        shutil.rmtree(directory, ignore_errors=True)


async def test_rediss_with_the_ca_works(tls_redis: tuple[int, Path]) -> None:
    port, ca = tls_redis
    store = RedisStore(f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}")
    try:
        assert await store.set("tls-test", b"over tls")
        assert await store.get("tls-test") == b"over tls"
        assert await store.ping()
    finally:
        await store.close()


async def test_unverifiable_server_or_plain_text_is_refused(
    tls_redis: tuple[int, Path],
) -> None:
    port, _ca = tls_redis
    # No CA given: the system's CAs do not know the test CA.
    for url in (f"rediss://127.0.0.1:{port}/0", f"redis://127.0.0.1:{port}/0"):
        store = RedisStore(url)
        try:
            with pytest.raises(StoreError):
                await store.set("tls-test", b"x")
        finally:
            await store.close()
