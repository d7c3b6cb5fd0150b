"""Validation of MasterServer2 requests (reference §2.3), without I/O.

A POST/PUT body is a JSON object (or RakNet's loose JSON, see
:mod:`.lenient_json`). Members whose names start with ``__`` are control fields;
every other member is a user column stored with the row. Errors carry the HTTP
status RakNet's server used: 400 for bad JSON, empty or badly typed fields and
unknown games, 401 for a wrong password, 403 for ``__timeoutSec`` out of range or
too many rows from one IP.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from crossroads.errors import DecodeError
from crossroads.proto.masterserver.lenient_json import loads
from crossroads.types import frozen

#: MasterServer2's public limits: default 60 s, at least 15 s, at most 300 s
#: (900 on private servers; the service's ``master_max_timeout`` picks).
DEFAULT_TIMEOUT = 60
MIN_TIMEOUT = 15
#: ``__minResultsHint``: default 200, clamped to 10..500 (reference §2.3).
DEFAULT_RESULTS_HINT = 200
MIN_RESULTS_HINT = 10
MAX_RESULTS_HINT = 500
#: Bounds on what a row may hold, so one client cannot store megabytes: 64
#: columns, 64-character names, values of at most 1024 characters (a string's
#: length, or an array's or object's compact JSON text).
MAX_COLUMNS = 64
MAX_COLUMN_NAME = 64
MAX_VALUE_CHARS = 1024
MAX_ID_CHARS = 64
#: The readers are RakNet's samples, which parse responses with jansson 2.4:
#: its ``json_int_t`` is ``long long``, so a single integer above 2^63-1 (or
#: below -2^63) anywhere in a GET makes ``json_loads`` fail for the whole
#: response -- one such row would hide the game from every later reader. Row
#: ids and every number a row stores are held to that range.
MAX_JSON_INT = 2**63 - 1
MIN_JSON_INT = -(2**63)
MAX_ROW_ID = MAX_JSON_INT

#: Control fields a POST may carry (others starting with ``__`` are ignored).
CONTROL_FIELDS = frozenset(
    {
        "__gameId",
        "__clientReqId",
        "__timeoutSec",
        "__rowId",
        "__rowPW",
        "__updatePW",
        "__readPW",
        "__geoIP",
    }
)


class ListingError(Exception):
    """A request the listing refuses; ``status`` is the HTTP status."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


Scalar = str | int | float | bool | None
#: A column value: a scalar, or an array/object of them (ComprehensivePCGame
#: posts ``'natTypes' : [ {'type': 5} ]``).
JsonValue = Scalar | list["JsonValue"] | dict[str, "JsonValue"]


@frozen
class PostRequest:
    game_id: str
    client_req_id: Scalar
    has_client_req_id: bool
    timeout: int
    row_id: int | None
    row_pw: str
    update_pw: str
    read_pw: str
    columns: Mapping[str, JsonValue]


def _text(obj: Mapping[str, Any], key: str, *, required: bool = False) -> str:
    value = obj.get(key)
    if value is None:
        if required:
            raise ListingError(400, "missing_field", f"{key} is required")
        return ""
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ListingError(400, "bad_type", f"{key} must be a string")
    text = str(value)
    if required and not text:
        raise ListingError(400, "empty_field", f"{key} must not be empty")
    if len(text) > MAX_ID_CHARS:
        raise ListingError(400, "bad_type", f"{key} is longer than {MAX_ID_CHARS}")
    return text


def parse_int(value: Any, key: str, low: int, high: int) -> int:
    """An integer given as a JSON number or a decimal string (the samples send
    ``'__timeoutSec': '30'``)."""
    if isinstance(value, bool):
        raise ListingError(400, "bad_type", f"{key} must be an integer")
    if isinstance(value, str):
        text = value.strip()
        if not text.isdigit() or len(text) > 20:
            raise ListingError(400, "bad_type", f"{key} must be an integer")
        value = int(text)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int):
        raise ListingError(400, "bad_type", f"{key} must be an integer")
    if not low <= value <= high:
        raise ListingError(400, "bad_value", f"{key} must be in {low}..{high}")
    return value


