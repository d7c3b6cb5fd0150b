"""The RakNet server core in memory with a fake clock: handshake bytes, caps,
floods, liveness; an in-memory client built from the same reliability layer."""

from __future__ import annotations

import gc
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crossroads.proto.admission import LocalTable
from crossroads.proto.raknet import messages as m
from crossroads.proto.raknet.bitstream import BitWriter
from crossroads.proto.raknet.node import RakNetNode
from crossroads.proto.raknet.peer import (
    CONNECTION_BYTES,
    HANDSHAKE_BYTES,
    Connected,
    Disconnected,
    MessageReceived,
    OutOfBandReceived,
    RakNetServer,
    ServerConfig,
)
from crossroads.proto.raknet.reliability import Frame, Reliability, decode_ranges
from crossroads.proto.reflection import (
    DEFAULT_ALLOWANCE,
    DROP_REFLECTION,
    ReflectionBudget,
)
from tests.proto.raknet.support import CLIENT, SERVER, Client, Network, ocr2

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
    for port in (1, 2):
        Client(server, ("198.51.100.7", port), guid=port).connect(1.0)
    (refusal,) = Client(server, ("198.51.100.7", 3), guid=3).raw(ocr2(3), 1.0)
    assert refusal[0] == 0x14 and server.stats.dropped["ip-full"] == 1
    Client(server, ("198.51.100.8", 9), guid=9).connect(1.0)
    (refusal,) = Client(server, ("198.51.100.9", 10), guid=10).raw(ocr2(10), 1.0)
    assert refusal[0] == 0x14 and server.stats.dropped["server-full"] == 1
    assert server.connected_count == 3 and not server.handshakes


def test_a_guid_connected_elsewhere_gets_already_connected() -> None:
    server = new_server()
    Client(server).connect(1.0)
    server.receive_datagram(ocr2(42), ("198.51.100.99", 1), 1.0)
    assert [d[0] for d, _ in server.datagrams_to_send(1.0)] == [0x12]


