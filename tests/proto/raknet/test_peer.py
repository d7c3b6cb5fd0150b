"""The RakNet server core in memory with a fake clock: handshake bytes, caps,
floods, liveness; an in-memory client built from the same reliability layer."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crossroads.proto.raknet import messages as m
from crossroads.proto.raknet.peer import (
    Connected,
    Disconnected,
    MessageReceived,
    OutOfBandReceived,
    RakNetServer,
    ServerConfig,
)
from crossroads.proto.raknet.reliability import Frame, Reliability
from tests.proto.raknet.support import CLIENT, Client, ocr2

SERVER_GUID = 0x1122334455667788


def new_server(**overrides: object) -> RakNetServer:
    return RakNetServer(ServerConfig(**overrides), guid=SERVER_GUID)  # type: ignore[arg-type]


def test_open_connection_request_1_gets_a_28_byte_reply_with_the_mtu() -> None:
    server = new_server()
    server.receive_datagram(m.OpenConnectionRequest1(6, 1200).encode(), CLIENT, 0.0)
    ((reply, addr),) = server.datagrams_to_send(0.0)
    assert addr == CLIENT and len(reply) == 28
    assert reply == b"\x06" + m.MAGIC + SERVER_GUID.to_bytes(8, "big") + b"\x00" + (
        1200
    ).to_bytes(2, "big")


def test_other_protocol_versions_get_incompatible_protocol_version() -> None:
    server = new_server()
    server.receive_datagram(m.OpenConnectionRequest1(11, 1492).encode(), CLIENT, 0.0)
    ((reply, _),) = server.datagrams_to_send(0.0)
    assert reply == b"\x19\x06" + m.MAGIC + SERVER_GUID.to_bytes(8, "big")
    assert server.stats.dropped["protocol-version"] == 1


def test_open_connection_request_2_gets_a_35_byte_reply_with_the_address_seen() -> None:
    server = new_server()
    server.receive_datagram(ocr2(42), CLIENT, 0.0)
    ((reply, _),) = server.datagrams_to_send(0.0)
    assert len(reply) == 35 and reply[0] == 0x08
    assert reply[25:32] == bytes.fromhex("04") + bytes(
        b ^ 0xFF for b in bytes([198, 51, 100, 7])
    ) + (50000).to_bytes(2, "big")


def test_full_handshake_and_messages_both_ways() -> None:
    server = new_server()
    client = Client(server)
    client.connect()
    (event,) = server.pop_events()
    assert event == Connected(42, CLIENT, (("192.168.1.20", 50000),))
    assert not client.inbox
    accepted = client.accepted
    assert len(accepted) == 96 and accepted[1:8] == bytes.fromhex("0439cc9bf8c350")
    client.send(b"\x86ping", 1.1)
    assert server.pop_events() == [MessageReceived(42, CLIENT, b"\x86ping")]
    assert server.send(CLIENT, b"\x86pong" * 1000, now=1.2)
    client.pump(1.2)
    assert client.inbox[-1] == b"\x86pong" * 1000
    client.send(bytes([m.MessageId.DISCONNECTION_NOTIFICATION]), 1.3)
    assert server.pop_events() == [Disconnected(42, CLIENT, "closed")]
    assert not server.connections


def test_connected_ping_is_answered_from_the_same_clock() -> None:
    server = new_server()
    client = Client(server)
    client.connect(5.0)
    client.send(m.connected_ping(777), 5.25)
    pong = client.inbox[-1]
    assert pong == m.connected_pong(777, 5250)


def test_unconnected_ping_gets_a_pong_no_larger() -> None:
    server = new_server(offline_ping_response=b"x" * 500)
    ping = b"\x01" + (99).to_bytes(8, "big") + m.MAGIC + (5).to_bytes(8, "big")
    server.receive_datagram(ping, CLIENT, 0.0)
    ((pong, _),) = server.datagrams_to_send(0.0)
    assert pong[:9] == b"\x1c" + (99).to_bytes(8, "big") and len(pong) <= len(ping)


def test_out_of_band_is_an_event() -> None:
    server = new_server()
    server.receive_datagram(m.OutOfBand(7, b"\x0a\xcb\x20").encode(), CLIENT, 0.0)
    assert server.pop_events() == [OutOfBandReceived(7, CLIENT, b"\x0a\xcb\x20")]


def test_connections_per_ip_and_in_total_are_capped() -> None:
    server = new_server(max_connections=3, max_connections_per_ip=2)
    for port in (1, 2, 3):
        server.receive_datagram(ocr2(port), ("198.51.100.7", port), 0.0)
    refusals = [d for d, _ in server.datagrams_to_send(0.0) if d[0] == 0x14]
    assert len(refusals) == 1 and server.stats.dropped["ip-full"] == 1
    server.receive_datagram(ocr2(9), ("198.51.100.8", 9), 0.0)
    server.receive_datagram(ocr2(10), ("198.51.100.9", 10), 0.0)
    assert server.stats.dropped["server-full"] == 1
    assert len(server.connections) == 3


def test_a_guid_connected_elsewhere_gets_already_connected() -> None:
    server = new_server()
    server.receive_datagram(ocr2(42), CLIENT, 0.0)
    server.receive_datagram(ocr2(42), ("198.51.100.99", 1), 0.0)
    assert [d[0] for d, _ in server.datagrams_to_send(0.0)] == [0x08, 0x12]


def test_handshake_floods_are_rate_limited() -> None:
    server = new_server(handshakes_per_second=10.0)
    for i in range(100):
        server.receive_datagram(
            m.OpenConnectionRequest1(6, 576).encode(), ("198.51.100.7", i), 0.0
        )
    assert len(server.datagrams_to_send(0.0)) == 10
    assert server.stats.dropped["handshake-rate"] == 90


def test_silent_connections_time_out_and_handshakes_expire() -> None:
    server = new_server()
    client = Client(server)
    client.connect(1.0)
    server.receive_datagram(ocr2(77), ("198.51.100.50", 1), 1.0)
    server.pop_events()
    now = 1.0
    while server.get_timer() is not None and now < 30:
        now = max(now, server.get_timer() or now)
        server.handle_timer(now)
        server.datagrams_to_send(now)  # nobody answers
    assert Disconnected(42, CLIENT, "timeout") in server.pop_events()
    assert not server.connections and 11.0 <= now <= 13.0


def test_keepalive_ping_goes_out_after_five_quiet_seconds() -> None:
    server = new_server()
    client = Client(server)
    client.connect(1.0)
    now = 1.0
    while now < 7.0:
        now = server.get_timer() or now + 0.5
        server.handle_timer(now)
        client.pump(now)
    assert any(p[0] == m.MessageId.CONNECTED_PING for p in client.inbox)
    assert server.connection(CLIENT) is not None


def test_limits_close_only_the_offending_connection() -> None:
    server = new_server()
    good = Client(server)
    good.connect(1.0)
    bad = Client(server, ("198.51.100.66", 4000), guid=66)
    bad.connect(1.0)
    server.pop_events()
    # a split message claiming 2^31 fragments
    frame = Frame(Reliability.RELIABLE, b"\x86", 50, split_count=2**31)
    server.receive_datagram(b"\x84\x50\x00\x00" + frame.encode(), bad.addr, 1.5)
    assert server.pop_events() == [Disconnected(66, bad.addr, "limit")]
    assert server.stats.dropped["split-count"] == 1
    good.send(b"\x86still here", 1.6)
    assert server.pop_events() == [MessageReceived(42, CLIENT, b"\x86still here")]


@settings(max_examples=200)
@given(st.binary(max_size=120), st.booleans())
def test_garbage_is_dropped_and_counted(data: bytes, connected: bool) -> None:
    server = new_server()
    if connected:
        Client(server).connect(1.0)
        server.pop_events()
    server.receive_datagram(data, CLIENT, 2.0)
    server.datagrams_to_send(2.0)
    server.handle_timer(server.get_timer() or 2.0)
    for event in server.pop_events():
        assert isinstance(event, MessageReceived | OutOfBandReceived | Disconnected)


@pytest.mark.parametrize(
    "data",
    [
        b"\x05" + m.MAGIC,  # no protocol byte
        b"\x07" + m.MAGIC + b"\x04",  # truncated REQUEST_2
        ocr2(1, mtu=100),  # MTU below RakNet's smallest
        b"\x0d" + bytes(8) + m.MAGIC[:-1],  # truncated magic
    ],
)
def test_malformed_handshakes_are_counted(data: bytes) -> None:
    server = new_server()
    server.receive_datagram(data, CLIENT, 0.0)
    assert server.datagrams_to_send(0.0) == []
    assert sum(server.stats.dropped.values()) == 1


def test_close_sends_disconnection_notification_and_forgets_the_connection() -> None:
    server = new_server()
    client = Client(server)
    client.connect(1.0)
    server.pop_events()
    server.close(CLIENT, 2.0)
    assert server.pop_events() == [Disconnected(42, CLIENT, "local")]
    client.pump(2.0)
    assert client.take(m.MessageId.DISCONNECTION_NOTIFICATION) == [b"\x15"]
    now = 2.0
    while server.connections and now < 5:
        now = server.get_timer() or now + 0.5
        server.handle_timer(now)
        client.pump(now)
    assert not server.connections and now < 3.6
