"""The OpenTTD server list as the coordinator serves it: when to refresh,
around the sans-I/O refresh flow of :mod:`crossroads.proto.openttd.listing`."""

from __future__ import annotations

import asyncio

from crossroads.errors import StoreError
from crossroads.proto.openttd.listing import ListingPacker, ListingRefresh, Refreshed
from crossroads.proto.openttd.record import ServerRecord
from crossroads.services.openttd.registry import Registry
from crossroads.services.openttd.runners import run_store_flow


class ListingCache:
    """The server list, re-read from the store at most every ``ttl`` s.

    Clients refresh their server list by hand and all at once after an outage;
    one HGETALL every couple of seconds serves them all. What is live, what
    is swept and how it is packed is the sans-I/O
    :mod:`crossroads.proto.openttd.listing` (its :class:`ListingRefresh` flow,
    run by :func:`~crossroads.services.openttd.runners.run_store_flow`); this
    class decides when to refresh.

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
            refresh = ListingRefresh(
                self._raw, self._newgrf_max, self.registry.wall_clock()
            )
            outcome = await run_store_flow(self.registry, refresh)
            if not isinstance(outcome, Refreshed):
                # The previous list stays; the callers count the failure.
                raise StoreError("the server list could not be read")
            self._raw = outcome.parsed
            self._newgrf_max = outcome.newgrf_max
            self.records = outcome.records
            self.loaded_at = now
            self.packer.refresh([r for r in outcome.records if r.public])
            return outcome.records

    def invalidate(self) -> None:
        self._dirty = True
