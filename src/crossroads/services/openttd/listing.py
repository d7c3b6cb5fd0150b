"""The OpenTTD server list as the coordinator serves it: Store reads and
sweeps around the sans-I/O :mod:`crossroads.proto.openttd.listing`."""

from __future__ import annotations

import asyncio

from crossroads.proto.openttd.listing import (
    ListingPacker,
    sort_records,
    without_owners,
)
from crossroads.proto.openttd.record import ServerRecord
from crossroads.services.openttd.registry import (
    NEWGRF_COUNTER_KEY,
    SERVERS_KEY,
    Registry,
)


class ListingCache:
    """The server list, re-read from the store at most every ``ttl`` s.

    Clients refresh their server list by hand and all at once after an outage;
    one HGETALL every couple of seconds serves them all. What is live and how
    it is packed is the sans-I/O :mod:`crossroads.proto.openttd.listing`; this
    class does the reads and the sweeps.

    :meth:`invalidate` asks for an earlier refresh when a server becomes
    listable or leaves, but refreshes stay at least :data:`MIN_REFRESH` apart so
    a registration storm cannot turn every listing into an HGETALL. While one
    refresh runs, other readers get the previous list.
    """

    #: Shortest time between two refreshes, even when invalidated.
    MIN_REFRESH = 0.25

    def __init__(self, registry: Registry, ttl: float) -> None:
        self.registry = registry
        self.ttl = ttl
        self.records: list[ServerRecord] = []
        self.packer = ListingPacker(registry.newgrf_index)
        self.loaded_at = -1e9
        self._dirty = True
        self._lock = asyncio.Lock()
        self._raw: dict[str, tuple[bytes, ServerRecord]] = {}
        self._newgrf_max = 0

    def _fresh(self, now: float) -> bool:
        age = now - self.loaded_at
        return age < self.ttl and not (self._dirty and age >= self.MIN_REFRESH)

    async def all(self, now: float) -> list[ServerRecord]:
        if self._fresh(now):
            return self.records
        if self._lock.locked() and self.loaded_at > -1e9:
            # A refresh is under way (an HGETALL of every record): serve the
            # list it replaces rather than make every client wait for it.
            return self.records
        async with self._lock:
            if self._fresh(now):
                return self.records
            self._dirty = False
            raw = await self.registry.store.hgetall(SERVERS_KEY)
            parsed, dead = sort_records(raw, self._raw, self.registry.wall_clock())
            gone = await self.registry.dead_instances(
                {r.owner for _, r in parsed.values()}
            )
            dead += without_owners(parsed, gone)
            self._raw = parsed
            if dead:
                await self.registry.sweep(dead)
            live = sorted((r for _, r in parsed.values()), key=lambda r: r.registered)
            self.records = live
            self.loaded_at = now
            counter = await self.registry.store.get(NEWGRF_COUNTER_KEY)
            if counter is not None and int(counter) > self._newgrf_max:
                await self.registry.load_newgrfs()
                self._newgrf_max = int(counter)
            self.packer.refresh([r for r in live if r.public])
            return live

    def invalidate(self) -> None:
        self._dirty = True
