"""One contract, two stores: the in-memory default and a real redis-server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from crossroads.store.base import Store
from crossroads.store.memory import MemoryStore
from crossroads.store.redis import RedisStore


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    if request.param == "memory":
        backend: Store = MemoryStore()
    else:
        backend = RedisStore(request.getfixturevalue("redis_url"))
    try:
        yield backend
    finally:
        await backend.close()


async def test_set_get_delete(store: Store) -> None:
    assert await store.get("k") is None
    assert await store.set("k", b"v1")
    assert await store.get("k") == b"v1"
    assert await store.delete("k", "missing") == 1
    assert await store.get("k") is None


async def test_set_only_if_absent_claims_once(store: Store) -> None:
    assert await store.set("code:ABC", b"one", only_if_absent=True)
    assert not await store.set("code:ABC", b"two", only_if_absent=True)
    assert await store.get("code:ABC") == b"one"


async def test_ttl_expires(store: Store) -> None:
    await store.set("short", b"x", ttl=0.15)
    remaining = await store.ttl("short")
    assert remaining is not None and 0 < remaining <= 0.15
    await asyncio.sleep(0.3)
    assert await store.get("short") is None
    assert await store.set("short", b"y", only_if_absent=True)


async def test_delete_if_equal_releases_only_the_holders_claim(store: Store) -> None:
    await store.set("claim", b"me", ttl=10)
    assert not await store.delete_if_equal("claim", b"someone else")
    assert await store.get("claim") == b"me"
    assert await store.delete_if_equal("claim", b"me")
    assert await store.get("claim") is None
    assert not await store.delete_if_equal("claim", b"me")  # already gone
    await store.incr("counter")
    assert not await store.delete_if_equal("counter", b"me")


async def test_expire_refreshes_and_reports_missing(store: Store) -> None:
    await store.set("hb", b"x", ttl=0.2)
    assert await store.expire("hb", 10)
    await asyncio.sleep(0.3)
    assert await store.get("hb") == b"x"
    assert not await store.expire("nothing", 10)
    assert await store.ttl("nothing") is None


async def test_incr(store: Store) -> None:
    assert await store.incr("n") == 1
    assert await store.incr("n", 5) == 6
    assert await store.get("n") == b"6"


async def test_keys_by_prefix(store: Store) -> None:
    for name in ("a:1", "a:2", "b:1"):
        await store.set(name, b"")
    assert sorted(await store.keys("a:")) == ["a:1", "a:2"]
    assert await store.keys("zzz") == []


async def test_hashes(store: Store) -> None:
    await store.hset("h", {"x": b"1", "y": b"2"})
    assert await store.hget("h", "x") == b"1"
    assert await store.hgetall("h") == {"x": b"1", "y": b"2"}
    assert await store.hdel("h", "x", "nope") == 1
    assert await store.hgetall("h") == {"y": b"2"}
    assert await store.hgetall("missing") == {}


async def test_publish_subscribe(store: Store) -> None:
    subscription = await store.subscribe("events")
    try:
        assert await store.publish("events", b"hello") == 1
        assert await subscription.get(timeout=2) == b"hello"
        assert await subscription.get(timeout=0.1) is None
    finally:
        await subscription.close()
    assert await store.publish("events", b"nobody") == 0


async def test_ping(store: Store) -> None:
    assert await store.ping()


async def test_redis_down_is_a_store_error() -> None:
    from crossroads.errors import StoreError
    from tests.conftest import free_port

    store = RedisStore(f"redis://127.0.0.1:{free_port()}/0")
    try:
        assert not await store.ping()
        with pytest.raises(StoreError):
            await store.get("k")
    finally:
        await store.close()


async def test_redis_burst_beyond_pool_size_waits_instead_of_failing(
    redis_url: str,
) -> None:
    store = RedisStore(redis_url)
    try:
        burst = RedisStore.MAX_CONNECTIONS * 4
        results = await asyncio.gather(
            *(store.set(f"burst:{i}", b"x") for i in range(burst))
        )
        assert all(results)
        assert len(await store.keys("burst:")) == burst
    finally:
        await store.close()


async def test_hincrby_counts_in_a_hash(store: Store) -> None:
    assert await store.hincrby("usage", "a", 5) == 5
    assert await store.hincrby("usage", "a", 2) == 7
    assert await store.hincrby("usage", "b") == 1
    assert await store.hgetall("usage") == {"a": b"7", "b": b"1"}


async def test_stream_is_capped_and_read_newest_first(store: Store) -> None:
    ids = [await store.stream_add("s", f"{i}".encode(), maxlen=10) for i in range(300)]
    assert ids == sorted(ids, key=lambda i: tuple(map(int, i.split("-"))))
    length = await store.stream_len("s")
    # At least the newest maxlen; at most one Redis stream node (100) more.
    assert 10 <= length <= 10 + 100
    newest = await store.stream_range("s", count=3)
    assert [value for _id, value in newest] == [b"299", b"298", b"297"]
    assert [entry_id for entry_id, _ in newest] == ids[::-1][:3]
    assert await store.stream_range("missing", count=5) == []
    assert await store.stream_len("missing") == 0


async def test_stream_range_since(store: Store) -> None:
    first = await store.stream_add("s", b"old", maxlen=100)
    await asyncio.sleep(0.01)
    second = await store.stream_add("s", b"new", maxlen=100)
    since = int(second.split("-")[0])
    assert int(first.split("-")[0]) < since
    assert [v for _i, v in await store.stream_range("s", count=10, since_ms=since)] == [
        b"new"
    ]
    assert len(await store.stream_range("s", count=10)) == 2
