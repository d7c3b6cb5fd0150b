"""A Store wrapper that bounds how many operations are in flight.

Thousands of OpenTTD connections can each await the store at once (a reconnect
storm after an outage registers every server together). redis-py's pool has a
fixed number of connections and fails an operation at once when none is free,
so the OpenTTD service queues its store operations here instead: at most
:data:`MAX_IN_FLIGHT` at a time, the rest wait their turn.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from crossroads.store.base import Store, Subscription

#: Concurrent store operations of one OpenTTD service. Below redis-py's default
#: pool of 100 connections, leaving room for pub/sub connections and for other
#: services of the same process sharing the pool.
MAX_IN_FLIGHT = 48


class BoundedStore:
    """Delegates to ``store`` with at most ``limit`` operations at once."""

    def __init__(self, store: Store, limit: int = MAX_IN_FLIGHT) -> None:
        self.inner = store
        self._slots = asyncio.Semaphore(limit)

    async def get(self, key: str) -> bytes | None:
        async with self._slots:
            return await self.inner.get(key)

    async def set(
        self,
        key: str,
        value: bytes,
        *,
        ttl: float | None = None,
        only_if_absent: bool = False,
    ) -> bool:
        async with self._slots:
            return await self.inner.set(
                key, value, ttl=ttl, only_if_absent=only_if_absent
            )

    async def delete(self, *keys: str) -> int:
        async with self._slots:
            return await self.inner.delete(*keys)

    async def delete_if_equal(self, key: str, value: bytes) -> bool:
        async with self._slots:
            return await self.inner.delete_if_equal(key, value)

    async def expire(self, key: str, ttl: float) -> bool:
        async with self._slots:
            return await self.inner.expire(key, ttl)

    async def ttl(self, key: str) -> float | None:
        async with self._slots:
            return await self.inner.ttl(key)

    async def incr(self, key: str, amount: int = 1) -> int:
        async with self._slots:
            return await self.inner.incr(key, amount)

    async def keys(self, prefix: str) -> list[str]:
        async with self._slots:
            return await self.inner.keys(prefix)

    async def hset(self, key: str, mapping: Mapping[str, bytes]) -> None:
        async with self._slots:
            await self.inner.hset(key, mapping)

    async def hget(self, key: str, field: str) -> bytes | None:
        async with self._slots:
            return await self.inner.hget(key, field)

    async def hgetall(self, key: str) -> dict[str, bytes]:
        async with self._slots:
            return await self.inner.hgetall(key)

    async def hdel(self, key: str, *fields: str) -> int:
        async with self._slots:
            return await self.inner.hdel(key, *fields)

    async def hincrby(self, key: str, field: str, amount: int = 1) -> int:
        async with self._slots:
            return await self.inner.hincrby(key, field, amount)

    async def stream_add(self, key: str, value: bytes, *, maxlen: int) -> str:
        async with self._slots:
            return await self.inner.stream_add(key, value, maxlen=maxlen)

    async def stream_range(
        self, key: str, *, count: int, since_ms: int = 0
    ) -> list[tuple[str, bytes]]:
        async with self._slots:
            return await self.inner.stream_range(key, count=count, since_ms=since_ms)

    async def stream_len(self, key: str) -> int:
        async with self._slots:
            return await self.inner.stream_len(key)

    async def publish(self, channel: str, message: bytes) -> int:
        async with self._slots:
            return await self.inner.publish(channel, message)

    async def subscribe(self, channel: str) -> Subscription:
        # A subscription holds its own connection for its lifetime; it is not
        # an operation to queue.
        return await self.inner.subscribe(channel)

    async def ping(self) -> bool:
        return await self.inner.ping()

    async def close(self) -> None:
        """The runtime owns the real store; nothing to close here."""
