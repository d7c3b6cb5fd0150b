"""What the TURN-over-TLS and TURN-over-DTLS interop tests share: a runtime
with a development certificate, uclient's secure arguments, a UDP echo peer,
crossroads' client against coturn once coturn's listener is up, and the SIGHUP
certificate reload case. The transport-specific parts (how to connect, how to
read the served certificate) come in as arguments."""

from __future__ import annotations

import asyncio
import shutil
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from crossroads.client.turn import TurnClient
from crossroads.runtime import Runtime
from crossroads.transport.tls import development_certificate
from tests.conftest import eventually
from tests.interop.stun_support import CrossroadsProcess
from tests.interop.test_turn import (
    PASSWORD,
    USER,
    TurnRuntime,
    base_args,
    exercise,
    udp_echo,
)
from tests.tls_support import serial

#: ``connect(port, cafile)``: a TURN client over TLS or DTLS that trusts ``cafile``.
Connect = Callable[[int, Path], Awaitable[TurnClient]]
#: ``served_serial(port, cafile)``: the serial of the certificate a new
#: handshake on ``port`` gets.
ServedSerial = Callable[[int, Path], Awaitable[int]]


async def runtime_with_certificate(make: TurnRuntime, directory: Path) -> Runtime:
    """STUN + TURN in-process with a development certificate written to
    ``directory`` (``dev-cert.pem``): TLS and DTLS listeners on the TLS port."""
    cert, key = development_certificate(directory)
    return await make(core__tls_cert=str(cert), core__tls_key=str(key))


def secure_args(port: int) -> list[str]:
    """uclient's ``-S`` (TLS, or DTLS without ``-t``) and the short run of
    :func:`tests.interop.test_turn.base_args` towards ``port``."""
    return ["-S", *base_args(port)]


@asynccontextmanager
async def echoing_peer() -> AsyncIterator[tuple[str, int]]:
    """A UDP echo socket on loopback, for as long as the block runs."""
    sock, task = await udp_echo()
    try:
        yield sock.getsockname()
    finally:
        task.cancel()
        sock.close()


async def exercise_once_up(
    connect: Callable[[], Awaitable[TurnClient]],
    refused: type[Exception],
    what: str,
) -> None:
    """Connect until coturn's secure listener answers (its start is not
    announced: ``connect`` raises ``refused`` until then), then relay through
    it both ways."""
    clients: list[TurnClient] = []

    async def connected() -> bool:
        try:
            clients.append(await connect())
        except refused:
            return False
        return True

    await eventually(connected, what)
    async with echoing_peer() as peer, clients[0] as client:
        await exercise(client, peer)
        assert client.mapped == client.local_address


async def reload_keeps_relaying(
    crossroads_serve: Callable[..., CrossroadsProcess],
    directory: Path,
    *,
    listener_port: Callable[[CrossroadsProcess], Awaitable[int]],
    served_serial: ServedSerial,
    connect: Connect,
) -> CrossroadsProcess:
    """`crossroads serve` with a certificate; after the files change and
    SIGHUP, new handshakes get the new certificate while a client that
    allocated before it still relays both ways and refreshes."""
    first = development_certificate(directory / "first")
    second = development_certificate(directory / "second")
    cert, key = directory / "cert.pem", directory / "key.pem"
    shutil.copy(first[0], cert)
    shutil.copy(first[1], key)
    server = await asyncio.to_thread(
        crossroads_serve,
        "--only", "stun,turn", "--turn-tls-port", "0",
        "--tls-cert", str(cert), "--tls-key", str(key),
        "--turn-user", f"{USER}:{PASSWORD}", "--allow-loopback-peers",
    )  # fmt: skip
    port = await listener_port(server)
    assert await served_serial(port, first[0]) == serial(first[0])
    async with echoing_peer() as peer, await connect(port, first[0]) as client:
        await exercise(client, peer)
        shutil.copy(second[0], cert)
        shutil.copy(second[1], key)
        server.process.send_signal(signal.SIGHUP)

        async def reloaded() -> bool:
            return await served_serial(port, second[0]) == serial(second[0])

        await eventually(reloaded, "new handshakes get the new certificate")
        await client.send(b"after reload", peer)
        assert await client.receive(timeout=5) == (b"after reload", peer)
        assert await client.refresh() > 0
    assert server.process.poll() is None
    return server
