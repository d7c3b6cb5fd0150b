"""The typed messages of the OpenTTD coordinators' bus (proto/openttd/bus.py):
every message survives its round trip, the wire format is the JSON earlier
versions publish, and no input makes the decoder raise anything but
DecodeError (the bus drops and counts those)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crossroads.errors import DecodeError
from crossroads.proto.openttd.bus import (
    MAX_MESSAGE,
    BusMessage,
    ConnectedReport,
    ConnectFailedReport,
    DropSession,
    ForwardToServer,
    PeerReport,
    StunReport,
    StunSeen,
    decode_bus_message,
)
from crossroads.proto.openttd.wire import TCP_MTU
from tests.proto.openttd.strategies import u8, u16
from tests.strategies import json_values as any_json

names = st.text(max_size=80)
reports = st.one_of(
    st.builds(ConnectFailedReport, u8),
    st.just(ConnectedReport()),
    st.builds(StunReport, u8, st.booleans()),
)
messages: st.SearchStrategy[BusMessage] = st.one_of(
    st.builds(ForwardToServer, names, st.binary(max_size=TCP_MTU)),
    st.builds(PeerReport, names, names, reports),
    st.builds(StunSeen, names, u8, names, u16),
    st.builds(DropSession, names, names),
)


@settings(max_examples=300, deadline=None)
@given(messages)
def test_every_message_survives_its_round_trip(message: BusMessage) -> None:
    raw = message.encode()
    assert len(raw) <= MAX_MESSAGE
    assert decode_bus_message(raw) == message


@pytest.mark.parametrize(
    ("message", "fields"),
    [
        (
            ForwardToServer("+abc", b"\x03\x00\x01"),
            {"t": "send", "code": "+abc", "data": "AwAB"},
        ),
        (
            PeerReport("Sx", "+abc", ConnectFailedReport(2)),
            {"t": "event", "token": "Sx", "code": "+abc", "ev": "failed", "n": 2},
        ),
        (
            PeerReport("Sx", "+abc", ConnectedReport()),
            {"t": "event", "token": "Sx", "code": "+abc", "ev": "connected"},
        ),
        (
            PeerReport("Sx", "+abc", StunReport(1, True)),
            {
                "t": "event",
                "token": "Sx",
                "code": "+abc",
                "ev": "stun",
                "family": 1,
                "ok": True,
            },
        ),
        (
            StunSeen("Cx", 2, "2001:db8::1", 3975),
            {
                "t": "seen",
                "token": "Cx",
                "family": 2,
                "host": "2001:db8::1",
                "port": 3975,
            },
        ),
        (DropSession("+abc", "s1"), {"t": "drop", "code": "+abc", "session": "s1"}),
    ],
)
def test_the_wire_format_is_the_one_earlier_versions_publish(
    message: BusMessage, fields: dict[str, object]
) -> None:
    assert json.loads(message.encode()) == fields
    assert decode_bus_message(json.dumps(fields).encode()) == message


def raw(**fields: object) -> bytes:
    return json.dumps(fields).encode()


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"{", "bad-json"),
        (b"\xff", "not-utf8"),
        (b"[1]", "bad-message"),
        (b" " * (MAX_MESSAGE + 1), "too-large"),
        (raw(t="shutdown"), "unknown-message"),
        (raw(code="+abc"), "unknown-message"),
        (raw(t="send", code="+abc", data="not base64!"), "bad-send"),
        (raw(t="send", code=7, data=""), "bad-send"),
        (raw(t="send", code="+a", data="A" * (4 * (TCP_MTU // 3 + 1))), "bad-send"),
        (raw(t="event", token="S", code="+a", ev="exploded"), "bad-event"),
        (raw(t="event", token="S", code="+a", ev="failed", n=256), "bad-event"),
        (raw(t="event", token="S", code="+a", ev="failed", n=True), "bad-event"),
        (raw(t="event", token="S", code="+a", ev="stun", family=1, ok=1), "bad-event"),
        (raw(t="event", token="S", ev="connected"), "bad-event"),
        (raw(t="seen", token="C", family=1, host="h", port=70000), "bad-seen"),
        (raw(t="seen", token="C", family="1", host="h", port=1), "bad-seen"),
        (raw(t="drop", code="+a"), "bad-drop"),
        (raw(t="drop", code="+a", session="x" * 256), "bad-drop"),
    ],
)
def test_malformed_messages_are_refused_with_a_reason(data: bytes, reason: str) -> None:
    with pytest.raises(DecodeError) as refused:
        decode_bus_message(data)
    assert refused.value.reason == reason


json_values = any_json()


@settings(max_examples=500, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=300),
        json_values.map(lambda v: json.dumps(v).encode()),
        st.fixed_dictionaries(
            {
                "t": st.sampled_from(["send", "event", "seen", "drop"])
                | st.text(max_size=5)
            },
            optional={
                key: json_values
                for key in (
                    "code",
                    "data",
                    "token",
                    "ev",
                    "n",
                    "family",
                    "ok",
                    "host",
                    "port",
                    "session",
                )
            },
        ).map(lambda v: json.dumps(v).encode()),
    )
)
def test_any_input_decodes_or_is_refused(data: bytes) -> None:
    try:
        message = decode_bus_message(data)
    except DecodeError:
        return
    # What decodes encodes back to something that decodes to the same.
    assert decode_bus_message(message.encode()) == message
