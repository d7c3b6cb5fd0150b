"""DTLS codecs: random bytes decode or raise DecodeError; encode/decode round trip.
The cores never raise on random datagrams either."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from crossroads.errors import DecodeError
from crossroads.proto.dtls import wire as w
from crossroads.proto.dtls.crypto import SUITES, RecordProtection, ReplayWindow
from crossroads.proto.dtls.handshake import Reassembler
from tests.proto.dtls.support import CLIENT, SERVER, Wire, make_client, make_server

DECODERS: list[Callable[[bytes], Any]] = [
    w.decode_fragments,
    w.ClientHello.decode,
    w.ServerHello.decode,
    w.HelloVerifyRequest.decode,
    w.decode_psk_identity,
    w.Alert.decode,
]

u16 = st.integers(0, 0xFFFF)
extensions = st.lists(
    st.tuples(u16, st.binary(max_size=40)), max_size=5, unique_by=lambda e: e[0]
).map(tuple)


@given(st.binary(max_size=600), st.sampled_from(DECODERS))
def test_decoders_return_or_raise_decode_error(data: bytes, decode: Any) -> None:
    try:
        decode(data)
    except DecodeError:
        pass


@given(st.binary(max_size=600))
def test_split_records_never_raises(data: bytes) -> None:
    records, bad = w.split_records(data)
    assert sum(13 + len(r.fragment) for r in records) <= len(data)
    assert (bad is None) == (sum(13 + len(r.fragment) for r in records) == len(data))


@given(
    st.lists(
        st.builds(
            w.Record,
            st.sampled_from(sorted(w.VALID_CONTENT_TYPES)),
            st.sampled_from([w.DTLS1_0, w.DTLS1_2]),
            u16,
            st.integers(0, 2**48 - 1),
            st.binary(max_size=200),
        ),
        max_size=4,
    )
)
def test_records_round_trip(records: list[w.Record]) -> None:
    assert w.split_records(b"".join(r.encode() for r in records)) == (records, None)


@given(
    st.builds(
        w.ClientHello,
        u16,
        st.binary(min_size=32, max_size=32),
        st.binary(max_size=32),
        st.binary(max_size=255),
        st.lists(u16, min_size=1, max_size=20).map(tuple),
        st.binary(min_size=1, max_size=4),
        extensions,
    )
)
def test_client_hello_round_trips(hello: w.ClientHello) -> None:
    assert w.ClientHello.decode(hello.encode()) == hello


@given(
    st.builds(
        w.ServerHello,
        u16,
        st.binary(min_size=32, max_size=32),
        st.binary(max_size=32),
        u16,
        st.integers(0, 255),
        extensions,
    )
)
def test_server_hello_round_trips(hello: w.ServerHello) -> None:
    assert w.ServerHello.decode(hello.encode()) == hello


@given(u16, st.binary(max_size=255), st.binary(max_size=300))
def test_small_messages_round_trip(
    version: int, cookie: bytes, identity: bytes
) -> None:
    verify = w.HelloVerifyRequest(version, cookie)
    assert w.HelloVerifyRequest.decode(verify.encode()) == verify
    assert w.decode_psk_identity(w.encode_psk_identity(identity)) == identity
    alert = w.Alert(version & 0xFF, version >> 8)
    assert w.Alert.decode(alert.encode()) == alert


@given(st.binary(min_size=1, max_size=3000), st.randoms(use_true_random=False))
def test_reassembly_of_shuffled_overlapping_fragments(
    body: bytes, rnd: random.Random
) -> None:
    cuts = sorted({0, len(body), *(rnd.randrange(len(body)) for _ in range(5))})
    fragments = [
        w.HandshakeFragment(1, len(body), 3, a, body[a:b])
        for a, b in zip(cuts, cuts[1:], strict=False)
    ]
    fragments += rnd.sample(fragments, k=min(2, len(fragments)))  # duplicates
    rnd.shuffle(fragments)
    reassembler = Reassembler(3)
    done = []
    for fragment in fragments:
        messages, repeated = reassembler.add(fragment)
        done += messages
        assert repeated == (len(done) == 1 and not messages)
    assert [(m.msg_type, m.message_seq, m.body) for m in done] == [(1, 3, body)]


@given(st.lists(st.integers(0, 300), max_size=200))
def test_replay_window_matches_a_set_model(sequences: list[int]) -> None:
    window = ReplayWindow()
    seen: set[int] = set()
    for seq in sequences:
        expected = seq not in seen and (not seen or seq > max(seen) - 64)
        assert window.fresh(seq) == expected
        if expected:
            window.accept(seq)
            seen.add(seq)


@settings(max_examples=300)
@given(st.binary(max_size=400))
def test_server_core_survives_random_datagrams(data: bytes) -> None:
    server = make_server()
    server.receive_datagram(data, CLIENT, 0.0)
    server.handle_timer(100.0)
    assert not server.sessions


@settings(max_examples=200)
@given(
    st.sampled_from(sorted(w.VALID_CONTENT_TYPES)),
    st.integers(0, 2),
    st.binary(max_size=300),
)
def test_server_with_a_session_survives_random_records(
    content_type: int, epoch: int, body: bytes
) -> None:
    wire = Wire(make_client(), make_server())
    wire.handshake()
    record = w.Record(content_type, w.DTLS1_2, epoch, 7, body).encode()
    wire.server.receive_datagram(record, CLIENT, wire.now)
    wire.client.receive_datagram(record, SERVER, wire.now)
    assert CLIENT in wire.server.sessions


@settings(max_examples=200)
@given(st.binary(max_size=400))
def test_client_core_survives_random_datagrams(data: bytes) -> None:
    client = make_client()
    client.start(0.0)
    client.receive_datagram(data, SERVER, 0.0)
    client.handle_timer(100.0)


def test_a_sealed_warning_is_a_two_byte_warning_alert_record() -> None:
    suite = SUITES[0x00A8]
    key, salt = bytes(range(suite.key_size)), b"salt"
    sealed = RecordProtection(suite, key, salt, 1).seal_warning(
        7, w.AlertDescription.CLOSE_NOTIFY
    )
    assert sealed == RecordProtection(suite, key, salt, 1).seal(
        w.ContentType.ALERT, 7, b"\x01\x00"
    )
    (record,), bad = w.split_records(sealed)
    assert bad is None
    assert (record.content_type, record.epoch, record.sequence) == (21, 1, 7)
    opened = RecordProtection(suite, key, salt, 1).open(record)
    assert w.Alert.decode(opened) == w.Alert(1, w.AlertDescription.CLOSE_NOTIFY)
