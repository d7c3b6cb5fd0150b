"""A Redis that stops answering (SIGSTOP: the socket stays open, nothing comes
back -- a frozen VM, a black-holed route) cannot hang a service.

Before: redis-py read without a socket timeout of crossroads' own (none at
all before redis-py 6; 5 s retried, 20 s a call, with 8.x), so every Store
call -- an HTTP request, a heartbeat -- waited that long or for ever. Now a
call fails with StoreError after ``RedisStore.SOCKET_TIMEOUT`` and the HTTP
APIs answer 503; after SIGCONT the same store works again.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from crossroads.errors import StoreError
from crossroads.store.redis import RedisStore
from tests.adversarial.store_faults_support import private_redis
from tests.conftest import RedisServer
from tests.e2e.relay_support import base_url, relay_runtime

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]

#: "Did not hang": several times the worst case of one call (a health-check
#: PING, then the command, each up to SOCKET_TIMEOUT), far below the 20 s a
#: call took before; a loaded machine is far inside it.
NOT_HUNG = 5 * RedisStore.SOCKET_TIMEOUT


@contextmanager
def stopped(redis: RedisServer) -> Iterator[None]:
    """redis-server frozen with SIGSTOP while the block runs (always thawed)."""
    os.kill(redis.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(redis.process.pid, signal.SIGCONT)


async def test_store_calls_fail_instead_of_hanging_on_a_frozen_redis() -> None:
    with private_redis() as redis:
        store = RedisStore(redis.url)
        try:
            await store.set("key", b"before")
            calls: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
                ("get", lambda: store.get("key")),
                ("set", lambda: store.set("key", b"during")),
                ("keys", lambda: store.keys("k")),
                ("publish", lambda: store.publish("channel", b"x")),
            ]
            with stopped(redis):
                for name, call in calls:
                    with pytest.raises(StoreError):
                        await asyncio.wait_for(call(), NOT_HUNG)
                    assert store.outage.down_since is not None, name
                assert await asyncio.wait_for(store.ping(), NOT_HUNG) is False
            # Thawed: the same store (its pool of connections) answers again.
            assert await store.get("key") == b"before"
            assert store.outage.down_since is None
        finally:
            await store.close()


async def test_http_apis_answer_503_while_redis_is_frozen() -> None:
    with private_redis() as redis:
        async with relay_runtime(core__store=redis.url, core__only="relay,p2p") as rt:
            async with httpx.AsyncClient(
                base_url=base_url(rt), timeout=NOT_HUNG * 2
            ) as http:
                with stopped(redis):
                    response = await http.get("/testServer?__gameId=g")
                    assert response.status_code == 503, response.text
                    assert set(response.json()) >= {"code", "message"}
                response = await http.get("/testServer?__gameId=g")
                assert response.status_code != 503, response.text
