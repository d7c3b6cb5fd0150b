"""Redis-backed Store (redis-py asyncio): many processes, many machines, one state."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from crossroads.errors import StoreError
from crossroads.store.redis_url import redis_client

T = TypeVar("T")


log = logging.getLogger("crossroads.store")


class OutageLog:
    """One log line when the store becomes unreachable and one when it answers
    again, however many operations fail in between (a traceback per
    request and per heartbeat would bury the one fact that matters)."""

    def __init__(self, url: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.url = url
        self.clock = clock
        #: When the current outage started (None: the store answers).
        self.down_since: float | None = None
        #: Operations that failed in the current outage.
        self.failures = 0
        #: Outages seen since start.
        self.outages = 0

    def failed(self, exc: Exception) -> None:
        self.failures += 1
        if self.down_since is None:
            self.down_since = self.clock()
            self.outages += 1
            log.warning("store %s is unreachable: %s", _redact(self.url), exc)

    def answered(self) -> None:
        if self.down_since is not None:
            log.warning(
                "store %s answers again after %.1f s (%d operations failed)",
                _redact(self.url),
                self.clock() - self.down_since,
                self.failures,
            )
            self.down_since = None
            self.failures = 0


def _redact(url: str) -> str:
    """The URL without a password (``redis://:secret@host`` -> ``redis://***@host``)."""
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        rest = "***@" + rest.rsplit("@", 1)[1]
    return scheme + sep + rest


async def _guard(call: Awaitable[T], outage: OutageLog | None = None) -> T:
    try:
        result = await call
    except RedisError as exc:
        if outage is not None:
            outage.failed(exc)
        raise StoreError(f"redis: {exc}") from exc
    if outage is not None:
        outage.answered()
    return result


class RedisSubscription:
    def __init__(self, pubsub: PubSub) -> None:
        self._pubsub = pubsub

    async def get(self, timeout: float | None = None) -> bytes | None:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            wait = 1.0 if deadline is None else max(0.0, deadline - loop.time())
            message = await _guard(
                self._pubsub.get_message(ignore_subscribe_messages=True, timeout=wait)
            )
            if message is not None and message.get("type") == "message":
                data = message["data"]
                return data if isinstance(data, bytes) else str(data).encode()
            if deadline is not None and loop.time() >= deadline:
                return None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while True:
            message = await self.get()
            if message is not None:
                yield message

    async def close(self) -> None:
        await self._pubsub.aclose()  # type: ignore[no-untyped-call]


_DELETE_IF_EQUAL = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def _millis(ttl: float) -> int:
    """A TTL in whole milliseconds, at least 1: a TTL under a millisecond
    would round to ``PX 0``, which Redis refuses ("invalid expire time")."""
    return max(1, int(ttl * 1000))


class RedisStore:
    """A Store on a Redis server. Reconnects on its own (redis-py's pool)."""

    #: Connections per process. A burst beyond it waits for a free connection
    #: (BlockingConnectionPool) instead of failing at once, which redis-py's
    #: default pool does when its limit is reached.
    MAX_CONNECTIONS = 64
    #: How long an operation waits for a pooled connection before StoreError.
    POOL_TIMEOUT = 10.0
    #: How long one reply may take. Every Store call is one small command (or a
    #: SCAN page of 500 keys) that a live Redis answers in well under a
    #: millisecond; a Redis that stopped answering (SIGSTOP, a frozen VM, a
    #: black-holed route: the socket stays open, nothing comes back) would
    #: otherwise hold the caller -- an HTTP request, a heartbeat -- for as long
    #: as redis-py's default allows (none before redis-py 6; 5 s, retried, in
    #: 8.x: 20 s a call measured). 2 s leaves a loaded machine ample margin.
    SOCKET_TIMEOUT = 2.0
    #: A PING on a connection idle this long before it is used (redis-py's
    #: health check): a connection a restarted Redis dropped is noticed there.
    HEALTH_CHECK_INTERVAL = 10
    #: Retries of a command on a dropped connection (a Redis restart: the
    #: pool's connection is stale, a new one works) -- not on a read timeout: a
    #: Redis that did not answer in SOCKET_TIMEOUT will not answer a retry.
    RETRIES = 1

    def __init__(self, url: str) -> None:
        self.url = url
        self._redis: aioredis.Redis = redis_client(
            url,
            max_connections=self.MAX_CONNECTIONS,
            timeout=self.POOL_TIMEOUT,
            decode_responses=False,
            health_check_interval=self.HEALTH_CHECK_INTERVAL,
            retry=Retry(
                NoBackoff(), self.RETRIES, supported_errors=(RedisConnectionError,)
            ),
            socket_timeout=self.SOCKET_TIMEOUT,
            socket_connect_timeout=5,
        )
        self.outage = OutageLog(url)

    async def _run(self, call: Awaitable[T]) -> T:
        return await _guard(call, self.outage)

    async def get(self, key: str) -> bytes | None:
        value: Any = await self._run(self._redis.get(key))
        return None if value is None else bytes(value)

    async def set(
        self,
        key: str,
        value: bytes,
        *,
        ttl: float | None = None,
        only_if_absent: bool = False,
    ) -> bool:
        px = None if ttl is None else _millis(ttl)
        result = await self._run(self._redis.set(key, value, px=px, nx=only_if_absent))
        return bool(result)

    async def delete(self, *keys: str) -> int:
        if not keys:
            return 0
        return int(await self._run(self._redis.delete(*keys)))

    async def delete_if_equal(self, key: str, value: bytes) -> bool:
        # GET and DEL in one script: nothing can claim the key in between.
        deleted = await self._run(self._redis.eval(_DELETE_IF_EQUAL, 1, key, value))
        return bool(deleted)

    async def expire(self, key: str, ttl: float) -> bool:
        return bool(await self._run(self._redis.pexpire(key, _millis(ttl))))

    async def ttl(self, key: str) -> float | None:
        millis = int(await self._run(self._redis.pttl(key)))
        return None if millis < 0 else millis / 1000

    async def incr(self, key: str, amount: int = 1) -> int:
        return int(await self._run(self._redis.incrby(key, amount)))

    async def keys(self, prefix: str) -> list[str]:
        pattern = prefix.replace("[", r"\[").replace("*", r"\*").replace("?", r"\?")

        async def scan() -> list[str]:
            found: list[str] = []
            async for key in self._redis.scan_iter(match=pattern + "*", count=500):
                found.append(key.decode() if isinstance(key, bytes) else str(key))
            return found

        # Guarded like every other call: a scan against a dead Redis raised
        # redis' own ConnectionError, which reached HTTP handlers as a 500.
        return await self._run(scan())

    async def hset(self, key: str, mapping: Mapping[str, bytes]) -> None:
        if mapping:
            await self._run(self._redis.hset(key, mapping=dict(mapping)))  # type: ignore[arg-type]

    async def hget(self, key: str, field: str) -> bytes | None:
        value: Any = await self._run(self._redis.hget(key, field))
        return None if value is None else bytes(value)

    async def hgetall(self, key: str) -> dict[str, bytes]:
        raw: Any = await self._run(self._redis.hgetall(key))
        return {k.decode(): v for k, v in raw.items()}

    async def hdel(self, key: str, *fields: str) -> int:
        if not fields:
            return 0
        return int(await self._run(self._redis.hdel(key, *fields)))

    async def hincrby(self, key: str, field: str, amount: int = 1) -> int:
        return int(await self._run(self._redis.hincrby(key, field, amount)))

    async def stream_add(self, key: str, value: bytes, *, maxlen: int) -> str:
        # MAXLEN ~: Redis trims whole stream nodes, O(1) amortised; exact
        # trimming (=) would rewrite a node on every append.
        entry: Any = await self._run(
            self._redis.xadd(key, {"v": value}, maxlen=max(1, maxlen), approximate=True)
        )
        return entry.decode() if isinstance(entry, bytes) else str(entry)

    async def stream_range(
        self, key: str, *, count: int, since_ms: int = 0
    ) -> list[tuple[str, bytes]]:
        if count <= 0:
            return []
        raw: Any = await self._run(
            self._redis.xrevrange(key, "+", f"{max(0, since_ms)}-0", count=count)
        )
        found: list[tuple[str, bytes]] = []
        for entry_id, fields in raw:
            value = fields.get(b"v")
            if value is None:
                continue  # not written by stream_add: ignore it
            name = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
            found.append((name, bytes(value)))
        return found

    async def stream_len(self, key: str) -> int:
        return int(await self._run(self._redis.xlen(key)))

    async def publish(self, channel: str, message: bytes) -> int:
        return int(await self._run(self._redis.publish(channel, message)))

    async def subscribe(self, channel: str) -> RedisSubscription:
        pubsub = self._redis.pubsub()
        await self._run(pubsub.subscribe(channel))
        return RedisSubscription(pubsub)

    async def ping(self) -> bool:
        try:
            return bool(await self._run(self._redis.ping()))
        except StoreError:
            return False

    async def close(self) -> None:
        await self._redis.aclose()
        await self._redis.connection_pool.disconnect()
