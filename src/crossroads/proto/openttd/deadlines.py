"""The coordinator's one timer over all its flows (sans-I/O).

Theory of operation
-------------------
The coordinator runs many small cores at once: one
:class:`~crossroads.proto.openttd.ladder.ConnectAttempt` per join, one
registration per registering server, each with its own deadline (its
``get_timer()``). Rather than one event-loop timer each, the coordinator has a
single ``get_timer`` / ``handle_timer`` pair (the one core API,
:mod:`crossroads.proto.core`) over all of them, and the service keeps that one
deadline with one :class:`~crossroads.transport.driver.CoreTimer`.

:class:`DeadlineBook` holds, per flow, the deadline the flow last reported
(:meth:`~DeadlineBook.update`, called after every input the flow took) in a
heap. An entry that no longer matches its flow's current deadline is stale and
skipped when it comes up (lazy deletion), so an update costs one heap push and
never a search. :meth:`~DeadlineBook.due` pops the flows whose deadline has
come; the owner calls their ``handle_timer`` and updates them again.

Bounded by the flows themselves: one live entry per flow, and stale entries are
dropped as they reach the top, or all at once when they outnumber the live ones
(:data:`COMPACT_RATIO`), so churn cannot grow the heap.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from typing import Generic, TypeVar

KeyT = TypeVar("KeyT", bound=Hashable)

#: Rebuild the heap when it holds this many times more entries than live
#: deadlines (each input of a flow may push one): memory stays linear in the
#: number of flows.
COMPACT_RATIO = 4


class DeadlineBook(Generic[KeyT]):
    """The earliest of many flows' deadlines (see the module docstring)."""

    __slots__ = ("_deadlines", "_heap", "_order")

    def __init__(self) -> None:
        self._deadlines: dict[KeyT, float] = {}
        # (deadline, insertion order, key): the order breaks ties without
        # comparing keys.
        self._heap: list[tuple[float, int, KeyT]] = []
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._deadlines)

    @property
    def entries(self) -> int:
        """Heap entries, live and stale: what the book holds in memory."""
        return len(self._heap)

    def update(self, key: KeyT, deadline: float | None) -> None:
        """``key``'s deadline is now ``deadline`` (None: it has none)."""
        if deadline is None:
            self._deadlines.pop(key, None)
            return
        if self._deadlines.get(key) == deadline:
            return
        self._deadlines[key] = deadline
        heapq.heappush(self._heap, (deadline, next(self._order), key))
        if len(self._heap) > COMPACT_RATIO * max(len(self._deadlines), 16):
            self._compact()

    def discard(self, key: KeyT) -> None:
        """Forget ``key`` (a flow that ended)."""
        self._deadlines.pop(key, None)

    def get_timer(self) -> float | None:
        """The earliest deadline of any flow, or None."""
        heap = self._heap
        deadlines = self._deadlines
        while heap:
            deadline, _, key = heap[0]
            if deadlines.get(key) == deadline:
                return deadline
            heapq.heappop(heap)  # stale: the flow moved on or ended
        return None

    def due(self, now: float) -> list[KeyT]:
        """The flows whose deadline is at or before ``now``, earliest first;
        each is removed (update it again after its ``handle_timer``)."""
        heap = self._heap
        deadlines = self._deadlines
        fired: list[KeyT] = []
        while heap and heap[0][0] <= now:
            deadline, _, key = heapq.heappop(heap)
            if deadlines.get(key) == deadline:
                del deadlines[key]
                fired.append(key)
        return fired

    def _compact(self) -> None:
        self._heap = [
            entry for entry in self._heap if self._deadlines.get(entry[2]) == entry[0]
        ]
        heapq.heapify(self._heap)
