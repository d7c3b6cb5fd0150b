"""The insight recorder: ring and stream bounded, pseudonymous by default,
records and usage kept in the store (and so across an instance's restart)."""

from __future__ import annotations

import stat
from pathlib import Path

from prometheus_client import CollectorRegistry

from crossroads.insight import (
    STREAM_KEY,
    AttemptFilter,
    Config,
    InsightRecorder,
    load_or_create_key,
    recorder_for,
)
from crossroads.proto.insight import Attempt, Step, Usage
from crossroads.store.base import Store
from crossroads.store.memory import MemoryStore
from crossroads.store.redis import RedisStore

DAY = 1_700_000_000.0  # 2023-11-14 UTC


def attempt(rec: InsightRecorder, n: int, **overrides: object) -> Attempt:
    values: dict[str, object] = {
        "family": "relay",
        "session": f"CODE{n % 3}",
        "started": DAY + n,
        "duration": 1.0,
        "sides": (rec.side(f"198.51.100.{n % 250}"), rec.side("203.0.113.9")),
        "steps": (Step("relay", 0.0, 1.0, "ok"),),
        "winner": "relay",
        "outcome": "relayed",
        "cause": "relay-only",
        "game": "game-a" if n % 2 else "game-b",
        "usage": Usage(1, 1000, 2, 2000),
    }
    values.update(overrides)
    return Attempt(**values)  # type: ignore[arg-type]


async def drain(rec: InsightRecorder) -> None:
    await rec.close()


async def test_ring_is_bounded_and_filters() -> None:
    rec = InsightRecorder(config=Config(ring=5))
    for n in range(20):
        rec.record(attempt(rec, n, outcome="failed" if n % 4 == 0 else "relayed"))
    assert len(rec.ring) == 5
    recent = await rec.attempts(AttemptFilter())
    assert [a.started for a in recent] == [DAY + n for n in range(19, 14, -1)]
    failed = await rec.attempts(AttemptFilter(outcome="failed"))
    assert [a.started for a in failed] == [DAY + 16]
    assert all(a.instance == rec.instance for a in recent)


async def test_disabled_keeps_nothing() -> None:
    rec = InsightRecorder(config=Config(enabled=False))
    rec.record(attempt(rec, 1))
    assert not rec.ring


async def test_metrics_count_by_family_outcome_cause() -> None:
    registry = CollectorRegistry()
    rec = InsightRecorder()
    rec.register(registry)
    rec.record(attempt(rec, 1))
    rec.record(attempt(rec, 2, family="natneg", outcome="direct", cause="", usage=None))
    labels = {"family": "relay", "outcome": "relayed", "cause": "relay-only"}
    assert registry.get_sample_value("crossroads_insight_attempts_total", labels) == 1
    assert (
        registry.get_sample_value(
            "crossroads_insight_relayed_bytes_total", {"family": "relay"}
        )
        == 3000
    )


async def test_store_stream_is_capped_and_usage_totalled() -> None:
    store = MemoryStore()
    rec = recorder_for(Config(stream_max=7), store, None)
    rec.clock = lambda: DAY + 100
    rec.start()
    for n in range(30):
        rec.record(attempt(rec, n))
    await drain(rec)
    assert await store.stream_len(STREAM_KEY) == 7
    usage = await rec.usage()
    games = {(e["game"], e["day"]): e for e in usage["per_game"]}
    assert games[("game-a", "2023-11-14")]["sessions"] == 15
    assert games[("game-a", "2023-11-14")]["bytes_up"] == 15_000
    assert games[("game-b", "2023-11-14")]["bytes_down"] == 30_000
    # Per code: from the records the stream keeps (7 of them).
    assert sum(e["sessions"] for e in usage["per_code"]) == 7


async def test_no_raw_address_in_the_store_unless_asked() -> None:
    for raw in (False, True):
        store = MemoryStore()
        rec = recorder_for(Config(raw_addresses=raw), store, None)
        rec.start()
        rec.record(attempt(rec, 7))
        await drain(rec)
        [(_id, value)] = await store.stream_range(STREAM_KEY, count=10)
        assert (b"198.51.100.7" in value) is raw
        assert b"198.51.100.0/24" in value


async def test_records_survive_an_instance_restart_with_redis(redis_url: str) -> None:
    first_store: Store = RedisStore(redis_url)
    first = recorder_for(Config(stream_max=50, secret="shared"), first_store, None)
    first.start()
    for n in range(120):
        first.record(attempt(first, n))
    await drain(first)
    await first_store.close()
    # A new instance (fresh process state, same store) answers for them.
    second_store: Store = RedisStore(redis_url)
    second = recorder_for(Config(stream_max=50, secret="shared"), second_store, None)
    second.clock = lambda: DAY + 100
    try:
        assert not second.ring
        found = await second.attempts(AttemptFilter(limit=1000))
        # The stream is bounded: at least the newest 50, at most one node more.
        assert 50 <= len(found) <= 150
        assert found[0].started == DAY + 119
        assert found[0].instance == first.instance
        assert found[0].sides[0] == second.side("198.51.100.119")  # same key
        usage = await second.usage()
        assert sum(e["sessions"] for e in usage["per_game"]) == 120
    finally:
        await second_store.close()


def test_key_file_created_once_private(tmp_path: Path) -> None:
    key = load_or_create_key(tmp_path / "state")
    assert len(key) == 32
    assert load_or_create_key(tmp_path / "state") == key
    mode = (tmp_path / "state" / "insight.key").stat().st_mode
    assert stat.S_IMODE(mode) == 0o600


async def test_summary_counts_causes_and_ranks_codes_by_bytes() -> None:
    rec = InsightRecorder()
    rec.record(attempt(rec, 0, session="BIG", usage=Usage(5, 50_000, 5, 50_000)))
    rec.record(attempt(rec, 1, session="SMALL"))
    rec.record(attempt(rec, 2, family="natneg", cause="both-symmetric"))
    rec.record(attempt(rec, 3, family="natneg", cause="both-symmetric"))
    rec.record(
        attempt(rec, 4, outcome="failed", cause="timed-out", winner="", usage=None)
    )
    rec.record(attempt(rec, 5, family="natneg", outcome="direct", cause="", usage=None))
    summary = await rec.summary(top=2)
    assert summary["why_relayed"] == [
        {"cause": "both-symmetric", "count": 2},
        {"cause": "relay-only", "count": 2},
    ]
    assert summary["why_failed"] == [{"cause": "timed-out", "count": 1}]
    assert [c["code"] for c in summary["top_codes"]] == ["BIG", "CODE0"]
    outcomes = {(o["family"], o["outcome"]): o["count"] for o in summary["outcomes"]}
    assert outcomes == {
        ("natneg", "direct"): 1,
        ("natneg", "relayed"): 2,
        ("relay", "failed"): 1,
        ("relay", "relayed"): 2,
    }
