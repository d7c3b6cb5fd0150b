"""The certificate DTLS server core and the client core, driven against each
other in memory with a fake clock: cookies before state, a handshake, data
both ways, and the first-message deadline."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from crossroads.proto.admission import LocalTable
from crossroads.proto.dtls.certificate_client import ClientState, Connected, DtlsClient
from crossroads.proto.dtls.certificate_server import DtlsServer
from crossroads.proto.dtls.handshake import ApplicationData, Closed
from crossroads.proto.dtls_cookie import CookieJar
from crossroads.proto.reflection import ReflectionBudget
from crossroads.transport.dtls import client_context, server_context
from crossroads.transport.tls import Certificates, development_certificate

SERVER = ("192.0.2.10", 5349)
CLIENT = ("198.51.100.7", 40000)
FIRST_MESSAGE_TIMEOUT = 10.0


def pair(tmp_path: Path) -> tuple[DtlsServer, DtlsClient, Counter[str]]:
    certificates = Certificates(*development_certificate(tmp_path))
    drops: Counter[str] = Counter()
    server = DtlsServer(
        server_context(certificates),
        LocalTable(),
        LocalTable(),
        lambda reason: drops.update([reason]),
        ReflectionBudget(),
        CookieJar(b"k" * 32),
        handshake_timeout=10.0,
        first_message_timeout=FIRST_MESSAGE_TIMEOUT,
        first_message=lambda data: data.startswith(b"valid"),
    )
    client = DtlsClient(client_context(verify=False), SERVER)
    return server, client, drops


def carry(server: DtlsServer, client: DtlsClient, now: float) -> None:
    """Datagrams both ways until neither core has anything to send."""
    while True:
        to_server = client.datagrams_to_send(now)
        for data, _ in to_server:
            server.receive_datagram(data, CLIENT, now)
        to_client = server.datagrams_to_send(now)
        for data, addr in to_client:
            assert addr == CLIENT
            client.receive_datagram(data, SERVER, now)
        if not to_server and not to_client:
            return


def test_a_hello_without_a_cookie_keeps_nothing(tmp_path: Path) -> None:
    server, client, _ = pair(tmp_path)
    client.start(0.0)
    [(hello, _)] = client.datagrams_to_send(0.0)
    server.receive_datagram(hello, CLIENT, 0.0)
    [(verify, addr)] = server.datagrams_to_send(0.0)
    assert addr == CLIENT and len(verify) < len(hello)  # no amplification
    assert server.hello_verify_requests == 1
    assert not server.sessions
    assert server.get_timer() is None


def test_handshake_data_and_first_message(tmp_path: Path) -> None:
    server, client, drops = pair(tmp_path)
    client.start(0.0)
    carry(server, client, 0.0)
    assert [type(e) for e in client.pop_events()] == [Connected]
    assert server.handshakes == 1 and CLIENT in server.sessions

    assert client.send(b"valid allocate", 0.5)
    carry(server, client, 0.5)
    assert server.pop_events() == [ApplicationData(CLIENT, b"valid allocate")]
    assert server.send(b"answer", CLIENT)
    carry(server, client, 0.6)
    assert client.pop_events() == [ApplicationData(SERVER, b"answer")]

    # Proved: the first-message deadline no longer applies.
    now = 0.6
    while (deadline := server.get_timer()) is not None and deadline < 30.0:
        now = deadline
        server.handle_timer(now)
    assert CLIENT in server.sessions
    assert not drops


def test_a_silent_session_is_ended_at_its_first_message_deadline(
    tmp_path: Path,
) -> None:
    server, client, drops = pair(tmp_path)
    client.start(0.0)
    carry(server, client, 0.0)
    assert client.state is ClientState.CONNECTED
    client.pop_events()
    assert client.send(b"not a valid first message", 1.0)
    carry(server, client, 1.0)
    server.pop_events()  # delivered all the same

    now = 1.0
    while CLIENT in server.sessions:
        deadline = server.get_timer()
        assert deadline is not None and deadline <= FIRST_MESSAGE_TIMEOUT + 2.0
        now = deadline
        server.handle_timer(now)
    assert drops["dtls-first-message-timeout"] == 1
    carry(server, client, now)  # the close_notify
    assert client.pop_events() == [Closed(SERVER, "close-notify")]
    assert server.get_timer() is None
