"""The typed relay-node commands (proto/raknet/nodebus.py): round trips and
the JSON wire format. Refusals with reasons and the fuzzing of the whole
handler are in tests/services/test_raknet_nodes.py."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from crossroads.errors import DecodeError
from crossroads.proto.raknet.nodebus import (
    MAX_MESSAGE,
    MAX_TIMEOUT_MS,
    Forward,
    Forwarded,
    NodeMessage,
    decode_node_message,
)

ids = st.text(max_size=64)
addresses = st.tuples(st.ip_addresses().map(str), st.integers(1, 65535))
messages: st.SearchStrategy[NodeMessage] = st.one_of(
    st.builds(Forward, ids, addresses, addresses, st.integers(0, MAX_TIMEOUT_MS)),
    st.builds(
        Forwarded,
        ids,
        addresses,
        addresses,
        st.text(max_size=45),
        st.integers(0, 255),
        st.integers(0, 65535),
    ),
)


@settings(max_examples=300, deadline=None)
@given(messages)
def test_every_command_survives_its_round_trip(message: NodeMessage) -> None:
    raw = message.encode()
    assert len(raw) <= MAX_MESSAGE
    assert decode_node_message(raw) == message


def test_the_wire_format_is_the_one_earlier_versions_publish() -> None:
    forward = Forward("a", ("192.0.2.1", 1), ("198.51.100.2", 2), 5000)
    assert json.loads(forward.encode()) == {
        "t": "forward",
        "from": "a",
        "source": ["192.0.2.1", 1],
        "target": ["198.51.100.2", 2],
        "timeout_ms": 5000,
    }


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_garbage_is_refused_with_a_decode_error(data: bytes) -> None:
    try:
        message = decode_node_message(data)
    except DecodeError:
        return
    assert decode_node_message(message.encode()) == message
