"""The TURN core never raises on network input (Hypothesis)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crossroads.errors import DecodeError, LocalProtocolError
from crossroads.proto.stun import decode, encode
from crossroads.proto.stun.message import Message
from crossroads.proto.turn.credentials import LongTermSession
from tests.proto.stun.strategies import messages as message_parts
from tests.proto.turn.conftest import Harness, udp

FUZZ = settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])

#: The STUN strategies build (class, method, txid, attributes).
messages = message_parts.map(lambda parts: Message(*parts))


@FUZZ
@given(messages)
def test_random_messages_get_an_answer_or_nothing(message: Message) -> None:
    harness = Harness()
    try:
        data = encode(message)
    except LocalProtocolError:
        return  # not encodable: not something that can arrive
    answer = harness.send(data, udp())
    if answer is not None:
        decode(answer)


@FUZZ
@given(messages, st.booleans())
def test_random_signed_messages_after_allocation(message: Message, sha: bool) -> None:
    """Authenticated garbage: valid integrity, arbitrary attributes."""
    harness = Harness()
    session = LongTermSession("alice", "secret", prefer_sha256=sha)
    harness.allocate(udp(), session)
    try:
        data = session.sign(message)
    except LocalProtocolError:
        return
    harness.now = 1.0
    answer = harness.send(data, udp())
    if answer is not None:
        decode(answer)
    harness.advance(7200)  # everything expires without error
    assert harness.server.allocations == {}
    assert harness.binder.open_count == 0


@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes_never_break_the_core(data: bytes) -> None:
    # The core decodes: what does not decode is counted, never raised.
    harness = Harness()
    answer = harness.send(data, udp())
    if answer is not None:
        decode(answer)
    try:
        decode(data)
    except DecodeError:
        assert sum(harness.server.counters.drops.values()) == 1
