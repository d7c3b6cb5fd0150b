"""Hostile DTLS clients against a DtlsListener (crossroads.transport.dtls):
ClientHello floods get only HelloVerifyRequests and create nothing, forged
cookies and truncated records are dropped and counted, renegotiation is
refused without ending the session, slow handshakes are cut, caps hold, and a
certificate that expired is never served (docs/security.md, "DTLS")."""

from __future__ import annotations

import asyncio
import datetime
import shutil
from pathlib import Path

from crossroads.proto.dtls.wire import HandshakeType
from crossroads.proto.dtls_cookie import RECORD_HEADER_SIZE, parse_client_hello
from crossroads.transport.tls import (
    DEV_CERT_LIFETIME,
    Certificates,
    development_certificate,
)
from tests.conftest import eventually
from tests.dtls_support import (  # noqa: F401 (fixture)
    MakeServer,
    connect,
    echo,
    echo_tables,
    flight,
    make_dtls_server_fixture,
    memory_client,
    raw_socket,
    served_serial,
)
from tests.tls_support import s_client, serial


async def recv(sock: object, size: int = 65536) -> bytes:
    return await asyncio.to_thread(sock.recv, size)  # type: ignore[attr-defined]


async def test_a_client_hello_flood_gets_only_small_hello_verify_requests(
    make_dtls_server: MakeServer,
) -> None:
    """500 ClientHellos from 50 source ports: each is answered by one
    HelloVerifyRequest no larger than itself, and no session, handshake slot
    or memory per client exists afterwards."""
    server = await make_dtls_server()
    hellos = [flight(memory_client()) for _ in range(10)]
    sockets = [raw_socket() for _ in range(50)]
    try:
        for sock in sockets:
            for hello in hellos:
                sock.sendto(hello, ("127.0.0.1", server.port))
        for sock in sockets:
            for hello in hellos:
                reply = await recv(sock)
                assert len(reply) <= len(hello)
                assert reply[0] == 22 and reply[RECORD_HEADER_SIZE] == (
                    HandshakeType.HELLO_VERIFY_REQUEST
                )
    finally:
        for sock in sockets:
            sock.close()
    listener = server.listener
    assert listener.hello_verify_requests == 500
    assert listener.sessions == {} and listener.tables.sessions.live == 0
    assert listener.tables.handshakes.live == 0 and listener.handshakes == 0


async def test_forged_cookies_are_counted_and_challenged_again(
    make_dtls_server: MakeServer,
) -> None:
    server = await make_dtls_server()
    client = memory_client()
    hello = flight(client)
    sock = raw_socket()
    try:
        sock.sendto(hello, ("127.0.0.1", server.port))
        verify = await recv(sock)
        client.bio_write(verify)
        second = flight(client)
        parsed = parse_client_hello(second)
        assert parsed is not None and parsed.cookie
        # Same ClientHello, one cookie byte flipped.
        at = second.index(parsed.cookie)
        forged = second[:at] + bytes([second[at] ^ 1]) + second[at + 1 :]
        sock.sendto(forged, ("127.0.0.1", server.port))
        again = await recv(sock)
        assert again[RECORD_HEADER_SIZE] == HandshakeType.HELLO_VERIFY_REQUEST
        # A cookie made for another source port is refused too.
        other = raw_socket()
        try:
            other.sendto(second, ("127.0.0.1", server.port))
            assert (await recv(other))[RECORD_HEADER_SIZE] == (
                HandshakeType.HELLO_VERIFY_REQUEST
            )
        finally:
            other.close()
    finally:
        sock.close()
    assert server.drops["dtls-cookie-invalid"] == 2
    assert server.listener.sessions == {}


async def test_truncated_and_stray_records_are_dropped_and_counted(
    make_dtls_server: MakeServer, tmp_path: Path
) -> None:
    server = await make_dtls_server()
    sock = raw_socket()
    address = ("127.0.0.1", server.port)
    try:
        hello = flight(memory_client())
        sock.sendto(hello[:40], address)  # a ClientHello cut short
        sock.sendto(b"\x17\xfe\xfd" + bytes(10) + b"x" * 30, address)  # no session
        sock.sendto(b"GET / HTTP/1.1\r\n\r\n", address)  # not DTLS (RFC 7983)
        await server.counted("dtls-bad-client-hello")
        await server.counted("dtls-no-session")
        await server.counted("dtls-not-dtls")
        # Inside a live session: truncated and garbage records are discarded
        # (RFC 6347 §4.1.2.7) and the session goes on.
        client, inbox = await connect(server.port, tmp_path / "dev" / "dev-cert.pem")
        try:
            await echo(client, inbox)
            assert client.udp is not None
            client.udp.sendto(b"\x17\xfe\xfd\x00\x01" + bytes(6) + b"\x00\x40" + b"x")
            client.udp.sendto(
                b"\x17\xfe\xfd\x00\x01" + bytes(6) + b"\x00\x20" + bytes(32)
            )
            client.udp.sendto(b"\x15\xfe\xfd\x00\x01" + bytes(6) + b"\x00\x02\x02")
            await echo(client, inbox, b"still here")
        finally:
            client.close()
    finally:
        sock.close()
    assert server.listener.handshakes == 1


