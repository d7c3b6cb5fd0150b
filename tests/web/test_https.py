"""HTTPS for the HTTP app (``--https-port`` with ``--tls-cert``): REST, pages
and the p2p WebSocket over TLS, the certificate reloaded without dropping
connections, and one TLS port shared with TURN over TLS (``--turn-tls-port``
equal to ``--https-port``), sorted by ALPN or by the first bytes.

Real sockets, a real runtime, clients that are not crossroads' HTTP code
(httpx, the ``websockets`` library, raw ``ssl`` sockets) and, on the shared
port, coturn's ``turnutils_uclient`` and crossroads' TURN client over TLS."""

from __future__ import annotations

import asyncio
import shutil
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography import x509
from websockets.asyncio.client import connect

from crossroads.client.turn import TurnClient
from crossroads.config import default_config
from crossroads.runtime import Runtime, start
from crossroads.transport.tls import development_certificate
from tests.conftest import eventually, free_port, free_udp_tcp_port, loopback_config
from tests.interop.test_turn import (
    PASSWORD,
    REALM,
    SECRET,
    USER,
    assert_no_loss,
    exercise,
    turn_service,
    uclient,
    udp_echo,
)

pytestmark = pytest.mark.timeout(90)


@asynccontextmanager
async def https_runtime(
    directory: Path, *, share_with_turn: bool = False, **extra: Any
) -> AsyncIterator[tuple[Runtime, int, ssl.SSLContext]]:
    """A runtime with a development certificate and HTTPS on a free high port
    (``--https-port 0`` means none, so the test picks one)."""
    cert, key = development_certificate(directory)
    port = free_udp_tcp_port() if share_with_turn else free_port()
    values: dict[str, Any] = {
        "core__tls_cert": str(cert),
        "core__tls_key": str(key),
        "core__https_port": port,
    }
    if share_with_turn:
        values.update(
            {
                "core__only": ["stun", "turn", "p2p"],
                "turn__tls_port": port,
                "turn__user": [f"{USER}:{PASSWORD}"],
                "turn__secret": [SECRET],
                "turn__realm": REALM,
                "turn__allow_loopback_peers": True,
            }
        )
    values.update(extra)
    runtime = await start(default_config(loopback_config(**values)))
    try:
        assert runtime.https_address == ("127.0.0.1", port)
        yield runtime, port, ssl.create_default_context(cafile=str(cert))
    finally:
        await runtime.close()


def serial_of(der: bytes) -> int:
    return x509.load_der_x509_certificate(der).serial_number


def trusting(cafile: Path, alpn: list[str] | None = None) -> ssl.SSLContext:
    """A client context trusting ``cafile``, offering ``alpn`` if given."""
    context = ssl.create_default_context(cafile=str(cafile))
    if alpn is not None:
        context.set_alpn_protocols(alpn)
    return context


async def raw_request(
    port: int, context: ssl.SSLContext, request: bytes
) -> tuple[bytes, str | None]:
    """One request over a new TLS connection: the first bytes of the answer,
    and the ALPN protocol the server selected."""
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=context, server_hostname="localhost"
    )
    try:
        selected = writer.get_extra_info("ssl_object").selected_alpn_protocol()
        writer.write(request)
        answer = await asyncio.wait_for(reader.read(200), 10)
        return answer, selected
    finally:
        writer.close()


GET_HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"


async def test_rest_pages_and_p2p_websocket_over_https(tmp_path: Path) -> None:
    async with https_runtime(tmp_path, core__only=["p2p"]) as (rt, port, trust):
        async with httpx.AsyncClient(
            base_url=f"https://localhost:{port}", verify=trust
        ) as http:
            health = await http.get("/healthz")
            assert health.status_code == 200 and health.json()["status"] == "ok"
            assert (await http.get("/")).status_code == 200  # the console page
            assert (await http.get("/metrics")).status_code == 200
        # The p2p signalling WebSocket, as wss.
        async with connect(
            f"wss://localhost:{port}/p2p/v1/ws", ssl=trust, open_timeout=10
        ) as ws:
            assert ws.protocol.state.name == "OPEN"
        # The plain HTTP port keeps serving.
        host, http_port = rt.http_address
        async with httpx.AsyncClient() as http:
            assert (
                await http.get(f"http://{host}:{http_port}/healthz")
            ).status_code == 200


