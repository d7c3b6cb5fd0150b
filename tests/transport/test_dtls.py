"""The DTLS session layer (crossroads.transport.dtls): record splitting and
datagram packing, certificate name checks of the client side, and an echo
through a DtlsListener over IPv4 and IPv6 with records of every size TURN uses."""

from __future__ import annotations

import datetime
import ipaddress
import socket
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from hypothesis import given
from hypothesis import strategies as st

from crossroads.proto.dtls.certificate_client import (
    HANDSHAKE_MTU,
    certificate_names_match,
    pack_datagrams,
    split_records,
)
from crossroads.proto.reflection import ReflectionBudget
from crossroads.transport.dtls import (
    MAX_PLAINTEXT,
    DtlsListener,
    client_context,
    dtls_connect,
    open_dtls_listener,
)
from crossroads.transport.tls import (
    Certificates,
    development_certificate,
)
from tests.dtls_support import (  # noqa: F401 (fixture)
    Inbox,
    MakeServer,
    connect,
    echo,
    echo_tables,
    make_dtls_server_fixture,
)


def record(body: bytes, content: int = 23) -> bytes:
    return bytes([content, 0xFE, 0xFD]) + bytes(8) + len(body).to_bytes(2, "big") + body


@given(st.lists(st.binary(max_size=1500), max_size=20))
def test_records_split_and_pack_without_splitting_one(bodies: list[bytes]) -> None:
    records = [record(body) for body in bodies]
    assert split_records(b"".join(records)) == records
    datagrams = pack_datagrams(records)
    assert b"".join(datagrams) == b"".join(records)
    for datagram in datagrams:
        parts = split_records(datagram)
        # A datagram is at most the MTU unless it holds one larger record.
        assert len(datagram) <= HANDSHAKE_MTU or len(parts) == 1


def certificate(*names: x509.GeneralName) -> x509.Certificate:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "t")])
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
    )
    if names:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(list(names)), critical=False
        )
    return builder.sign(key, hashes.SHA256())


def test_certificate_names() -> None:
    cert = certificate(
        x509.DNSName("turn.example.org"),
        x509.DNSName("*.relay.example.org"),
        x509.IPAddress(ipaddress.ip_address("203.0.113.5")),
    )
    assert certificate_names_match(cert, "turn.example.org")
    assert certificate_names_match(cert, "TURN.example.org.")
    assert certificate_names_match(cert, "eu1.relay.example.org")
    assert certificate_names_match(cert, "203.0.113.5")
    assert not certificate_names_match(cert, "a.b.relay.example.org")
    assert not certificate_names_match(cert, "relay.example.org")
    assert not certificate_names_match(cert, "example.org")
    assert not certificate_names_match(cert, "203.0.113.6")
    assert not certificate_names_match(certificate(), "turn.example.org")


async def test_echo_of_every_turn_size(
    make_dtls_server: MakeServer, tmp_path: Path
) -> None:
    """Datagrams from 1 byte to the largest record are one record each way;
    larger ones are refused and counted, the session goes on."""
    server = await make_dtls_server()
    client, inbox = await connect(server.port, tmp_path / "dev" / "dev-cert.pem")
    try:
        for size in (1, 100, 1200, 1500, 4000, MAX_PLAINTEXT - 100):
            await echo(client, inbox, bytes([size & 0xFF]) * size)
        # The server cannot encrypt more than one record's worth.
        server.listener.send(b"x" * (MAX_PLAINTEXT + 1), client_address(client))
        await server.counted("dtls-send-failed")
        server.listener.send(b"x", ("127.0.0.1", 9))
        await server.counted("dtls-send-no-session")
        await echo(client, inbox, b"still here")
    finally:
        client.close()
    assert server.listener.handshakes == 1


def client_address(client: object) -> tuple[str, int]:
    udp = client.udp
    name = udp.get_extra_info("sockname")
    return name[0], name[1]


async def test_ipv6(tmp_path: Path) -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    certificates = Certificates(*development_certificate(tmp_path))
    delivered: list[tuple[bytes, tuple[str, int]]] = []

    def deliver(data: bytes, client: tuple[str, int], listener: DtlsListener) -> None:
        delivered.append((data, client))
        listener.send(data, client)

    listener = DtlsListener(
        certificates,
        deliver,
        echo_tables(),
        lambda reason: None,
        ReflectionBudget(),
    )
    await open_dtls_listener("::1", 0, True, listener)
    inbox = Inbox()
    client = await dtls_connect(
        ("::1", listener.local[1]),
        client_context(str(certificates.cert)),
        inbox.deliver,
        inbox.lost,
    )
    try:
        client.send(b"over ipv6")
        assert await inbox.get() == b"over ipv6"
        assert delivered[0][1][0] == "::1" and len(delivered[0][1]) == 2
    finally:
        client.close()
        listener.close()
