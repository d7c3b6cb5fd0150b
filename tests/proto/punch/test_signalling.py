"""Signalling message codec: strict decoding, round trips, clear error reasons."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crossroads.errors import DecodeError
from crossroads.proto.punch import signalling as sig

KEY = bytes(range(32))

ENDPOINTS = st.builds(
    sig.TransportAddress,
    st.ip_addresses().map(str),
    st.integers(1, 65535),
)
CANDIDATES = st.builds(
    sig.Candidates,
    st.lists(ENDPOINTS, max_size=sig.MAX_LOCAL_CANDIDATES).map(tuple),
    st.none() | ENDPOINTS,
    st.none() | ENDPOINTS,
    st.text(max_size=40),
)
PEER_INFO = st.builds(
    sig.PeerInfo,
    st.none() | ENDPOINTS,
    st.lists(st.integers(1, 65535), max_size=3).map(tuple),
    st.sampled_from(sig.MAPPINGS),
    st.integers(-65535, 65535),
    CANDIDATES,
)
IDS = st.text(min_size=1, max_size=sig.MAX_ID_CHARS)
MEMBERS = st.builds(
    sig.Member, IDS, st.binary(min_size=32, max_size=32), st.integers(0, 2**31)
)

CLIENT_MESSAGES = st.one_of(
    st.builds(
        sig.Hello,
        st.integers(0, 1_000_000),
        st.binary(min_size=32, max_size=32),
        st.text(max_size=64),
    ),
    st.builds(sig.Ping, st.integers(0, 2**53)),
    st.builds(sig.Pong, st.integers(0, 2**53)),
    st.builds(sig.Host, st.integers(2, sig.MAX_MEMBERS)),
    st.builds(sig.Join, st.text(min_size=1, max_size=32)),
    st.builds(
        sig.JoinResult,
        IDS,
        st.lists(IDS, max_size=5).map(tuple),
        st.lists(IDS, max_size=5).map(tuple),
    ),
    st.builds(sig.JoinAnswer, IDS, IDS, st.booleans(), st.text(max_size=200)),
    st.builds(sig.Leave, IDS),
    st.builds(sig.Connect, IDS),
    st.builds(sig.PunchReady, st.integers(1, 2**31), CANDIDATES),
    st.builds(
        sig.PunchResult,
        st.integers(1, 2**31),
        st.booleans(),
        st.sampled_from(("",) + sig.STEPS),
        st.integers(0, 600_000),
    ),
    st.builds(sig.Signal, IDS, st.none() | st.integers() | st.text(max_size=100)),
)
SERVER_MESSAGES = st.one_of(
    st.builds(
        sig.Welcome,
        st.integers(0, 10),
        IDS,
        IDS,
        IDS,
        st.lists(ENDPOINTS, max_size=3).map(tuple),
        st.none()
        | st.builds(
            sig.TurnInfo,
            st.lists(ENDPOINTS, max_size=4).map(tuple),
            st.text(min_size=1, max_size=128),
            st.text(min_size=1, max_size=128),
            st.integers(0, 2**40),
        ),
    ),
    st.builds(sig.Hosted, IDS, IDS, st.integers(0, 2**31)),
    st.builds(sig.JoinStart, IDS, IDS, st.lists(MEMBERS, max_size=4).map(tuple)),
    st.builds(
        sig.Redirect,
        st.text(min_size=1, max_size=32),
        st.sampled_from(["ws://", "wss://"]).flatmap(
            lambda scheme: st.text(min_size=1, max_size=200).map(scheme.__add__)
        ),
    ),
    st.builds(sig.JoinCapable, IDS, IDS, st.binary(min_size=32, max_size=32)),
    st.builds(
        sig.JoinAccepted,
        IDS,
        st.integers(0, 2**31),
        IDS,
        st.lists(MEMBERS, max_size=4).map(tuple),
    ),
    st.builds(sig.JoinRejected, IDS, st.text(max_size=200)),
    st.builds(sig.MemberJoined, IDS, MEMBERS),
    st.builds(sig.MemberLeft, IDS, IDS, IDS),
    st.builds(sig.PunchPrepare, st.integers(1, 2**31), IDS),
    st.builds(
        sig.PunchStart,
        st.integers(1, 2**31),
        IDS,
        st.binary(min_size=32, max_size=32),
        st.sampled_from(sig.ROLES),
        st.integers(0, 60_000),
        PEER_INFO,
        PEER_INFO,
    ),
    st.builds(sig.PunchFailed, st.integers(0, 2**31), IDS, IDS),
    st.builds(sig.SignalFrom, IDS, st.none() | st.booleans() | st.text(max_size=100)),
    st.builds(sig.Error, IDS, st.text(max_size=400), st.text(max_size=64)),
)


@given(CLIENT_MESSAGES)
def test_client_messages_round_trip(message: sig.Message) -> None:
    assert sig.decode_client(sig.encode(message)) == message


@given(SERVER_MESSAGES)
def test_server_messages_round_trip(message: sig.Message) -> None:
    assert sig.decode_server(sig.encode(message)) == message


@given(st.text(max_size=300) | st.binary(max_size=300))
def test_random_frames_decode_or_raise_decode_error(frame: str | bytes) -> None:
    for decode in (sig.decode_client, sig.decode_server):
        try:
            decode(frame)
        except DecodeError:
            pass


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=20,
)


@given(
    st.sampled_from(
        [
            "hello",
            "punch_ready",
            "join_result",
            "connect",
            "signal",
            "host",
            "punch_result",
        ]
    ),
    st.dictionaries(
        st.sampled_from(
            [
                "v",
                "key",
                "attempt",
                "candidates",
                "session",
                "connected",
                "peer",
                "to",
                "data",
                "ok",
                "step",
                "ms",
                "max_members",
            ]
        ),
        JSON_VALUES,
        max_size=6,
    ),
)
def test_typed_garbage_decodes_or_raises(kind: str, members: dict[str, object]) -> None:
    try:
        sig.decode_client(json.dumps({"type": kind, **members}))
    except DecodeError:
        pass


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        ("not json", "bad-json"),
        ("[1, 2]", "not-object"),
        ('{"v": 1}', "no-type"),
        ('{"type": "teleport"}', "unknown-type"),
        ('{"type": "hello", "v": 1}', "missing-member"),
        ('{"type": "hello", "v": "1", "key": "x"}', "bad-type"),
        ('{"type": "hello", "v": 1, "key": "AAAA"}', "bad-key"),
        ('{"type": "connect", "peer": ""}', "empty"),
        ('{"type": "host", "max_members": 1000}', "out-of-range"),
        (
            '{"type": "punch_result", "attempt": 1, "ok": true, "step": "teleport"}',
            "bad-value",
        ),
        ('{"type": "join_result", "session": "s", "connected": "a"}', "bad-type"),
        (
            '{"type": "join_result", "session": "s", "connected": '
            + json.dumps([f"p{i}" for i in range(33)])
            + "}",
            "too-many",
        ),
        (
            '{"type": "punch_ready", "attempt": 1, "candidates": {"local": {}}}',
            "bad-type",
        ),
        (
            '{"type": "punch_ready", "attempt": 1, "candidates": {"local": '
            + json.dumps([["192.0.2.1", 1000 + i] for i in range(9)])
            + "}}",
            "too-many",
        ),
        ("[" * 100_000 + "]" * 100_000, "too-large"),
        ('{"type": "signal", "to": "x", "data": "' + "a" * 5000 + '"}', "too-large"),
        # 5 000 characters, 20 000 bytes of UTF-8: the limit counts bytes
        (
            '{"type": "ping", "id": 1, "pad": "' + "\U0001f600" * 5000 + '"}',
            "too-large",
        ),
    ],
)
def test_errors_have_stable_reasons(frame: str, reason: str) -> None:
    with pytest.raises(DecodeError) as info:
        sig.decode_client(frame)
    assert info.value.reason == reason


def test_deep_nesting_within_size_is_a_decode_error() -> None:
    frame = '{"type": "signal", "to": "x", "data": ' + "[" * 5000 + "]" * 5000 + "}"
    with pytest.raises(DecodeError):
        sig.decode_client(frame)


def test_unknown_members_are_ignored() -> None:
    frame = json.dumps({"type": "connect", "peer": "abc", "future": [1, 2]})
    assert sig.decode_client(frame) == sig.Connect("abc")


def test_endpoint_rejects_hostnames_and_port_zero() -> None:
    for bad in (["example.org", 1], ["1.2.3.4", 0], ["1.2.3.4", 70000], "1.2.3.4:5"):
        with pytest.raises(DecodeError):
            sig.TransportAddress.from_json(bad, "x")


def test_hello_example_from_the_protocol_document() -> None:
    key = os.urandom(32)
    import base64

    frame = json.dumps({"type": "hello", "v": 1, "key": base64.b64encode(key).decode()})
    assert sig.decode_client(frame) == sig.Hello(1, key, "")


@pytest.mark.parametrize(
    "body",
    [
        {"code": "K7QM-3XZP"},
        {"code": "K7QM-3XZP", "url": "http://x/p2p/v1/ws"},
        {"code": "K7QM-3XZP", "url": "ws://" + "x" * sig.MAX_URL_CHARS},
        {"code": "", "url": "ws://x/p2p/v1/ws"},
        {"code": "K7QM-3XZP", "url": 7},
    ],
)
def test_bad_redirects_are_refused(body: dict[str, object]) -> None:
    with pytest.raises(DecodeError):
        sig.decode_server(json.dumps({"type": "redirect", **body}))


def test_frames_are_byte_exact() -> None:
    """Members in the documented order (docs/p2p-protocol.md), renamed members
    (``from``) and nested objects as the other implementations expect them."""
    assert sig.encode(sig.SignalFrom("p1", {"a": [1]})) == (
        '{"type":"signal","from":"p1","data":{"a":[1]}}'
    )
    assert sig.encode(sig.JoinResult("s", ("a",))) == (
        '{"type":"join_result","session":"s","connected":["a"],"failed":[]}'
    )
    assert sig.encode(sig.Hosted("s", "CODE", 0)) == (
        '{"type":"hosted","session":"s","code":"CODE","seniority":0,"turn":null}'
    )
    member = sig.Member("p", KEY, 1)
    assert sig.encode(sig.MemberJoined("s", member)) == (
        '{"type":"member_joined","session":"s","member":'
        '{"peer":"p","key":"AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=","seniority":1}}'
    )
    assert sig.encode(sig.TurnRefresh()) == '{"type":"turn_refresh"}'