def test_handshake_floods_are_rate_limited() -> None:
    server = new_server(handshakes_per_second=10.0)
    for i in range(100):  # from 100 addresses: the global bucket
        server.receive_datagram(
            m.OpenConnectionRequest1(6, 576).encode(), (f"198.51.100.{i}", 1), 0.0
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


# ---------------------------------------- what a peer holds before NEW_INCOMING


def request_frame(guid: int, reliable: int = 0, order: int = 0) -> Frame:
    writer = BitWriter()
    writer.write_u8(m.MessageId.CONNECTION_REQUEST)
    writer.write_u64(guid)
    writer.write_u64(1234)
    writer.write_bool(False)
    return Frame(Reliability.RELIABLE_ORDERED, writer.data(), reliable, 0, order, 0)


def incoming_frame(reliable: int = 1, order: int = 1) -> Frame:
    writer = BitWriter()
    writer.write_u8(m.MessageId.NEW_INCOMING_CONNECTION)
    for _ in range(11):
        writer.write_address(("0.0.0.0", 0))
    writer.write_u64(1)
    writer.write_u64(2)
    return Frame(Reliability.RELIABLE_ORDERED, writer.data(), reliable, 0, order, 0)


def datagram(number: int, *frames: Frame) -> bytes:
    return b"\x84" + number.to_bytes(3, "little") + b"".join(f.encode() for f in frames)


def run_timers(server: RakNetServer, until: float) -> float:
    now = 0.0
    while server.get_timer() is not None and now < until:
        now = server.get_timer() or now
        server.handle_timer(now)
        server.datagrams_to_send(now)
    return now


def test_request_2_leaves_only_a_record_that_expires_in_five_seconds() -> None:
    server = new_server()
    server.receive_datagram(ocr2(42), CLIENT, 1.0)
    assert server.datagrams_to_send(1.0)[0][0][0] == 0x08
    assert not server.connections and list(server.handshakes) == [CLIENT]
    assert server.handshake_table.live == 1  # type: ignore[attr-defined]
    run_timers(server, 7.0)
    assert not server.handshakes and server.stats.dropped["handshake-deadline"] == 1
    assert server.handshake_table.live == 0  # type: ignore[attr-defined]
    server.receive_datagram(datagram(0, request_frame(42)), CLIENT, 7.0)
    assert not server.connections and server.stats.dropped["unknown-source"] == 1


def test_a_connection_must_complete_within_ten_seconds_whatever_it_sends() -> None:
    """Finding 3: any datagram used to keep a handshake alive."""
    server = new_server()
    server.receive_datagram(ocr2(42), CLIENT, 1.0)
    server.receive_datagram(datagram(0, request_frame(42)), CLIENT, 1.0)
    assert len(server.connections) == 1 and not server.handshakes
    now, number = 1.0, 1
    while server.connections and now < 20.0:
        now += 0.5
        ping = Frame(Reliability.UNRELIABLE, m.connected_ping(int(now * 1000)))
        server.receive_datagram(datagram(number, ping), CLIENT, now)
        number += 1
        server.handle_timer(now)
        server.datagrams_to_send(now)
    assert not server.connections and now <= 11.6
    assert server.stats.dropped["connect-deadline"] == 1
    assert server.connection_table.live == 0  # type: ignore[attr-defined]


def test_nothing_is_held_before_new_incoming_connection() -> None:
    """Finding 2: split parts and frames out of order were buffered for a
    connection that had not completed its handshake."""
    server = new_server()
    server.receive_datagram(ocr2(42), CLIENT, 1.0)
    server.receive_datagram(datagram(0, request_frame(42)), CLIENT, 1.0)
    server.datagrams_to_send(1.0)
    parts = [
        Frame(
            Reliability.RELIABLE,
            bytes(200),
            2 + i,
            split_count=64,
            split_id=i % 16,
            split_index=i // 16,
        )
        for i in range(40)
    ]
    early = [
        Frame(Reliability.RELIABLE_ORDERED, bytes(1000), 50 + i, 0, 5 + i, 0)
        for i in range(20)
    ]
    for i, frame in enumerate(parts + early):
        server.receive_datagram(datagram(1 + i, frame), CLIENT, 1.1)
    out = server.datagrams_to_send(1.1)
    # Held: only what the server sends (its CONNECTION_REQUEST_ACCEPTED,
    # unacknowledged), nothing of what the peer sent.
    layer = server.connections[CLIENT].layer
    assert layer.charged == layer.send_bytes > 0
    assert server.connection_table.buffered == layer.charged  # type: ignore[attr-defined]
    assert server.stats.dropped["held-back-before-connected"] == 60
    # None of them was acknowledged: the sender sends them again.
    acked = [d for d, _ in out if d[0] == 0xC0]
    assert not any(decode_ranges(a, 1) != [(0, 0)] for a in acked)
    # After NEW_INCOMING_CONNECTION the same frames are taken (and charged).
    server.receive_datagram(datagram(100, incoming_frame()), CLIENT, 1.2)
    assert server.connection(CLIENT) is not None
    server.receive_datagram(datagram(101, parts[0]), CLIENT, 1.2)
    assert server.buffered_bytes > 200
    assert server.connection_table.buffered == server.buffered_bytes  # type: ignore[attr-defined]


def test_a_request_2_flood_from_many_sources_does_not_keep_a_real_client_out() -> None:
    """Finding 3: 1,056 REQUEST_2 from 66 addresses filled 1,024 slots."""
    server = new_server(max_connections=1024)
    for ip in range(66):
        for port in range(16):
            server.receive_datagram(
                ocr2(ip * 100 + port), (f"198.51.100.{ip + 10}", port + 1), 1.0
            )
    server.datagrams_to_send(1.0)
    assert not server.connections and len(server.handshakes) <= 1024
    client = Client(server, ("192.0.2.77", 4000), guid=4242)
    client.connect(1.5)
    assert Connected(4242, client.addr, (("192.168.1.20", 50000),)) in (
        server.pop_events()
    )
    assert server.stats.dropped["server-full"] == 0


def test_forged_request_2_cannot_keep_an_address_out() -> None:
    """Finding 3: 16 blind REQUEST_2 with a victim's address kept it out; here a
    spoofer also completes blind CONNECTION_REQUESTs on 16 ports, and forges a
    REQUEST_2 with its own GUID on the victim's very address, after the
    victim's REQUEST_2."""
    server = new_server()
    victim_ip = CLIENT[0]
    for port in range(1, 17):
        forged = (victim_ip, port)
        server.receive_datagram(ocr2(900 + port), forged, 1.0)
        server.receive_datagram(datagram(0, request_frame(900 + port)), forged, 1.0)
    server.receive_datagram(ocr2(999), CLIENT, 1.0)  # before the victim, too
    server.datagrams_to_send(1.0)
    victim = Client(server, CLIENT, guid=42)
    assert victim.raw(m.OpenConnectionRequest1(6, 1492).encode(), 1.1)[0][0] == 0x06
    assert victim.raw(ocr2(42), 1.1)[0][0] == 0x08
    server.receive_datagram(ocr2(777), CLIENT, 1.1)  # forged after it
    writer = BitWriter()
    writer.write_u8(m.MessageId.CONNECTION_REQUEST)
    writer.write_u64(42)
    writer.write_u64(1234)
    writer.write_bool(False)
    victim.send(writer.data(), 1.2)
    assert victim.take(m.MessageId.CONNECTION_REQUEST_ACCEPTED)
    victim.send(incoming_frame().payload, 1.2)
    assert server.address_of(42) == CLIENT
    assert server.stats.dropped["connect-evicted"] >= 1


def test_one_flooding_source_takes_its_share_of_the_handshake_rate_only() -> None:
    """Finding 3: the 1,000/s handshake bucket was global, so one address
    sending 3,000 REQUEST_1/s took every other client's handshakes."""
    server = new_server()
    for i in range(3000):
        server.receive_datagram(
            m.OpenConnectionRequest1(6, 576).encode(), ("198.51.100.66", i), 0.0
        )
    answered = len(server.datagrams_to_send(0.0))
    assert answered <= 125 and server.stats.dropped["handshake-ip-rate"] >= 2875
    for i in range(20):
        server.receive_datagram(
            m.OpenConnectionRequest1(6, 576).encode(), (f"192.0.2.{i}", 1), 0.0
        )
    assert len(server.datagrams_to_send(0.0)) == 20


def test_answers_to_unconnected_addresses_are_within_the_reflection_budget() -> None:
    """Finding 9 (low): an 18-byte REQUEST_1 got a 28-byte reply every time."""
    server = RakNetServer(
        ServerConfig(handshakes_per_second=1e9, handshakes_per_second_per_ip=1e9),
        guid=SERVER_GUID,
        reflection=ReflectionBudget(),
    )
    request = m.OpenConnectionRequest1(6, 46).encode()  # the smallest: 18 bytes
    assert len(request) == 18
    victim = ("192.0.2.99", 5000)
    for _ in range(2000):
        server.receive_datagram(request, victim, 1.0)
    sent = sum(len(d) for d, _ in server.datagrams_to_send(1.0))
    assert sent <= 2000 * 18 + DEFAULT_ALLOWANCE
    assert server.stats.dropped[DROP_REFLECTION] > 0
    # A real client pads REQUEST_1 to its MTU: it is never refused.
    client = Client(server, ("192.0.2.1", 4000), guid=7)
    client.connect(2.0)
    assert server.address_of(7) == client.addr


def test_per_item_costs_cover_what_is_held() -> None:
    """HANDSHAKE_BYTES and CONNECTION_BYTES are measured, not guessed."""
    server = RakNetServer(
        ServerConfig(
            max_connections=10_000,
            handshakes_per_second=1e9,
            handshakes_per_second_per_ip=1e9,
        ),
        guid=1,
    )
    net = Network(server)
    n = 200
    clients = [
        Client(net, (f"10.0.{i // 256}.{i % 256}", 40000), guid=1000 + i)
        for i in range(n)
    ]
    tracemalloc.start()
    try:
        for c in clients[: n // 2]:
            c.connect(1.0)
            c.send(b"\x86hello", 1.1)
        for c in clients[n // 2 :]:
            server.receive_datagram(ocr2(c.guid), c.addr, 1.0)
        server.datagrams_to_send(1.1)
        server.pop_events()
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
        for record in list(server.handshakes.values()):
            server._forget_handshake(record, "test")
        gc.collect()
        records = held - tracemalloc.get_traced_memory()[0]
        for conn in list(server.connections.values()):
            server._forget(conn)
        gc.collect()
        connections = held - records - tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert 0 < records / (n // 2) <= HANDSHAKE_BYTES
    assert 0 < connections / (n // 2) <= CONNECTION_BYTES


# ------------------------------------------- the send side of peers that never ACK

#: What the flood leaves besides the connections' layers: the ACKs of the
#: attackers' datagrams waiting to go, counters, transient lists.
SEND_FLOOD_SLACK = 256 * 1024


def test_peers_that_never_ack_cannot_make_the_server_hold_more_than_its_share() -> None:
    """The send side was not charged: eight connected clients that ask for
    NAT_RESPOND_BOUND_ADDRESSES 3,000 times each and never ACK made the
    server hold ~0.9 MB each (512 in flight, the rest queued) for up to 10 s,
    with the table's buffered bytes at 0. Now what it holds stays within the
    table's share, and the connections whose reliable backlog does not fit
    are lost, counted."""
    share = 1024 * 1024
    table = LocalTable(max_items=64, max_per_source=64, max_bytes=share)
    node = RakNetNode(
        ServerConfig(handshakes_per_second=1e9, handshakes_per_second_per_ip=1e9),
        bound_addresses=[SERVER],
        guid=7,
        connections=table,
    )
    net = Network(node)
    clients = [
        Client(net, (f"198.51.100.{10 + i}", 40000), guid=100 + i) for i in range(8)
    ]
    for client in clients:
        client.connect(1.0)
    node.pop_events()
    assert node.peer.connected_count == 8 and table.buffered == 0
    request = bytes([m.MessageId.NAT_REQUEST_BOUND_ADDRESSES])
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        peak = 0
        now = 1.0
        for _ in range(60):  # 60 rounds of 50 requests per client, 20 ms apart
            now += 0.02
            now_ms = int(now * 1000)
            for client in clients:
                for _ in range(50):
                    client.layer.send(request, Reliability.UNRELIABLE, 0, now_ms)
                for data in client.layer.datagrams(now_ms):
                    node.receive_datagram(data, client.addr, now)
            node.datagrams_to_send(now)  # lost on the way: nothing is ACKed
            node.handle_timer(now)
            node.pop_events()
            assert table.buffered <= share
            peak = max(peak, tracemalloc.get_traced_memory()[0] - before)
    finally:
        tracemalloc.stop()
    assert peak <= share + SEND_FLOOD_SLACK, (peak, share)
    lost = node.peer.stats.dropped["send-memory"]
    assert lost > 0 and table.closes["send-memory"] == lost
    assert node.peer.connected_count == 8 - lost
    # What the lost connections held is given back; a client that ACKs is
    # served as before.
    for conn in list(node.peer.connections.values()):
        node.peer.close(conn.address, now)
    now += 2.0
    node.handle_timer(now)
    node.datagrams_to_send(now)
    assert not node.peer.connections and table.buffered == 0
    honest = Client(net, ("192.0.2.50", 40000), guid=999)
    honest.connect(now)
    honest.send(request, now)
    assert honest.take(m.MessageId.NAT_RESPOND_BOUND_ADDRESSES)
    honest.pump(now)
    assert table.buffered == 0
