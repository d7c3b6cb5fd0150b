"""One bounded map for every table keyed by what the network sends.

Per-source token buckets, reply-source caches, history tables: each must stay
bounded whatever the number of addresses an attacker has, so a new key arriving
at a full table pushes an old one out. :class:`BoundedMap` is that table, in one
place, with the two policies the limits use:

- ``lru=True`` (the default): the least recently *used* entry goes -- a
  :meth:`~BoundedMap.get` or :meth:`~BoundedMap.put` of a key makes it the
  newest. A rate limiter wants this: a source that keeps knocking (and keeps
  being refused) stays tracked while a flood of new addresses pushes out the
  idle ones, instead of being forgotten and getting a fresh bucket.
- ``lru=False``: the oldest *inserted* entry goes (FIFO), for tables whose
  entries matter by age (a history of recent events).

Why not a plain dict with ``del d[next(iter(d))]``: CPython leaves a dummy slot
where an entry was deleted, and ``next(iter(d))`` walks past every dummy at the
front of the table, so evicting one by one under a flood of new keys costs
O(evictions since the last resize) each -- tens of microseconds per datagram
at 65,536 entries (the same finding as :mod:`crossroads.proto.reflection`). An
``OrderedDict`` evicts from its linked list in O(1).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class BoundedMap(Generic[K, V]):
    """A mapping of at most ``capacity`` entries (see the module docstring).
    ``evicted`` counts the entries pushed out (a metric for the owner)."""

    __slots__ = ("capacity", "lru", "evicted", "_entries")

    def __init__(self, capacity: int, *, lru: bool = True) -> None:
        if capacity < 1:
            raise ValueError("a bounded map holds at least one entry")
        self.capacity = capacity
        self.lru = lru
        self.evicted = 0
        self._entries: OrderedDict[K, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[K]:
        return iter(self._entries)

    def get(self, key: K) -> V | None:
        """The value of ``key`` or None (with ``lru``, ``key`` becomes the newest)."""
        value = self._entries.get(key)
        if value is not None and self.lru:
            self._entries.move_to_end(key)
        return value

    def peek(self, key: K) -> V | None:
        """The value of ``key`` or None, without making it the newest."""
        return self._entries.get(key)

    def put(self, key: K, value: V) -> None:
        """Set ``key``; a new key at a full map first evicts the oldest entry."""
        entries = self._entries
        if key in entries:
            entries[key] = value
            if self.lru:
                entries.move_to_end(key)
            return
        if len(entries) >= self.capacity:
            entries.popitem(last=False)
            self.evicted += 1
        entries[key] = value

    def pop(self, key: K) -> V | None:
        """Remove ``key``; its value, or None when absent."""
        return self._entries.pop(key, None)

    def items(self) -> list[tuple[K, V]]:
        """A snapshot of the entries, oldest first (safe to modify the map while
        walking it)."""
        return list(self._entries.items())

    def clear(self) -> None:
        self._entries.clear()
