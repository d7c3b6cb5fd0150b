"""A real mbedTLS DTLS client for the interop tests: ``mbedtls_dtls_client.c``
compiled once per module against Debian's libmbedtls (Makefile
DEBIAN_PACKAGES: libmbedtls-dev), run as a process whose hex lines the tests
read."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SOURCE = Path(__file__).with_name("mbedtls_dtls_client.c")
HEADER = Path("/usr/include/mbedtls/ssl.h")

#: Exit codes of mbedtls_dtls_client.c.
EXIT_HANDSHAKE = 4


@pytest.fixture(scope="module")
def client_binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("cc") is None:
        pytest.skip("needs cc (Makefile DEBIAN_PACKAGES: gcc)")
    if not HEADER.exists():
        pytest.skip("needs mbedTLS headers (Makefile DEBIAN_PACKAGES: libmbedtls-dev)")
    binary = tmp_path_factory.mktemp("mbedtls") / "mbedtls_dtls_client"
    subprocess.run(
        [
            "cc",
            "-O1",
            "-Wall",
            "-Werror",
            "-o",
            str(binary),
            str(SOURCE),
            "-lmbedtls",
            "-lmbedx509",
            "-lmbedcrypto",
        ],
        check=True,
    )
    return binary


@dataclass
class Run:
    """One finished run of the mbedTLS client."""

    returncode: int
    lines: list[str]
    stderr: str

    @property
    def ciphersuite(self) -> str:
        return next(
            line.split()[1] for line in self.lines if line.startswith("ciphersuite ")
        )

    @property
    def records(self) -> list[bytes]:
        return [
            bytes.fromhex(line)
            for line in self.lines
            if not line.startswith(("ciphersuite", "version"))
        ]


class MbedtlsClient:
    """The compiled client as a running process, read line by line."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []

    async def line(self, timeout: float = 15.0) -> str:
        assert self.proc.stdout is not None
        raw = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        assert raw, f"client ended early: {await self.finish()}"
        text = raw.decode().strip()
        self.lines.append(text)
        return text

    async def finish(self, timeout: float = 20.0) -> Run:
        assert self.proc.stdout is not None and self.proc.stderr is not None
        out, err = await asyncio.wait_for(
            asyncio.gather(self.proc.stdout.read(), self.proc.stderr.read()), timeout
        )
        await self.proc.wait()
        self.lines += out.decode().splitlines()
        assert self.proc.returncode is not None
        return Run(self.proc.returncode, self.lines, err.decode())


@contextlib.asynccontextmanager
async def mbedtls_client(
    binary: Path,
    server: tuple[str, int],
    credentials: list[str],
    steps: list[str],
) -> AsyncIterator[MbedtlsClient]:
    """Start the client (``credentials`` from :func:`psk` or :func:`ca`); it
    is killed on the way out if still running."""
    proc = await asyncio.create_subprocess_exec(
        str(binary),
        server[0],
        str(server[1]),
        *credentials,
        *steps,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        yield MbedtlsClient(proc)
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


def psk(identity: bytes, key: bytes) -> list[str]:
    """DTLS-PSK with a binary identity and key."""
    return [identity.hex(), key.hex()]


def ca(ca_pem: Path, server_name: str) -> list[str]:
    """Certificates: the server's must chain to ``ca_pem`` and name
    ``server_name``."""
    return [f"ca:{ca_pem}", server_name]


async def run_client(
    binary: Path,
    server: tuple[str, int],
    credentials: list[str],
    steps: list[str],
) -> Run:
    async with mbedtls_client(binary, server, credentials, steps) as client:
        return await client.finish()
