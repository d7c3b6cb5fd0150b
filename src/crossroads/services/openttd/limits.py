"""Per-address token buckets (registration floods)."""

from __future__ import annotations

from dataclasses import dataclass, field

from crossroads.proto.budget import source_key


@dataclass(slots=True)
class AddressRateLimiter:
    """Allow ``per_minute`` events per address, in bursts of up to ``per_minute``.

    An address is a source as the connection admission counts it: an IPv4
    address, or an IPv6 /64 (:func:`~crossroads.proto.budget.source_key`), the
    smallest block an IPv6 site gets. Keyed by the full address, a /64 had a
    fresh bucket for each of its 2^64 addresses, so its registrations were not
    limited at all, and each one leaves an invite-code reservation in the store
    for 30 days (registry.CODE_RESERVATION).

    Memory is bounded: at most ``max_addresses`` buckets are kept; when full, the
    buckets that have refilled completely (idle addresses) are forgotten first,
    and if none has, the oldest ones go.
    """

    per_minute: float
    max_addresses: int = 65536
    _buckets: dict[str, tuple[float, float]] = field(default_factory=dict)

    def allow(self, host: str, now: float) -> bool:
        address = source_key(host)
        capacity = self.per_minute
        rate = self.per_minute / 60.0
        tokens, stamp = self._buckets.get(address, (capacity, now))
        tokens = min(capacity, tokens + (now - stamp) * rate)
        if tokens < 1.0:
            self._buckets[address] = (tokens, now)
            return False
        if address not in self._buckets and len(self._buckets) >= self.max_addresses:
            self.prune(now)
        self._buckets[address] = (tokens - 1.0, now)
        return True

    def prune(self, now: float) -> None:
        rate = self.per_minute / 60.0
        full = [
            a
            for a, (t, s) in self._buckets.items()
            if t + (now - s) * rate >= self.per_minute
        ]
        for address in full:
            del self._buckets[address]
        while len(self._buckets) >= self.max_addresses:
            del self._buckets[next(iter(self._buckets))]

    def __len__(self) -> int:
        return len(self._buckets)