def _jansson_problem(value: Any) -> str | None:
    """Why jansson 2.4 could not read ``value`` back, or None.

    Beyond the integer range above: jansson < 2.6 refuses ``\\u0000`` in
    strings and keys, every version refuses lone UTF-16 surrogates, and JSON has
    no NaN or Infinity (Python's ``json`` accepts and writes all of these).
    """
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        if not MIN_JSON_INT <= value <= MAX_JSON_INT:
            return "an integer outside the signed 64-bit range"
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else "a non-finite number"
    if isinstance(value, str):
        if "\x00" in value or any("\ud800" <= c <= "\udfff" for c in value):
            return "a NUL character or a lone surrogate"
        return None
    if isinstance(value, list):
        for item in value:
            if (problem := _jansson_problem(item)) is not None:
                return problem
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            problem = _jansson_problem(key) or _jansson_problem(item)
            if problem is not None:
                return problem
        return None
    return "an unsupported value"  # pragma: no cover - the parsers give no other type


def check_column(key: str, value: Any) -> JsonValue:
    """A user column's value, refused with 400 unless RakNet can read it back."""
    if not key or len(key) > MAX_COLUMN_NAME:
        raise ListingError(400, "bad_column", "column names are 1..64 characters")
    problem = _jansson_problem(key) or _jansson_problem(value)
    if problem is not None:
        raise ListingError(400, "bad_value", f"column {key[:64]} holds {problem}")
    if isinstance(value, str):
        size = len(value)
    elif isinstance(value, list | dict):
        size = len(json.dumps(value, separators=(",", ":")))
    else:
        size = 0
    if size > MAX_VALUE_CHARS:
        raise ListingError(400, "bad_type", f"column {key[:64]} is too long")
    result: JsonValue = value
    return result


def parse_post(body: bytes, max_timeout: int) -> PostRequest:
    """Validate a POST/PUT body."""
    if not body.strip():
        raise ListingError(400, "bad_json", "the body is empty")
    try:
        obj = loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise ListingError(400, "bad_json", "the body is not UTF-8") from None
    except DecodeError as exc:
        raise ListingError(400, "bad_json", str(exc)) from None
    if not isinstance(obj, dict):
        raise ListingError(400, "bad_json", "the body must be a JSON object")
    game_id = _text(obj, "__gameId", required=True)
    if _jansson_problem(game_id) is not None:
        raise ListingError(400, "bad_value", "__gameId cannot be echoed")
    timeout = DEFAULT_TIMEOUT
    if obj.get("__timeoutSec") is not None:
        timeout = parse_int(obj["__timeoutSec"], "__timeoutSec", 0, 2**31)
        if not MIN_TIMEOUT <= timeout <= max_timeout:
            raise ListingError(
                403,
                "timeout_out_of_range",
                f"__timeoutSec must be in {MIN_TIMEOUT}..{max_timeout}",
            )
    row_id = None
    if obj.get("__rowId") is not None:
        row_id = parse_int(obj["__rowId"], "__rowId", 0, MAX_ROW_ID)
    req_id = obj.get("__clientReqId")
    if isinstance(req_id, dict | list):
        raise ListingError(400, "bad_type", "__clientReqId must be a scalar")
    if isinstance(req_id, str) and len(req_id) > MAX_ID_CHARS:
        raise ListingError(400, "bad_type", "__clientReqId is too long")
    if _jansson_problem(req_id) is not None:
        raise ListingError(400, "bad_value", "__clientReqId cannot be echoed")
    if obj.get("__geoIP") is not None:
        _text(obj, "__geoIP")
    columns: dict[str, JsonValue] = {}
    for key, value in obj.items():
        if key.startswith("__"):
            continue
        columns[key] = check_column(key, value)
        if len(columns) > MAX_COLUMNS:
            raise ListingError(
                400, "too_many_columns", f"at most {MAX_COLUMNS} columns"
            )
    return PostRequest(
        game_id=game_id,
        client_req_id=req_id,
        has_client_req_id="__clientReqId" in obj,
        timeout=timeout,
        row_id=row_id,
        row_pw=_text(obj, "__rowPW"),
        update_pw=_text(obj, "__updatePW"),
        read_pw=_text(obj, "__readPW"),
        columns=columns,
    )


def results_hint(value: str | None) -> int:
    """``__minResultsHint``, clamped to 10..500 (default 200)."""
    if value is None or value == "":
        return DEFAULT_RESULTS_HINT
    hint = parse_int(value, "__minResultsHint", 0, 2**31)
    return max(MIN_RESULTS_HINT, min(MAX_RESULTS_HINT, hint))
