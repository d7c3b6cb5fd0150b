"""Stopping a background task (a sweeper, a sampler) on close."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any


async def cancel_and_wait(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` and wait until it has ended, so that nothing it does
    outlives the close that stopped it. Its cancellation is swallowed; any other
    exception it ended with propagates (a crashed sweeper is a bug to see)."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


class Sweeper:
    """A background task that calls ``sweep(now)`` (loop time) every
    ``interval`` seconds: the idle sweep of a table whose entries expire by
    themselves (relay pairs, forwarders, connections waiting for a request).

    :meth:`start` is idempotent, so a pool may start it on its first entry and
    cost no task while empty; :meth:`stop` ends it (and waits) on close."""

    def __init__(self, sweep: Callable[[float], None], interval: float) -> None:
        self._sweep = sweep
        self.interval = interval
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.interval)
            self._sweep(loop.time())
