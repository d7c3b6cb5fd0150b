"""MasterServer2 POST validation: any body gives a request or a ListingError,
and what is accepted reads back through jansson 2.4's limits."""

from __future__ import annotations

import json

from hypothesis import example, given
from hypothesis import strategies as st

from crossroads.proto.masterserver.rows import (
    MAX_JSON_INT,
    MIN_JSON_INT,
    ListingError,
    parse_post,
)

ANY_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=40),
    lambda c: (
        st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=8), c, max_size=5)
    ),
    max_leaves=30,
)


def assert_jansson_safe(value: object) -> None:
    text = json.dumps(value)
    # no lone surrogates: jansson refuses them, and they have no UTF-8 form
    json.dumps(value, ensure_ascii=False).encode("utf-8")

    def integer(token: str) -> int:
        assert MIN_JSON_INT <= int(token) <= MAX_JSON_INT
        return int(token)

    def constant(token: str) -> None:
        raise AssertionError(f"{token} is not JSON that jansson reads")

    def no_nul(item: object) -> None:
        # A NUL ends a C string: jansson refuses it in keys and values. (A key
        # or value that merely spells "NaN" or "\\u0000" is fine.)
        if isinstance(item, str):
            assert "\x00" not in item
        elif isinstance(item, dict):
            for key, inner in item.items():
                no_nul(key)
                no_nul(inner)
        elif isinstance(item, list):
            for inner in item:
                no_nul(inner)

    no_nul(json.loads(text, parse_int=integer, parse_constant=constant))


@example({"Infinity": None, "NaN": "NaN", "\\u0000": "-Infinity"}, 1)
@given(st.dictionaries(st.text(max_size=10), ANY_JSON, max_size=8), ANY_JSON)
def test_any_body_is_a_request_or_a_listing_error(
    columns: dict[str, object], req_id: object
) -> None:
    body = {"__gameId": "g", "__clientReqId": req_id, **columns}
    try:
        request = parse_post(json.dumps(body).encode(), 300)
    except ListingError as exc:
        assert 400 <= exc.status < 500
        return
    assert_jansson_safe(dict(request.columns))
    assert_jansson_safe(request.client_req_id)


@given(st.binary(max_size=300))
def test_random_bytes_are_a_request_or_a_listing_error(body: bytes) -> None:
    try:
        request = parse_post(body, 300)
    except ListingError:
        return
    assert_jansson_safe(dict(request.columns))
