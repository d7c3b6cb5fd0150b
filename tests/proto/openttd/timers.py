"""Running the timer of an OpenTTD flow in a test, as its runner does."""

from __future__ import annotations

from typing import Protocol, TypeVar

EventT = TypeVar("EventT", covariant=True)


class TimedFlow(Protocol[EventT]):
    def handle_timer(self, now: float) -> None: ...

    def pop_events(self) -> list[EventT]: ...


def fire(flow: TimedFlow[EventT], now: float) -> list[EventT]:
    """``flow.handle_timer(now)``, then what it queued (the core API)."""
    flow.handle_timer(now)
    return flow.pop_events()
