"""A per-source request limiter cheap enough for every datagram.

Theory of operation: fixed one-second windows. Each source (an IP address
string) has a counter in a dict; the dict is cleared when a new window starts,
so memory is bounded by the number of distinct sources seen in one window, and
by ``max_sources`` on top of that: once the table is full, every new source
shares one overflow counter with the same limit, so a flood of spoofed sources
cannot grow memory and cannot take more than ``limit`` answers per window.

A fixed window allows up to ``2 * limit`` requests across a window boundary;
that is the price of an O(1) check with no per-source timestamps, and it is
still a hard bound on the reflection rate per source.
"""

from __future__ import annotations

#: Window length in seconds: limits are expressed "per second".
WINDOW = 1.0

_OVERFLOW = "\0overflow"


class SourceRateLimiter:
    """Allow at most ``limit`` events per source per second (0 = unlimited)."""

    __slots__ = ("limit", "max_sources", "_counts", "_window_end", "limited")

    def __init__(self, limit: int, max_sources: int = 100_000) -> None:
        self.limit = limit
        self.max_sources = max_sources
        self._counts: dict[str, int] = {}
        self._window_end = 0.0
        #: Events refused so far (for metrics).
        self.limited = 0

    def allow(self, source: str, now: float) -> bool:
        """Count one event from ``source`` at ``now``; False if over the limit."""
        if not self.limit:
            return True
        if now >= self._window_end:
            self._counts.clear()
            self._window_end = now + WINDOW
        counts = self._counts
        count = counts.get(source)
        if count is None:
            if len(counts) >= self.max_sources:
                source = _OVERFLOW
                count = counts.get(source, 0)
            else:
                count = 0
        if count >= self.limit:
            self.limited += 1
            return False
        counts[source] = count + 1
        return True

    def __len__(self) -> int:
        return len(self._counts)
