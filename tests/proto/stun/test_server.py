"""The sans-I/O Binding core, checked by decoding its replies with the codec."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crossroads.proto.reflection import (
    DROP_REFLECTION,
    ReflectionBudget,
    ReflectionSettings,
)
from crossroads.proto.stun import (
    ChangedAddress,
    ChangeRequest,
    Class,
    ErrorCodeAttribute,
    Fingerprint,
    MappedAddress,
    Message,
    Method,
    OtherAddress,
    Padding,
    ResponseOrigin,
    ResponsePort,
    Software,
    SourceAddress,
    UnknownAttribute,
    UnknownAttributes,
    Username,
    XorMappedAddress,
    decode,
    encode,
    request,
)
from crossroads.proto.stun.server import (
    DROP_BAD_FINGERPRINT,
    DROP_INDICATION,
    DROP_MALFORMED,
    DROP_RATE_LIMITED,
    DROP_RESPONSE,
    DROP_UNSUPPORTED,
    BindingCore,
    Reply,
)
from crossroads.types import Address

TXID = bytes(range(1, 13))
CLIENT = ("192.0.2.10", 40000)
A1P1, A1P2 = ("198.51.100.1", 3478), ("198.51.100.1", 3479)
A2P1, A2P2 = ("198.51.100.2", 3478), ("198.51.100.2", 3479)
FULL = [A1P1, A1P2, A2P1, A2P2]


def _binding(*attrs: object, fingerprint: bool = False) -> bytes:
    return encode(request(Method.BINDING, TXID, attrs), fingerprint=fingerprint)  # type: ignore[arg-type]


def _handle(
    core: BindingCore,
    data: bytes,
    addr: Address = CLIENT,
    local: int = 0,
    now: float = 0.0,
) -> Reply | str:
    """One datagram through the core API: its one reply, or the drop reason
    it was counted under."""
    before = dict(core.drops)
    core.receive_datagram(data, addr, now, local)
    replies = core.datagrams_to_send(now)
    if replies:
        assert len(replies) == 1 and core.drops == before
        return replies[0]
    (reason,) = [r for r, n in core.drops.items() if n != before.get(r, 0)]
    return reason


def _stream(core: BindingCore) -> BindingCore:
    """The core's twin for TCP connections (same endpoints, shared limiter)."""
    return BindingCore(core.advertised, stream=True, limiter=core.limiter)


def _answer(
    core: BindingCore,
    data: bytes,
    addr: Address = CLIENT,
    local: int = 0,
    tcp: bool = False,
) -> tuple[Message, Address, int]:
    reply = _handle(_stream(core) if tcp else core, data, addr, local)
    assert isinstance(reply, tuple), reply
    wire, dest, send_from = reply
    return decode(wire), dest, send_from


def test_plain_binding_rfc5780_off() -> None:
    core = BindingCore([A1P1], software="test")
    msg, dest, send_from = _answer(core, _binding())
    assert msg.msg_class is Class.SUCCESS and msg.method is Method.BINDING
    assert msg.transaction_id == TXID
    assert [type(a) for a in msg.attributes] == [XorMappedAddress, Software]
    assert msg.get(XorMappedAddress) == XorMappedAddress(*CLIENT)
    assert (dest, send_from) == (CLIENT, 0)


def test_binding_with_alternate_port_only_never_sends_other_address() -> None:
    core = BindingCore([A1P1, A1P2])
    msg, _, _ = _answer(core, _binding(), local=1)
    assert msg.get(XorMappedAddress) == XorMappedAddress(*CLIENT)
    assert msg.get(MappedAddress) == MappedAddress(*CLIENT)
    assert msg.get(ResponseOrigin) == ResponseOrigin(*A1P2)
    assert msg.get(OtherAddress) is None
    # RFC 5780 §6: no second IP -> 420 to CHANGE-REQUEST.
    for change in (ChangeRequest(change_port=True), ChangeRequest()):
        err, _, _ = _answer(core, _binding(change))
        assert err.msg_class is Class.ERROR
        assert err.error is not None and err.error.code == 420
        assert err.get(UnknownAttributes) == UnknownAttributes((0x0003,))


@pytest.mark.parametrize(
    ("local", "change_ip", "change_port", "expected_from"),
    [
        (0, False, False, 0),
        (0, False, True, 1),
        (0, True, False, 2),
        (0, True, True, 3),
        (3, True, True, 0),
        (2, False, True, 3),
    ],
)
def test_change_request_picks_the_socket(
    local: int, change_ip: bool, change_port: bool, expected_from: int
) -> None:
    core = BindingCore(FULL)
    msg, dest, send_from = _answer(
        core, _binding(ChangeRequest(change_ip, change_port)), local=local
    )
    assert send_from == expected_from and dest == CLIENT
    assert msg.get(ResponseOrigin) == ResponseOrigin(*FULL[expected_from])
    # OTHER-ADDRESS is Ca:Cp of the endpoint that received the request, whatever
    # the flags (RFC 5780 §6.1, Table 1).
    assert msg.get(OtherAddress) == OtherAddress(*FULL[local ^ 3])


