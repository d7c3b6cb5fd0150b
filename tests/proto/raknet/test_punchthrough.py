"""NatPunchthroughServer in memory (RakNetNode + in-memory clients, fake clock):
the message exchange byte by byte, its failure messages, the port-stride
exchange, and its bounds."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from crossroads.proto.raknet import messages as m
from crossroads.proto.raknet.bitstream import BitReader
from crossroads.proto.raknet.messages import MessageId
from crossroads.proto.raknet.node import RakNetNode
from crossroads.proto.raknet.punchthrough import MAX_ATTEMPTS_PER_USER
from tests.proto.raknet.support import Client, Network

BOUND = [("203.0.113.1", 61111), ("203.0.113.2", 61112)]
A_ADDR = ("198.51.100.10", 40000)
B_ADDR = ("192.0.2.20", 50000)
A_GUID, B_GUID = 0xA1, 0xB2


def setup(now: float = 1.0) -> tuple[RakNetNode, Client, Client]:
    node = RakNetNode(bound_addresses=BOUND, guid=7)
    net = Network(node)
    a = Client(net, A_ADDR, A_GUID)
    b = Client(net, B_ADDR, B_GUID)
    a.connect(now, lan=("10.0.0.10", 40000))
    b.connect(now, lan=("10.1.0.20", 50000))
    return node, a, b


def request(target: int) -> bytes:
    return bytes([MessageId.NAT_PUNCHTHROUGH_REQUEST]) + target.to_bytes(8, "big")


def port_reply(session: int, port: int) -> bytes:
    return (
        bytes([MessageId.NAT_GET_MOST_RECENT_PORT])
        + session.to_bytes(2, "big")
        + port.to_bytes(2, "big")
    )


def parse_connect_at_time(data: bytes) -> dict[str, object]:
    reader = BitReader(data)
    assert reader.read_u8() == MessageId.TIMESTAMP
    go = reader.read_u64()
    assert reader.read_u8() == MessageId.NAT_CONNECT_AT_TIME
    session = reader.read_u16()
    public = reader.read_address()
    internal = [reader.read_address() for _ in range(10)]
    guid = reader.read_u64()
    sender = reader.read_bool()
    assert reader.remaining_bits < 8
    return {
        "go": go,
        "session": session,
        "public": public,
        "internal": internal,
        "guid": guid,
        "sender": sender,
    }


def test_the_whole_punchthrough_exchange() -> None:
    node, a, b = setup()
    a.send(request(B_GUID), 2.0)
    (ask_a,) = a.take(MessageId.NAT_GET_MOST_RECENT_PORT)
    (ask_b,) = b.take(MessageId.NAT_GET_MOST_RECENT_PORT)
    assert ask_a == ask_b == bytes.fromhex("3c0000")
    a.send(port_reply(0, 40001), 2.1)
    assert not a.take(MessageId.TIMESTAMP)  # waits for both ports
    b.send(port_reply(0, 50001), 2.2)
    (to_a,) = a.take(MessageId.TIMESTAMP)
    (to_b,) = b.take(MessageId.TIMESTAMP)
    assert len(to_a) == len(to_b) == 98
    at_a, at_b = parse_connect_at_time(to_a), parse_connect_at_time(to_b)
    assert at_a["public"] == (B_ADDR[0], 50001) and at_a["guid"] == B_GUID
    assert at_a["sender"] is True and at_b["sender"] is False
    assert at_b["public"] == (A_ADDR[0], 40001) and at_b["guid"] == A_GUID
    assert at_a["internal"][0] == ("10.1.0.20", 50000)
    assert at_a["internal"][1:] == [("0.0.0.0", 0)] * 9
    # round trips are known (in memory: 0 ms) -> the least lead, 100 ms
    assert at_a["go"] == at_b["go"] == 2200 + 100
    assert node.punch.stats.connect_at_time == 1
    # both ready again: a second attempt can start at once
    a.send(bytes([MessageId.NAT_CLIENT_READY]), 3.0)
    b.send(bytes([MessageId.NAT_CLIENT_READY]), 3.0)
    b.send(request(A_GUID), 3.1)
    assert a.take(MessageId.NAT_GET_MOST_RECENT_PORT) == [bytes.fromhex("3c0001")]


def test_unknown_targets_and_self_get_target_not_connected() -> None:
    _, a, _ = setup()
    a.send(request(0xDEAD), 2.0)
    a.send(request(A_GUID), 2.0)
    assert a.take(MessageId.NAT_TARGET_NOT_CONNECTED) == [
        bytes([0x3E]) + (0xDEAD).to_bytes(8, "big"),
        bytes([0x3E]) + A_GUID.to_bytes(8, "big"),
    ]


def test_a_second_request_for_the_same_pair_is_already_in_progress() -> None:
    _, a, b = setup()
    a.send(request(B_GUID), 2.0)
    b.send(request(A_GUID), 2.0)
    assert b.take(MessageId.NAT_ALREADY_IN_PROGRESS) == [
        bytes([0x41]) + A_GUID.to_bytes(8, "big")
    ]


def test_an_attempt_without_ports_for_10_s_is_unresponsive_to_both() -> None:
    node, a, b = setup()
    a.send(request(B_GUID), 2.0)
    a.send(port_reply(0, 40001), 2.1)  # b never answers
    now = 2.1
    while now < 12.0:
        now = node.get_timer() or now + 0.25
        node.handle_timer(now)
        a.pump(now)
    assert not a.take(MessageId.NAT_TARGET_UNRESPONSIVE)
    while now < 12.5:
        now = node.get_timer() or now + 0.25
        node.handle_timer(now)
        a.pump(now)
    assert a.take(MessageId.NAT_TARGET_UNRESPONSIVE) == [
        bytes([0x3F]) + B_GUID.to_bytes(8, "big") + b"\x00\x00"
    ]
    assert b.take(MessageId.NAT_TARGET_UNRESPONSIVE) == [
        bytes([0x3F]) + A_GUID.to_bytes(8, "big") + b"\x00\x00"
    ]
    assert node.punch.get_timer() is None


def test_a_peer_that_disconnects_mid_attempt_is_connection_lost() -> None:
    node, a, b = setup()
    a.send(request(B_GUID), 2.0)
    b.send(bytes([MessageId.DISCONNECTION_NOTIFICATION]), 2.5)
    assert a.take(MessageId.NAT_CONNECTION_TO_TARGET_LOST) == [
        bytes([0x40]) + B_GUID.to_bytes(8, "big") + b"\x00\x00"
    ]
    assert B_GUID not in node.punch.users


def test_bound_addresses_and_the_port_stride_ping() -> None:
    node, a, _ = setup()
    a.send(bytes([MessageId.NAT_REQUEST_BOUND_ADDRESSES]), 2.0)
    (answer,) = a.take(MessageId.NAT_RESPOND_BOUND_ADDRESSES)
    # the reference's capture: 7d 02 203.0.113.1:61111 203.0.113.2:61112
    assert answer == bytes.fromhex("7d020434ff8efeeeb70434ff8efdeeb8")
    # OOB NAT_PING on the second socket -> OOB NAT_PONG (from the first)
    ping = m.OutOfBand(A_GUID, bytes.fromhex("0acb20")).encode()
    node.receive_second(ping, ("198.51.100.10", 40002), 2.1)
    ((pong, to),) = node.datagrams_to_send(2.1)
    assert to == ("198.51.100.10", 40002)
    assert m.OutOfBand.decode(pong) == m.OutOfBand(7, bytes.fromhex("0bcb209c42"))
    # anything but OOB is refused on the second socket
    node.receive_second(m.OpenConnectionRequest1(6, 576).encode(), A_ADDR, 2.2)
    assert node.second_dropped == 1 and node.datagrams_to_send(2.2) == []


def test_attempts_per_user_are_bounded() -> None:
    node = RakNetNode(guid=7)
    net = Network(node)
    a = Client(net, A_ADDR, A_GUID)
    a.connect(1.0)
    targets = []
    for i in range(MAX_ATTEMPTS_PER_USER + 2):
        target = Client(net, (f"192.0.2.{30 + i}", 1000), 1000 + i)
        target.connect(1.0)
        targets.append(target)
    for target in targets:
        a.send(request(target.guid), 2.0)
    assert node.punch.stats.dropped["attempts-full"] == 2
    assert len(node.punch.users[A_GUID].attempts) == MAX_ATTEMPTS_PER_USER


def test_unknown_plugin_messages_are_ignored_and_counted() -> None:
    node, a, _ = setup()
    a.send(bytes([0x53]) + bytes(8), 2.0)  # ID_FCM2_REQUEST_FCMGUID
    assert node.unhandled[0x53] == 1
    assert not a.inbox


@settings(max_examples=100)
@given(
    st.sampled_from([0x3A, 0x3C, 0x3D, 0x7C]).flatmap(
        lambda kind: st.binary(max_size=12).map(lambda rest: bytes([kind]) + rest)
    )
)
def test_truncated_plugin_messages_are_dropped_and_counted(message: bytes) -> None:
    node, a, b = setup()
    a.send(message, 2.0)
    b.send(message, 2.0)
    assert node.peer.connected_count == 2
