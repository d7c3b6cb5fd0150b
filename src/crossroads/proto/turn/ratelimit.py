"""A bounded per-key token bucket.

Used to cap how many unauthenticated answers (401, 438) one source IP gets per
second: a reflector must not be usable for floods (coturn docs/401-ratelimit.md,
reference §4 item 4), and the table must not grow without bound under spoofed
sources.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False, slots=True)
class TokenBuckets:
    """``allow(key, now)`` spends one token from ``key``'s bucket.

    Each bucket holds up to ``burst`` tokens and refills at ``rate`` per second.
    At most ``max_keys`` buckets exist; when full, the table is cleared (a spoofing
    flood can reset limits for real clients, but can never exhaust memory, and a
    full table already means the source is spread too thin to matter).
    """

    rate: float
    burst: float
    max_keys: int = 65536
    _buckets: dict[str, tuple[float, float]] = field(default_factory=dict, init=False)

    def __len__(self) -> int:
        return len(self._buckets)

    def allow(self, key: str, now: float) -> bool:
        """True when ``key`` may have one more answer now."""
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= self.max_keys:
                self._buckets.clear()
            self._buckets[key] = (self.burst - 1, now)
            return True
        tokens, last = bucket
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        if tokens < 1:
            self._buckets[key] = (tokens, now)
            return False
        self._buckets[key] = (tokens - 1, now)
        return True
