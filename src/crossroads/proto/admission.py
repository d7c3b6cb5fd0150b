"""What a sans-I/O core asks before it keeps per-client state, and the plain
in-memory table it uses when nobody injected the process's budget.

Theory of operation
-------------------
Every core that keeps state for strangers (DTLS handshakes and sessions, TURN
allocations, natneg and p2p sessions, RakNet handshake records and
connections, Unity relay allocations) asks a table before it creates an item
and tells it when the item ends. In a running process that table is one of
the process's resource budget
(:class:`crossroads.transport.admission.Admission`), which derives its caps
from descriptors and memory; a core must not import transport, so it names
what it needs here, as :class:`typing.Protocol` s the budget's ``Admission``
satisfies structurally:

- :class:`Admitter`: ``admit(host)`` (None, or the reason it refuses),
  ``release(host)`` once per admitted item, ``closed(reason)`` to count an
  item the core ended itself (a deadline, a slow peer);
- :class:`MemoryCharge`: ``charge(nbytes)`` / ``uncharge(nbytes)`` for the
  variable bytes an item holds (split parts, queued frames), counted with
  their per-part overhead;
- :class:`Table`: both, with the caps in force readable (a core that makes
  room by evicting its own oldest items needs to know when it is full).

:class:`LocalTable` is the one in-memory implementation, for a core built
without the process budget (unit tests, tools, simulations): a global cap, a
per-source cap keyed like the budget's (:func:`crossroads.proto.budget.source_key`:
an IPv4 address or an IPv6 /64), an optional byte cap, and the same refusal
reasons, so a core behaves the same whichever table it was given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from crossroads.proto.budget import source_key

#: Refusal reasons, shared by every table (the transport's budget imports
#: them from here): the table is full; the source holds its share; the bytes
#: do not fit the table's memory.
REFUSED_OVER_LIMIT = "over-limit"
REFUSED_OVER_IP_LIMIT = "over-ip-limit"
REFUSED_OVER_MEMORY = "over-memory"

#: "No cap" for :class:`LocalTable` (a count no table can reach).
UNBOUNDED = 1 << 62


class Admitter(Protocol):
    """Admits items per source and in total (see the module docstring)."""

    def admit(self, host: str) -> str | None:
        """Count a new item of a client at ``host``; None if admitted, else
        why not (:data:`REFUSED_OVER_IP_LIMIT`: that source's cap; anything
        else: the table's)."""
        ...

    def release(self, host: str) -> None:
        """An admitted item of ``host`` ended (call exactly once per item)."""
        ...

    def closed(self, reason: str) -> None:
        """Count an item the core ended for ``reason``."""
        ...


class MemoryCharge(Protocol):
    """Bytes an item makes the process hold beyond its fixed cost."""

    def charge(self, nbytes: int) -> bool:
        """Take ``nbytes``; False (nothing taken) when they do not fit."""
        ...

    def uncharge(self, nbytes: int) -> None:
        """Give back bytes taken with :meth:`charge`."""
        ...


class Table(Admitter, MemoryCharge, Protocol):
    """An :class:`Admitter` and a :class:`MemoryCharge` whose caps in force
    the core can read."""

    @property
    def max_items(self) -> int: ...

    @property
    def max_per_source(self) -> int: ...


@dataclass(eq=False)
class TableCounts:
    """What every table counts and the one way the counts change: items in
    all and per source (an IPv4 address or an IPv6 /64), buffered bytes,
    refusals and closes by reason. The caps in force come from the subclass
    (:meth:`item_caps`, :meth:`byte_cap`): fixed in :class:`LocalTable`,
    derived from the process's budget in the transport's ``Admission``."""

    live: int = field(default=0, init=False)
    buffered: int = field(default=0, init=False)
    per_source: dict[str, int] = field(default_factory=dict, init=False)
    refused: dict[str, int] = field(default_factory=dict, init=False)
    closes: dict[str, int] = field(default_factory=dict, init=False)

    def item_caps(self) -> tuple[int, int]:
        """(items in all, items per source) in force now."""
        raise NotImplementedError

    def byte_cap(self) -> int:
        """Buffered bytes the table may hold now."""
        raise NotImplementedError

    def admit(self, host: str, *, per_ip_cap: bool = True) -> str | None:
        """Count a new item of ``host``; None if admitted, else the reason it
        is refused (counted). ``per_ip_cap=False`` for a source that speaks
        for many clients (a trusted reverse proxy): only the global cap applies."""
        total, per_source = self.item_caps()
        key = source_key(host)
        count = self.per_source.get(key, 0)
        if self.live >= total:
            reason = REFUSED_OVER_LIMIT
        elif count >= per_source and per_ip_cap:
            reason = REFUSED_OVER_IP_LIMIT
        else:
            self.per_source[key] = count + 1
            self.live += 1
            return None
        self.refused[reason] = self.refused.get(reason, 0) + 1
        return reason

    def release(self, host: str) -> None:
        """An admitted item of ``host`` ended (call exactly once)."""
        key = source_key(host)
        count = self.per_source.get(key, 0)
        if count <= 0:
            return
        if count == 1:
            del self.per_source[key]
        else:
            self.per_source[key] = count - 1
        self.live -= 1

    def closed(self, reason: str) -> None:
        """Count an item the owner ended for ``reason``."""
        self.closes[reason] = self.closes.get(reason, 0) + 1

    def charge(self, nbytes: int) -> bool:
        """Take ``nbytes`` of buffered data (with their per-part overhead);
        False, nothing taken and counted as ``over-memory``, when they do not
        fit."""
        if self.buffered + nbytes > self.byte_cap():
            self.refused[REFUSED_OVER_MEMORY] = (
                self.refused.get(REFUSED_OVER_MEMORY, 0) + 1
            )
            return False
        self.buffered += nbytes
        return True

    def uncharge(self, nbytes: int) -> None:
        """Give back bytes taken with :meth:`charge`."""
        self.buffered = max(0, self.buffered - nbytes)


@dataclass(eq=False)
class LocalTable(TableCounts):
    """The in-memory :class:`Table`: at most ``max_items`` in all,
    ``max_per_source`` per IPv4 address or IPv6 /64, ``max_bytes`` charged
    (each :data:`UNBOUNDED` unless given). Refusals and closes are counted by
    reason, like the budget's tables."""

    max_items: int = UNBOUNDED
    max_per_source: int = UNBOUNDED
    max_bytes: int = UNBOUNDED

    def item_caps(self) -> tuple[int, int]:
        return self.max_items, self.max_per_source

    def byte_cap(self) -> int:
        return self.max_bytes
