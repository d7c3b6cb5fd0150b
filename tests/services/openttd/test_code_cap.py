"""The global invite-code cap counts the codes drawn in the last 30 days, one
store counter a UTC day (registry.CODE_DAYS), over every instance."""

from __future__ import annotations

import os

from crossroads.services.openttd.registry import CODE_DAY, CODE_DAYS, Registry
from crossroads.store.memory import MemoryStore


async def test_the_cap_spans_the_reservation_lifetime_and_all_instances() -> None:
    wall = [1_000 * CODE_DAY]
    store = MemoryStore(clock=lambda: wall[0])
    one, two = (
        Registry(store, os.urandom, wall_clock=lambda: wall[0], max_codes=3)
        for _ in range(2)
    )
    assert await one.new_code() and await two.new_code()
    wall[0] += CODE_DAY  # drawn yesterday still counts (each lives 30 days)
    assert await one.new_code()
    assert await two.new_code() is None
    assert await one.new_code() is None  # refusals are not counted as codes
    wall[0] += (CODE_DAYS - 2) * CODE_DAY  # the first day's codes still count
    assert await one.new_code() is None
    wall[0] += CODE_DAY  # ... until they expired: two codes free again
    assert await two.new_code() and await one.new_code()
    assert await one.new_code() is None


async def test_no_cap_draws_without_counting() -> None:
    store = MemoryStore()
    registry = Registry(store, os.urandom)
    codes = {await registry.new_code() for _ in range(5)}
    assert len(codes) == 5 and None not in codes
    assert await store.keys("openttd:codes:") == []
