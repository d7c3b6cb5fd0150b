"""Unity Relay over DTLS with DTLS stacks that are not crossroads' code.

OpenSSL's ``s_client`` and GnuTLS's ``gnutls-cli`` complete the PSK handshake
with an allocation's key (the identity is the allocationId text: both treat it
as a C string, reference unity-secure-transports.md §6), then send a BIND as
DTLS application data and must get BIND_RECEIVED back, decrypted by them. A
wrong key fails the handshake.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import shutil
from typing import Any

import httpx
import pytest

from tests.e2e.relay_support import (
    BIND_RECEIVED,
    allocate,
    api,
    base_url,
    endpoint_address,
    metric,
    raw_bind,
    relay_runtime,
)

pytestmark = pytest.mark.timeout(60)

OPENSSL = shutil.which("openssl")
GNUTLS = shutil.which("gnutls-cli")


def openssl_command(
    server: tuple[str, int], identity: str | bytes, key: bytes
) -> list[str | bytes]:
    assert OPENSSL is not None
    return [
        OPENSSL,
        "s_client",
        "-dtls1_2",
        "-connect",
        f"{server[0]}:{server[1]}",
        "-psk",
        key.hex(),
        "-psk_identity",
        identity,
        "-cipher",
        "PSK-AES128-GCM-SHA256",
        "-quiet",
    ]


def gnutls_command(server: tuple[str, int], identity: str, key: bytes) -> list[str]:
    assert GNUTLS is not None
    return [
        GNUTLS,
        "--udp",
        "-p",
        str(server[1]),
        server[0],
        "--pskusername",
        identity,
        "--pskkey",
        key.hex(),
        "--priority",
        "NORMAL:-KX-ALL:+PSK:-VERS-ALL:+VERS-DTLS1.2",
    ]


async def bind_through(
    command: list[str | bytes], bind: bytes, timeout: float = 15.0
) -> bytes:
    """Run a DTLS client, write a BIND to it (application data) until the
    relay's BIND_RECEIVED comes back on its stdout; all its output."""
    proc = await asyncio.create_subprocess_exec(
        *command,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert proc.stdin is not None and proc.stdout is not None
    output = b""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        while BIND_RECEIVED not in output and loop.time() < deadline:
            # Before the handshake the clients do not read stdin; a BIND sent
            # again after it is a duplicate the relay answers again (reference
            # §1.1), so resending until the answer shows is harmless.
            proc.stdin.write(bind)
            await proc.stdin.drain()
            try:
                chunk = await asyncio.wait_for(proc.stdout.read(4096), 1.0)
            except TimeoutError:
                continue
            if not chunk:
                break
            output += chunk
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
    return output


async def completed_handshakes(rt: Any) -> float:
    async with httpx.AsyncClient(base_url=base_url(rt)) as http:
        page = (await http.get("/metrics")).text
    return metric(page, "crossroads_relay_dtls_handshakes_completed_total")


@pytest.mark.skipif(OPENSSL is None, reason="openssl not installed")
async def test_openssl_s_client_binds_through_dtls() -> None:
    async with relay_runtime() as rt, api(rt) as http:
        allocation = await allocate(http, 1)
        key = base64.b64decode(allocation["key"])
        output = await bind_through(
            openssl_command(
                endpoint_address(allocation, "dtls"), allocation["allocationId"], key
            ),
            raw_bind(allocation, nonce=0),
        )
        assert BIND_RECEIVED in output, output[-2000:]
        assert await completed_handshakes(rt) >= 1


@pytest.mark.skipif(OPENSSL is None, reason="openssl not installed")
async def test_openssl_with_the_raw_allocation_id_bytes_as_identity() -> None:
    """Unity Transport's identity: the 16 raw allocationIdBytes. OpenSSL takes
    the identity as a C string, so only an ID without a zero byte can be passed
    (94 % of random IDs); a command-line argument carries the high bytes as they
    are."""
    async with relay_runtime() as rt, api(rt) as http:
        for _ in range(20):
            allocation = await allocate(http, 1)
            raw = base64.b64decode(allocation["allocationIdBytes"])
            if 0 not in raw:
                break
        assert 0 not in raw and len(raw) == 16
        key = base64.b64decode(allocation["key"])
        output = await bind_through(
            openssl_command(endpoint_address(allocation, "dtls"), raw, key),
            raw_bind(allocation, nonce=0),
        )
        assert BIND_RECEIVED in output, output[-2000:]


@pytest.mark.skipif(GNUTLS is None, reason="gnutls-cli not installed (gnutls-bin)")
async def test_gnutls_cli_binds_through_dtls() -> None:
    async with relay_runtime() as rt, api(rt) as http:
        allocation = await allocate(http, 1)
        key = base64.b64decode(allocation["key"])
        output = await bind_through(
            gnutls_command(
                endpoint_address(allocation, "dtls"), allocation["allocationId"], key
            ),
            raw_bind(allocation, nonce=0),
        )
        assert b"(DTLS1.2-X.509)-(PSK)-(AES-128-GCM)" in output, output[-2000:]
        assert BIND_RECEIVED in output, output[-2000:]


@pytest.mark.skipif(OPENSSL is None, reason="openssl not installed")
async def test_openssl_with_a_wrong_key_fails() -> None:
    async with relay_runtime() as rt, api(rt) as http:
        allocation = await allocate(http, 1)
        wrong = bytes(64)
        proc = await asyncio.create_subprocess_exec(
            *openssl_command(
                endpoint_address(allocation, "dtls"), allocation["allocationId"], wrong
            ),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:
            output, _ = await asyncio.wait_for(proc.communicate(), 30)
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        assert proc.returncode != 0
        assert b"bad record mac" in output.lower(), output[-2000:]
        assert await completed_handshakes(rt) == 0
