"""The event loop every long-running command runs on."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_async(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` on uvloop when it is installed, else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)
