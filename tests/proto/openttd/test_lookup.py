"""Resolving a join's invite code (proto/openttd/lookup.py)."""

from __future__ import annotations

from crossroads.proto.openttd.lookup import CodeLookup, Resolved
from crossroads.proto.openttd.record import ServerRecord
from crossroads.proto.openttd.store import (
    GetServer,
    StoreRead,
)
from tests.proto.openttd.test_listing import record as listed_record

CODE = "+abcdefg"


def record() -> ServerRecord:
    return listed_record(CODE, owner="other")


def test_junk_is_unknown_without_a_store_read() -> None:
    for junk in ("", "abcdefg", "+", "+0O1l", "+" + "a" * 31):
        assert CodeLookup(junk, None).start() == [Resolved(None)]


def test_a_code_seated_here_is_answered_from_memory() -> None:
    live = record()
    assert CodeLookup(CODE, live).start() == [Resolved(live)]


def test_other_codes_are_read_from_the_store() -> None:
    lookup = CodeLookup(CODE, None)
    read = lookup.start()
    assert read == [StoreRead(1, GetServer(CODE))]
    assert lookup.store_result(2, record()) == []  # not what it asked
    stored = record()
    assert lookup.store_result(1, stored) == [Resolved(stored)]
    assert lookup.store_result(1, stored) == []  # once


def test_unknown_codes_malformed_answers_and_store_failures() -> None:
    unknown = CodeLookup(CODE, None)
    unknown.start()
    assert unknown.store_result(1, None) == [Resolved(None)]
    odd = CodeLookup(CODE, None)
    odd.start()
    assert odd.store_result(1, b"not a record") == [Resolved(None)]
    failed = CodeLookup(CODE, None)
    failed.start()
    assert failed.store_failed(1) == [Resolved(None, store_failed=True)]
    assert failed.store_failed(1) == []
