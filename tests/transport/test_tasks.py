"""cancel_and_wait: a background task is over when close returns."""

from __future__ import annotations

import asyncio

import pytest

from crossroads.transport.tasks import cancel_and_wait


async def test_the_task_has_ended_and_its_cancellation_is_swallowed() -> None:
    cleaned: list[str] = []

    async def sweeper() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.append("done")

    task = asyncio.create_task(sweeper())
    await asyncio.sleep(0)  # let it start
    await cancel_and_wait(task)
    assert task.cancelled()
    assert cleaned == ["done"]


async def test_a_task_that_crashed_is_reported() -> None:
    async def broken() -> None:
        raise RuntimeError("sweep failed")

    task = asyncio.create_task(broken())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="sweep failed"):
        await cancel_and_wait(task)
