"""Shared state behind one small protocol: in memory by default, Redis to scale out."""

from crossroads.errors import ConfigError
from crossroads.store.base import REDIS_SCHEMES, Store, Subscription

__all__ = ["Store", "Subscription", "open_store"]


def open_store(url: str) -> Store:
    """Open the store named by ``url``: ``memory`` or a Redis URL
    (:mod:`crossroads.store.redis_url`: redis://, rediss://, unix://,
    redis+sentinel://)."""
    if url == "memory":
        from crossroads.store.memory import MemoryStore

        return MemoryStore()
    if url.startswith(REDIS_SCHEMES):
        from crossroads.store.redis import RedisStore

        return RedisStore(url)
    raise ConfigError(f"store: {url!r} is neither 'memory' nor a redis:// URL")
