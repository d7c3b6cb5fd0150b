"""RakNet's offline messages: the captured sizes, round trips, and every
decoder fuzzed (random bytes give a message or DecodeError, nothing else);
every plugin decoder fed random payloads through a connected client."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crossroads.errors import DecodeError
from crossroads.proto.raknet import messages as m
from crossroads.proto.raknet.messages import MessageId
from crossroads.proto.raknet.node import RakNetNode
from tests.proto.raknet.support import CLIENT, Client, Network

ADDRESSES = st.tuples(st.ip_addresses(v=4).map(str), st.integers(0, 65535))
GUIDS = st.integers(0, 2**64 - 1)


@given(st.integers(0, 255), st.integers(m.MINIMUM_MTU, m.MAXIMUM_MTU))
def test_request_1_round_trips_and_is_padded_to_the_mtu(
    protocol: int, mtu: int
) -> None:
    data = m.OpenConnectionRequest1(protocol, mtu).encode()
    assert len(data) == mtu - 28
    assert m.OpenConnectionRequest1.decode(data) == m.OpenConnectionRequest1(
        protocol, mtu
    )


@given(ADDRESSES, st.integers(0, 65535), GUIDS)
def test_request_2_round_trips_in_34_bytes(
    addr: tuple[str, int], mtu: int, guid: int
) -> None:
    data = m.OpenConnectionRequest2(addr, mtu, guid).encode()
    assert len(data) == 34
    assert m.OpenConnectionRequest2.decode(data) == m.OpenConnectionRequest2(
        addr, mtu, guid
    )


@given(GUIDS, st.binary(max_size=50))
def test_out_of_band_round_trips(guid: int, payload: bytes) -> None:
    message = m.OutOfBand(guid, payload)
    assert m.OutOfBand.decode(message.encode()) == message


def test_reply_sizes_from_the_capture() -> None:
    assert len(m.open_connection_reply_1(1, 1492)) == 28
    assert len(m.open_connection_reply_2(1, ("198.51.100.7", 5), 1492)) == 35
    accepted = m.connection_request_accepted(("198.51.100.7", 5), 0, [], 1, 2)
    assert len(accepted) == 96


DECODERS: list[Callable[[bytes], object]] = [
    m.OpenConnectionRequest1.decode,
    m.OpenConnectionRequest2.decode,
    m.UnconnectedPing.decode,
    m.UnconnectedPong.decode,
    m.OutOfBand.decode,
    m.ConnectionRequest.decode,
    m.NewIncomingConnection.decode,
]


@pytest.mark.parametrize("decode", DECODERS)
@given(data=st.binary(max_size=120))
def test_random_bytes_decode_or_raise_decode_error(
    decode: Callable[[bytes], object], data: bytes
) -> None:
    for candidate in (
        data,
        data[:1] + m.MAGIC + data[1:],
        data[:9] + m.MAGIC + data[9:],
        data[:17] + m.MAGIC + data[17:],
    ):
        try:
            decode(candidate)
        except DecodeError:
            pass


PLUGIN_IDS = [
    MessageId.NAT_PUNCHTHROUGH_REQUEST,
    MessageId.NAT_GET_MOST_RECENT_PORT,
    MessageId.NAT_CLIENT_READY,
    MessageId.NAT_REQUEST_BOUND_ADDRESSES,
    MessageId.NAT_TYPE_DETECTION_REQUEST,
    MessageId.UDP_PROXY_GENERAL,
]


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(PLUGIN_IDS), st.binary(max_size=40))
def test_plugin_decoders_take_random_payloads(kind: int, rest: bytes) -> None:
    node = RakNetNode(guid=7, s3p4=("203.0.113.3", 4))
    client = Client(Network(node), CLIENT, 42)
    client.connect(1.0)
    client.send(bytes([kind]) + rest, 2.0)
    node.handle_timer(3.0)
    node.receive_s3p4(bytes([3]) + rest, CLIENT, 3.0)
    assert node.peer.connected_count == 1


def test_unconnected_ping_round_trips_through_the_server_s_pong() -> None:
    ping = m.unconnected_ping(0x0102030405060708, 77)
    assert len(ping) == 33 and m.is_offline(ping)
    decoded = m.UnconnectedPing.decode(ping)
    assert decoded.time == 0x0102030405060708 and not decoded.open_connections_only
    pong = m.UnconnectedPong.decode(m.unconnected_pong(decoded.time, 99, b"hi"))
    assert pong == m.UnconnectedPong(0x0102030405060708, 99, b"hi")
    with pytest.raises(DecodeError):
        m.UnconnectedPong.decode(ping)
