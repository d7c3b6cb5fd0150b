"""The relay-node commands (services/raknet_nodes.py) as they come out of the
Store: well-formed ones do their job, anything else is refused with a reason
(counted by the service), and no input makes the decoder raise anything but
DecodeError. The two-instance flow with Redis is tests/services/test_raknet_cluster.py."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crossroads.errors import DecodeError
from crossroads.proto.raknet.node import RakNetNode
from crossroads.proto.raknet.udpproxy import ForwarderResult
from crossroads.services.raknet_nodes import RelayNodes
from crossroads.store.memory import MemoryStore
from tests.proto.raknet.support import RecordingForwarders
from tests.strategies import json_values as any_json

SOURCE, TARGET = ["198.51.100.10", 40000], ["192.0.2.20", 50000]


def nodes(forwarders: RecordingForwarders | None = None) -> RelayNodes:
    return RelayNodes(
        MemoryStore(),
        RakNetNode().proxy,
        forwarders,
        ("203.0.113.2", 61111),
        "203.0.113.2",
        lambda now: None,
    )


def command(**fields: Any) -> bytes:
    message = {"t": "forward", "from": "a" * 32, "source": SOURCE}
    message |= {"target": TARGET, "timeout_ms": 5000, **fields}
    return json.dumps(message).encode()


def test_a_forward_command_starts_a_forwarder_and_queues_the_answer() -> None:
    forwarders = RecordingForwarders()
    relay = nodes(forwarders)
    relay.handle(command())
    assert forwarders.started == [(tuple(SOURCE), tuple(TARGET), 5000)]
    ((channel_node, raw),) = relay._outbox
    assert channel_node == "a" * 32
    assert json.loads(raw) == {
        "t": "forwarded",
        "from": relay.node_id,
        "source": SOURCE,
        "target": TARGET,
        "ip": "203.0.113.2",
        "result": ForwarderResult.SUCCESS,
        "port": 45000,
    }


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"{", "bad-json"),
        (b"[]", "bad-command"),
        (command(**{"from": 7}), "bad-command"),
        (command(t="shutdown"), "unknown-command"),
        (command(source=["localhost", 1]), "bad-address"),
        (command(target=["192.0.2.1", 0]), "bad-address"),
        (command(target=["192.0.2.1", True, 3]), "bad-address"),
        (command(timeout_ms=-1), "bad-timeout"),
        (command(timeout_ms=2**32), "bad-timeout"),
        (command(timeout_ms="5000"), "bad-timeout"),
        (command(t="forwarded", ip="", result=5, port=1), "unknown-node"),
        (b" " * 5000, "too-large"),
    ],
)
def test_malformed_commands_are_refused_with_a_reason(raw: bytes, reason: str) -> None:
    forwarders = RecordingForwarders()
    with pytest.raises(DecodeError) as refused:
        nodes(forwarders).handle(raw)
    assert refused.value.reason == reason
    assert forwarders.started == []


def test_an_instance_without_a_forwarder_refuses_to_forward() -> None:
    with pytest.raises(DecodeError) as refused:
        nodes(None).handle(command())
    assert refused.value.reason == "not-a-node"


json_values = any_json()


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=300),
        json_values.map(lambda v: json.dumps(v).encode()),
        st.fixed_dictionaries(
            {
                "t": st.sampled_from(["forward", "forwarded"]) | st.text(max_size=5),
                "from": st.text(max_size=5) | st.integers(),
                "source": json_values,
                "target": json_values,
            },
            optional={"timeout_ms": json_values, "ip": json_values},
        ).map(lambda v: json.dumps(v).encode()),
    )
)
def test_any_command_is_handled_or_refused(raw: bytes) -> None:
    try:
        nodes(RecordingForwarders()).handle(raw)
    except DecodeError:
        pass
