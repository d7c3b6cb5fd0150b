"""Helpers of the store, guessing and bad-input adversarial tests (h12-store)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from crossroads.config import default_config
from crossroads.runtime import Runtime, start
from tests.conftest import loopback_config


@contextmanager
def runtime_in_thread(**overrides: Any) -> Iterator[Runtime]:
    """A runtime on its own event loop in a background thread.

    For Hypothesis tests, which drive a synchronous HTTP client example by
    example: the server must keep running between (and during) the examples.
    """
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    config = default_config(loopback_config(**overrides))
    rt = asyncio.run_coroutine_threadsafe(start(config), loop).result(60)
    try:
        yield rt
    finally:
        asyncio.run_coroutine_threadsafe(rt.close(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def http_base(rt: Runtime) -> str:
    host, port = rt.http_address
    return f"http://{host}:{port}"
