"""Helpers of the store, guessing and bad-input adversarial tests (a store that fails or stalls, guessers, bad requests)."""

from __future__ import annotations

import asyncio
import json
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


def redis_command(server: RedisServer, *args: str | bytes) -> bytes:
    """One command over a raw RESP connection (no crossroads code involved);
    returns the reply's payload (bulk string or integer as text; b"" for nil)."""
    parts = [a.encode() if isinstance(a, str) else a for a in args]
    request = b"*%d\r\n" % len(parts) + b"".join(
        b"$%d\r\n%s\r\n" % (len(p), p) for p in parts
    )
    with socket.create_connection(("127.0.0.1", server.port), timeout=2) as s:
        s.sendall(request)
        reply = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
            header, sep, rest = reply.partition(b"\r\n")
            if not sep:
                continue
            if header[:1] != b"$" or header == b"$-1":
                break
            if len(rest) >= int(header[1:]) + 2:
                break
    header, _, rest = reply.partition(b"\r\n")
    if header[:1] == b"$":
        return b"" if header == b"$-1" else rest[: int(header[1:])]
    return header[1:]


def redis_get(server: RedisServer, key: str) -> bytes | None:
    return redis_command(server, "GET", key) or None


def redis_set(server: RedisServer, key: str, value: bytes) -> None:
    assert redis_command(server, "SET", key, value) == b"OK"


@contextmanager
def private_redis() -> Iterator[RedisServer]:
    """A redis-server of the test's own (it is stopped and restarted)."""
    server = RedisServer()
    try:
        yield server
    finally:
        server.stop()


async def next_frame(ws: Any, kind: str) -> dict[str, Any]:
    """The next p2p signalling frame of type ``kind`` (keep-alive pings skipped)."""
    while True:
        frame: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), 10))
        if frame["type"] == kind:
            return frame
        assert frame["type"] == "ping", frame
