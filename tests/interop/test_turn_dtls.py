"""TURN over DTLS (RFC 8656 §3, RFC 7350: UDP 5349) with coturn's
``turnutils_uclient -S`` (no ``-t``: DTLS over UDP) against crossroads: 0 lost
packets with channels, Send indications and client to client. The certificate
is a development certificate made by the test. And crossroads' own TURN
client over DTLS, against crossroads and against coturn's ``turnserver``."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from crossroads.client.turn import TurnClient, TurnClientError
from crossroads.runtime import Runtime
from crossroads.transport.dtls import DtlsHandshakeError, client_context
from crossroads.transport.tls import development_certificate
from tests.conftest import eventually
from tests.dtls_support import served_serial
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
    coturn_with_user,
    echo_peer,
    exercise,
    expire_everything,
    turn_runtime,
    turn_service,
    uclient,
)

pytestmark = [pytest.mark.interop, pytest.mark.timeout(90)]


async def dtls_runtime(make: TurnRuntime, directory: Path) -> tuple[Runtime, int]:
    runtime = await runtime_with_certificate(make, directory)
    service = turn_service(runtime)
    (listener,) = service.dtls_listeners
    tls_port = service.stun.tls_addresses[0][1]
    # The same port number as TURN over TLS (RFC 8656 §3), as coturn does.
    assert listener.local == ("127.0.0.1", tls_port)
    return runtime, tls_port


@pytest.mark.parametrize(
    "flags", [["-c"], ["-s", "-c"]], ids=["channels", "send-indications"]
)
async def test_uclient_over_dtls_to_peer(
    turn_runtime: TurnRuntime,  # noqa: F811
    echo_peer: Callable[..., Awaitable[int]],  # noqa: F811
    tmp_path: Path,
    flags: list[str],
) -> None:
    runtime, port = await dtls_runtime(turn_runtime, tmp_path)
    service = turn_service(runtime)
    peer = await echo_peer("127.0.0.1")
    output = await uclient(
        *flags, "-e", "127.0.0.1", "-r", str(peer), "-u", USER, "-w", PASSWORD,
        *secure_args(port), "127.0.0.1",
    )  # fmt: skip
    # uclient picks DTLS 1.0 or 1.2 at random per connection; 1.0 is refused
    # (RFC 8996) with a protocol_version alert, and uclient retries until 1.2.
    assert "method=DTLSv1.2" in output and "method=DTLSv1 " not in output
    assert_no_loss(output)
    to_peer, _, to_client, _, _ = service.counters()
    assert to_peer >= 20 and to_client >= 20
    (listener,) = service.dtls_listeners
    # uclient really spoke DTLS: every client completed a handshake after a
    # cookie round trip, and nothing went to the plain UDP port.
    assert listener.handshakes >= 2
    assert listener.hello_verify_requests >= listener.handshakes
    assert service.stun.udp_endpoints[0].requests == 0
    # uclient leaves its allocations (and DTLS sessions, no close_notify)
    # behind: when the allocations expire, the sessions end with them.
    assert listener.sessions
    expire_everything(service)
    await sessions_ended(runtime)


async def sessions_ended(runtime: Runtime) -> None:
    service = turn_service(runtime)
    (listener,) = service.dtls_listeners

    async def ended() -> bool:
        return not service.core.allocations and not listener.sessions

    await eventually(ended, "allocations and DTLS sessions ended")
    assert listener.tables.sessions.live == 0
    assert listener.tables.handshakes.live == 0


async def test_uclient_over_dtls_client_to_client(
    turn_runtime: TurnRuntime,  # noqa: F811
    tmp_path: Path,
) -> None:
    runtime, port = await dtls_runtime(turn_runtime, tmp_path)
    output = await uclient(
        "-y", "-u", USER, "-w", PASSWORD, *secure_args(port), "127.0.0.1"
    )
    assert_no_loss(output)
    (listener,) = turn_service(runtime).dtls_listeners
    assert listener.handshakes >= 2


async def test_crossroads_client_over_dtls_sees_its_own_address(
    turn_runtime: TurnRuntime,  # noqa: F811
    tmp_path: Path,
) -> None:
    """crossroads' own client over DTLS: the relay works both ways, the
    allocation's five-tuple holds the real client address, a wrong password
    gets 401 over DTLS too, and a client that does not trust the certificate
    fails the handshake."""
    runtime, port = await dtls_runtime(turn_runtime, tmp_path)
    trust = client_context(str(tmp_path / "dev-cert.pem"))
    async with echoing_peer() as peer:
        async with await TurnClient.connect(
            ("127.0.0.1", port), USER, PASSWORD, dtls=trust
        ) as client:
            await exercise(client, peer)
            assert client.mapped == client.local_address
        # Refresh(0) was answered, then the session ended with the allocation.
        await sessions_ended(runtime)
        drops = turn_service(runtime).stun.stats.drops
        assert drops.get("dtls-send-no-session", 0) == 0, drops
        async with await TurnClient.connect(
            ("127.0.0.1", port), USER, "wrong", dtls=trust
        ) as client:
            with pytest.raises(TurnClientError) as excinfo:
                await client.allocate()
            assert excinfo.value.code == 401
        with pytest.raises(DtlsHandshakeError):
            await TurnClient.connect(
                ("127.0.0.1", port), USER, PASSWORD, dtls=client_context(), timeout=5
            )
        with pytest.raises(DtlsHandshakeError, match="does not name"):
            await TurnClient.connect(
                ("127.0.0.1", port),
                USER,
                PASSWORD,
                dtls=trust,
                server_hostname="turn.example.org",
            )
    drops = turn_service(runtime).stun.stats.drops

    async def counted() -> bool:
        return drops.get("dtls-handshake-failed", 0) >= 1

    await eventually(counted, "the refused handshake counted")


async def test_crossroads_client_over_dtls_against_coturn(
    coturn: Callable[..., Coturn], tmp_path: Path
) -> None:
    cert, key = development_certificate(tmp_path)
    server = await coturn_with_user(coturn, tls=(cert, key), dtls=True)
    await exercise_once_up(
        lambda: TurnClient.connect(
            ("127.0.0.1", server.tls_port),
            USER,
            PASSWORD,
            dtls=client_context(str(cert)),
            server_hostname="localhost",
            timeout=2,
        ),
        DtlsHandshakeError,
        "coturn's DTLS listener answers",
    )


async def test_sighup_reloads_the_dtls_certificate_and_keeps_sessions(
    crossroads_serve: Callable[..., CrossroadsProcess], tmp_path: Path
) -> None:
    """`crossroads serve` describes its DTLS listener on the TLS port number;
    after the files change and SIGHUP, new DTLS handshakes get the new
    certificate while an allocation made over DTLS before it still relays."""

    async def dtls_port(server: CrossroadsProcess) -> int:
        described: list[int] = []

        async def dtls_described() -> bool:
            log = server.log.read_text()
            found = re.search(r"udp 127\.0\.0\.1:(\d+) \(dtls\)", log)
            if found:
                described.append(int(found.group(1)))
            return bool(found)

        await eventually(dtls_described, "the DTLS listener in the startup lines")
        assert server.endpoint("tls")[1] == described[0]
        return described[0]

    async def connect(port: int, cafile: Path) -> TurnClient:
        return await TurnClient.connect(
            ("127.0.0.1", port), USER, PASSWORD, dtls=client_context(str(cafile))
        )

    await reload_keeps_relaying(
        crossroads_serve,
        tmp_path,
        listener_port=dtls_port,
        served_serial=served_serial,
        connect=connect,
    )
