"""Small counting helpers the cores share: per-key counts and token buckets.

Pure functions on plain containers, so each core keeps its own tables (and its
own bound and eviction policy on them) and only the arithmetic is written once.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import TypeVar

K = TypeVar("K")


def decrement(counts: MutableMapping[K, int], key: K) -> None:
    """One less for ``key``; a count that reaches zero leaves the table, so a
    table of per-source counts holds only sources with something live."""
    left = counts.get(key, 0) - 1
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)


def spend_token(bucket: list[float], now: float, rate: float, burst: float) -> bool:
    """Refill ``bucket`` (``[tokens, last refill time]``, updated in place) at
    ``rate`` tokens per second up to ``burst``, then spend one token: True when
    a whole token was there, False (nothing spent) when not."""
    tokens = min(burst, bucket[0] + (now - bucket[1]) * rate)
    bucket[1] = now
    if tokens < 1.0:
        bucket[0] = tokens
        return False
    bucket[0] = tokens - 1.0
    return True
