"""Hostile TLS clients against a TlsAcceptor (crossroads.transport.tls): slow
handshakes, garbage and truncated records, handshake floods from one address,
old protocol versions and renegotiation are bounded, counted, and leave the
listener serving real clients (docs/security.md, "TLS handshakes")."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from tests.conftest import eventually
from tests.tls_support import (  # noqa: F401 (fixture)
    MakeServer,
    echo_once,
    make_server_fixture,
    s_client,
)


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
    make_server: MakeServer, garbage: bytes
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


@pytest.mark.parametrize(
    ("limits", "sources", "reason"),
    [
        ({"max_handshakes_per_source": 3}, ["127.0.0.1"] * 4, "tls-handshake-ip-limit"),
        (
            {"max_handshakes": 3},
            ["127.0.7.1", "127.0.7.2", "127.0.7.3", "127.0.7.4"],
            "tls-handshake-limit",
        ),
    ],
    ids=["per-ip", "global"],
)
async def test_handshake_floods_are_capped(
    make_server: MakeServer, limits: dict[str, int], sources: list[str], reason: str
) -> None:
    """Three silent clients hold every slot; the fourth connection is closed
    at accept and counted; the slots come back when the three leave. (A
    source may hold an eighth of the table at most: the global cap of 3 is
    filled from three sources.)"""
    server = await make_server(handshake_timeout=30, **limits)
    idle = [
        await asyncio.open_connection("127.0.0.1", server.port, local_addr=(s, 0))
        for s in sources[:3]
    ]
    handshakes = server.tables.handshakes

    async def admitted() -> bool:
        return handshakes.live == 3

    await eventually(admitted, "three handshakes pending")
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", server.port, local_addr=(sources[3], 0)
    )
    with contextlib.suppress(ConnectionResetError):  # aborted: EOF or RST
        assert await asyncio.wait_for(reader.read(), 10) == b""
    assert server.drops[reason] == 1
    assert handshakes.live == 3
    for _, w in idle:
        w.close()
    writer.close()

    async def released() -> bool:
        return handshakes.live == 0 and not handshakes.per_source

    await eventually(released, "slots released when the clients left")
    _, good, _ = await echo_once(server.port, server.certificates.cert)
    good.close()


async def test_tls_below_1_2_is_refused(make_server: MakeServer) -> None:
    server = await make_server()
    code, _ = await s_client(server.port, "-tls1_1")
    assert code != 0
    await server.counted("tls-handshake-failed")


async def test_renegotiation_is_refused(make_server: MakeServer) -> None:
    """A TLS 1.2 client asking to renegotiate (openssl s_client's ``R``) gets
    no second handshake: the server answers no_renegotiation (OP_NO_RENEGOTIATION;
    OpenSSL 3 also refuses client-initiated renegotiation by default)."""
    server = await make_server()
    _, text = await s_client(server.port, "-tls1_2", stdin=b"R\n")
    assert "RENEGOTIATING" in text, text
    assert "no renegotiation" in text, text
