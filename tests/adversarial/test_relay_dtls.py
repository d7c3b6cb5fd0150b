"""Hostile DTLS traffic against the relay's DTLS port: bounded and counted.

- ClientHello floods get only HelloVerifyRequests (no state before the cookie
  round trip; never larger than the hello);
- garbage and truncated records are dropped and counted;
- renegotiation inside a session is refused, the session goes on;
- slow (half-open) handshakes are capped per IP and time out.
"""

from __future__ import annotations

import asyncio
import base64
import os
import socket
from typing import Any

import httpx
import pytest

from crossroads.proto.dtls import wire as w
from crossroads.proto.dtls.client import PskDtlsClient
from crossroads.proto.dtls.handshake import Established, HandshakeFailed
from tests.conftest import eventually
from tests.dtls_psk_support import DtlsPeer
from tests.e2e.relay_support import (
    allocate,
    api,
    base_url,
    endpoint_address,
    metric,
    raw_bind,
    relay_runtime,
)
from tests.proto.dtls.support import CLIENT, Wire, make_client, make_server

pytestmark = pytest.mark.timeout(60)


async def metrics(rt: Any) -> str:
    async with httpx.AsyncClient(base_url=base_url(rt)) as http:
        return (await http.get("/metrics")).text


def first_hello() -> bytes:
    client = PskDtlsClient(("192.0.2.1", 1), b"x", bytes(64), os.urandom)
    client.start(0.0)
    ((hello, _),) = client.datagrams_to_send(0.0)
    return hello


async def test_client_hello_flood_gets_only_small_verify_requests() -> None:
    async with relay_runtime() as rt, api(rt) as http:
        server = endpoint_address(await allocate(http, 1), "dtls")
        socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(50)]
        loop = asyncio.get_running_loop()
        try:
            sizes: list[tuple[int, int]] = []
            for sock in socks:
                sock.bind(("127.0.0.1", 0))
                sock.setblocking(False)
                hello = first_hello()
                sock.sendto(hello, server)
                answer = await asyncio.wait_for(loop.sock_recv(sock, 2048), 5)
                sizes.append((len(hello), len(answer)))
                (record,), bad = w.split_records(answer)
                assert bad is None
                assert w.decode_fragments(record.fragment)[0].msg_type == (
                    w.HandshakeType.HELLO_VERIFY_REQUEST
                )
            assert all(reply <= request for request, reply in sizes)
            page = await metrics(rt)
            assert (
                metric(page, "crossroads_relay_dtls_hello_verify_requests_total") >= 50
            )
            assert metric(page, "crossroads_relay_dtls_handshakes") == 0
            assert metric(page, "crossroads_relay_dtls_sessions") == 0
        finally:
            for sock in socks:
                sock.close()


async def test_garbage_and_truncated_records_are_counted_and_harmless() -> None:
    async with relay_runtime() as rt, api(rt) as http:
        alloc = await allocate(http, 1)
        server = endpoint_address(alloc, "dtls")
        hello = first_hello()
        junk = [
            b"",
            os.urandom(300),
            hello[:20],  # truncated record
            b"\x16\xfe\xfd" + bytes(8) + b"\xff\xff",  # length beyond the datagram
            b"\x63" + hello[1:],  # no such content type
            b"\x17\xfe\xfd\x00\x01" + bytes(6) + b"\x00\x04abcd",  # data, no session
        ]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.bind(("127.0.0.1", 0))
            for data in junk:
                sock.sendto(data, server)

            async def counted() -> bool:
                page = await metrics(rt)
                return all(
                    metric(
                        page, "crossroads_relay_dtls_dropped_records_total", reason=r
                    )
                    >= 1
                    for r in ("truncated", "bad-content-type", "no-session")
                )

            await eventually(counted, "the drops counted by reason")
        key = base64.b64decode(alloc["key"])
        peer = DtlsPeer(server, base64.b64decode(alloc["allocationIdBytes"]), key)
        try:
            assert isinstance(await peer.handshake(), Established)
        finally:
            peer.close()


async def test_renegotiation_is_refused_and_the_session_survives() -> None:
    async with relay_runtime() as rt, api(rt) as http:
        alloc = await allocate(http, 1)
        server = endpoint_address(alloc, "dtls")
        peer = DtlsPeer(
            server,
            base64.b64decode(alloc["allocationIdBytes"]),
            base64.b64decode(alloc["key"]),
        )
        try:
            assert isinstance(await peer.handshake(), Established)
            writer = peer.core._write  # no public API sends a renegotiation
            assert writer is not None
            hello = w.handshake_message(
                w.HandshakeType.CLIENT_HELLO, 4, first_hello()[25:]
            )
            peer.sock.sendto(writer.seal(w.ContentType.HANDSHAKE, 40, hello), server)
            await peer.pump(2.0)
            page = await metrics(rt)
            assert (
                metric(
                    page,
                    "crossroads_relay_dtls_dropped_records_total",
                    reason="renegotiation",
                )
                == 1
            )
            assert metric(page, "crossroads_relay_dtls_sessions") == 1
            assert peer.established
        finally:
            peer.close()


