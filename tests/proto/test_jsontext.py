"""jsontext.loads: JSON from the network raises DecodeError and nothing else."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crossroads.errors import DecodeError
from crossroads.proto import jsontext


@given(st.binary(max_size=300) | st.text(max_size=300))
def test_random_input_decodes_or_raises_decode_error(data: bytes | str) -> None:
    try:
        jsontext.loads(data)
    except DecodeError:
        pass


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (b"9" * 5000, "bad-json"),
        ("[" * 5000 + "]" * 5000, "too-deep"),
        (b"\xff\xfe\x00", "not-utf8"),
        ("{", "bad-json"),
    ],
)
def test_hostile_json_is_a_decode_error(text: bytes | str, reason: str) -> None:
    with pytest.raises(DecodeError) as info:
        jsontext.loads(text)
    assert info.value.reason == reason


def test_valid_json_decodes() -> None:
    assert jsontext.loads(b'{"a": [1, 2.5, null, "x"]}') == {"a": [1, 2.5, None, "x"]}