async def test_certificate_reload_keeps_connections(tmp_path: Path) -> None:
    """SIGHUP (Runtime.reload) loads the new chain into the context HTTPS
    uses: a connection made before keeps working, the next handshake gets
    the new certificate."""
    first = tmp_path / "first"
    async with https_runtime(first, core__only=["p2p"]) as (rt, port, trust):
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=trust, server_hostname="localhost"
        )
        before = serial_of(writer.get_extra_info("ssl_object").getpeercert(True))
        # A new certificate at the same paths, then the reload.
        second_cert, second_key = development_certificate(tmp_path / "second")
        shutil.copy(second_cert, first / "dev-cert.pem")
        shutil.copy(second_key, first / "dev-key.pem")
        assert "tls: certificate" in rt.reload(rt.config)
        new_trust = ssl.create_default_context(cafile=str(second_cert))
        async with httpx.AsyncClient(
            base_url=f"https://localhost:{port}", verify=new_trust
        ) as http:
            assert (await http.get("/healthz")).status_code == 200
        _, new_writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=new_trust, server_hostname="localhost"
        )
        after = serial_of(new_writer.get_extra_info("ssl_object").getpeercert(True))
        new_writer.close()
        assert after != before
        # The old connection still answers.
        writer.write(GET_HEALTHZ)
        assert (await asyncio.wait_for(reader.read(12), 10)) == b"HTTP/1.1 200"
        writer.close()


async def test_turn_and_https_share_one_port(tmp_path: Path) -> None:
    """One TLS port: HTTP by ALPN (``http/1.1``) and without ALPN (first
    bytes), TURN by ALPN (``stun.turn``) and without (coturn's uclient and
    crossroads' client send none)."""
    async with https_runtime(tmp_path, share_with_turn=True) as (rt, port, trust):
        cafile = tmp_path / "dev-cert.pem"
        for alpn in (None, ["h2", "http/1.1"]):
            answer, selected = await raw_request(
                port, trusting(cafile, alpn), GET_HEALTHZ
            )
            assert answer.startswith(b"HTTP/1.1 200"), (alpn, answer)
            assert selected == (None if alpn is None else "http/1.1")
        async with httpx.AsyncClient(
            base_url=f"https://localhost:{port}", verify=trust
        ) as http:
            assert (await http.get("/healthz")).status_code == 200
        # TURN over TLS on the same port, crossroads' client (no ALPN)...
        assert turn_service(rt).stun.tls_addresses == [("127.0.0.1", port)]
        sock, task = await udp_echo()
        try:
            # (A fresh context: httpx set ALPN http/1.1 on ``trust``.)
            async with await TurnClient.connect(
                ("127.0.0.1", port),
                USER,
                PASSWORD,
                transport="tcp",
                tls=trusting(cafile),
            ) as client:
                await exercise(client, sock.getsockname())
            # ...the same with ALPN stun.turn (RFC 7443)...
            turn_alpn = trusting(cafile, ["stun.turn"])
            async with await TurnClient.connect(
                ("127.0.0.1", port), USER, PASSWORD, transport="tcp", tls=turn_alpn
            ) as client:
                await exercise(client, sock.getsockname())
        finally:
            task.cancel()
            sock.close()
        # ...and coturn's uclient, a real third-party TURN-over-TLS client.
        output = await uclient(
            "-y", "-t", "-S", "-u", USER, "-w", PASSWORD,
            "-m", "2", "-n", "10", "-z", "10", "-l", "100", "-p", str(port),
            "127.0.0.1",
        )  # fmt: skip
        assert "method=TLSv1." in output
        assert_no_loss(output)


async def test_shared_port_refuses_what_is_neither(tmp_path: Path) -> None:
    async with https_runtime(tmp_path, share_with_turn=True) as (rt, port, trust):
        answer, _ = await raw_request(port, trust, b"\xff\xfe junk\r\n\r\n")
        assert answer == b""
        async with httpx.AsyncClient(verify=trust) as http:
            page = (await http.get(f"https://localhost:{port}/metrics")).text

        async def counted() -> bool:
            return rt.resources.admissions["http"].closes.get("tls-sort-unknown") == 1

        await eventually(counted, "the unknown first byte counted")
        async with httpx.AsyncClient(verify=trust) as http:
            page = (await http.get(f"https://localhost:{port}/metrics")).text
        assert 'reason="tls-sort-unknown"' in page
