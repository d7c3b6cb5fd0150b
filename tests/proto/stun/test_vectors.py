"""The RFC 5769 vectors and RFC 8489 B.1 decode, verify and re-encode byte-exact."""

from __future__ import annotations

import pytest

from crossroads.proto.stun import (
    Class,
    Fingerprint,
    IceControlled,
    Message,
    MessageIntegrity,
    MessageIntegritySha256,
    Method,
    Nonce,
    PasswordAlgorithm,
    PasswordAlgorithmId,
    Priority,
    Realm,
    Software,
    Userhash,
    Username,
    XorMappedAddress,
    check_fingerprint,
    check_message_integrity,
    check_message_integrity_sha256,
    decode,
    encode,
    long_term_key,
    short_term_key,
    userhash,
)
from tests.proto.stun import vectors as v

TXID_5769 = bytes.fromhex("b7e7a701bc34d686fa87dfae")
TXID_LONG = bytes.fromhex("78ad3433c6ad72c029da412e")


def _payload(msg: Message) -> Message:
    """The message without MI / MI-SHA256 / FINGERPRINT, for re-encoding."""
    keep = tuple(
        a
        for a in msg.attributes
        if not isinstance(a, MessageIntegrity | MessageIntegritySha256 | Fingerprint)
    )
    return Message(msg.msg_class, msg.method, msg.transaction_id, keep, msg.cookie)


def test_sample_request() -> None:
    msg = decode(v.SAMPLE_REQUEST)
    assert msg.msg_class is Class.REQUEST and msg.method is Method.BINDING
    assert msg.transaction_id == TXID_5769
    assert msg.get(Software) == Software("STUN test client")
    assert msg.get(Priority) == Priority(0x6E0001FF)
    assert msg.get(IceControlled) == IceControlled(0x932FF9B151263B36)
    assert msg.get(Username) == Username("evtj:h6vY")
    assert msg.unknown_comprehension_required() == ()
    key = short_term_key(v.SHORT_TERM_PASSWORD)
    assert check_message_integrity(v.SAMPLE_REQUEST, key)
    assert not check_message_integrity(v.SAMPLE_REQUEST, key + b"x")
    assert check_fingerprint(v.SAMPLE_REQUEST)
    again = encode(_payload(msg), integrity_key=key, fingerprint=True, pad=b" ")
    assert again == v.SAMPLE_REQUEST


@pytest.mark.parametrize(
    ("wire", "host"),
    [
        (v.SAMPLE_IPV4_RESPONSE, "192.0.2.1"),
        (v.SAMPLE_IPV6_RESPONSE, "2001:db8:1234:5678:11:2233:4455:6677"),
    ],
)
def test_sample_responses(wire: bytes, host: str) -> None:
    msg = decode(wire)
    assert msg.msg_class is Class.SUCCESS and msg.method is Method.BINDING
    assert msg.get(XorMappedAddress) == XorMappedAddress(host, 32853)
    assert msg.get(Software) == Software("test vector")
    key = short_term_key(v.SHORT_TERM_PASSWORD)
    assert check_message_integrity(wire, key)
    assert check_fingerprint(wire)
    again = encode(_payload(msg), integrity_key=key, fingerprint=True, pad=b" ")
    assert again == wire


def test_sample_long_term_request() -> None:
    msg = decode(v.SAMPLE_LONG_TERM_REQUEST)
    assert msg.transaction_id == TXID_LONG
    assert msg.get(Username) == Username(v.LONG_TERM_USERNAME)
    assert msg.get(Nonce) == Nonce(v.LONG_TERM_NONCE)
    assert msg.get(Realm) == Realm(v.LONG_TERM_REALM)
    key = long_term_key(v.LONG_TERM_USERNAME, v.LONG_TERM_REALM, v.LONG_TERM_PASSWORD)
    assert check_message_integrity(v.SAMPLE_LONG_TERM_REQUEST, key)
    assert not check_fingerprint(v.SAMPLE_LONG_TERM_REQUEST)
    assert encode(_payload(msg), integrity_key=key) == v.SAMPLE_LONG_TERM_REQUEST


def test_rfc8489_b1_sha256_request() -> None:
    msg = decode(v.SAMPLE_B1_REQUEST)
    assert msg.get(Userhash) == Userhash(v.B1_USERHASH)
    assert userhash(v.LONG_TERM_USERNAME, v.LONG_TERM_REALM) == v.B1_USERHASH
    assert msg.get(Nonce) == Nonce(v.B1_NONCE)
    assert msg.get(PasswordAlgorithm) == PasswordAlgorithm(PasswordAlgorithmId.SHA256)
    key = long_term_key(
        v.LONG_TERM_USERNAME,
        v.LONG_TERM_REALM,
        v.LONG_TERM_PASSWORD,
        PasswordAlgorithmId.SHA256,
    )
    assert check_message_integrity_sha256(v.SAMPLE_B1_REQUEST, key)
    md5_key = long_term_key(
        v.LONG_TERM_USERNAME, v.LONG_TERM_REALM, v.LONG_TERM_PASSWORD
    )
    assert not check_message_integrity_sha256(v.SAMPLE_B1_REQUEST, md5_key)
    again = encode(_payload(msg), integrity_sha256_key=key)
    assert again == v.SAMPLE_B1_REQUEST
