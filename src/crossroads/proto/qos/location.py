"""Ping locations: a player's measured round trip to each region, as a compact
string, and what two or more of them say about a relayed (and direct) path.

A location is ``region=rtt`` pairs separated by commas, round trips in
milliseconds with at most one decimal, best first:
``eu-west=12.5,us-east=84,ap-south=181``. A client measures it with a QoS
round (the smallest of the five answers of each region's best server: the
least queueing, so the closest to the path's propagation time) and publishes
it; a matchmaker hands two or more to ``POST /v1/ping/estimate``.

Estimator (docs/qos.md, "Ping locations"): a relay region's QoS server runs
on the relay node itself, so a player's QoS round trip to a region is the
round trip of its leg to that region's relay. Through relay ``R`` the round
trip between players ``a`` and ``b`` is the sum of both legs plus the relay's
processing, once each way::

    relayed(a, b, R) = rtt(a, R) + rtt(b, R) + 2 * processing

A group's best region minimises its worst pair (the sum of the two largest
round trips to it), then the sum over all players. A direct path is bounded
by the triangle inequality through every region both measured::

    max_R |rtt(a, R) - rtt(b, R)|  <=  direct(a, b)  <=  min_R relayed(a, b, R)

and is estimated (the middle of the bounds, error at most half their width)
only when they are within :data:`DIRECT_TOLERANCE` of each other: a region
near one of the players, or on the path between them, pins it down; two
players far from every region get bounds and no estimate.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

from crossroads.errors import DecodeError
from crossroads.types import frozen

#: Regions in one location: a deployment has a handful; Steam's relay network,
#: the largest, has a few dozen points of presence.
MAX_REGIONS = 64
#: Longest location string (64 regions of 32-character ids and a round trip).
MAX_LOCATION = 64 * 42
#: Round trips beyond this are no measurement (Unity's QoS client drops
#: answers later than 60,000 ms, WebTransportQosRunner).
MAX_RTT_MS = 60_000.0
#: Relay processing per crossing, ms: what one pass through the relay's data
#: plane adds to a datagram (docs/benchmarks.md: well under 0.1 ms for the C
#: plane, ~0.1 ms for the pure-Python one); rounded up.
DEFAULT_PROCESSING_MS = 0.2
#: A direct estimate is given when its bounds differ by at most this part of
#: the upper bound (or :data:`DIRECT_TOLERANCE_MS`).
DIRECT_TOLERANCE = 0.3
DIRECT_TOLERANCE_MS = 5.0
_REGION = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,31}\Z")


def parse_location(text: str) -> dict[str, float]:
    """The region -> round trip (ms) map of a location string.

    Raises:
        DecodeError: a malformed string (``reason`` says which part).
    """
    if not text or len(text) > MAX_LOCATION:
        raise DecodeError("a location has 1 to 2688 characters", "length")
    found: dict[str, float] = {}
    for part in text.split(","):
        region, sep, value = part.partition("=")
        if not sep or not _REGION.match(region):
            raise DecodeError(f"bad region in {part[:40]!r}", "region")
        try:
            rtt = float(value)
        except ValueError:
            raise DecodeError(f"bad round trip in {part[:40]!r}", "rtt") from None
        if not 0.0 <= rtt <= MAX_RTT_MS or not math.isfinite(rtt):
            raise DecodeError(f"round trip out of range in {part[:40]!r}", "rtt")
        if region in found:
            raise DecodeError(f"region {region} twice", "duplicate")
        found[region] = rtt
    if len(found) > MAX_REGIONS:
        raise DecodeError(f"more than {MAX_REGIONS} regions", "length")
    return found


def format_location(rtts: Mapping[str, float]) -> str:
    """The location string of ``rtts`` (best first, 0.1 ms resolution)."""
    ordered = sorted(rtts.items(), key=lambda kv: (kv[1], kv[0]))
    return ",".join(f"{r}={round(v, 1):g}" for r, v in ordered[:MAX_REGIONS])


@frozen
class RegionEstimate:
    """One region's figures for a group."""

    region: str
    #: Worst pair's relayed round trip through it (ms).
    worst_ms: float
    #: Relayed round trip of each pair (i, j), i < j, in input order.
    pairs: tuple[tuple[int, int, float], ...]


@frozen
class DirectEstimate:
    """Bounds (and, when they are tight, an estimate) of a direct path."""

    a: int
    b: int
    low_ms: float
    high_ms: float
    #: The estimate (middle of the bounds), None when they are too far apart.
    estimate_ms: float | None

    @property
    def error_ms(self) -> float:
        """The estimate is within this of the truth (half the bounds' width)."""
        return (self.high_ms - self.low_ms) / 2


@frozen
class Estimate:
    """What a group's locations say."""

    #: Regions every player measured, best (smallest worst pair) first.
    regions: tuple[RegionEstimate, ...]
    #: One per pair (i < j).
    direct: tuple[DirectEstimate, ...]

    @property
    def best(self) -> str | None:
        return self.regions[0].region if self.regions else None


def estimate(
    locations: Sequence[Mapping[str, float]],
    processing_ms: float = DEFAULT_PROCESSING_MS,
    live_regions: frozenset[str] | None = None,
) -> Estimate:
    """Relayed round trips through each region every player measured (only
    ``live_regions`` when given), the best region first, and direct bounds."""
    common = set(locations[0]) if locations else set()
    for location in locations[1:]:
        common &= set(location)
    if live_regions is not None:
        common &= live_regions
    n = len(locations)
    rows = []
    for region in common:
        rtts = [loc[region] for loc in locations]
        pairs = tuple(
            (i, j, rtts[i] + rtts[j] + 2 * processing_ms)
            for i in range(n)
            for j in range(i + 1, n)
        )
        worst = max((p[2] for p in pairs), default=0.0)
        rows.append((worst, sum(rtts), region, pairs))
    rows.sort()
    direct = []
    for i in range(n):
        for j in range(i + 1, n):
            shared = set(locations[i]) & set(locations[j])
            if not shared:
                continue
            a, b = locations[i], locations[j]
            low = max(abs(a[r] - b[r]) for r in shared)
            high = min(a[r] + b[r] for r in shared)
            tight = high - low <= max(DIRECT_TOLERANCE_MS, DIRECT_TOLERANCE * high)
            direct.append(
                DirectEstimate(i, j, low, high, (low + high) / 2 if tight else None)
            )
    return Estimate(
        tuple(RegionEstimate(r, w, p) for w, _, r, p in rows), tuple(direct)
    )
