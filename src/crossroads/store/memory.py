"""In-memory Store for the embedded, single-process default."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping


class MemorySubscription:
    # Bounded so a subscriber that stops reading cannot grow memory without end;
    # the oldest message is dropped, as a lagging Redis subscriber would lose it.
    MAX_QUEUED = 10_000

    def __init__(self, store: MemoryStore, channel: str) -> None:
        self._store = store
        self._channel = channel
        self._queue: asyncio.Queue[bytes] = asyncio.Queue()
        self._closed = False

    def _deliver(self, message: bytes) -> None:
        if self._queue.qsize() >= self.MAX_QUEUED:
            self._queue.get_nowait()
        self._queue.put_nowait(message)

    async def get(self, timeout: float | None = None) -> bytes | None:
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            return None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while not self._closed:
            yield await self._queue.get()

    async def close(self) -> None:
        self._closed = True
        self._store._unsubscribe(self._channel, self)


class MemoryStore:
    """A Store in this process's memory. Expired keys vanish on the next access."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._clock = clock
        #: Stream ids are Unix milliseconds, as Redis makes them.
        self._wall_clock = wall_clock
        self._values: dict[str, bytes | dict[str, bytes] | int] = {}
        #: Capped streams: (id milliseconds, sequence, value), oldest first.
        self._streams: dict[str, deque[tuple[int, int, bytes]]] = {}
        self._deadlines: dict[str, float] = {}
        self._subscribers: dict[str, list[MemorySubscription]] = {}

    def _drop(self, key: str) -> None:
        """Forget ``key``: its value and its deadline."""
        self._values.pop(key, None)
        self._streams.pop(key, None)
        self._deadlines.pop(key, None)

    def _live(self, key: str) -> bool:
        deadline = self._deadlines.get(key)
        if deadline is not None and deadline <= self._clock():
            self._drop(key)
        return key in self._values

    def _expire_all(self) -> None:
        now = self._clock()
        for key in [k for k, d in self._deadlines.items() if d <= now]:
            self._drop(key)

    async def get(self, key: str) -> bytes | None:
        if not self._live(key):
            return None
        value = self._values[key]
        if isinstance(value, int):
            return str(value).encode()
        if isinstance(value, dict):
            raise TypeError(f"{key} holds a hash")
        return value

    async def set(
        self,
        key: str,
        value: bytes,
        *,
        ttl: float | None = None,
        only_if_absent: bool = False,
    ) -> bool:
        if only_if_absent and self._live(key):
            return False
        self._values[key] = bytes(value)
        if ttl is None:
            self._deadlines.pop(key, None)
        else:
            self._deadlines[key] = self._clock() + ttl
        return True

    async def delete(self, *keys: str) -> int:
        count = 0
        for key in keys:
            if self._live(key):
                count += 1
            self._drop(key)
        return count

    async def delete_if_equal(self, key: str, value: bytes) -> bool:
        if not self._live(key) or self._values.get(key) != value:
            return False
        self._drop(key)
        return True

    async def expire(self, key: str, ttl: float) -> bool:
        if not self._live(key):
            return False
        self._deadlines[key] = self._clock() + ttl
        return True

    async def ttl(self, key: str) -> float | None:
        if not self._live(key) or key not in self._deadlines:
            return None
        return max(0.0, self._deadlines[key] - self._clock())

    async def incr(self, key: str, amount: int = 1) -> int:
        current = 0
        if self._live(key):
            value = self._values[key]
            if isinstance(value, dict):
                raise TypeError(f"{key} holds a hash")
            current = value if isinstance(value, int) else int(value)
        self._values[key] = current + amount
        return current + amount

    async def keys(self, prefix: str) -> list[str]:
        self._expire_all()
        return [k for k in self._values if k.startswith(prefix)]

    def _hash(self, key: str, create: bool) -> dict[str, bytes] | None:
        if not self._live(key):
            if not create:
                return None
            self._values[key] = {}
        value = self._values[key]
        if not isinstance(value, dict):
            raise TypeError(f"{key} does not hold a hash")
        return value

    async def hset(self, key: str, mapping: Mapping[str, bytes]) -> None:
        table = self._hash(key, create=True)
        assert table is not None
        table.update({k: bytes(v) for k, v in mapping.items()})

    async def hget(self, key: str, field: str) -> bytes | None:
        table = self._hash(key, create=False)
        return None if table is None else table.get(field)

    async def hgetall(self, key: str) -> dict[str, bytes]:
        table = self._hash(key, create=False)
        return {} if table is None else dict(table)

    async def hdel(self, key: str, *fields: str) -> int:
        table = self._hash(key, create=False)
        if table is None:
            return 0
        count = sum(1 for f in fields if table.pop(f, None) is not None)
        if not table:
            await self.delete(key)
        return count

    async def hincrby(self, key: str, field: str, amount: int = 1) -> int:
        table = self._hash(key, create=True)
        assert table is not None
        value = int(table.get(field, b"0")) + amount
        table[field] = str(value).encode()
        return value

    async def stream_add(self, key: str, value: bytes, *, maxlen: int) -> str:
        if key in self._values:
            raise TypeError(f"{key} does not hold a stream")
        stream = self._streams.get(key)
        if stream is None or stream.maxlen != maxlen:
            stream = self._streams[key] = deque(stream or (), maxlen=max(1, maxlen))
        millis = int(self._wall_clock() * 1000)
        sequence = 0
        if stream:
            last_millis, last_sequence, _ = stream[-1]
            # Ids only grow, as Redis's do, even if the clock steps back.
            if millis <= last_millis:
                millis, sequence = last_millis, last_sequence + 1
        stream.append((millis, sequence, bytes(value)))
        return f"{millis}-{sequence}"

    async def stream_range(
        self, key: str, *, count: int, since_ms: int = 0
    ) -> list[tuple[str, bytes]]:
        found: list[tuple[str, bytes]] = []
        for millis, sequence, value in reversed(self._streams.get(key, ())):
            if len(found) >= count or millis < since_ms:
                break
            found.append((f"{millis}-{sequence}", value))
        return found

    async def stream_len(self, key: str) -> int:
        return len(self._streams.get(key, ()))

    async def publish(self, channel: str, message: bytes) -> int:
        subscribers = list(self._subscribers.get(channel, ()))
        for subscriber in subscribers:
            subscriber._deliver(bytes(message))
        return len(subscribers)

    async def subscribe(self, channel: str) -> MemorySubscription:
        subscription = MemorySubscription(self, channel)
        self._subscribers.setdefault(channel, []).append(subscription)
        return subscription

    def _unsubscribe(self, channel: str, subscription: MemorySubscription) -> None:
        subscribers = self._subscribers.get(channel, [])
        if subscription in subscribers:
            subscribers.remove(subscription)
        if not subscribers:
            self._subscribers.pop(channel, None)

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        self._subscribers.clear()
