"""Helpers of the store, guessing and bad-input adversarial tests (h12-store)."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from crossroads.config import default_config
from crossroads.runtime import Runtime, start
from tests.conftest import RedisServer, loopback_config


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


def redis_get(server: RedisServer, key: str) -> bytes | None:
    """GET ``key`` over a raw RESP connection (no crossroads code involved)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=2) as s:
        name = key.encode()
        s.sendall(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(name), name))
        reply = b""
        while not reply.endswith(b"\r\n") or (
            reply.startswith(b"$")
            and not reply.startswith(b"$-1")
            and reply.count(b"\r\n") < 2
        ):
            chunk = s.recv(4096)
            if not chunk:
                break
            reply += chunk
    if reply.startswith(b"$-1"):
        return None
    header, _, rest = reply.partition(b"\r\n")
    return rest[: int(header[1:])]


def redis_set(server: RedisServer, key: str, value: bytes) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=2) as s:
        name = key.encode()
        s.sendall(
            b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n"
            % (len(name), name, len(value), value)
        )
        assert s.recv(16).startswith(b"+OK")


@contextmanager
def private_redis() -> Iterator[RedisServer]:
    """A redis-server of the test's own (it is stopped and restarted)."""
    server = RedisServer()
    try:
        yield server
    finally:
        server.stop()