async def half_open(
    server: tuple[str, int], sock: socket.socket, timeout: float = 5.0
) -> None:
    """Pass the cookie exchange, take the ServerHello flight, then go silent."""
    loop = asyncio.get_running_loop()
    client = PskDtlsClient(server, b"slow", bytes(64), os.urandom)
    client.start(0.0)
    ((hello, _),) = client.datagrams_to_send(0.0)
    sock.sendto(hello, server)
    verify = await asyncio.wait_for(loop.sock_recv(sock, 2048), 5)
    client.receive_datagram(verify, server, 0.0)
    ((second, _),) = client.datagrams_to_send(0.0)
    sock.sendto(second, server)
    await asyncio.wait_for(loop.sock_recv(sock, 2048), timeout)


async def test_slow_handshakes_are_capped_per_ip() -> None:
    async with relay_runtime() as rt, api(rt) as http:
        alloc = await allocate(http, 1)
        server = endpoint_address(alloc, "dtls")
        socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(10)]
        try:
            for sock in socks[:8]:
                sock.bind(("127.0.0.1", 0))
                sock.setblocking(False)
                await half_open(server, sock)
            page = await metrics(rt)
            assert metric(page, "crossroads_relay_dtls_handshakes") == 8
            # The ninth from the same IP passes the cookie but gets no state.
            sock = socks[8]
            sock.bind(("127.0.0.1", 0))
            sock.setblocking(False)
            with pytest.raises(TimeoutError):
                await half_open(server, sock, timeout=1.0)
            page = await metrics(rt)
            assert metric(page, "crossroads_relay_dtls_handshakes") == 8
            assert (
                metric(
                    page,
                    "crossroads_relay_dtls_dropped_records_total",
                    reason="handshake-cap",
                )
                >= 1
            )
        finally:
            for sock in socks:
                sock.close()


def only_hellos(data: bytes) -> bool:
    """Let only ClientHellos through: the handshake stays half-open."""
    (first, *_), _ = w.split_records(data)
    return first.epoch == 0 and first.fragment[:1] == b"\x01"


def test_half_open_handshakes_time_out_and_free_their_slot() -> None:
    server = make_server(handshake_timeout=15.0, max_handshakes_per_ip=1)
    silent = Wire(make_client(), server)
    silent.to_server = only_hellos
    silent.handshake()
    assert CLIENT in server.handshakes
    silent.advance(16.0)
    assert CLIENT not in server.handshakes
    assert server.failures["handshake-timeout"] == 1
    assert HandshakeFailed(CLIENT, "handshake-timeout") in server.pop_events()
    fresh = Wire(make_client(), server, addr=(CLIENT[0], CLIENT[1] + 1))
    fresh.now = silent.now
    fresh.handshake()
    assert (CLIENT[0], CLIENT[1] + 1) in server.sessions


def test_global_handshake_cap() -> None:
    server = make_server(max_handshakes=3, max_handshakes_per_ip=100)
    for port in range(5):
        wire = Wire(make_client(), server, addr=("203.0.113.5", 1000 + port))
        wire.to_server = only_hellos
        wire.handshake()
    assert len(server.handshakes) == 3
    assert server.drops["handshake-cap"] == 2


def test_client_hellos_from_one_source_are_rate_limited() -> None:
    server = make_server(hello_rate=50.0, hello_burst=200.0)
    hello = first_hello()
    for port in range(300):
        server.receive_datagram(hello, ("198.51.100.7", 2000 + port), 0.0)
    assert len(server.datagrams_to_send(0.0)) == 200
    assert server.drops["hello-rate"] == 100
    # Another source is not affected; the bucket refills with time.
    server.receive_datagram(hello, ("198.51.100.8", 2000), 0.0)
    server.receive_datagram(hello, ("198.51.100.7", 2000), 1.0)
    assert len(server.datagrams_to_send(1.0)) == 2


async def test_a_session_that_does_not_bind_ends_and_one_that_binds_stays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A completed handshake proves the client was given a key, but only a
    BIND makes the session worth keeping: a silent session ends (close_notify)
    at the first-message deadline (1 s here instead of 10), counted in
    dtls-sessions:relay; one that bound stays past it."""
    monkeypatch.setattr("crossroads.services.relay_dtls.FIRST_MESSAGE_TIMEOUT", 1.0)
    async with relay_runtime() as rt, api(rt) as http:
        silent_alloc, bound_alloc = await allocate(http, 1), await allocate(http, 1)
        server = endpoint_address(silent_alloc, "dtls")
        peers = [
            DtlsPeer(
                server,
                base64.b64decode(alloc["allocationIdBytes"]),
                base64.b64decode(alloc["key"]),
            )
            for alloc in (silent_alloc, bound_alloc)
        ]
        silent, bound = peers
        try:
            for peer in peers:
                assert isinstance(await peer.handshake(), Established)
            bound.send(raw_bind(bound_alloc, nonce=0))
            assert (await bound.recv())[:4] == b"\xda\x72\x00\x01"  # BIND_RECEIVED
            assert await silent.closed(timeout=5.0)
            await bound.pump(1.5)
            assert bound.established
            page = await metrics(rt)
            assert metric(page, "crossroads_relay_dtls_sessions") == 1
            row = rt.resources.admissions["dtls-sessions:relay"].row()
            assert row["closed"] == {"first-message-timeout": 1}
            assert row["live"] == 1 and row["preauth_deadline"] == 1.0
        finally:
            for peer in peers:
                peer.close()