async def test_renegotiation_is_refused(make_dtls_server: MakeServer) -> None:
    """openssl s_client -dtls1_2 asking to renegotiate (``R``) gets no second
    handshake: the server answers no_renegotiation (OP_NO_RENEGOTIATION)."""
    server = await make_dtls_server()
    _, text = await s_client(server.port, "-dtls1_2", stdin=b"R\n")
    assert "RENEGOTIATING" in text, text
    assert "no renegotiation" in text, text
    assert server.listener.handshakes == 1


async def test_dtls_1_0_is_refused_with_an_alert(make_dtls_server: MakeServer) -> None:
    """RFC 8996: DTLS 1.0 is refused with a protocol_version alert (after
    the cookie round trip), so a client that offers it gives up at once."""
    server = await make_dtls_server()
    code, text = await s_client(server.port, "-dtls1", "-cipher", "DEFAULT:@SECLEVEL=0")
    assert code != 0
    assert "protocol version" in text or "unsupported protocol" in text, text
    await server.counted("dtls-handshake-failed")
    assert server.listener.sessions == {}


async def test_slow_handshakes_are_cut_and_counted(
    make_dtls_server: MakeServer,
) -> None:
    """A client that proves its address and then stops is cut at the handshake
    deadline; its slot is freed."""
    server = await make_dtls_server(tables=echo_tables(handshake_timeout=0.5))
    client = memory_client()
    sock = raw_socket()
    try:
        sock.sendto(flight(client), ("127.0.0.1", server.port))
        client.bio_write(await recv(sock))
        sock.sendto(flight(client), ("127.0.0.1", server.port))
        assert len(await recv(sock)) > 200  # the server's first flight

        async def started() -> bool:
            return len(server.listener.sessions) == 1

        await eventually(started, "a session being set up")
        await server.counted("dtls-handshake-timeout")
    finally:
        sock.close()
    assert server.listener.sessions == {}
    assert server.listener.tables.handshakes.live == 0


async def test_session_and_handshake_caps_hold(
    make_dtls_server: MakeServer, tmp_path: Path
) -> None:
    cafile = tmp_path / "dev" / "dev-cert.pem"
    server = await make_dtls_server(tables=echo_tables(max_sessions_per_source=2))
    clients = [await connect(server.port, cafile) for _ in range(2)]
    try:
        try:
            third = await connect(server.port, cafile)
        except ConnectionError:
            pass
        else:
            third[0].close()
            raise AssertionError("a third session from one IP")
        await server.counted("dtls-session-ip-limit")
        for client, inbox in clients:
            await echo(client, inbox)
    finally:
        for client, _ in clients:
            client.close()
    # Handshakes in progress per IP.
    limited = await make_dtls_server(tables=echo_tables(max_handshakes_per_source=1))
    first, second = memory_client(), memory_client()
    socks = [raw_socket(), raw_socket()]
    try:
        for client, sock in zip((first, second), socks, strict=True):
            sock.sendto(flight(client), ("127.0.0.1", limited.port))
            client.bio_write(await recv(sock))
            sock.sendto(flight(client), ("127.0.0.1", limited.port))
        await limited.counted("dtls-handshake-ip-limit")
        assert len(limited.listener.sessions) == 1
    finally:
        for sock in socks:
            sock.close()


async def test_a_fresh_client_hello_replaces_a_live_session(
    make_dtls_server: MakeServer, tmp_path: Path
) -> None:
    """RFC 6347 §4.2.8: a client that restarted on the same address gets a
    new handshake (after the cookie round trip) and the old session goes."""
    cafile = tmp_path / "dev" / "dev-cert.pem"
    server = await make_dtls_server()
    client, inbox = await connect(server.port, cafile)
    local = client.udp.get_extra_info("sockname") if client.udp else None
    assert local is not None
    assert client.udp is not None
    client.udp.abort()  # no close_notify: a crash

    async def gone() -> bool:
        return inbox.closed

    await eventually(gone, "the client socket closed")
    again, inbox2 = await connect(server.port, cafile, local=(local[0], local[1]))
    try:
        await echo(again, inbox2)
    finally:
        again.close()
    assert server.listener.handshakes == 2


async def test_an_expired_certificate_is_never_served(
    make_dtls_server: MakeServer, tmp_path: Path
) -> None:
    """A reload with an expired certificate is refused and DTLS keeps the old
    one; a valid reload reaches new handshakes while live sessions go on."""
    first = development_certificate(tmp_path / "first")
    expired = development_certificate(
        tmp_path / "expired",
        now=datetime.datetime.now(datetime.UTC) - DEV_CERT_LIFETIME * 2,
    )
    second = development_certificate(tmp_path / "second")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    shutil.copy(first[0], cert)
    shutil.copy(first[1], key)
    certificates = Certificates(cert, key)
    server = await make_dtls_server(certificates=certificates)

    live, inbox = await connect(server.port, first[0])
    try:
        shutil.copy(expired[0], cert)
        shutil.copy(expired[1], key)
        assert not certificates.reload()
        assert await served_serial(server.port, first[0]) == serial(first[0])
        shutil.copy(second[0], cert)
        shutil.copy(second[1], key)
        assert certificates.reload()
        # The DTLS context was built at the reload, from the files it checked:
        # files replaced afterwards (without a SIGHUP) are not read.
        shutil.copy(expired[0], cert)
        shutil.copy(expired[1], key)
        assert await served_serial(server.port, second[0]) == serial(second[0])
        await echo(live, inbox, b"live session kept")
    finally:
        live.close()
