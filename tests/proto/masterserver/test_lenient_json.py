"""RakNet's loose JSON: strict JSON round-trips, the samples' bodies parse."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crossroads.errors import DecodeError
from crossroads.proto.masterserver.lenient_json import loads

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(), c, max_size=4),
    max_leaves=15,
)


@given(JSON)
def test_strict_json_round_trips(value: object) -> None:
    assert loads(json.dumps(value)) == value


@given(st.text(max_size=200))
def test_random_text_parses_or_raises_decode_error(text: str) -> None:
    try:
        loads(text)
    except DecodeError:
        pass


def test_raknet_sample_body() -> None:
    # Help/nattraversalarchitecture.html, step 6 (with the format arguments filled)
    body = "{'__gameId': myGameId, '__clientReqId': '0', '__timeoutSec': '30', '__rowId': 18446744073709551615, 'routerIsOpen': 1 }"
    assert loads(body) == {
        "__gameId": "myGameId",
        "__clientReqId": "0",
        "__timeoutSec": "30",
        "__rowId": 2**64 - 1,
        "routerIsOpen": 1,
    }


def test_escapes_and_trailing_commas() -> None:
    assert loads("{'a': 'it\\'s \\u00e9', b: [1, 2,],}") == {"a": "it's é", "b": [1, 2]}


@pytest.mark.parametrize(
    "text",
    [
        "{'a' 1}",
        "{'a': }",
        "['x'",
        "{'a': 'open",
        "[" * 100 + "'x'" + "]" * 100,
        "{'a': 1} x",
    ],
)
def test_malformed(text: str) -> None:
    with pytest.raises(DecodeError):
        loads(text)
