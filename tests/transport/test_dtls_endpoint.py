"""The DTLS endpoint on a real socket: it reads through the data plane's tap
(no read loop of its own) and, on a wildcard bind, answers from the address
each client dialled."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest

from crossroads.proto.dtls.handshake import ApplicationData, Established, Event
from crossroads.proto.dtls.server import PskDtlsServer, PskDtlsServerConfig
from crossroads.transport.dtls_endpoint import PskDtlsEndpoint
from tests.conftest import eventually
from tests.dtls_psk_support import DtlsPeer

pytestmark = pytest.mark.timeout(30)

IDENTITY = b"player"
PSK = bytes(range(32))


def psk_for(identity: bytes) -> tuple[bytes, ...]:
    return (PSK,) if identity == IDENTITY else ()


@pytest.fixture
def wildcard_socket() -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", 0))
    sock.setblocking(False)
    yield sock
    sock.close()


async def test_a_wildcard_endpoint_answers_from_the_address_dialled(
    wildcard_socket: socket.socket,
) -> None:
    """The client dials 127.0.0.2 (any 127/8 address is the loopback's); by
    route the kernel would answer from 127.0.0.1, and the client drops a
    datagram from anywhere but its server: the handshake and an echo complete
    only when every reply leaves from 127.0.0.2."""
    events: list[Event] = []
    core = PskDtlsServer(PskDtlsServerConfig(), psk_for, os.urandom)
    endpoint = PskDtlsEndpoint(core, wildcard_socket, events.extend)
    endpoint.start()
    peer = DtlsPeer(("127.0.0.2", wildcard_socket.getsockname()[1]), IDENTITY, PSK)
    try:
        assert isinstance(await peer.handshake(), Established)
        peer.send(b"ping")

        async def echoed() -> bool:
            return any(isinstance(e, ApplicationData) for e in events)

        await eventually(echoed, "the server core got the record")
        (echo,) = [e for e in events if isinstance(e, ApplicationData)]
        assert echo.data == b"ping" and echo.address == peer.address
        endpoint.send_to(peer.address, b"pong")
        assert await peer.recv() == b"pong"
        # Every datagram went through the tap's fallback, none was routed.
        assert endpoint.tap.forwarded == 0 and endpoint.tap.malformed == 0
        assert peer.address in endpoint.sessions
    finally:
        peer.close()
        endpoint.close()
