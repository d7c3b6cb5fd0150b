"""Stopping a background task (a sweeper, a sampler) on close."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


async def cancel_and_wait(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` and wait until it has ended, so that nothing it does
    outlives the close that stopped it. Its cancellation is swallowed; any other
    exception it ended with propagates (a crashed sweeper is a bug to see)."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
