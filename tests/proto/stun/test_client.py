"""The client transaction core with a fake clock."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from crossroads.proto.stun import (
    Class,
    Method,
    XorMappedAddress,
    decode,
    encode,
    request,
    success_response,
)
from crossroads.proto.stun.client import (
    RFC8489_TIMERS,
    RequestReceived,
    StunClientCore,
    TransactionResult,
    TransactionTimers,
)

SERVER = ("192.0.2.1", 3478)


def _core() -> StunClientCore:
    counter = itertools.count()
    return StunClientCore(random_bytes=lambda n: next(counter).to_bytes(n, "big"))


def test_rfc8489_retransmission_schedule() -> None:
    core = _core()
    core.start_request(SERVER, 0.0)
    sends = [0.0] if core.datagrams_to_send(0.0) else []
    while (deadline := core.get_timer()) is not None:
        core.handle_timer(deadline)
        if core.datagrams_to_send(deadline):
            sends.append(deadline)
        events = core.pop_events()
        if events:
            (result,) = events
            assert isinstance(result, TransactionResult) and result.response is None
            assert result.finished == 39.5 and result.transmissions == 7
    assert sends == [0.0, 0.5, 1.5, 3.5, 7.5, 15.5, 31.5]
    assert RFC8489_TIMERS.total == 39.5


def test_response_matched_by_transaction_id_from_any_source() -> None:
    core = _core()
    txid = core.start_request(SERVER, 0.0, timers=TransactionTimers(rto=1.0))
    ((wire, dest),) = core.datagrams_to_send(0.0)
    assert dest == SERVER
    req = decode(wire)
    assert req.method is Method.BINDING and req.msg_class is Class.REQUEST
    core.handle_timer(1.0)
    assert len(core.datagrams_to_send(1.0)) == 1  # one retransmission
    other = request(Method.BINDING, b"x" * 12)
    core.receive_datagram(encode(success_response(other)), SERVER, 1.1)  # stray
    core.receive_datagram(b"garbage", SERVER, 1.1)
    answer = success_response(req, [XorMappedAddress("203.0.113.9", 4000)])
    core.receive_datagram(encode(answer), ("192.0.2.2", 3479), 1.2)
    (result,) = core.pop_events()
    assert isinstance(result, TransactionResult)
    assert result.transaction_id == txid and result.source == ("192.0.2.2", 3479)
    assert result.response is not None and result.transmissions == 2
    assert core.pending == 0 and core.get_timer() is None
    assert core.ignored == {"unknown-transaction": 1, "not-stun": 1}
    # A late duplicate is ignored.
    core.receive_datagram(encode(answer), SERVER, 1.3)
    assert core.pop_events() == []


def test_incoming_request_is_reported() -> None:
    core = _core()
    core.receive_datagram(encode(request(Method.BINDING, b"h" * 12)), SERVER, 0.0)
    (event,) = core.pop_events()
    assert isinstance(event, RequestReceived) and event.source == SERVER


def test_concurrent_transactions_have_distinct_ids() -> None:
    core = _core()
    ids = {core.start_request(SERVER, 0.0) for _ in range(5)}
    assert len(ids) == 5 and len(core.datagrams_to_send(0.0)) == 5


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=80))
def test_random_datagrams_never_raise(data: bytes) -> None:
    core = _core()
    core.start_request(SERVER, 0.0)
    core.receive_datagram(data, SERVER, 0.1)
    core.receive_datagram(b"\x01\x01" + data, SERVER, 0.1)
    for event in core.pop_events():
        assert isinstance(event, TransactionResult | RequestReceived)
