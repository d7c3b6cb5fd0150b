"""Stopping a background task (a sweeper, a sampler, a heartbeat) on close."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


async def cancel_until_done(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` until it has ended.

    Once is not always enough: cancelled in the middle of a store command,
    redis-py can swallow the CancelledError (seen right after a Redis restart),
    and a heartbeat loop then went back to sleep while its close waited for it
    forever. So cancel again until the task is done. (A cancellation of the
    caller itself is not swallowed: it propagates out of the wait.)
    """
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.1)


async def cancel_and_wait(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` and wait until it has ended, so that nothing it does
    outlives the close that stopped it. Its cancellation is swallowed; any other
    exception it ended with propagates (a crashed sweeper is a bug to see)."""
    await cancel_until_done(task)
    if not task.cancelled():
        task.result()


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
