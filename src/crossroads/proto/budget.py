"""Guessing budgets: how many failed lookups or failed keys a source, and this
instance as a whole, may spend.

Theory of operation
-------------------
A secret that a client names to get something (a Unity join code, a p2p or
OpenTTD invite code, an API key) is only as strong as the number of wrong
guesses an attacker is allowed. Two token buckets bound that number:

- one per source (an IPv4 address, or an IPv6 /64: one customer's LAN gets a
  whole /64, so counting single IPv6 addresses would give an attacker 2^64
  budgets), ``per_source_rate`` failures a second with ``per_source_burst``
  in a row, so a user who mistypes a code a few times is never refused;
- one global, ``global_rate`` failures a second with ``global_burst`` in a
  row, so spreading the guesses over many addresses does not help either.

A lookup first :meth:`FailureBudget.try_spend` s one token from both buckets
(refused when either is empty: the caller answers 429 or the protocol's
error without looking), then :meth:`FailureBudget.refund` s it when the
lookup succeeded. So a success costs nothing, a failure costs one token, and
concurrent lookups can never spend more than the buckets hold (checking
after the fact would let a burst of concurrent requests through).

The global bucket is deliberately strict: while it is empty every lookup is
refused, right or wrong, because answering a right guess would tell the
attacker it was right. An attacker can therefore make lookups fail for
everybody by spending the global budget, but cannot find a code faster than
``global_rate``; the docs (docs/security.md, "Guessing budgets") give the
arithmetic. The budget is per instance: N instances behind one name allow N
times the global rate.

Sans-I/O: time comes in as ``now`` (seconds, any monotonic origin).
"""

from __future__ import annotations

import ipaddress

from crossroads.proto.bounded import BoundedMap
from crossroads.types import frozen

#: Sources remembered at once; beyond it the least recently charged one is
#: forgotten (its bucket refills), so memory stays bounded whatever the number
#: of addresses an attacker has. The global bucket still bounds them all.
MAX_TRACKED_SOURCES = 65_536
#: IPv6 sources are counted per /64 (RFC 6177: a site gets at least a /64).
IPV6_SOURCE_PREFIX = 64


def source_key(host: str) -> str:
    """The unit a per-source budget counts: the IPv4 address or the IPv6 /64."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        mapped = address.ipv4_mapped
        if mapped is not None:
            return str(mapped)
        network = ipaddress.IPv6Network((address, IPV6_SOURCE_PREFIX), strict=False)
        return str(network)
    return str(address)


@frozen
class BudgetConfig:
    """Rates in failures per second; a rate of 0 switches that bucket off."""

    per_source_rate: float
    per_source_burst: float
    global_rate: float
    global_burst: float

    @classmethod
    def from_settings(
        cls, per_source_per_minute: float, global_per_second: float
    ) -> BudgetConfig:
        """The budget of the ``--guess-*`` settings: a source may fail its
        whole minute's budget in a row; the instance ten seconds' worth."""
        return cls(
            per_source_rate=per_source_per_minute / 60.0,
            per_source_burst=max(1.0, per_source_per_minute),
            global_rate=global_per_second,
            global_burst=max(1.0, global_per_second * 10.0),
        )


class FailureBudget:
    """Per-source and global token buckets of failures (see the module docstring)."""

    def __init__(
        self, config: BudgetConfig, max_sources: int = MAX_TRACKED_SOURCES
    ) -> None:
        self.config = config
        self.max_sources = max_sources
        #: source -> [tokens, last update], least recently charged evicted first.
        self._sources: BoundedMap[str, list[float]] = BoundedMap(max_sources)
        self._global = [config.global_burst, 0.0]
        self._global_started = False
        #: Lookups refused because a bucket was empty, per bucket.
        self.refused_source = 0
        self.refused_global = 0

    @property
    def tracked_sources(self) -> int:
        return len(self._sources)

    @staticmethod
    def _refill(bucket: list[float], rate: float, burst: float, now: float) -> None:
        bucket[0] = min(burst, bucket[0] + max(0.0, now - bucket[1]) * rate)
        bucket[1] = now

    def _source_bucket(self, key: str, now: float) -> list[float]:
        bucket = self._sources.get(key)
        if bucket is None:
            bucket = [self.config.per_source_burst, now]
            self._sources.put(key, bucket)
        return bucket

    def try_spend(self, source: str, now: float) -> bool:
        """Take one failure's token from ``source``'s bucket and the global one;
        False (nothing taken) when either is empty."""
        config = self.config
        key = source_key(source)
        source_bucket: list[float] | None = None
        if config.per_source_rate > 0:
            source_bucket = self._source_bucket(key, now)
            self._refill(
                source_bucket, config.per_source_rate, config.per_source_burst, now
            )
            if source_bucket[0] < 1.0:
                self.refused_source += 1
                return False
        if config.global_rate > 0:
            if not self._global_started:
                self._global_started = True
                self._global[1] = now
            self._refill(self._global, config.global_rate, config.global_burst, now)
            if self._global[0] < 1.0:
                self.refused_global += 1
                return False
            self._global[0] -= 1.0
        if source_bucket is not None:
            source_bucket[0] -= 1.0
        return True

    def refund(self, source: str) -> None:
        """Give back the token of a lookup that succeeded."""
        config = self.config
        if config.per_source_rate > 0:
            bucket = self._sources.peek(source_key(source))
            if bucket is not None:
                bucket[0] = min(config.per_source_burst, bucket[0] + 1.0)
        if config.global_rate > 0:
            self._global[0] = min(config.global_burst, self._global[0] + 1.0)
