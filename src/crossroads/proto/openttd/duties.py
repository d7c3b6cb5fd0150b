"""The OpenTTD service's periodic duties on one timer (sans-I/O).

Theory of operation
-------------------
Besides its per-connection flows, the OpenTTD service has a few things to do
every so often, each with its own period (see :mod:`crossroads.services.openttd`
and :mod:`crossroads.services.openttd.registry` for why each period is what it
is): the coordinator's liveness beat, the sweep of expired server records, the
TURN relay's announcement, and the discovery of other instances' relays.

:class:`Duties` is their one ``get_timer`` / ``handle_timer`` (the one core
API, :mod:`crossroads.proto.core`): ``handle_timer(now)`` returns the duties
that are due. A duty is due at once when added, then one period after it last
*finished* (:meth:`Duties.finished`), as a ``while True: work; sleep(period)``
loop would run it, so a slow Store never makes a duty overlap itself: a duty
handed out and not yet finished has no deadline.
"""

from __future__ import annotations

from enum import Enum

from crossroads.proto.core import EventQueue
from crossroads.proto.openttd.deadlines import DeadlineBook


class Duty(Enum):
    """A periodic task of the OpenTTD service."""

    HEARTBEAT = "instance heartbeat"
    SWEEP = "record sweep"
    ANNOUNCE_TURN = "TURN announcement"
    DISCOVER_RELAYS = "relay discovery"


class Duties(EventQueue[Duty]):
    """Which periodic duties are due (see the module docstring): the timer
    queues them for :meth:`pop_events`."""

    def __init__(self) -> None:
        super().__init__()
        self._periods: dict[Duty, float] = {}
        self._deadlines: DeadlineBook[Duty] = DeadlineBook()
        self._running: set[Duty] = set()

    def add(self, duty: Duty, period: float, now: float) -> None:
        """Run ``duty`` now and then every ``period`` seconds."""
        if period <= 0:
            raise ValueError("a duty's period must be positive")
        self._periods[duty] = period
        self._deadlines.update(duty, now)

    def get_timer(self) -> float | None:
        return self._deadlines.get_timer()

    def handle_timer(self, now: float) -> None:
        """Queue the duties to start now; tell :meth:`finished` when each is
        done."""
        due = self._deadlines.due(now)
        self._running.update(due)
        self._events += due

    def finished(self, duty: Duty, now: float) -> None:
        """``duty`` is done (or failed): due again one period from ``now``."""
        if duty in self._running:
            self._running.discard(duty)
            self._deadlines.update(duty, now + self._periods[duty])
