"""A server's SERVER_UPDATE and its leaving as Store flows: requests out,
answers in."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from crossroads.proto.openttd.coordinator import ServerUpdate
from crossroads.proto.openttd.gameinfo import GameInfo, NewGRF, NewGRFSerialization
from crossroads.proto.openttd.record import ServerRecord
from crossroads.proto.openttd.store import (
    AnnounceInstance,
    DeleteServer,
    IndexNewgrfs,
    KeepCode,
    PutServer,
    StoreWrite,
)
from crossroads.proto.openttd.update import (
    Beat,
    BeatFailed,
    InstanceBeat,
    Left,
    ServerLeavingFlow,
    ServerUpdateFlow,
    Updated,
    UpdateFailed,
)
from tests.proto.openttd.test_registration import CODE, WALL
from tests.proto.openttd.test_registration import record as owned_record

TTL = 90.0
GRFS = (NewGRF(1, bytes(16), "one"), NewGRF(2, bytes(range(16)), None))


def record() -> ServerRecord:
    """A seated server's record before its first update."""
    return owned_record("0a1b2c3d")


def update(newgrfs: tuple[NewGRF, ...] = ()) -> ServerUpdate:
    return ServerUpdate(
        protocol=6,
        game_info_version=7,
        serialization=NewGRFSerialization.GRFID_MD5,
        info=GameInfo(server_name="x", newgrfs=newgrfs),
    )


def only(commands: list[Any], kind: type) -> Any:
    assert len(commands) == 1 and isinstance(commands[0], kind), commands
    return commands[0]


def test_an_update_without_newgrfs_writes_the_record_and_the_first_lists_it() -> None:
    stored = record()
    flow = ServerUpdateFlow(stored, update(), 512, WALL, TTL)
    put = only(flow.start(), StoreWrite)
    assert put.update == PutServer(stored)
    assert stored.info == GameInfo(server_name="x")
    assert stored.game_info_version == 7
    assert (stored.updated, stored.expires) == (WALL, WALL + TTL)
    assert flow.store_result(put.request + 1, None) == []  # not its request
    assert only(flow.store_result(put.request, None), Updated) == Updated(0, True)
    # The next update of a listed server does not refresh the listing.
    again = ServerUpdateFlow(stored, update(), 512, WALL + 30, TTL)
    put = only(again.start(), StoreWrite)
    assert again.store_result(put.request, None) == [Updated(0, False)]
    assert stored.expires == WALL + 30 + TTL


def test_newgrfs_are_indexed_within_the_budget_before_the_write() -> None:
    stored = record()
    flow = ServerUpdateFlow(stored, update(GRFS), 1, WALL, TTL)
    index = only(flow.start(), StoreWrite)
    assert index.update == IndexNewgrfs(GRFS, 1)
    assert stored.info is None  # not touched before the index is written
    put = only(flow.store_result(index.request, 1), StoreWrite)
    assert isinstance(put.update, PutServer)
    assert flow.store_result(put.request, None) == [Updated(1, True)]


def test_no_budget_left_means_no_index_request() -> None:
    flow = ServerUpdateFlow(record(), update(GRFS), 0, WALL, TTL)
    assert isinstance(only(flow.start(), StoreWrite).update, PutServer)


def test_a_store_failure_ends_the_update_and_an_index_failure_leaves_the_record() -> (
    None
):
    stored = record()
    flow = ServerUpdateFlow(stored, update(GRFS), 512, WALL, TTL)
    index = only(flow.start(), StoreWrite)
    assert flow.store_failed(index.request) == [UpdateFailed(0)]
    assert stored.info is None and stored.expires == WALL + 10
    assert flow.store_result(index.request, 3) == []  # over

    flow = ServerUpdateFlow(stored, update(GRFS), 512, WALL, TTL)
    index = only(flow.start(), StoreWrite)
    put = only(flow.store_result(index.request, 2), StoreWrite)
    assert flow.store_failed(put.request) == [UpdateFailed(2)]


@given(st.one_of(st.none(), st.booleans(), st.text(), st.integers(-(2**40), 2**40)))
def test_a_malformed_index_answer_never_spends_outside_the_budget(
    answer: object,
) -> None:
    flow = ServerUpdateFlow(record(), update(GRFS), 5, WALL, TTL)
    index = only(flow.start(), StoreWrite)
    put = only(flow.store_result(index.request, answer), StoreWrite)
    updated = only(flow.store_result(put.request, None), Updated)
    assert 0 <= updated.newgrfs_indexed <= 5


def test_leaving_deletes_the_record_of_its_own_session_once() -> None:
    flow = ServerLeavingFlow(CODE, "s1")
    delete = only(flow.start(), StoreWrite)
    assert delete.update == DeleteServer(CODE, "s1")
    assert flow.store_result(delete.request + 5, None) == []
    assert flow.store_result(delete.request, None) == [Left(False)]
    assert flow.store_failed(delete.request) == []

    failing = ServerLeavingFlow(CODE, "s1")
    delete = only(failing.start(), StoreWrite)
    assert failing.store_failed(delete.request) == [Left(True)]


def test_a_beat_that_finds_its_key_does_nothing_more() -> None:
    beat = InstanceBeat("0a1b2c3d", [record()])
    announce = only(beat.start(), StoreWrite)
    assert announce.update == AnnounceInstance("0a1b2c3d")
    assert beat.store_result(announce.request, False) == [Beat(0)]


def test_a_beat_after_the_store_lost_everything_puts_every_record_back() -> None:
    first, second = record(), record()
    second.code = "+def"
    beat = InstanceBeat("0a1b2c3d", [first, second])
    command = only(beat.start(), StoreWrite)
    writes = []
    answer: object = True  # the liveness key was missing
    while True:
        commands = beat.store_result(command.request, answer)
        if not isinstance(commands[0], StoreWrite):
            break
        command = only(commands, StoreWrite)
        writes.append(command.update)
        answer = None
    assert writes == [
        KeepCode(CODE),
        PutServer(first),
        KeepCode("+def"),
        PutServer(second),
    ]
    assert commands == [Beat(2)]


@given(st.integers(0, 5), st.booleans())
def test_a_store_failure_stops_the_beat_wherever_it_comes(
    fail_at: int, junk_first: bool
) -> None:
    beat = InstanceBeat("0a1b2c3d", [record(), record()])
    commands: list[Any] = beat.start()
    step = 0
    while isinstance(commands[0], StoreWrite):
        request = commands[0].request
        assert beat.store_result(request + 7, True) == []  # never its request
        if step == fail_at:
            commands = beat.store_failed(request)
            assert commands == [BeatFailed()]
            break
        commands = beat.store_result(request, True if step == 0 else None)
        step += 1
    else:
        assert commands == [Beat(2)]
    if junk_first:
        assert beat.store_result(0, True) == []  # over: nothing more happens