def test_change_request_over_tcp_is_400() -> None:
    core = BindingCore(FULL)
    msg, _, _ = _answer(core, _binding(ChangeRequest(True, True)), tcp=True)
    assert msg.error is not None and msg.error.code == 400
    # No flag set: nothing to change, answered normally.
    msg, _, _ = _answer(core, _binding(ChangeRequest()), tcp=True)
    assert msg.msg_class is Class.SUCCESS


def test_response_port_and_padding() -> None:
    core = BindingCore(FULL)
    _, dest, _ = _answer(core, _binding(ResponsePort(5555)))
    assert dest == (CLIENT[0], 5555)
    msg, _, _ = _answer(core, _binding(ResponsePort(5555), Padding(b"x" * 8)))
    assert msg.error is not None and msg.error.code == 400
    msg, _, _ = _answer(core, _binding(ResponsePort(0)))
    assert msg.error is not None and msg.error.code == 400
    msg, _, _ = _answer(core, _binding(ResponsePort(5555)), tcp=True)
    assert msg.error is not None and msg.error.code == 400
    request_wire = _binding(Padding(b"p" * 101))
    msg, _, _ = _answer(core, request_wire)
    padding = msg.get(Padding)
    assert padding is not None and len(padding.value) == 104
    # The padded answer is no larger than the question plus the usual attributes.
    plain, _, _ = _answer(core, _binding())
    assert len(encode(msg)) <= len(request_wire) + len(encode(plain))


def test_rfc5780_off_makes_its_attributes_unknown() -> None:
    core = BindingCore([A1P1])
    msg, _, _ = _answer(core, _binding(ChangeRequest(), ResponsePort(9), Padding(b"")))
    assert msg.error is not None and msg.error.code == 420
    assert msg.get(UnknownAttributes) == UnknownAttributes((0x0003, 0x0027, 0x0026))


def test_unknown_attributes() -> None:
    core = BindingCore([A1P1])
    data = _binding(UnknownAttribute(0x7F00, b"a"), UnknownAttribute(0xFF00, b"b"))
    msg, _, _ = _answer(core, data)
    assert msg.error == ErrorCodeAttribute(420, "Unknown Attribute")
    assert msg.get(UnknownAttributes) == UnknownAttributes((0x7F00,))
    # Only comprehension-optional unknowns: ignored.
    msg, _, _ = _answer(core, _binding(UnknownAttribute(0xFF00, b"b")))
    assert msg.msg_class is Class.SUCCESS


def test_fingerprint_is_echoed_and_checked() -> None:
    core = BindingCore(FULL, software="s")
    msg, _, _ = _answer(core, _binding(Username("u"), fingerprint=True))
    assert isinstance(msg.attributes[-1], Fingerprint)  # decode() verified it
    bad = bytearray(_binding(fingerprint=True))
    bad[-1] ^= 0xFF
    assert _handle(core, bytes(bad)) == DROP_BAD_FINGERPRINT
    err, _, _ = _answer(
        core, _binding(ChangeRequest(), UnknownAttribute(0x7000, b""), fingerprint=True)
    )
    assert isinstance(err.attributes[-1], Fingerprint)


def test_ipv6_client() -> None:
    core = BindingCore([("2001:db8::1", 3478), ("2001:db8::1", 3479)])
    client = ("2001:db8::99", 1234)
    msg, _, _ = _answer(core, _binding(), addr=client)
    assert msg.get(XorMappedAddress) == XorMappedAddress(*client)
    assert msg.get(MappedAddress) == MappedAddress(*client)
    plain = BindingCore([("2001:db8::1", 3478)])
    msg, _, _ = _answer(plain, _binding(), addr=client)
    assert msg.get(XorMappedAddress) == XorMappedAddress(*client)


def test_ipv4_mapped_client_is_reported_as_ipv4() -> None:
    core = BindingCore([("::", 3478)])
    msg, _, _ = _answer(core, _binding(), addr=("::ffff:192.0.2.7", 9))
    assert msg.get(XorMappedAddress) == XorMappedAddress("192.0.2.7", 9)


