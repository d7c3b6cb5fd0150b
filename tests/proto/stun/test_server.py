"""The sans-I/O Binding core, checked by decoding its replies with the codec."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
)

TXID = bytes(range(1, 13))
CLIENT = ("192.0.2.10", 40000)
A1P1, A1P2 = ("198.51.100.1", 3478), ("198.51.100.1", 3479)
A2P1, A2P2 = ("198.51.100.2", 3478), ("198.51.100.2", 3479)
FULL = [A1P1, A1P2, A2P1, A2P2]


def _binding(*attrs: object, fingerprint: bool = False) -> bytes:
    return encode(request(Method.BINDING, TXID, attrs), fingerprint=fingerprint)  # type: ignore[arg-type]


def _answer(
    core: BindingCore, data: bytes, **kw: object
) -> tuple[Message, tuple[str, int], int]:
    reply = core.handle(data, kw.pop("addr", CLIENT), kw.pop("local", 0), 0.0, **kw)  # type: ignore[arg-type]
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
    assert core.handle(bytes(bad), CLIENT, 0, 0.0) == DROP_BAD_FINGERPRINT
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
    wire, dest, send_from = core.handle(data, CLIENT, 0, 0.0)  # type: ignore[misc]
    msg = decode(wire)
    assert msg.cookie == 0x01020304 and msg.is_rfc3489
    assert msg.get(XorMappedAddress) is None
    assert msg.get(MappedAddress) == MappedAddress(*CLIENT)
    assert msg.get(SourceAddress) == SourceAddress(*A2P1) and send_from == 2
    assert msg.get(ChangedAddress) == ChangedAddress(*A2P2)


def test_drops() -> None:
    core = BindingCore([A1P1], rate_limit=2)
    good = _binding()
    assert core.handle(good[:19], CLIENT, 0, 0.0) == DROP_MALFORMED
    assert core.handle(good + b"\0\0\0\0", CLIENT, 0, 0.0) == DROP_MALFORMED
    indication = b"\x00\x11" + good[2:]
    assert core.handle(indication, CLIENT, 0, 0.0) == DROP_INDICATION
    response = b"\x01\x01" + good[2:]
    assert core.handle(response, CLIENT, 0, 0.0) == DROP_RESPONSE
    assert isinstance(core.handle(good, CLIENT, 0, 0.0), tuple)
    assert isinstance(core.handle(good, CLIENT, 0, 0.0), tuple)
    assert core.handle(good, CLIENT, 0, 0.5) == DROP_RATE_LIMITED
    assert isinstance(core.handle(good, ("192.0.2.11", 1), 0, 0.5), tuple)
    assert isinstance(core.handle(good, CLIENT, 0, 1.0), tuple)
    truncated = struct.pack("!HHI", 1, 4, 0x2112A442) + TXID + b"\x80\x22\x00\x08"
    assert core.handle(truncated, ("192.0.2.12", 1), 0, 2.0) == DROP_MALFORMED


def test_unsupported_method_is_discarded() -> None:
    # RFC 8489 §6.3: unsupported methods are silently discarded.
    core = BindingCore([A1P1], software="sw")
    allocate = encode(request(Method.ALLOCATE, TXID), fingerprint=True)
    assert core.unsupported(allocate) == DROP_UNSUPPORTED
    send = encode(Message(Class.INDICATION, Method.SEND, TXID))
    assert core.unsupported(send) == DROP_UNSUPPORTED
    assert core.unsupported(b"\x00\x03\x00") == DROP_MALFORMED
    assert core.unsupported(allocate + b"\0\0\0\0") == DROP_MALFORMED


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=120), st.sampled_from([0, 1, 2, 3]), st.booleans())
def test_random_input_never_raises(body: bytes, local: int, tcp: bool) -> None:
    core = BindingCore(FULL, software="x")
    data = b"\x00\x01" + body
    reply = core.handle(data, CLIENT, local, 0.0, tcp=tcp)
    if isinstance(reply, tuple):
        decode(reply[0])  # whatever we send is valid STUN


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64).map(lambda b: b[: len(b) & ~3]), st.booleans())
def test_random_attributes_behind_valid_header(body: bytes, magic: bool) -> None:
    core = BindingCore(FULL)
    cookie = 0x2112A442 if magic else 0x01020304
    data = struct.pack("!HHI", 1, len(body), cookie) + TXID + body
    reply = core.handle(data, CLIENT, 0, 0.0)
    if isinstance(reply, tuple):
        assert decode(reply[0]).transaction_id == TXID
