"""Fixtures shared by the whole suite: free ports, a real redis-server, runtimes."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

import pytest

from crossroads.config import default_config
from crossroads.runtime import Runtime, start


def free_port(kind: int = socket.SOCK_STREAM, host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (for programs that need a number up front)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, kind) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def free_udp_tcp_port(host: str = "127.0.0.1") -> int:
    """A port free for both UDP and TCP (STUN and TURN listen on both)."""
    for _ in range(50):
        port = free_port(socket.SOCK_DGRAM, host)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError("no port free for both UDP and TCP")


def consecutive_free_ports(count: int, kind: int = socket.SOCK_STREAM) -> int:
    """A port P with P..P+count-1 all free a moment ago (``--workers N`` puts
    worker i's HTTP port and relay node on the base port + i)."""
    for _ in range(100):
        base = free_port(kind)
        held: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                sock = socket.socket(socket.AF_INET, kind)
                held.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports")


class RedisServer:
    """A real redis-server on a private port and directory, for one test session."""

    def __init__(self, port: int | None = None, extra: Sequence[str] = ()) -> None:
        """``port``: start on this one (a restart of a stopped server);
        ``extra``: more redis-server arguments (``--replicaof host port``)."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed; run `make install`")
        self.port = port or free_port()
        self.directory = tempfile.mkdtemp(prefix="crossroads-redis-")
        self.process = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.directory,
                *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(
                    ("127.0.0.1", self.port), timeout=0.2
                ) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("redis-server did not start")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def flush(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
            s.sendall(b"FLUSHALL\r\n")
            s.recv(16)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def private_state_dir() -> Iterator[str]:
    """Point XDG_STATE_HOME at a temporary directory for the whole session: a
    ``crossroads serve`` the tests start (in-process or as a child, which inherits
    the environment) keeps its development credentials there, never in the
    home directory of whoever runs the tests."""
    directory = tempfile.mkdtemp(prefix="crossroads-state-")
    previous = os.environ.get("XDG_STATE_HOME")
    os.environ["XDG_STATE_HOME"] = directory
    try:
        yield directory
    finally:
        if previous is None:
            os.environ.pop("XDG_STATE_HOME", None)
        else:
            os.environ["XDG_STATE_HOME"] = previous
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """URL of a real, empty Redis (flushed before each test)."""
    redis_server.flush()
    return redis_server.url


def loopback_config(**overrides: Any) -> dict[str, Any]:
    """Config overrides for a runtime on 127.0.0.1 with every port chosen by the OS."""
    import dataclasses

    from crossroads.config import SECTIONS, setting_info
    from crossroads.services import load_service_modules

    load_service_modules()
    values: dict[str, Any] = {"core.host": "127.0.0.1", "core.http_port": 0}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            if setting_info(f).kind == "port" and section != "core":
                values[f"{section}.{f.name}"] = 0
    values.update({k.replace("__", "."): v for k, v in overrides.items()})
    return values


def serve_command(
    only: str, *args: str, host: str = "127.0.0.1", http_port: int = 0
) -> list[str]:
    """The command line of a ``crossroads serve`` process a test starts: the
    ``only`` services on ``host``, HTTP on ``http_port`` (0: any free port),
    then ``args``."""
    return [
        sys.executable, "-m", "crossroads", "serve", "--only", only,
        "--host", host, "--http-port", str(http_port), *args,
    ]  # fmt: skip


S = TypeVar("S")


def running_service(rt: Runtime, name: str, cls: type[S]) -> S:
    """The running service ``name`` of a runtime, checked to be a ``cls``."""
    service = rt.services[name]
    assert isinstance(service, cls), service
    return service


@pytest.fixture
async def runtime() -> AsyncIterator[Runtime]:
    """Every service on 127.0.0.1, OS-chosen ports, in-memory store."""
    rt = await start(default_config(loopback_config()))
    try:
        yield rt
    finally:
        await rt.close()


async def until(condition: Callable[[], bool], seconds: float = 10.0) -> bool:
    """Whether the synchronous ``condition`` holds within ``seconds`` (polled
    every 10 ms), for tests that assert on it themselves."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not condition():
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


async def eventually(
    check: Callable[[], Awaitable[bool]], what: str, timeout: float = 10.0
) -> None:
    """Poll ``check`` until it holds; fail naming ``what`` after ``timeout`` s.

    For effects a protocol does not acknowledge (OpenTTD's SERVER_UPDATE, a
    released claim): a test learns they happened by looking, not by sleeping; a
    fixed sleep is too short on a loaded CI machine and too long elsewhere.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await check():
        if loop.time() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.05)
