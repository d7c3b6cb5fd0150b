"""cancel_and_wait, stop_task and stop_tasks: a background task is over when close returns,
even one that swallowed a cancellation; Sweeper: a periodic sweep started once
and stopped on close."""

from __future__ import annotations

import asyncio

import pytest

from crossroads.services.base import stop_task, stop_tasks
from crossroads.transport.tasks import Sweeper, cancel_and_wait
from tests.conftest import eventually


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


async def test_a_task_that_swallows_its_cancellation_is_cancelled_again() -> None:
    """As redis-py can, cancelled in the middle of a command: the loop goes on
    after the first CancelledError. Close must still end it, not wait forever."""
    swallowed: list[int] = []

    async def stubborn_heartbeat() -> None:
        while True:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                if not swallowed:
                    swallowed.append(1)
                    continue  # the first one is lost
                raise

    for stop in (cancel_and_wait, stop_task):
        swallowed.clear()
        task = asyncio.create_task(stubborn_heartbeat())
        await asyncio.sleep(0)
        stopping = asyncio.create_task(stop(task))

        async def stopped(stopping: asyncio.Task[None] = stopping) -> bool:
            return stopping.done()

        try:
            await eventually(stopped, f"{stop.__name__} ended the task")
        finally:
            for leftover in (stopping, task):
                leftover.cancel()
        await stopping
        assert task.cancelled() and swallowed == [1]


async def test_stop_task_does_not_raise_what_the_task_failed_with() -> None:
    async def broken() -> None:
        raise RuntimeError("heartbeat failed")

    task = asyncio.create_task(broken())
    await asyncio.sleep(0)
    await stop_task(task)
    assert isinstance(task.exception(), RuntimeError)


async def test_stop_tasks_cancels_every_task_before_waiting_for_any() -> None:
    """A service's close: every task has ended when it returns, None entries
    are skipped, a failure is not raised, and each task sees its cancellation
    only once every one of them has been asked to stop (none works on while
    another ends)."""
    all_asked: list[bool] = []

    async def worker() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            all_asked.append(all(t.cancelling() or t.done() for t in tasks))
            raise

    async def broken() -> None:
        raise RuntimeError("lookup failed")

    tasks = [asyncio.create_task(worker()) for _ in range(2)]
    failed = asyncio.create_task(broken())
    await asyncio.sleep(0)
    await stop_tasks([tasks[0], None, failed, tasks[1]])
    assert all(task.cancelled() for task in tasks)
    assert isinstance(failed.exception(), RuntimeError)
    assert all_asked == [True, True]


async def test_the_sweeper_sweeps_with_loop_time_until_stopped() -> None:
    seen: list[float] = []
    sweeper = Sweeper(seen.append, 0.01)
    await sweeper.stop()  # never started: nothing to stop
    sweeper.start()
    sweeper.start()  # idempotent: still one task

    async def swept_twice() -> bool:
        return len(seen) >= 2

    await eventually(swept_twice, "two sweeps")
    loop = asyncio.get_running_loop()
    assert seen == sorted(seen) and seen[-1] <= loop.time()
    await sweeper.stop()
    after = len(seen)
    await asyncio.sleep(0.05)  # would be several sweeps if it still ran
    assert len(seen) == after
    sweeper.start()  # a stopped sweeper can start again

    async def swept_again() -> bool:
        return len(seen) > after

    await eventually(swept_again, "a sweep after the restart")
    await sweeper.stop()
