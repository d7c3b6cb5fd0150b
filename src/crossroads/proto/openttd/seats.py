"""The servers registered on this instance, and how many per source.

Theory of operation. Each registered server holds a seat under its invite
code: the connection that registered it. The number of seats per source (an
IPv4 address or an IPv6 /64, :func:`~crossroads.proto.budget.source_key`, as
the admission counts them) is what ``--openttd-max-servers-per-address``
caps. A connection that re-registers under another code moves its seat; a
new connection registering a code whose seat is still held (the old
connection's close has not been noticed yet) displaces the old one, whose
source then loses its count at once, not when the old connection's close is
seen (by then the seat is no longer its own, so nothing would be released).
Pure bookkeeping: connections are the caller's handles.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from crossroads.proto.budget import source_key

Conn = TypeVar("Conn", bound=Hashable)


@dataclass(slots=True)
class Seats(Generic[Conn]):
    """Seats by invite code and counts by source (module docstring)."""

    #: Invite code -> the connection holding it (read freely; change it only
    #: through :meth:`take` and :meth:`release`).
    by_code: dict[str, Conn] = field(default_factory=dict)
    _sources: dict[str, str] = field(default_factory=dict)
    _per_source: dict[str, int] = field(default_factory=dict)

    def count_from(self, host: str) -> int:
        return self._per_source.get(source_key(host), 0)

    def take(
        self, code: str, conn: Conn, host: str, previous: str | None
    ) -> Conn | None:
        """``conn`` (from ``host``, holding ``previous`` if any) now holds
        ``code``; returns the connection it displaced, to close."""
        if previous is not None and previous != code:
            self.release(previous, conn)
        if self.by_code.get(code) is conn:
            return None
        displaced = self.by_code.get(code)
        if displaced is not None:
            self.release(code, displaced)
        self.by_code[code] = conn
        source = source_key(host)
        self._sources[code] = source
        self._per_source[source] = self._per_source.get(source, 0) + 1
        return displaced

    def release(self, code: str, conn: Conn) -> bool:
        """``conn`` gives ``code`` up; False when the seat is not (or no longer) its."""
        if self.by_code.get(code) is not conn:
            return False
        del self.by_code[code]
        source = self._sources.pop(code)
        count = self._per_source[source] - 1
        if count <= 0:
            del self._per_source[source]
        else:
            self._per_source[source] = count
        return True

    def __len__(self) -> int:
        return len(self.by_code)
