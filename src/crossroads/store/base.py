"""The Store protocol.

A deliberately small key-value surface — the operations Redis does natively and
that the services need to share state between processes: TTL keys refreshed by a
heartbeat (registrations, relay nodes), ``SET NX`` claims (invite codes, join codes,
slots), counters, hashes, and pub/sub to route a command to the instance that
holds a peer's socket. Keys are strings, values bytes; services own their key
prefixes (``openttd:``, ``relay:``, ...).

Both implementations pass the same contract suite (``tests/store/test_contract.py``),
the Redis one against a real ``redis-server``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Protocol

#: URL schemes of the Redis store (see crossroads.store.redis_url).
REDIS_SCHEMES = (
    "redis://",
    "rediss://",
    "unix://",
    "redis+sentinel://",
    "rediss+sentinel://",
)


class Subscription(Protocol):
    """Messages published on one channel after the subscription was made."""

    def __aiter__(self) -> AsyncIterator[bytes]: ...

    async def get(self, timeout: float | None = None) -> bytes | None:
        """The next message, or None when ``timeout`` seconds pass without one."""
        ...

    async def close(self) -> None: ...


class Store(Protocol):
    """Shared state. All TTLs are in seconds (floats allowed, millisecond precision)."""

    async def get(self, key: str) -> bytes | None: ...

    async def set(
        self,
        key: str,
        value: bytes,
        *,
        ttl: float | None = None,
        only_if_absent: bool = False,
    ) -> bool:
        """Store ``value``; with ``only_if_absent`` only when the key is free.

        Returns True when the value was written.
        """
        ...

    async def delete(self, *keys: str) -> int:
        """Delete keys; returns how many existed."""
        ...

    async def expire(self, key: str, ttl: float) -> bool:
        """Set a key's TTL; False when the key does not exist."""
        ...

    async def delete_if_equal(self, key: str, value: bytes) -> bool:
        """Delete ``key`` only while it holds ``value``, atomically (a claim is
        released only by its holder). True when it was deleted."""
        ...

    async def ttl(self, key: str) -> float | None:
        """Seconds left, or None when the key is missing or has no TTL."""
        ...

    async def incr(self, key: str, amount: int = 1) -> int: ...

    async def keys(self, prefix: str) -> list[str]:
        """Every live key starting with ``prefix`` (scanned, not KEYS)."""
        ...

    async def hset(self, key: str, mapping: Mapping[str, bytes]) -> None: ...

    async def hget(self, key: str, field: str) -> bytes | None: ...

    async def hgetall(self, key: str) -> dict[str, bytes]: ...

    async def hdel(self, key: str, *fields: str) -> int: ...

    async def hincrby(self, key: str, field: str, amount: int = 1) -> int:
        """Add ``amount`` to an integer field of a hash (created at 0)."""
        ...

    async def stream_add(self, key: str, value: bytes, *, maxlen: int) -> str:
        """Append ``value`` to the capped stream at ``key``; returns its id
        (``"<unix ms>-<seq>"``, increasing). The stream keeps at least the
        newest ``maxlen`` entries and at most ``maxlen`` plus one Redis stream
        node (``stream-node-max-entries``, 100 by default): Redis trims whole
        nodes (``XADD MAXLEN ~``), which is what makes the cap cheap."""
        ...

    async def stream_range(
        self, key: str, *, count: int, since_ms: int = 0
    ) -> list[tuple[str, bytes]]:
        """The newest ``count`` entries of the stream, newest first, with an
        id at or after ``since_ms`` (Unix milliseconds; 0: any)."""
        ...

    async def stream_len(self, key: str) -> int:
        """Entries in the stream at ``key`` (0 when there is none)."""
        ...

    async def publish(self, channel: str, message: bytes) -> int:
        """Send to every current subscriber; returns how many got it (0 is fine)."""
        ...

    async def subscribe(self, channel: str) -> Subscription: ...

    async def ping(self) -> bool:
        """True when the backend answers (used by /healthz)."""
        ...

    async def close(self) -> None: ...
