"""The timer of a core's periodic sweep (expiry of requests, attempts, budgets).

A core that keeps many small deadlines does not give each one a timer: it sweeps
its tables every ``interval`` seconds, and only while it holds something to
sweep, so an idle server sets no timer at all. The core :meth:`SweepTimer.arm`\\ s
it when work arrives, reports :attr:`SweepTimer.deadline` from ``get_timer``,
asks :meth:`SweepTimer.due` in ``handle_timer`` and :meth:`SweepTimer.stop`\\ s it
when a sweep leaves nothing behind.
"""

from __future__ import annotations


class SweepTimer:
    """When the next sweep is due (None: no sweep set)."""

    __slots__ = ("interval", "deadline")

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.deadline: float | None = None

    def arm(self, now: float) -> None:
        """Work arrived: sweep ``interval`` from ``now``, unless one is set."""
        if self.deadline is None:
            self.deadline = now + self.interval

    def due(self, now: float) -> bool:
        """Whether a sweep is due at ``now``; if so the next one is set."""
        if self.deadline is None or now < self.deadline:
            return False
        self.deadline = now + self.interval
        return True

    def stop(self) -> None:
        """Nothing is left to sweep."""
        self.deadline = None


__all__ = ["SweepTimer"]
