"""The sans-I/O server list (proto/openttd/listing.py): which stored records
are live, and the GC_LISTING packets of each listing shape."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from crossroads.proto.openttd.coordinator import (
    ConnectionType,
    GcListing,
    GcNewgrfLookup,
    ServerGameType,
    decode_gc_packet,
)
from crossroads.proto.openttd.gameinfo import GameInfo, NewGRF, NewGRFSerialization
from crossroads.proto.openttd.listing import (
    MAX_SHAPES,
    ListingPacker,
    ListingRefresh,
    Refreshed,
    RefreshFailed,
    lookup_packets,
    sort_records,
    without_owners,
)
from crossroads.proto.openttd.record import ServerRecord
from crossroads.proto.openttd.store import (
    AllServers,
    DeadInstances,
    LoadNewgrfs,
    NewgrfCounter,
    StoreRead,
    StoreWrite,
    SweepServers,
)
from crossroads.proto.openttd.wire import PacketSplitter
from tests.strategies import json_values as any_json


def record(
    code: str,
    *,
    expires: float = 100.0,
    owner: str = "a",
    revision: str = "14.1",
    updated: float = 1.0,
    direct: list[tuple[str, int]] | None = None,
) -> ServerRecord:
    return ServerRecord(
        code=code,
        owner=owner,
        session="s",
        protocol=6,
        game_type=ServerGameType.PUBLIC,
        connection_type=ConnectionType.DIRECT,
        source="192.0.2.1",
        port=3979,
        direct=direct if direct is not None else [("192.0.2.1", 3979)],
        registered=0.0,
        expires=expires,
        game_info_version=7,
        info=GameInfo(server_name=f"server {code}", server_revision=revision),
        updated=updated,
    )


def test_corrupt_and_expired_records_are_named_for_sweeping() -> None:
    raw = {
        "+live": record("+live").to_json(),
        "+old": record("+old", expires=10.0).to_json(),
        "+bad": b"{not json",
        "+half": b'{"code": "+half"}',
    }
    parsed, dead = sort_records(raw, {}, wall=50.0)
    assert list(parsed) == ["+live"]
    assert sorted(dead) == ["+bad", "+half", "+old"]


def test_unchanged_bytes_are_not_parsed_again() -> None:
    value = record("+a").to_json()
    first, _ = sort_records({"+a": value}, {}, wall=0.0)
    again, _ = sort_records({"+a": value}, first, wall=0.0)
    assert again["+a"][1] is first["+a"][1]
    changed, _ = sort_records({"+a": record("+a", updated=2.0).to_json()}, first, 0.0)
    assert changed["+a"][1] is not first["+a"][1]


def test_records_of_gone_instances_are_dropped() -> None:
    parsed, _ = sort_records(
        {
            "+a": record("+a", owner="x").to_json(),
            "+b": record("+b", owner="y").to_json(),
        },
        {},
        wall=0.0,
    )
    assert without_owners(parsed, {"y"}) == ["+b"]
    assert list(parsed) == ["+a"]


def names(packets: list[bytes]) -> list[str]:
    out = []
    for packet_type, payload in PacketSplitter().feed(b"".join(packets)):
        message = decode_gc_packet(packet_type, payload, 6)
        assert isinstance(message, GcListing)
        out += [entry.info.server_name for entry in message.entries]
    return out


def test_the_clients_own_revision_comes_first() -> None:
    packer = ListingPacker({})
    packer.refresh([record("+a", revision="13.0"), record("+b", revision="14.1")])
    packets = packer.packets(7, NewGRFSerialization.GRFID_MD5, True, "14.1")
    assert names(packets) == ["server +b", "server +a"]


def test_without_invite_codes_a_server_needs_a_direct_address() -> None:
    packer = ListingPacker({})
    direct, hidden = (
        record("+a", direct=[("2001:db8::1", 3979)]),
        record("+b", direct=[]),
    )
    assert packer.entry(hidden, 4, NewGRFSerialization.GRFID_MD5, False) is None
    entry = packer.entry(direct, 4, NewGRFSerialization.GRFID_MD5, False)
    assert entry is not None and b"[2001:db8::1]:3979" in entry


def test_shapes_are_packed_once_per_refresh_and_bounded() -> None:
    packer = ListingPacker({})
    packer.refresh([record("+a")])
    first = packer.packets(7, NewGRFSerialization.GRFID_MD5, True, "r")
    assert packer.packets(7, NewGRFSerialization.GRFID_MD5, True, "r") is first
    for n in range(MAX_SHAPES * 2):
        packer.packets(7, NewGRFSerialization.GRFID_MD5, True, f"r{n}")
    assert len(packer._packed) <= MAX_SHAPES
    packer.refresh([record("+a")])
    assert packer.packets(7, NewGRFSerialization.GRFID_MD5, True, "r") is not first


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.text(max_size=8), st.binary(max_size=64), max_size=8))
def test_any_stored_bytes_are_live_or_swept(raw: dict[str, bytes]) -> None:
    parsed, dead = sort_records(raw, {}, wall=0.0)
    assert set(parsed) | set(dead) == set(raw)


json_values = any_json(text_size=8, width=3, max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(list(json.loads(record("+a").to_json()))), json_values)
def test_a_record_with_any_field_corrupted_is_live_or_swept(
    key: str, value: object
) -> None:
    fields = json.loads(record("+a").to_json())
    fields[key] = value
    parsed, dead = sort_records({"+a": json.dumps(fields).encode()}, {}, wall=0.0)
    assert list(parsed) + dead == ["+a"]


def test_numbers_out_of_range_make_a_record_corrupt() -> None:
    for key, value in (("expires", "1" + "0" * 400), ("port", "Infinity")):
        text = record("+a").to_json().decode()
        fields = json.loads(text)
        fields[key] = 0
        raw = json.dumps(fields).replace(f'"{key}": 0', f'"{key}": {value}')
        assert sort_records({"+a": raw.encode()}, {}, wall=0.0) == ({}, ["+a"])


def test_a_client_gets_the_newgrf_entries_after_its_cursor() -> None:
    table = {i: NewGRF(i, bytes(16), f"grf {i}") for i in (1, 2, 3)}

    def indexes(packets: list[bytes]) -> tuple[list[int], set[int]]:
        seen: list[int] = []
        cursors: set[int] = set()
        for packet_type, payload in PacketSplitter().feed(b"".join(packets)):
            message = decode_gc_packet(packet_type, payload, 6)
            assert isinstance(message, GcNewgrfLookup)
            seen += [index for index, _ in message.entries]
            cursors.add(message.cursor)
        return seen, cursors

    assert indexes(lookup_packets(table, 0)) == ([1, 2, 3], {3})
    assert indexes(lookup_packets(table, 2)) == ([3], {3})
    assert lookup_packets(table, 3) == []
    # A cursor beyond our table (another deployment's): everything again.
    assert indexes(lookup_packets(table, 9)) == ([1, 2, 3], {3})
    assert lookup_packets({}, 0) == []


def answer_one(commands: list[Any], kind: type) -> Any:
    assert len(commands) == 1 and isinstance(commands[0], kind), commands
    return commands[0]


def test_a_refresh_reads_sweeps_and_reloads_newgrfs_in_order() -> None:
    previous, _ = sort_records({"+a": record("+a").to_json()}, {}, wall=0.0)
    refresh = ListingRefresh(previous, newgrf_max=1000, wall=50.0)
    read = answer_one(refresh.start(), StoreRead)
    assert read.query == AllServers()
    raw = {
        "+a": record("+a", owner="x").to_json(),
        "+b": record("+b", owner="gone").to_json(),
        "+old": record("+old", expires=10.0).to_json(),
        "+bad": b"{",
    }
    dead = answer_one(refresh.store_result(read.request, raw), StoreRead)
    assert dead.query == DeadInstances(frozenset({"x", "gone"}))
    assert refresh.store_result(dead.request + 1, set()) == []  # not its request
    sweep = answer_one(refresh.store_result(dead.request, {"gone"}), StoreWrite)
    assert isinstance(sweep.update, SweepServers)
    assert sorted(sweep.update.codes) == ["+b", "+bad", "+old"]
    counter = answer_one(refresh.store_result(sweep.request, None), StoreRead)
    assert counter.query == NewgrfCounter()
    load = answer_one(refresh.store_result(counter.request, b"2000"), StoreWrite)
    assert load.update == LoadNewgrfs()
    done = answer_one(refresh.store_result(load.request, None), Refreshed)
    assert [r.code for r in done.records] == ["+a"]
    assert list(done.parsed) == ["+a"] and done.newgrf_max == 2000


def test_nothing_to_sweep_and_no_new_newgrfs_take_three_reads() -> None:
    refresh = ListingRefresh({}, newgrf_max=2000, wall=0.0)
    read = answer_one(refresh.start(), StoreRead)
    dead = answer_one(
        refresh.store_result(read.request, {"+a": record("+a").to_json()}), StoreRead
    )
    counter = answer_one(refresh.store_result(dead.request, set()), StoreRead)
    assert counter.query == NewgrfCounter()
    done = answer_one(refresh.store_result(counter.request, b"2000"), Refreshed)
    assert done.newgrf_max == 2000 and [r.code for r in done.records] == ["+a"]


@given(
    st.integers(0, 3),
    st.one_of(
        st.none(),
        st.text(max_size=5),
        st.binary(max_size=25),
        st.integers(),
        st.lists(st.binary(max_size=3), max_size=3),
    ),
)
def test_a_failure_or_a_malformed_answer_at_any_step_ends_it_without_a_crash(
    fail_at: int, junk: object
) -> None:
    """Whatever the Store answers (or fails) at step ``fail_at``, the refresh
    ends in one outcome and never lists a record it did not parse."""
    good: list[object] = [{"+a": record("+a").to_json()}, set(), b"0", None]
    refresh = ListingRefresh({}, newgrf_max=0, wall=0.0)
    commands: list[Any] = refresh.start()
    step = 0
    while isinstance(commands[0], StoreRead | StoreWrite):
        request = commands[0].request
        if step == fail_at:
            commands = (
                refresh.store_failed(request)
                if junk is None
                else (refresh.store_result(request, junk))
            )
        else:
            commands = refresh.store_result(request, good[min(step, 3)])
        step += 1
        assert len(commands) == 1
    outcome = commands[0]
    assert isinstance(outcome, Refreshed | RefreshFailed)
    if isinstance(outcome, Refreshed):
        assert all(r.code == "+a" for r in outcome.records)
