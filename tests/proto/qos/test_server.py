"""The QoS codec and server core, in memory with a fake clock. Requests are
packed by the independent client of tests/qos_client.py (public tables)."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crossroads.errors import DecodeError
from crossroads.proto.admission import LocalTable
from crossroads.proto.qos.messages import (
    QosRequest,
    decode_request,
    decode_response,
    encode_response,
)
from crossroads.proto.qos.server import OVERFLOW_SHARE, WINDOW, QosServer
from tests import qos_client

CLIENT = ("192.0.2.10", 40000)


def test_a_unity_request_is_answered_with_everything_echoed() -> None:
    server = QosServer()
    data = qos_client.request(3, 0xBEEF, 1_700_000_000_123)
    assert len(data) == 25  # 3 + "QoS request" + 1 + 2 + 8 (docs/qos.md)
    server.receive_datagram(data, CLIENT, 0.0)
    ((answer, to),) = server.datagrams_to_send(0.0)
    assert to == CLIENT
    assert len(answer) == 13
    magic, verflow, sequence, identifier, timestamp = struct.unpack("<BBBHQ", answer)
    assert (magic, verflow, sequence, identifier) == (0x95, 0, 3, 0xBEEF)
    assert timestamp == 1_700_000_000_123
    result = qos_client.Result("x", 0xBEEF)
    assert result.accept(answer, 1_700_000_000_150)
    assert result.latencies == [27.0]


def test_the_rest_after_the_identifier_is_echoed_verbatim() -> None:
    server = QosServer()
    data = qos_client.request(0, 1, 5) + b"user data"
    server.receive_datagram(data, CLIENT, 0.0)
    ((answer, _),) = server.datagrams_to_send(0.0)
    assert answer.endswith(struct.pack("<Q", 5) + b"user data")


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"\x59\x00\x02x\x00\x01\x00" + bytes(7), "short"),
        (qos_client.request(0, 1, 2).replace(b"\x59", b"\x58", 1), "bad-magic"),
        (b"\x59\x10" + qos_client.request(0, 1, 2)[2:], "bad-version"),
        (b"\x59\x00\x01" + bytes(20), "bad-title"),
        (b"\x59\x00\xff" + bytes(20), "bad-title"),
        (qos_client.request(0, 1, 2) + bytes(1480), "long"),
    ],
)
def test_malformed_requests_are_dropped_and_counted(data: bytes, reason: str) -> None:
    server = QosServer()
    server.receive_datagram(data, CLIENT, 0.0)
    assert server.datagrams_to_send(0.0) == []
    assert server.drops == {reason: 1}


@given(st.binary(max_size=1600))
def test_random_bytes_decode_or_raise_decode_error_and_answers_are_smaller(
    data: bytes,
) -> None:
    try:
        request = decode_request(data)
    except DecodeError:
        return
    assert request.encode() == data
    answer = encode_response(request)
    assert len(answer) <= len(data) - 2
    assert decode_response(answer).sequence == request.sequence


@given(
    st.binary(min_size=1, max_size=200),
    st.integers(0, 255),
    st.binary(min_size=2, max_size=2),
    st.binary(min_size=8, max_size=64),
)
def test_parse_of_encode_is_identity(
    title: bytes, sequence: int, identifier: bytes, rest: bytes
) -> None:
    request = QosRequest(title, sequence, identifier, rest)
    assert decode_request(request.encode()) == request


def test_a_source_over_its_rate_is_throttled_then_dropped() -> None:
    server = QosServer(rate=5)
    flows = []
    for i in range(12):
        server.receive_datagram(qos_client.request(i % 5, 7, i), CLIENT, 0.1)
        flows += [decode_response(d).flow for d, _ in server.datagrams_to_send(0.1)]
    assert flows[:5] == [0] * 5
    assert len(flows) == 10 and all(1 <= f <= 7 for f in flows[5:])
    assert flows[5:] == sorted(flows[5:])  # units grow with the excess
    assert server.drops == {"rate": 2}
    # Another source is not affected.
    server.receive_datagram(qos_client.request(0, 7, 0), ("192.0.2.11", 1), 0.2)
    ((answer, _),) = server.datagrams_to_send(0.2)
    assert decode_response(answer).flow == 0


def test_rate_state_lives_one_window_and_is_released() -> None:
    table = LocalTable()
    server = QosServer(rate=5, admission=table)
    for i in range(3):
        server.receive_datagram(qos_client.request(0, 1, 0), (f"192.0.2.{i}", 1), 1.0)
    assert table.live == 3 and server.sources == 3
    assert server.get_timer() == 1.0 + WINDOW
    server.handle_timer(1.0 + WINDOW)
    assert table.live == 0 and server.sources == 0
    assert server.get_timer() is None
    # A new window: the source gets its full rate again.
    for _ in range(5):
        server.receive_datagram(qos_client.request(0, 1, 0), CLIENT, 3.0)
    assert all(decode_response(d).flow == 0 for d, _ in server.datagrams_to_send(3.0))


def test_sources_the_table_refuses_share_one_throttled_overflow() -> None:
    table = LocalTable(max_items=2)
    server = QosServer(rate=2, admission=table)
    answers = 0
    for i in range(100):
        server.receive_datagram(qos_client.request(0, 1, 0), (f"198.51.100.{i}", 1), 0)
        for data, _ in server.datagrams_to_send(0.0):
            answers += 1
            if answers > 2:
                assert decode_response(data).flow != 0
    assert table.live == 2
    assert answers == 2 + 2 * 2 * OVERFLOW_SHARE
    assert server.drops["rate"] == 100 - answers


def test_ipv6_sources_count_per_64() -> None:
    table = LocalTable()
    server = QosServer(rate=3, admission=table)
    for i in range(8):
        server.receive_datagram(
            qos_client.request(0, 1, 0), (f"2001:db8::{i + 1}", 1), 0
        )
    assert table.live == 1
    assert server.drops == {"rate": 2}