def test_rfc3489_client_gets_mapped_address_and_its_cookie() -> None:
    core = BindingCore(FULL)
    data = struct.pack("!HHI", 0x0001, 8, 0x01020304) + TXID
    data += encode(request(Method.BINDING, TXID, [ChangeRequest(True, False)]))[20:]
    reply = _handle(core, data)
    assert isinstance(reply, tuple)
    wire, dest, send_from = reply
    msg = decode(wire)
    assert msg.cookie == 0x01020304 and msg.is_rfc3489
    assert msg.get(XorMappedAddress) is None
    assert msg.get(MappedAddress) == MappedAddress(*CLIENT)
    assert msg.get(SourceAddress) == SourceAddress(*A2P1) and send_from == 2
    assert msg.get(ChangedAddress) == ChangedAddress(*A2P2)


def test_drops() -> None:
    core = BindingCore([A1P1], rate_limit=2)
    good = _binding()
    assert _handle(core, good[:19]) == DROP_MALFORMED
    assert _handle(core, good + b"\0\0\0\0") == DROP_MALFORMED
    indication = b"\x00\x11" + good[2:]
    assert _handle(core, indication) == DROP_INDICATION
    response = b"\x01\x01" + good[2:]
    assert _handle(core, response) == DROP_RESPONSE
    assert isinstance(_handle(core, good), tuple)
    assert isinstance(_handle(core, good), tuple)
    assert _handle(core, good, now=0.5) == DROP_RATE_LIMITED
    assert isinstance(_handle(core, good, ("192.0.2.11", 1), now=0.5), tuple)
    assert isinstance(_handle(core, good, now=1.0), tuple)
    truncated = struct.pack("!HHI", 1, 4, 0x2112A442) + TXID + b"\x80\x22\x00\x08"
    assert _handle(core, truncated, ("192.0.2.12", 1), now=2.0) == DROP_MALFORMED


def test_stream_twin_shares_the_rate_limit_and_skips_the_budget() -> None:
    # One client's requests over UDP and TCP count against one limit.
    budget = ReflectionBudget(ReflectionSettings(allowance=0, global_allowance=0))
    udp = BindingCore([A1P1], rate_limit=2, reflection=budget)
    tcp = BindingCore([A1P1], stream=True, limiter=udp.limiter, drops=udp.drops)
    good = _binding()
    # UDP: the answer is larger than the question and there is no allowance.
    assert _handle(udp, good) == DROP_REFLECTION
    # A stream client proved its address: no budget.
    assert isinstance(_handle(tcp, good), tuple)
    assert _handle(tcp, good) == DROP_RATE_LIMITED
    assert udp.drops == {DROP_REFLECTION: 1, DROP_RATE_LIMITED: 1}


def test_replies_queue_until_taken() -> None:
    core = BindingCore([A1P1, A1P2])
    assert core.get_timer() is None
    core.handle_timer(5.0)  # nothing is ever due
    for local in (0, 1):
        core.receive_datagram(_binding(), CLIENT, 0.0, local)
    replies = core.datagrams_to_send(0.0)
    assert [(dest, send_from) for _, dest, send_from in replies] == [
        (CLIENT, 0),
        (CLIENT, 1),
    ]
    # The reply goes back to the very address object it came from (the owner
    # answers it in the batch's sendmmsg slot).
    assert all(dest is CLIENT for _, dest, _ in replies)
    assert core.datagrams_to_send(0.0) == []


def test_unsupported_method_is_discarded() -> None:
    # RFC 8489 §6.3: unsupported methods are silently discarded.
    core = BindingCore([A1P1], software="sw")
    allocate = encode(request(Method.ALLOCATE, TXID), fingerprint=True)
    assert _handle(core, allocate) == DROP_UNSUPPORTED
    send = encode(Message(Class.INDICATION, Method.SEND, TXID))
    assert _handle(core, send) == DROP_UNSUPPORTED
    # A response of another method is one we do not support either.
    allocate_success = encode(Message(Class.SUCCESS, Method.ALLOCATE, TXID))
    assert _handle(core, allocate_success) == DROP_UNSUPPORTED
    assert _handle(core, b"\x00\x03\x00") == DROP_MALFORMED
    assert _handle(core, allocate + b"\0\0\0\0") == DROP_MALFORMED


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=120), st.sampled_from([0, 1, 2, 3]), st.booleans())
def test_random_input_never_raises(body: bytes, local: int, tcp: bool) -> None:
    core = BindingCore(FULL, software="x")
    data = b"\x00\x01" + body
    reply = _handle(_stream(core) if tcp else core, data, local=local)
    if isinstance(reply, tuple):
        decode(reply[0])  # whatever we send is valid STUN


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64).map(lambda b: b[: len(b) & ~3]), st.booleans())
def test_random_attributes_behind_valid_header(body: bytes, magic: bool) -> None:
    core = BindingCore(FULL)
    cookie = 0x2112A442 if magic else 0x01020304
    data = struct.pack("!HHI", 1, len(body), cookie) + TXID + body
    reply = _handle(core, data)
    if isinstance(reply, tuple):
        assert decode(reply[0]).transaction_id == TXID
