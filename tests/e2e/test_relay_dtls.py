"""End to end: Unity Relay over DTLS 1.2 (PSK) through a real runtime.

The clients are crossroads' sans-I/O DTLS client on real sockets; the relay
messages are built by hand (tests/e2e/relay_support.py), not with crossroads'
relay codec. Interop with OpenSSL and GnuTLS is in tests/interop/test_relay_dtls.py.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import os
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from crossroads.client.relay import RelayApi, RelayConnection, RelayConnectionError
from crossroads.proto.dtls.handshake import Established, HandshakeFailed
from crossroads.proto.relay.token import TokenSealer
from crossroads.services.relay import RelayService
from tests.conftest import eventually, running_service
from tests.dtls_psk_support import DtlsPeer
from tests.e2e.relay_support import (
    API_KEY,
    BIND_RECEIVED,
    RawPeer,
    allocate_pair,
    allocation_id,
    api,
    base_url,
    endpoint_address,
    metric,
    raw_accepted,
    raw_bind,
    raw_connect,
    raw_relay,
    relay_runtime,
)

pytestmark = pytest.mark.timeout(60)


async def request(peer: DtlsPeer, data: bytes, attempts: int = 3) -> bytes:
    """Send one relay message and wait for the answer, resending on loss."""
    for attempt in range(attempts):
        peer.send(data)
        try:
            return await peer.recv(timeout=2.0)
        except TimeoutError:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def ids(allocation: dict[str, Any]) -> tuple[bytes, bytes]:
    """(raw allocationIdBytes, 64-byte key)."""
    return (
        allocation_id(allocation),
        base64.b64decode(allocation["key"]),
    )


@dataclass
class Session:
    """A DTLS host and a plain UDP joiner, bound and connected."""

    host: DtlsPeer
    joiner: RawPeer
    hid: bytes
    jid: bytes


@asynccontextmanager
async def dtls_host_udp_joiner(http: httpx.AsyncClient) -> AsyncIterator[Session]:
    host_alloc, join_alloc = await allocate_pair(http)
    hid, host_key = ids(host_alloc)
    jid, _ = ids(join_alloc)
    host = DtlsPeer(endpoint_address(host_alloc, "dtls"), hid, host_key)
    joiner = RawPeer(endpoint_address(join_alloc, "udp"))
    try:
        assert isinstance(await host.handshake(), Established)
        assert await request(host, raw_bind(host_alloc, nonce=0)) == BIND_RECEIVED
        assert await joiner.request(raw_bind(join_alloc, nonce=0)) == BIND_RECEIVED
        host_data = base64.b64decode(join_alloc["hostConnectionData"])
        assert await joiner.request(raw_connect(jid, host_data)) == (
            raw_accepted(hid, jid)
        )
        yield Session(host, joiner, hid, jid)
    finally:
        host.close()
        joiner.close()


async def test_allocations_list_a_secure_dtls_endpoint() -> None:
    async with relay_runtime() as rt, api(rt) as http:
        body = (await http.post("/v1/allocate", json={"maxConnections": 1})).json()
        endpoints = body["data"]["allocation"]["serverEndpoints"]
        by_type = {e["connectionType"]: e for e in endpoints}
        assert by_type["dtls"]["network"] == "udp"
        assert by_type["dtls"]["secure"] is True
        assert by_type["dtls"]["reliable"] is False
        assert by_type["udp"]["secure"] is False
        assert by_type["dtls"]["host"] == by_type["udp"]["host"]
        assert by_type["dtls"]["port"] != by_type["udp"]["port"]


async def test_no_dtls_endpoint_when_disabled() -> None:
    async with relay_runtime(relay__dtls=False) as rt, api(rt) as http:
        body = (await http.post("/v1/allocate", json={"maxConnections": 1})).json()
        kinds = [
            e["connectionType"] for e in body["data"]["allocation"]["serverEndpoints"]
        ]
        assert kinds == ["udp"]


async def test_host_and_joiner_relay_both_ways_through_dtls() -> None:
    async with relay_runtime() as rt, api(rt) as http:
        host_alloc, join_alloc = await allocate_pair(http)
        hid, host_key = ids(host_alloc)
        jid, join_key = ids(join_alloc)
        server = endpoint_address(host_alloc, "dtls")
        # Unity Transport's identity: the 16 raw bytes; Unity's docs: the text.
        host = DtlsPeer(server, hid, host_key)
        joiner = DtlsPeer(server, join_alloc["allocationId"].encode(), join_key)
        try:
            assert isinstance(await host.handshake(), Established)
            assert isinstance(await joiner.handshake(), Established)
            assert await request(host, raw_bind(host_alloc, nonce=0)) == BIND_RECEIVED
            assert await request(joiner, raw_bind(join_alloc, nonce=0)) == BIND_RECEIVED
            host_data = base64.b64decode(join_alloc["hostConnectionData"])
            assert await request(joiner, raw_connect(jid, host_data)) == (
                raw_accepted(hid, jid)
            )
            for size in (0, 1, 100, 1200):
                payload = os.urandom(size)
                joiner.send(raw_relay(jid, hid, payload))
                assert await host.recv() == raw_relay(jid, hid, payload)
                host.send(raw_relay(hid, jid, payload))
                assert await joiner.recv() == raw_relay(hid, jid, payload)
            # Reference §1.4: every datagram a Unity client receives <= 1400 bytes.
            for peer in (host, joiner):
                assert peer.datagrams
                assert max(len(d) for d in peer.datagrams) <= 1400
        finally:
            host.close()
            joiner.close()


async def test_dtls_host_and_plain_udp_joiner_share_a_session() -> None:
    async with relay_runtime() as rt, api(rt) as http:
        async with dtls_host_udp_joiner(http) as pair:
            host, joiner, hid, jid = pair.host, pair.joiner, pair.hid, pair.jid
            joiner.send(raw_relay(jid, hid, b"to the dtls host"))
            assert await host.recv() == raw_relay(jid, hid, b"to the dtls host")
            host.send(raw_relay(hid, jid, b"to the udp joiner"))
            assert await joiner.recv() == raw_relay(hid, jid, b"to the udp joiner")


async def test_plaintext_from_a_dtls_clients_address_is_refused() -> None:
    async with relay_runtime() as rt, api(rt) as http:
        host_alloc, join_alloc = await allocate_pair(http)
        hid, host_key = ids(host_alloc)
        jid, join_key = ids(join_alloc)
        server = endpoint_address(host_alloc, "dtls")
        host = DtlsPeer(server, hid, host_key)
        joiner = DtlsPeer(server, jid, join_key)
        try:
            for peer, alloc in ((host, host_alloc), (joiner, join_alloc)):
                assert isinstance(await peer.handshake(), Established)
                assert await request(peer, raw_bind(alloc, nonce=0)) == BIND_RECEIVED
            host_data = base64.b64decode(join_alloc["hostConnectionData"])
            assert await request(joiner, raw_connect(jid, host_data)) == (
                raw_accepted(hid, jid)
            )
            # The same source address, in clear, on the plain UDP port: a
            # spoofer must not speak for an encrypted client.
            joiner.sock.sendto(
                raw_relay(jid, hid, b"forged"), endpoint_address(host_alloc, "udp")
            )
            joiner.send(raw_relay(jid, hid, b"genuine"))
            assert await host.recv() == raw_relay(jid, hid, b"genuine")
            async with httpx.AsyncClient(base_url=base_url(rt)) as plain:
                page = (await plain.get("/metrics")).text
            assert (
                metric(
                    page,
                    "crossroads_relay_dtls_dropped_records_total",
                    reason="plaintext-from-dtls-client",
                )
                == 1
            )
            assert host.received == []
        finally:
            host.close()
            joiner.close()


async def test_wrong_key_fails_the_handshake() -> None:
    async with relay_runtime() as rt, api(rt) as http:
        host_alloc, _ = await allocate_pair(http)
        hid, key = ids(host_alloc)
        wrong = bytes(b ^ 1 for b in key)
        peer = DtlsPeer(endpoint_address(host_alloc, "dtls"), hid, wrong)
        try:
            result = await peer.handshake()
            assert isinstance(result, HandshakeFailed)
            assert result.reason == "alert-20"  # bad_record_mac
        finally:
            peer.close()
        # And an identity that names no allocation: unknown_psk_identity.
        stranger = DtlsPeer(endpoint_address(host_alloc, "dtls"), b"not-an-id", key)
        try:
            result = await stranger.handshake()
            assert isinstance(result, HandshakeFailed)
            assert result.reason == "alert-115"
        finally:
            stranger.close()


async def test_uuid_text_identity_must_be_canonical() -> None:
    async with relay_runtime() as rt, api(rt) as http:
        host_alloc, _ = await allocate_pair(http)
        _, key = ids(host_alloc)
        text = str(uuid.UUID(host_alloc["allocationId"])).upper().encode()
        peer = DtlsPeer(endpoint_address(host_alloc, "dtls"), text, key)
        try:
            assert isinstance(await peer.handshake(), Established)
        finally:
            peer.close()


async def test_a_closed_dtls_session_ends_its_allocation_without_clear_text() -> None:
    async with relay_runtime() as rt, api(rt) as http:
        async with dtls_host_udp_joiner(http) as pair:
            host, joiner, hid, jid = pair.host, pair.joiner, pair.hid, pair.jid
            service = running_service(rt, "relay", RelayService)
            assert len(service.sessions()) == 2
            host.core.close(0.0)
            host.flush()

            async def host_gone() -> bool:
                return len(service.sessions()) == 0  # type: ignore[attr-defined]

            await eventually(host_gone, "the host's allocation ended with its session")
            # The joiner hears DISCONNECT; the host's socket gets nothing in clear.
            assert await joiner.recv() == b"\xda\x72\x00\x09" + hid + jid
            joiner.send(raw_relay(jid, hid, b"after the end"))
            assert await host.sock_silent()
            assert all(not d.startswith(b"\xda\x72") for d in host.datagrams)


async def test_a_frame_too_big_for_a_dtls_datagram_is_dropped_and_counted() -> None:
    async with relay_runtime() as rt, api(rt) as http:
        async with dtls_host_udp_joiner(http) as pair:
            host, joiner, hid, jid = pair.host, pair.joiner, pair.hid, pair.jid
            # 1400 - 37 bytes of AES-GCM record overhead = 1363 per relay message.
            joiner.send(raw_relay(jid, hid, bytes(1363 - 38 + 1)))
            joiner.send(raw_relay(jid, hid, bytes(1363 - 38)))
            assert await host.recv() == raw_relay(jid, hid, bytes(1363 - 38))
            async with httpx.AsyncClient(base_url=base_url(rt)) as plain:
                page = (await plain.get("/metrics")).text
            assert (
                metric(
                    page,
                    "crossroads_relay_dtls_dropped_records_total",
                    reason="oversize",
                )
                == 1
            )


async def test_the_offered_suites_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="crossroads.relay")
    async with relay_runtime() as rt, api(rt) as http:
        host_alloc, _ = await allocate_pair(http)
        hid, key = ids(host_alloc)
        peer = DtlsPeer(
            endpoint_address(host_alloc, "dtls"), hid, key, cipher_suites=(0xC0A4,)
        )
        try:
            assert isinstance(await peer.handshake(), Established)
        finally:
            peer.close()
    assert any(
        "offers suites [PSK-AES128-CCM, 0x00FF]" in r.getMessage()
        and "chosen PSK-AES128-CCM" in r.getMessage()
        for r in caplog.records
    )


async def test_allocations_keyed_under_a_previous_secret_still_connect() -> None:
    old_secret = b"an-old-secret-0123456789"
    async with relay_runtime(relay__secret=old_secret.decode()) as rt, api(rt) as http:
        host_alloc, _ = await allocate_pair(http)
        hid, key = ids(host_alloc)
        node = running_service(rt, "relay", RelayService).node
        # What RelayService does when it adopts another process's secret.
        node.core.sealer = TokenSealer(
            b"the-adopted-secret-98765", os.urandom, [old_secret]
        )
        peer = DtlsPeer(endpoint_address(host_alloc, "dtls"), hid, key)
        try:
            assert isinstance(await peer.handshake(), Established)
            assert await request(peer, raw_bind(host_alloc, nonce=0)) == BIND_RECEIVED
        finally:
            peer.close()


async def test_crossroads_relay_client_over_dtls() -> None:
    async with relay_runtime() as rt, RelayApi(base_url(rt), API_KEY) as relay_api:
        allocation = await relay_api.allocate(max_connections=2)
        assert allocation.dtls_server is not None
        code = await relay_api.join_code(allocation.allocation_id)
        host = await RelayConnection.open(allocation, secure=True)
        await host.bind()
        joined = await relay_api.join(code)
        player = await RelayConnection.open(joined, secure=True)
        await player.bind()
        assert await player.connect() == allocation.allocation_id_bytes
        player.send(host.allocation_id, b"over dtls")
        assert await host.recv(timeout=5) == (player.allocation_id, b"over dtls")
        host.send(player.allocation_id, b"and back")
        assert await player.recv(timeout=5) == (host.allocation_id, b"and back")
        # A NAT rebinding: a new socket needs a new DTLS session, then a re-BIND.
        await player.migrate("127.0.0.1")
        player.rebind()
        player.send(host.allocation_id, b"from the new address")

        async def arrived() -> bool:
            try:
                got = await host.recv(timeout=0.2)
            except TimeoutError:
                player.send(host.allocation_id, b"from the new address")
                return False
            return got == (player.allocation_id, b"from the new address")

        await eventually(arrived, "a frame from the migrated DTLS player")
        dtls = running_service(rt, "relay", RelayService).node.dtls
        assert dtls is not None and len(dtls.endpoint.core.sessions) == 3
        for connection in (player, host):
            await connection.close()


async def test_crossroads_relay_client_with_a_wrong_key_fails() -> None:
    async with relay_runtime() as rt, RelayApi(base_url(rt), API_KEY) as relay_api:
        allocation = await relay_api.allocate(max_connections=1)
        forged = dataclasses.replace(allocation, key=bytes(64))
        host = await RelayConnection.open(forged, secure=True)
        try:
            with pytest.raises(RelayConnectionError, match="alert-20"):
                await host.bind(timeout=10)
        finally:
            await host.close()
