"""TURN over TLS (RFC 8656 §3, port 5349) with real third-party programs, both
ways: coturn's ``turnutils_uclient -S -t`` against crossroads (channels, Send
indications, client-to-client, RFC 6062 TCP relays; 0 lost packets), and
crossroads' TURN client over TLS against coturn's ``turnserver`` with a
certificate. The certificate is a development certificate made by the test."""

from __future__ import annotations

import asyncio
import datetime
import os
import ssl
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from cryptography import x509

from crossroads.client.turn import TurnClient, TurnClientError
from crossroads.proto.stun.attributes import ResponseOrigin, XorMappedAddress
from crossroads.proto.stun.constants import Method
from crossroads.proto.stun.message import decode, encode, request
from crossroads.runtime import Runtime
from crossroads.transport.tls import DEV_CERT_LIFETIME, development_certificate
from tests.conftest import eventually
from tests.interop.secure_turn_support import (
    echoing_peer,
    exercise_once_up,
    reload_keeps_relaying,
    runtime_with_certificate,
    secure_args,
)
from tests.interop.stun_support import (  # noqa: F401 (fixtures)
    Coturn,
    CrossroadsProcess,
    coturn_fixture,
    crossroads_serve_fixture,
)
from tests.interop.test_turn import (  # noqa: F401 (fixtures)
    PASSWORD,
    USER,
    TurnRuntime,
    assert_no_loss,
    assert_released,
    coturn_with_user,
    echo_peer,
    exercise,
    settle,
    turn_runtime,
    turn_service,
    uclient,
)

pytestmark = [pytest.mark.interop, pytest.mark.timeout(90)]


async def tls_runtime(make: TurnRuntime, directory: Path) -> tuple[Runtime, int]:
    runtime = await runtime_with_certificate(make, directory)
    addresses = turn_service(runtime).stun.tls_addresses
    assert len(addresses) == 1 and addresses[0][0] == "127.0.0.1"
    return runtime, addresses[0][1]


@pytest.mark.parametrize(
    "flags", [["-t", "-c"], ["-t", "-s", "-c"]], ids=["channels", "send-indications"]
)
async def test_uclient_over_tls_to_peer(
    turn_runtime: TurnRuntime,  # noqa: F811
    echo_peer: Callable[..., Awaitable[int]],  # noqa: F811
    tmp_path: Path,
    flags: list[str],
) -> None:
    runtime, port = await tls_runtime(turn_runtime, tmp_path)
    service = turn_service(runtime)
    peer = await echo_peer("127.0.0.1")
    output = await uclient(
        *flags, "-e", "127.0.0.1", "-r", str(peer), "-u", USER, "-w", PASSWORD,
        *secure_args(port), "127.0.0.1",
    )  # fmt: skip
    assert "method=TLSv1." in output  # uclient really spoke TLS
    assert_no_loss(output)
    to_peer, _, to_client, _, _ = service.counters()
    assert to_peer >= 20 and to_client >= 20
    assert_released(service)


async def test_uclient_over_tls_client_to_client(
    turn_runtime: TurnRuntime,  # noqa: F811
    tmp_path: Path,
) -> None:
    runtime, port = await tls_runtime(turn_runtime, tmp_path)
    output = await uclient(
        "-y", "-t", "-u", USER, "-w", PASSWORD, *secure_args(port), "127.0.0.1"
    )
    assert_no_loss(output)
    assert_released(turn_service(runtime))


async def test_uclient_tcp_relay_rfc6062_over_tls(
    turn_runtime: TurnRuntime,  # noqa: F811
    tmp_path: Path,
) -> None:
    runtime, port = await tls_runtime(turn_runtime, tmp_path)
    service = turn_service(runtime)
    output = await uclient(
        "-T", "-u", USER, "-w", PASSWORD, *secure_args(port), "127.0.0.1"
    )
    assert_no_loss(output)
    await settle(service)
    assert_released(service)
    assert service.peer_pipes == {} and service.client_pipes == {}


