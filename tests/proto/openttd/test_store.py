"""The Store requests of the coordinator's flows: the one awaited request."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from crossroads.proto.openttd.store import (
    AwaitedRequest,
    GetServer,
    KeepCode,
    StoreRead,
    StoreWrite,
)


def test_only_the_awaited_request_is_answered_and_only_once() -> None:
    awaited = AwaitedRequest()
    assert not awaited.answered(1)  # nothing sent yet
    assert awaited.read(1, GetServer("+abcdefg")) == StoreRead(1, GetServer("+abcdefg"))
    assert not awaited.answered(2)
    assert awaited.answered(1)
    assert not awaited.answered(1)  # a repeated answer
    assert awaited.write(2, KeepCode("+abcdefg")) == StoreWrite(2, KeepCode("+abcdefg"))
    assert not awaited.answered(1)  # a late answer to the previous request
    assert awaited.answered(2)


@given(st.integers(0, 5), st.lists(st.integers(0, 5), max_size=10))
def test_whatever_answers_arrive_one_is_taken_at_most(
    sent: int, answers: list[int]
) -> None:
    awaited = AwaitedRequest()
    awaited.read(sent, GetServer("+abcdefg"))
    taken = [request for request in answers if awaited.answered(request)]
    assert taken == ([sent] if sent in answers else [])
