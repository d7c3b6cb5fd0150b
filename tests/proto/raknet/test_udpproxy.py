"""UDPProxyCoordinator in memory: every answer, external proxy servers (login,
forwarding request/reply, fallback), and the hardening against third-party
targets. The built-in forwarder here records what it is asked (the real one,
with sockets, is exercised in tests/services/test_raknet.py)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from crossroads.proto.raknet.bitstream import BitReader, BitWriter
from crossroads.proto.raknet.messages import MessageId
from crossroads.proto.raknet.node import RakNetNode
from crossroads.proto.raknet.udpproxy import (
    ForwarderResult,
    RemoteForwardingRequest,
    Sub,
)
from crossroads.types import Address
from tests.proto.raknet.support import Client, Network, RecordingForwarders

A_ADDR = ("198.51.100.10", 40000)
B_ADDR = ("192.0.2.20", 50000)
P_ADDR = ("203.0.113.50", 60000)  # an external proxy server
A_GUID, B_GUID, P_GUID = 0xA1, 0xB2, 0xC3


def setup(
    forwarders: RecordingForwarders | None = None, password: str = ""
) -> tuple[RakNetNode, Client, Client, Client]:
    node = RakNetNode(
        guid=7,
        forwarders=forwarders,
        proxy_public_ip="203.0.113.1",
        proxy_password=password,
    )
    net = Network(node)
    clients = [
        Client(net, a, g)
        for a, g in ((A_ADDR, A_GUID), (B_ADDR, B_GUID), (P_ADDR, P_GUID))
    ]
    for client in clients:
        client.connect(1.0)
    return node, *clients  # type: ignore[return-value]


def request(target_guid: int, timeout_ms: int = 7000) -> bytes:
    writer = BitWriter()
    writer.write_u8(MessageId.UDP_PROXY_GENERAL)
    writer.write_u8(Sub.FORWARDING_REQUEST_FROM_CLIENT_TO_COORDINATOR)
    writer.write_address(("0.0.0.0", 0))  # "as you see me"
    writer.write_bool(False)  # by GUID
    writer.write_u64(target_guid)
    writer.write_u32(timeout_ms)
    writer.write_bool(False)  # no server selection bitstream
    return writer.data()


def answer(
    client: Client,
) -> tuple[int, Address, Address, int, bytes | None, int | None]:
    (message,) = client.take(MessageId.UDP_PROXY_GENERAL)
    reader = BitReader(message, start_bits=8)
    sub = reader.read_u8()
    fields = (reader.read_address(), reader.read_address(), reader.read_u64())
    if reader.remaining_bits >= 24:
        return sub, *fields, reader.read_rakstring(), reader.read_u16()
    return sub, *fields, None, None


def test_forwarding_with_the_built_in_forwarder() -> None:
    forwarders = RecordingForwarders()
    node, a, b, _ = setup(forwarders)
    a.send(request(B_GUID), 2.0)
    assert forwarders.started == [(A_ADDR, B_ADDR, 7000)]
    assert answer(a) == (
        Sub.FORWARDING_SUCCEEDED,
        A_ADDR,
        B_ADDR,
        B_GUID,
        b"203.0.113.1",
        45000,
    )
    assert answer(b) == (
        Sub.FORWARDING_NOTIFICATION,
        A_ADDR,
        B_ADDR,
        A_GUID,
        b"203.0.113.1",
        45000,
    )
    # the other side asking too (within timeoutOnNoDataMS): in progress
    b.send(request(A_GUID), 3.0)
    assert answer(b)[0] == Sub.IN_PROGRESS
    # ... and forgotten once that time has passed
    now = 3.0
    while node.proxy.requests and now < 20:
        now += 0.25
        node.handle_timer(now)
    assert not node.proxy.requests and 9.0 <= now <= 9.5


def test_refusals() -> None:
    _, a, _, _ = setup(None)
    a.send(request(B_GUID), 2.0)
    assert answer(a)[0] == Sub.NO_SERVERS_ONLINE
    _, a, _, _ = setup(RecordingForwarders())
    a.send(request(0xDEAD), 2.0)
    assert answer(a)[0] == Sub.RECIPIENT_GUID_NOT_CONNECTED_TO_COORDINATOR
    a.send(request(A_GUID), 2.0)  # itself
    assert answer(a)[0] == Sub.RECIPIENT_GUID_NOT_CONNECTED_TO_COORDINATOR
    _, a, _, _ = setup(RecordingForwarders(ForwarderResult.NO_SOCKETS))
    a.send(request(B_GUID), 2.0)
    assert answer(a)[0] == Sub.ALL_SERVERS_BUSY


def test_a_forwarder_cannot_be_aimed_at_a_third_party() -> None:
    forwarders = RecordingForwarders()
    node, a, _, _ = setup(forwarders)
    writer = BitWriter()
    writer.write_u8(MessageId.UDP_PROXY_GENERAL)
    writer.write_u8(Sub.FORWARDING_REQUEST_FROM_CLIENT_TO_COORDINATOR)
    writer.write_address(("0.0.0.0", 0))
    writer.write_bool(True)  # by address: a victim that never connected
    writer.write_address(("192.0.2.99", 53))
    writer.write_u32(7000)
    writer.write_bool(False)
    a.send(writer.data(), 2.0)
    assert answer(a)[0] == Sub.RECIPIENT_GUID_NOT_CONNECTED_TO_COORDINATOR
    assert forwarders.started == []


def test_a_timeout_outside_raknets_range_is_refused_as_invalid_parameters() -> None:
    """timeoutOnNoDataMS 2^32-1 (49.7 days) or 0 starts no forwarder, here or
    on an external server; the requester gets what stock RakNet's coordinator
    answers a server's UDPFORWARDER_INVALID_PARAMETERS: IN_PROGRESS, the
    server's IP, port 0. RakNet's own maximum (10 min) is served."""
    forwarders = RecordingForwarders()
    node, a, b, p = setup(forwarders, password="pw")
    for timeout_ms in (2**32 - 1, 600_001, 0):
        a.send(request(B_GUID, timeout_ms), 2.0)
        assert answer(a) == (
            Sub.IN_PROGRESS,
            A_ADDR,
            B_ADDR,
            B_GUID,
            b"203.0.113.1",
            0,
        )
        assert forwarders.started == [] and not node.proxy.requests
        assert not b.take(MessageId.UDP_PROXY_GENERAL)
    assert node.proxy.stats.results["invalid_parameters"] == 3
    login(p, b"pw", 2.5)  # a logged-in stock server is never asked either
    a.send(request(B_GUID, 2**32 - 1), 2.6)
    assert answer(a)[0] == Sub.IN_PROGRESS
    assert not p.take(MessageId.UDP_PROXY_GENERAL)
    a.send(request(B_GUID, 600_000), 2.7)
    (asked,) = p.take(MessageId.UDP_PROXY_GENERAL)
    assert asked[1] == Sub.FORWARDING_REQUEST_FROM_COORDINATOR_TO_SERVER


def test_a_server_answering_invalid_parameters_gives_in_progress_port_0() -> None:
    # OnForwardingReplyFromServerToCoordinator: any result but SUCCESS and
    # NO_SOCKETS is answered IN_PROGRESS with the server's IP and port, and
    # the request is forgotten.
    node, a, _, _ = setup(RecordingForwarders(ForwarderResult.INVALID_PARAMETERS))
    a.send(request(B_GUID), 2.0)
    sub, *_, ip, port = answer(a)
    assert (sub, ip, port) == (Sub.IN_PROGRESS, b"203.0.113.1", 0)
    assert not node.proxy.requests


def test_a_client_leaving_ends_its_requests_and_its_unused_forwarders() -> None:
    forwarders = RecordingForwarders()
    node, a, b, _ = setup(forwarders)
    a.send(request(B_GUID, 600_000), 2.0)
    assert answer(a)[0] == Sub.FORWARDING_SUCCEEDED
    assert answer(b)[0] == Sub.FORWARDING_NOTIFICATION
    # Remembered for the timeout: b's request for the same pair is IN_PROGRESS.
    b.send(request(A_GUID), 2.1)
    assert answer(b)[0] == Sub.IN_PROGRESS
    b.send(bytes([MessageId.DISCONNECTION_NOTIFICATION]), 3.0)
    # The target left: the forwarder is told (it ends those nobody used) and
    # the request is forgotten at once, not after 10 minutes.
    assert forwarders.ended == [B_ADDR]
    assert not node.proxy.requests
    # The requester leaving does the same for its own requests.
    c = Client(a.net, ("198.51.100.77", 1), 0xD4)
    c.connect(4.0)
    a.send(request(0xD4, 600_000), 4.1)
    assert answer(a)[0] == Sub.FORWARDING_SUCCEEDED and node.proxy.requests
    a.send(bytes([MessageId.DISCONNECTION_NOTIFICATION]), 4.2)
    assert forwarders.ended == [B_ADDR, A_ADDR]
    assert not node.proxy.requests


def login(client: Client, password: bytes, now: float) -> int:
    writer = BitWriter()
    writer.write_u8(MessageId.UDP_PROXY_GENERAL)
    writer.write_u8(Sub.LOGIN_REQUEST_FROM_SERVER_TO_COORDINATOR)
    writer.write_rakstring(password)
    client.send(writer.data(), now)
    (reply,) = client.take(MessageId.UDP_PROXY_GENERAL)
    assert BitReader(reply, start_bits=16).read_rakstring() == password
    return reply[1]


def test_proxy_server_login() -> None:
    _, _, _, p = setup(None)
    assert login(p, b"pw", 2.0) == Sub.NO_PASSWORD_SET_FROM_COORDINATOR_TO_SERVER
    node, _, _, p = setup(None, password="pw")
    assert login(p, b"nope", 2.0) == Sub.WRONG_PASSWORD_FROM_COORDINATOR_TO_SERVER
    assert login(p, b"pw", 2.0) == Sub.LOGIN_SUCCESS_FROM_COORDINATOR_TO_SERVER
    assert login(p, b"pw", 2.0) == Sub.ALREADY_LOGGED_IN_FROM_COORDINATOR_TO_SERVER
    assert node.proxy.servers == [P_ADDR]


def server_reply(result: ForwarderResult, port: int) -> bytes:
    writer = BitWriter()
    writer.write_u8(MessageId.UDP_PROXY_GENERAL)
    writer.write_u8(Sub.FORWARDING_REPLY_FROM_SERVER_TO_COORDINATOR)
    writer.write_address(A_ADDR)
    writer.write_address(B_ADDR)
    writer.write_rakstring(b"")  # "use the address you see me at"
    writer.write_u8(result)
    writer.write_u16(port)
    return writer.data()


def test_an_external_proxy_server_does_the_forwarding() -> None:
    forwarders = RecordingForwarders()
    node, a, b, p = setup(forwarders, password="pw")
    login(p, b"pw", 2.0)
    a.send(request(B_GUID, 5000), 2.1)
    (asked,) = p.take(MessageId.UDP_PROXY_GENERAL)
    reader = BitReader(asked, start_bits=8)
    assert reader.read_u8() == Sub.FORWARDING_REQUEST_FROM_COORDINATOR_TO_SERVER
    assert (reader.read_address(), reader.read_address(), reader.read_u32()) == (
        A_ADDR,
        B_ADDR,
        5000,
    )
    p.send(server_reply(ForwarderResult.SUCCESS, 47000), 2.2)
    assert answer(a)[4:] == (P_ADDR[0].encode(), 47000)
    assert answer(b)[0] == Sub.FORWARDING_NOTIFICATION
    assert forwarders.started == []


def test_a_busy_or_silent_proxy_server_falls_back_to_the_built_in_one() -> None:
    forwarders = RecordingForwarders()
    node, a, b, p = setup(forwarders, password="pw")
    login(p, b"pw", 2.0)
    a.send(request(B_GUID), 2.1)
    p.take(MessageId.UDP_PROXY_GENERAL)
    p.send(server_reply(ForwarderResult.NO_SOCKETS, 0), 2.2)
    assert answer(a)[0] == Sub.FORWARDING_SUCCEEDED and len(forwarders.started) == 1
    # silent: after 3 s the built-in one takes over
    c = Client(a.net, ("198.51.100.77", 1), 0xD4)
    c.connect(3.0)
    c.send(request(B_GUID), 3.1)
    p.take(MessageId.UDP_PROXY_GENERAL)
    now = 3.1
    while len(forwarders.started) < 2 and now < 10:
        now += 0.25
        node.handle_timer(now)
    assert 6.1 <= now <= 6.6


# ------------------------------------------------ server selection by ping

Q_ADDR, R_ADDR = ("203.0.113.51", 60001), ("203.0.113.52", 60002)


def three_servers(
    forwarders: RecordingForwarders | None,
) -> tuple[RakNetNode, Client, Client, list[Client]]:
    node, a, b, p = setup(forwarders, password="pw")
    servers = [p]
    for addr, guid in ((Q_ADDR, 0xC4), (R_ADDR, 0xC5)):
        server = Client(a.net, addr, guid)
        server.connect(1.0)
        servers.append(server)
    for server in servers:
        assert login(server, b"pw", 1.5) == Sub.LOGIN_SUCCESS_FROM_COORDINATOR_TO_SERVER
    return node, a, b, servers


def ping_list(client: Client) -> tuple[Address, Address, int, list[Address]]:
    (message,) = client.take(MessageId.UDP_PROXY_GENERAL)
    assert message[1] == Sub.PING_SERVERS_FROM_COORDINATOR_TO_CLIENT
    reader = BitReader(message, start_bits=16)
    source, target, guid = (
        reader.read_address(),
        reader.read_address(),
        reader.read_u64(),
    )
    servers = [reader.read_address() for _ in range(reader.read_u16())]
    assert reader.remaining_bits < 8
    return source, target, guid, servers


def ping_reply(pings: list[tuple[Address, int]], count: int | None = None) -> bytes:
    writer = BitWriter()
    writer.write_u8(MessageId.UDP_PROXY_GENERAL)
    writer.write_u8(Sub.PING_SERVERS_REPLY_FROM_CLIENT_TO_COORDINATOR)
    writer.write_address(A_ADDR)
    writer.write_address(B_ADDR)
    writer.write_u16(len(pings) if count is None else count)
    for server, ping in pings:
        writer.write_address(server)
        writer.write_u16(ping)
    return writer.data()


def asked(server: Client) -> bool:
    """Whether ``server`` was sent a forwarding request (and take it)."""
    messages = server.take(MessageId.UDP_PROXY_GENERAL)
    assert all(
        m[1] == Sub.FORWARDING_REQUEST_FROM_COORDINATOR_TO_SERVER for m in messages
    )
    return bool(messages)


def test_several_servers_the_lowest_summed_ping_is_asked_first() -> None:
    forwarders = RecordingForwarders()
    node, a, b, (p, q, r) = three_servers(forwarders)
    a.send(request(B_GUID), 2.0)
    # both ends get the same list, byte for byte, in login order
    expected = (A_ADDR, B_ADDR, B_GUID, [P_ADDR, Q_ADDR, R_ADDR])
    assert ping_list(a) == expected and ping_list(b) == expected
    assert not any(asked(s) for s in (p, q, r))
    # P is nearest to A but far from B; Q is best summed (40 + 40 < 10 + 200)
    a.send(ping_reply([(P_ADDR, 10), (Q_ADDR, 40), (R_ADDR, 90)]), 2.1)
    assert not any(asked(s) for s in (p, q, r))  # waits for the other end
    b.send(ping_reply([(P_ADDR, 200), (Q_ADDR, 40), (R_ADDR, 60)]), 2.2)
    assert [asked(s) for s in (p, q, r)] == [False, True, False]
    # Q is out of sockets: next best is R (150) before P (210)
    q.send(server_reply(ForwarderResult.NO_SOCKETS, 0), 2.3)
    assert [asked(s) for s in (p, q, r)] == [False, False, True]
    # R goes away: P is last
    r.send(bytes([MessageId.DISCONNECTION_NOTIFICATION]), 2.4)
    assert node.proxy.servers == [P_ADDR, Q_ADDR]
    assert [asked(s) for s in (p, q, r)] == [True, False, False]
    # P is silent: after 3 s the built-in forwarder takes over
    now = 2.4
    while not forwarders.started and now < 10:
        now += 0.25
        node.handle_timer(now)
    assert 5.4 <= now <= 5.9
    a.net.flush(now)
    assert answer(a)[0] == Sub.FORWARDING_SUCCEEDED
    assert answer(b)[0] == Sub.FORWARDING_NOTIFICATION
    assert node.proxy.stats.dropped == {}


def test_an_end_that_never_reports_pings_counts_as_unresponsive() -> None:
    node, a, b, (p, q, r) = three_servers(None)
    a.send(request(B_GUID), 2.0)
    ping_list(a), ping_list(b)
    # only A reports, and does not name R: R counts 2000 + 2000, Q 30 + 2000
    a.send(ping_reply([(P_ADDR, 500), (Q_ADDR, 30)]), 2.1)
    now = 2.1
    while not any(asked(s) for s in (p, q, r)) and now < 10:
        now += 0.25
        node.handle_timer(now)
        a.net.flush(now)
    assert 5.0 <= now <= 5.6
    q.send(server_reply(ForwarderResult.BIND_FAILED, 0), now)
    assert [asked(s) for s in (p, q, r)] == [True, False, False]
    p.send(server_reply(ForwarderResult.NO_SOCKETS, 0), now)
    assert [asked(s) for s in (p, q, r)] == [False, False, True]
    # no built-in forwarder here: the last failure is ALL_SERVERS_BUSY
    r.send(server_reply(ForwarderResult.NO_SOCKETS, 0), now)
    assert answer(a)[0] == Sub.ALL_SERVERS_BUSY
    assert not node.proxy.requests


def test_ping_reports_cannot_be_forged_or_inflated() -> None:
    node, a, b, (p, q, r) = three_servers(RecordingForwarders())
    a.send(request(B_GUID), 2.0)
    ping_list(a), ping_list(b)
    # a third party (a proxy server here) reporting for the pair: ignored
    p.send(ping_reply([(P_ADDR, 0), (Q_ADDR, 9000), (R_ADDR, 9000)]), 2.1)
    # more entries than servers: dropped before anything is read
    a.send(ping_reply([(P_ADDR, 1)] * 4), 2.1)
    a.send(ping_reply([], count=60000), 2.1)
    # servers it was not asked about do not count; a second report is ignored
    a.send(ping_reply([(("192.0.2.1", 1), 0), (R_ADDR, 5)]), 2.2)
    a.send(ping_reply([(P_ADDR, 0)]), 2.2)
    b.send(ping_reply([(R_ADDR, 5)]), 2.3)
    assert [asked(s) for s in (p, q, r)] == [False, False, True]
    assert node.proxy.stats.dropped == {
        "ping-reply-not-from-an-end": 2,
        "too-many-pings": 2,
    }
    # a reply for no pending ping round
    a.send(ping_reply([(R_ADDR, 5)]), 2.4)
    assert node.proxy.stats.dropped["unexpected-ping-reply"] == 1


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=80))
def test_ping_reply_decoder_takes_random_payloads(rest: bytes) -> None:
    node, a, b, servers = three_servers(RecordingForwarders())
    a.send(request(B_GUID), 2.0)
    prefix = ping_reply([])[:-2]  # 5c 08 source target, then random
    a.send(prefix + rest, 2.1)
    b.send(bytes([MessageId.UDP_PROXY_GENERAL, 8]) + rest, 2.1)
    node.handle_timer(6.0)  # the round ends either way
    assert node.peer.connected_count == 5
    assert not node.proxy.requests or node.proxy.requests[(A_ADDR, B_ADDR)].server
    assert sum(node.proxy.stats.dropped.values()) <= 2


# ------------------------------------------------ crossroads relay nodes

OWN_ADDR, NODE_ADDR = ("203.0.113.1", 61111), ("203.0.113.2", 61111)


def relay_setup(
    forwarders: RecordingForwarders | None,
) -> tuple[RakNetNode, Client, Client]:
    node, a, b, _ = setup(forwarders)
    own = OWN_ADDR if forwarders is not None else None
    node.proxy.set_relay_nodes([*([own] if own else []), NODE_ADDR], own)
    return node, a, b


def test_relay_nodes_join_the_ping_round_and_a_remote_node_forwards() -> None:
    """This instance and another relay node are both listed for the clients
    to ping; the remote one, nearer, gets a RemoteForwardingRequest and its
    answer (through the Store, here handed over directly) reaches the ends."""
    forwarders = RecordingForwarders()
    node, a, b = relay_setup(forwarders)
    a.send(request(B_GUID, 5000), 2.0)
    expected = (A_ADDR, B_ADDR, B_GUID, [OWN_ADDR, NODE_ADDR])
    assert ping_list(a) == expected and ping_list(b) == expected
    a.send(ping_reply([(OWN_ADDR, 90), (NODE_ADDR, 10)]), 2.1)
    b.send(ping_reply([(OWN_ADDR, 90), (NODE_ADDR, 10)]), 2.2)
    assert node.proxy.pop_remote_requests() == [
        RemoteForwardingRequest(NODE_ADDR, A_ADDR, B_ADDR, 5000)
    ]
    assert node.proxy.pop_remote_requests() == []
    # an answer from a node that was not asked (or for another pair): dropped
    node.proxy.on_remote_reply(OWN_ADDR, A_ADDR, B_ADDR, "", 5, 47000, 2.25)
    node.proxy.on_remote_reply(NODE_ADDR, B_ADDR, A_ADDR, "", 5, 47000, 2.25)
    assert node.proxy.stats.dropped["unexpected-server-reply"] == 2
    node.proxy.on_remote_reply(NODE_ADDR, A_ADDR, B_ADDR, "", 5, 47000, 2.3)
    a.net.flush(2.3)
    assert answer(a) == (
        Sub.FORWARDING_SUCCEEDED,
        A_ADDR,
        B_ADDR,
        B_GUID,
        NODE_ADDR[0].encode(),  # no IP in the answer: the node's address
        47000,
    )
    assert answer(b)[0] == Sub.FORWARDING_NOTIFICATION
    assert forwarders.started == []


def test_a_silent_or_full_relay_node_falls_back_to_this_instance() -> None:
    forwarders = RecordingForwarders()
    node, a, b = relay_setup(forwarders)
    a.send(request(B_GUID), 2.0)
    ping_list(a), ping_list(b)
    a.send(ping_reply([(OWN_ADDR, 90), (NODE_ADDR, 10)]), 2.1)
    b.send(ping_reply([(OWN_ADDR, 90), (NODE_ADDR, 10)]), 2.2)
    assert len(node.proxy.pop_remote_requests()) == 1
    now = 2.2
    while not forwarders.started and now < 10:
        now += 0.25
        node.handle_timer(now)
    assert 5.2 <= now <= 5.7  # SERVER_REPLY_TIMEOUT_MS
    a.net.flush(now)
    assert answer(a)[4:] == (b"203.0.113.1", 45000)
    # this instance best, but out of sockets: the remote node is next
    full = RecordingForwarders(ForwarderResult.NO_SOCKETS)
    node, a, b = relay_setup(full)
    a.send(request(B_GUID), 2.0)
    ping_list(a), ping_list(b)
    a.send(ping_reply([(OWN_ADDR, 5), (NODE_ADDR, 50)]), 2.1)
    b.send(ping_reply([(OWN_ADDR, 5), (NODE_ADDR, 50)]), 2.2)
    assert len(full.started) == 1
    assert node.proxy.pop_remote_requests() == [
        RemoteForwardingRequest(NODE_ADDR, A_ADDR, B_ADDR, 7000)
    ]
    node.proxy.on_remote_reply(NODE_ADDR, A_ADDR, B_ADDR, "", 1, 0, 2.3)  # full too
    a.net.flush(2.3)
    assert answer(a)[0] == Sub.ALL_SERVERS_BUSY
    assert len(full.started) == 1  # not asked twice


def test_without_a_forwarder_here_only_the_relay_nodes_serve() -> None:
    node, a, b = relay_setup(None)
    a.send(request(B_GUID), 2.0)
    # one candidate: asked at once, no ping round
    assert b.take(MessageId.UDP_PROXY_GENERAL) == []
    assert node.proxy.pop_remote_requests() == [
        RemoteForwardingRequest(NODE_ADDR, A_ADDR, B_ADDR, 7000)
    ]
    # the relay node disappears (its registration expired): busy after 3 s
    node.proxy.set_relay_nodes([], None)
    now = 2.0
    while node.proxy.requests and now < 10:
        now += 0.25
        node.handle_timer(now)
    a.net.flush(now)
    assert answer(a)[0] == Sub.ALL_SERVERS_BUSY
    # ... and with no node left at all: no servers online
    a.send(request(B_GUID), now)
    assert answer(a)[0] == Sub.NO_SERVERS_ONLINE


def test_only_this_instance_listed_is_the_plain_built_in_forwarder() -> None:
    forwarders = RecordingForwarders()
    node, a, b, _ = setup(forwarders)
    node.proxy.set_relay_nodes([OWN_ADDR], OWN_ADDR)
    a.send(request(B_GUID), 2.0)
    assert forwarders.started == [(A_ADDR, B_ADDR, 7000)]
    assert answer(a)[0] == Sub.FORWARDING_SUCCEEDED
