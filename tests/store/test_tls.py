"""TLS to Redis (``rediss://``) against a real redis-server listening on TLS only,
with a certificate from a CA made for the test: the store works when given the
CA, and refuses a server it cannot verify or a plain-text connection."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from crossroads.errors import StoreError
from crossroads.store.redis import RedisStore
from tests.conftest import free_port
from tests.tls_support import write_certificates

pytestmark = pytest.mark.timeout(60)


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