async def test_crossroads_client_over_tls_sees_its_own_address(
    turn_runtime: TurnRuntime,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The allocation's five-tuple holds the real client address (per-source
    limits apply to it), the relay works both ways, a wrong password gets 401
    over TLS too, and an untrusting client fails the handshake."""
    runtime, port = await tls_runtime(turn_runtime, tmp_path)
    trust = ssl.create_default_context(cafile=str(tmp_path / "dev-cert.pem"))
    async with echoing_peer() as peer:
        async with await TurnClient.connect(
            ("127.0.0.1", port), USER, PASSWORD, transport="tcp", tls=trust
        ) as client:
            await exercise(client, peer)
            assert client.mapped == client.local_address
        async with await TurnClient.connect(
            ("127.0.0.1", port), USER, "wrong", transport="tcp", tls=trust
        ) as client:
            with pytest.raises(TurnClientError) as excinfo:
                await client.allocate()
            assert excinfo.value.code == 401
        with pytest.raises(ssl.SSLCertVerificationError):
            await TurnClient.connect(
                ("127.0.0.1", port),
                USER,
                PASSWORD,
                transport="tcp",
                tls=ssl.create_default_context(),
            )
    drops = turn_service(runtime).stun.stats.drops

    async def counted() -> bool:
        return drops.get("tls-handshake-failed", 0) == 1

    await eventually(counted, "the refused handshake counted")


async def test_crossroads_client_over_tls_against_coturn(
    coturn: Callable[..., Coturn], tmp_path: Path
) -> None:
    cert, key = development_certificate(tmp_path)
    server = await coturn_with_user(coturn, tls=(cert, key))
    trust = ssl.create_default_context(cafile=str(cert))
    await exercise_once_up(
        lambda: TurnClient.connect(
            ("127.0.0.1", server.tls_port),
            USER,
            PASSWORD,
            transport="tcp",
            tls=trust,
            server_hostname="localhost",
        ),
        ConnectionRefusedError,
        "coturn's TLS listener accepts",
    )


async def served_serial(port: int, cafile: Path | None = None) -> int:
    """The serial number of the certificate a new handshake on ``port`` gets
    (read without verifying it: ``cafile`` is not needed)."""
    insecure = ssl.create_default_context()
    insecure.check_hostname = False
    insecure.verify_mode = ssl.CERT_NONE
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=insecure)
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        return x509.load_der_x509_certificate(der).serial_number
    finally:
        writer.close()


async def test_sighup_reloads_the_certificate_and_keeps_allocations(
    crossroads_serve: Callable[..., CrossroadsProcess], tmp_path: Path
) -> None:
    """`crossroads serve`: after the files change and SIGHUP, new handshakes
    get the new certificate while an allocation made over TLS before it still
    relays both ways."""

    async def tls_port(server: CrossroadsProcess) -> int:
        return server.endpoint("tls")[1]

    async def connect(port: int, cafile: Path) -> TurnClient:
        trust = ssl.create_default_context(cafile=str(cafile))
        return await TurnClient.connect(
            ("127.0.0.1", port), USER, PASSWORD, transport="tcp", tls=trust
        )

    server = await reload_keeps_relaying(
        crossroads_serve,
        tmp_path,
        listener_port=tls_port,
        served_serial=served_serial,
        connect=connect,
    )
    assert "TLS certificate reloaded" in server.log.read_text()


async def test_serve_refuses_an_expired_certificate(tmp_path: Path) -> None:
    expired = datetime.datetime.now(datetime.UTC) - DEV_CERT_LIFETIME * 2
    cert, key = development_certificate(tmp_path, now=expired)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "crossroads", "serve", "--only", "stun,turn",
        "--host", "127.0.0.1", "--http-port", "0", "--stun-port", "0",
        "--stun-alt-port", "0", "--turn-tls-port", "0",
        "--tls-cert", str(cert), "--tls-key", str(key),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 2
    assert b"config error: tls_cert:" in out and b"expired on" in out


async def test_binding_over_tls_names_the_client_and_no_plain_port(
    turn_runtime: TurnRuntime,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A Binding request over TLS is answered with the client's real address,
    and without RFC 5780's RESPONSE-ORIGIN (which would name the UDP/TCP port)."""
    _, port = await tls_runtime(turn_runtime, tmp_path)
    trust = ssl.create_default_context(cafile=str(tmp_path / "dev-cert.pem"))
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=trust)
    try:
        writer.write(encode(request(Method.BINDING, os.urandom(12))))
        header = await asyncio.wait_for(reader.readexactly(20), 10)
        body = await reader.readexactly(int.from_bytes(header[2:4], "big"))
        answer = decode(header + body)
        mapped = answer.get(XorMappedAddress)
        assert mapped is not None
        local = writer.get_extra_info("sockname")
        assert (mapped.host, mapped.port) == (local[0], local[1])
        assert answer.get(ResponseOrigin) is None
    finally:
        writer.close()
