"""A per-source reflection budget: never send a spoofed address more than it sent.

Why
---
A UDP server that answers a request with a larger reply is an amplifier: an
attacker sends small requests with a victim's address as the source, and the
server sends the victim more bytes than the attacker spent (a TURN 401 is 120 B
for a 20 B Allocate, a STUN Binding response 88 B for a 20 B request). Every
UDP listener of crossroads runs its replies to not-yet-authenticated sources
through one :class:`ReflectionBudget`, which guarantees, per source IP address::

    bytes sent to it  <=  bytes received from it  +  allowance

over the current and the previous ``window`` (10 s), so a spoofed victim gets no
more than the attacker spent plus a small allowance (4 KiB by default, enough
for a legitimate client's handful of Binding requests or 401 challenges, whose
replies are larger than their requests). Replies beyond it are refused: the
caller drops them and counts them (a ``reflection-budget`` drop reason in every
service's metrics).

Theory of operation
-------------------
Time is cut into fixed periods of ``window`` seconds, aligned on multiples of
it. Each source IP has one ledger entry ``[received, sent, received_before,
sent_before]``: the first two are the totals over the previous and the current
period, the last two the part of those totals that belongs to the previous
period. A reply of ``n`` bytes is allowed when ``sent + n <= received +
allowance``. When a period ends, its table becomes the *previous* table, and a
source's entry is carried into the new period on its first use there (keeping
only the part of the period that just ended), so:

- at every reply the check covers the last 10 to 20 s: what the source was
  sent in that span is at most what it sent in the same span plus the
  allowance. So over **any** 10 s window a source is sent at most the allowance
  plus what it sent in the 20 s before the window's last reply, and over a long
  run at most what it sent plus one allowance per 10 s;
- one dict lookup and a few integer operations per reply (the STUN hot path).

Bounded memory, and the global cap
----------------------------------
A table holds at most ``max_sources`` entries per period (two tables: the
current and the previous period). When the current one is full it becomes the
previous one at once, and the older table is forgotten: O(1) per source, at most
``2 * max_sources`` entries. Forgetting resets those sources' ledgers (so they
could get the allowance again); that is why the allowance itself is also capped
*globally*: the bytes sent beyond what their destinations sent ("overdraft") add
up, across all sources, to at most ``global_allowance`` per period. A flood of spoofed
sources (each one a victim that gets its allowance) therefore yields at most
``global_allowance`` bytes of amplification per 10 s in all; replies that are no
larger than what their source sent are never refused by the global cap.

The budget is sans-I/O: time comes in as ``now``; it does no I/O and keeps no
reference to sockets. Each service owns one (budgets are not shared between
services: a source may receive one allowance from each).
"""

from __future__ import annotations

from crossroads.types import frozen

#: DESIGN.md: a reflector must not amplify "over any 10 s window". Seconds per period.
WINDOW = 10.0
#: "A small allowance (a few KiB)": 4 KiB covers ~60 STUN Binding exchanges
#: (68 B over their request each) or ~40 TURN 401 challenges (100 B over) per
#: 10 s from one address, far more than ICE or a TURN client needs (RFC 8445
#: paces checks at one per 50 ms per agent, but a client sends a few Bindings to
#: each server it was given; RFC 8656 clients get one 401 per allocation).
DEFAULT_ALLOWANCE = 4096
#: Sources tracked per period (two periods are kept). An entry costs ~200 bytes
#: (dict slot, key string, a list of four ints), so ~26 MB at most per service.
DEFAULT_MAX_SOURCES = 65_536
#: Overdraft across all sources per period: 16 MiB per 10 s (~13 Mbit/s of
#: amplified traffic at most, whatever the number of spoofed sources); a busy
#: STUN server answers ~240,000 distinct-source Binding requests per 10 s within it.
DEFAULT_GLOBAL_ALLOWANCE = 16 * 1024 * 1024

#: The drop reason every service counts a refused reply under.
DROP_REFLECTION = "reflection-budget"


@frozen
class ReflectionSettings:
    """How a service's :class:`ReflectionBudget` is sized (see module docstring)."""

    #: False: no budget (benchmarks that load one source, trusted networks).
    enabled: bool = True
    allowance: int = DEFAULT_ALLOWANCE
    global_allowance: int = DEFAULT_GLOBAL_ALLOWANCE
    max_sources: int = DEFAULT_MAX_SOURCES
    window: float = WINDOW


