"""NatTypeDetectionServer in memory: the test sequence, socket by socket, its
timing rule, both port-restricted outcomes, stop and bounds."""

from __future__ import annotations

from crossroads.proto.raknet import messages as m
from crossroads.proto.raknet.bitstream import BitReader, BitWriter
from crossroads.proto.raknet.messages import MessageId
from crossroads.proto.raknet.nattype import NatType, Socket
from crossroads.proto.raknet.node import RakNetNode
from tests.proto.raknet.support import CLIENT, Client, Network

S3P4 = ("203.0.113.3", 40003)


def setup() -> tuple[RakNetNode, Client]:
    node = RakNetNode(guid=7, s3p4=S3P4)
    client = Client(Network(node), CLIENT, 42)
    client.connect(1.0)
    return node, client


def request(c2_port: int) -> bytes:
    writer = BitWriter()
    writer.write_u8(MessageId.NAT_TYPE_DETECTION_REQUEST)
    writer.write_bool(True)
    writer.write_u16(c2_port)
    return writer.data()


def run(
    node: RakNetNode, client: Client, until: float, now: float
) -> tuple[float, list[tuple[bytes, tuple[str, int], Socket]]]:
    sent = []
    while now < until:
        timer = node.get_timer()
        now = max(now + 0.001, timer if timer is not None else now + 0.05)
        node.handle_timer(now)
        client.pump(now)
        sent += node.side_datagrams()
    return now, sent


def test_the_test_sequence_each_state_twice_then_symmetric() -> None:
    node, client = setup()
    assert request(32958) == bytes.fromhex("60c05f00")  # the capture in §0
    client.send(request(32958), 2.0)
    now, sent = run(node, client, 3.0, 2.0)
    host = CLIENT[0]
    oob = lambda kind: m.OutOfBand(7, bytes([2, kind])).encode()  # noqa: E731
    assert sent == [
        (b"\x00", (host, 32958), Socket.S4P5),
        (b"\x00", (host, 32958), Socket.S4P5),
        (oob(NatType.FULL_CONE), CLIENT, Socket.S2P3),
        (oob(NatType.FULL_CONE), CLIENT, Socket.S2P3),
        (oob(NatType.ADDRESS_RESTRICTED), CLIENT, Socket.S1P2),
        (oob(NatType.ADDRESS_RESTRICTED), CLIENT, Socket.S1P2),
    ]
    probes = client.take(MessageId.NAT_TYPE_DETECTION_REQUEST)
    assert len(probes) == 2
    reader = BitReader(probes[0], start_bits=8)
    assert (reader.read_rakstring(), reader.read_u16()) == (b"203.0.113.3", 40003)
    # nobody probed s3p4: SYMMETRIC
    assert client.take(MessageId.NAT_TYPE_DETECTION_RESULT) == [b"\x61\x04"]
    assert not node.detection.attempts  # type: ignore[union-attr]


def test_states_advance_every_last_ping_times_3_plus_50_ms() -> None:
    node, client = setup()
    client.send(request(1000), 2.0)
    # in memory the round trip is 0 ms: one state every 50 ms
    node.handle_timer(2.0)
    assert len(node.side_datagrams()) == 1
    node.handle_timer(2.049)
    assert node.side_datagrams() == []
    node.handle_timer(2.05)
    assert len(node.side_datagrams()) == 1


def test_a_probe_from_the_connection_s_address_is_port_restricted() -> None:
    node, client = setup()
    client.send(request(1000), 2.0)
    node.receive_s3p4(b"\x03" + (42).to_bytes(8, "big"), CLIENT, 2.1)
    client.pump(2.1)
    assert client.take(MessageId.NAT_TYPE_DETECTION_RESULT) == [b"\x61\x03"]


def test_a_probe_from_another_port_is_symmetric() -> None:
    node, client = setup()
    client.send(request(1000), 2.0)
    node.receive_s3p4(b"\x03" + (42).to_bytes(8, "big"), (CLIENT[0], 50001), 2.1)
    client.pump(2.1)
    assert client.take(MessageId.NAT_TYPE_DETECTION_RESULT) == [b"\x61\x04"]


def test_the_client_can_stop_and_disconnecting_ends_it() -> None:
    node, client = setup()
    client.send(request(1000), 2.0)
    client.send(bytes([MessageId.NAT_TYPE_DETECTION_REQUEST, 0x00]), 2.01)
    assert not node.detection.attempts  # type: ignore[union-attr]
    client.send(request(1000), 2.02)
    client.send(bytes([MessageId.DISCONNECTION_NOTIFICATION]), 2.03)
    assert not node.detection.attempts  # type: ignore[union-attr]


def test_garbage_on_s3p4_and_bad_requests_are_counted() -> None:
    node, client = setup()
    node.receive_s3p4(b"\x03", CLIENT, 2.0)
    node.receive_s3p4(b"\x03" + bytes(8), CLIENT, 2.0)
    client.send(bytes([MessageId.NAT_TYPE_DETECTION_REQUEST, 0x80]), 2.0)  # no port
    stats = node.detection.stats.dropped  # type: ignore[union-attr]
    assert stats["s3p4-not-a-probe"] == 1 and stats["s3p4-unknown-guid"] == 1
    assert stats["short"] == 1
