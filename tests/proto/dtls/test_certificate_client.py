"""The certificate DTLS client core, driven in memory: its datagrams go to an
OpenSSL server on memory BIOs and back, with the time passed in."""

from __future__ import annotations

import time
from pathlib import Path

from OpenSSL import SSL

from crossroads.proto.dtls.certificate_client import (
    HANDSHAKE_MTU,
    READ_SIZE,
    ClientState,
    Connected,
    DtlsClient,
    pack_datagrams,
    split_records,
)
from crossroads.proto.dtls.handshake import ApplicationData, Closed, HandshakeFailed
from crossroads.transport.dtls import client_context
from crossroads.transport.tls import development_certificate

SERVER = ("127.0.0.1", 5349)


class MemoryServer:
    """OpenSSL's DTLS server end on memory BIOs (no cookie exchange)."""

    def __init__(self, directory: Path) -> None:
        cert, key = development_certificate(directory)
        context = SSL.Context(SSL.DTLS_SERVER_METHOD)
        context.set_options(SSL.OP_NO_QUERY_MTU)
        context.use_certificate_chain_file(str(cert))
        context.use_privatekey_file(str(key))
        self.cafile = str(cert)
        self.connection = SSL.Connection(context)
        self.connection.set_ciphertext_mtu(HANDSHAKE_MTU)
        self.connection.set_accept_state()
        self.received: list[bytes] = []

    def receive(self, datagram: bytes) -> list[bytes]:
        self.connection.bio_write(datagram)
        try:
            self.connection.do_handshake()
            while True:
                self.received.append(self.connection.recv(READ_SIZE))
        except (SSL.WantReadError, SSL.ZeroReturnError):
            pass
        return self.pending()

    def pending(self) -> list[bytes]:
        try:
            data = self.connection.bio_read(READ_SIZE)
        except SSL.WantReadError:
            return []
        return pack_datagrams(split_records(data))


def exchange(client: DtlsClient, server: MemoryServer, now: float) -> None:
    """Carry datagrams both ways until neither side has anything to send."""
    while True:
        out = client.datagrams_to_send(now)
        if not out:
            return
        for data, addr in out:
            assert addr == SERVER
            for reply in server.receive(data):
                client.receive_datagram(reply, SERVER, now)


def test_a_handshake_then_data_both_ways(tmp_path: Path) -> None:
    server = MemoryServer(tmp_path)
    client = DtlsClient(
        client_context(server.cafile), SERVER, server_hostname="localhost"
    )
    client.start(0.0)
    assert client.get_timer() is not None  # the flight's retransmission
    exchange(client, server, 0.0)
    events = client.pop_events()
    assert [type(e) for e in events] == [Connected]
    assert client.state is ClientState.CONNECTED
    assert client.get_timer() is None

    assert client.send(b"allocate", 0.1)
    exchange(client, server, 0.1)
    assert server.received == [b"allocate"]
    server.connection.send(b"success")
    for datagram in server.pending():
        client.receive_datagram(datagram, SERVER, 0.2)
    assert client.pop_events() == [ApplicationData(SERVER, b"success")]

    client.close(0.3)
    assert client.pop_events() == [Closed(SERVER, "closed")]
    [(alert, _)] = client.datagrams_to_send(0.3)  # the close_notify
    assert alert[0] == 21  # an alert record
    assert not client.send(b"late", 0.4)


def test_a_certificate_that_does_not_name_the_server_fails(tmp_path: Path) -> None:
    server = MemoryServer(tmp_path)
    client = DtlsClient(
        client_context(server.cafile), SERVER, server_hostname="turn.example.org"
    )
    client.start(0.0)
    exchange(client, server, 0.0)
    [failed] = client.pop_events()
    assert isinstance(failed, HandshakeFailed)
    assert "does not name turn.example.org" in failed.reason
    assert client.state is ClientState.FAILED
    assert client.get_timer() is None
    assert not client.send(b"allocate", 1.0)


def test_a_lost_flight_is_sent_again_when_the_timer_fires(tmp_path: Path) -> None:
    server = MemoryServer(tmp_path)
    client = DtlsClient(client_context(verify=False), SERVER)
    client.start(100.0)
    hello = client.datagrams_to_send(100.0)
    assert hello  # lost on the way
    deadline = client.get_timer()
    assert deadline is not None and deadline > 100.0
    # OpenSSL keeps its own clock for this timer: let it run out for real.
    time.sleep(deadline - 100.0 + 0.05)
    client.handle_timer(deadline)
    again = client.datagrams_to_send(deadline)
    assert again  # the ClientHello once more (RFC 6347 §4.2.4)
    for data, _ in again:
        for reply in server.receive(data):
            client.receive_datagram(reply, SERVER, deadline)
    exchange(client, server, deadline)
    assert [type(e) for e in client.pop_events()] == [Connected]