class ReflectionBudget:
    """Per-source byte ledger of unauthenticated replies; see the module docstring.

    Call :meth:`received` for every datagram that reaches the service's
    unauthenticated path, and :meth:`allow` before sending each reply to a
    not-yet-authenticated source (or :meth:`answer` for both at once).
    """

    __slots__ = (
        "enabled",
        "allowance",
        "global_allowance",
        "max_sources",
        "window",
        "refused",
        "refused_bytes",
        "overdraft",
        "_current",
        "_previous",
        "_period_end",
    )

    def __init__(self, settings: ReflectionSettings | None = None) -> None:
        settings = settings or ReflectionSettings()
        if settings.window <= 0:
            raise ValueError("window must be > 0")
        if settings.allowance < 0 or settings.global_allowance < 0:
            raise ValueError("allowances must be >= 0")
        if settings.max_sources < 1:
            raise ValueError("max_sources must be >= 1")
        self.enabled = settings.enabled
        self.allowance = settings.allowance
        self.global_allowance = settings.global_allowance
        self.max_sources = settings.max_sources
        self.window = settings.window
        #: Replies refused so far, and their bytes (for metrics and tests).
        self.refused = 0
        self.refused_bytes = 0
        #: Overdraft granted in the current period, across all sources.
        self.overdraft = 0
        self._current: dict[str, list[int]] = {}
        self._previous: dict[str, list[int]] = {}
        self._period_end = -1.0

    @classmethod
    def or_unlimited(cls, budget: ReflectionBudget | None) -> ReflectionBudget:
        """``budget``, or a new disabled one for None (cores built without a
        budget: unit tests, tools). Not ``budget or ...``: an empty budget is
        falsy (``__len__``)."""
        return cls(ReflectionSettings(enabled=False)) if budget is None else budget

    def __len__(self) -> int:
        """Sources tracked (both periods)."""
        return len(self._current) + len(self._previous)

    def _entry(self, source: str, now: float) -> list[int]:
        if now >= self._period_end:
            # More than one period may have passed: then nothing carries over.
            stale = now >= self._period_end + self.window
            self._previous = {} if stale else self._current
            self._current = {}
            self.overdraft = 0
            # Periods are aligned on multiples of the window, so the previous
            # period always ends where the current one starts.
            self._period_end = (now // self.window + 1) * self.window
        current = self._current
        entry = current.get(source)
        if entry is None:
            old = self._previous.pop(source, None)
            if old is None:
                entry = [0, 0, 0, 0]
            else:
                # Keep only the previous period's part (the totals minus what
                # belonged to the period before it).
                received, sent = old[0] - old[2], old[1] - old[3]
                entry = [received, sent, received, sent]
            if len(current) >= self.max_sources:
                # Full: the current table becomes the previous one early, and
                # the older one is forgotten at once. (Evicting entries one by
                # one with ``next(iter(dict))`` costs O(deleted slots) per call
                # in CPython: ~50 us per datagram under a flood of new sources.)
                self._previous = current
                self._current = current = {}
            current[source] = entry
        return entry

    def received(self, source: str, size: int, now: float) -> None:
        """``size`` bytes arrived from ``source`` (an IP address string)."""
        if self.enabled:
            self._entry(source, now)[0] += size

    def allow(self, source: str, size: int, now: float) -> bool:
        """May ``size`` bytes be sent to ``source`` now? Counts them if so."""
        if not self.enabled:
            return True
        return self._spend(self._entry(source, now), size)

    def answer(self, source: str, size_in: int, size_out: int, now: float) -> bool:
        """:meth:`received` then :meth:`allow`: one request, one reply."""
        if not self.enabled:
            return True
        # Hot path (every STUN Binding): inlined lookup of a known source.
        entry = self._current.get(source) if now < self._period_end else None
        if entry is None:
            entry = self._entry(source, now)
        received = entry[0] + size_in
        entry[0] = received
        sent = entry[1]
        after = sent + size_out
        if after <= received:
            entry[1] = after
            return True
        # _spend() inlined: a Binding answer is always beyond its request.
        grown = after - (received if received > sent else sent)
        overdraft = self.overdraft + grown
        if after > received + self.allowance or overdraft > self.global_allowance:
            self.refused += 1
            self.refused_bytes += size_out
            return False
        self.overdraft = overdraft
        entry[1] = after
        return True

    def _spend(self, entry: list[int], size: int) -> bool:
        received, sent = entry[0], entry[1]
        after = sent + size
        if after <= received:
            entry[1] = after
            return True
        # The part beyond what the source sent counts against the global cap.
        grown = after - max(received, sent)
        if (
            after > received + self.allowance
            or self.overdraft + grown > self.global_allowance
        ):
            self.refused += 1
            self.refused_bytes += size
            return False
        self.overdraft += grown
        entry[1] = after
        return True


__all__ = [
    "DEFAULT_ALLOWANCE",
    "DEFAULT_GLOBAL_ALLOWANCE",
    "DEFAULT_MAX_SOURCES",
    "DROP_REFLECTION",
    "ReflectionBudget",
    "ReflectionSettings",
    "WINDOW",
]
