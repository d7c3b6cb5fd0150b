"""Helpers for the connection and visibility adversarial tests:
a `crossroads serve` subprocess under a lowered descriptor limit, and floods of
half-open TCP connections from many loopback source addresses."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.conftest import free_port, free_udp_tcp_port

#: A request line and one header, never finished: what a slowloris client sends.
HALF_REQUEST = b"GET /healthz HTTP/1.1\r\nHost: crossroads\r\n"


@dataclass
class ServeProcess:
    """A `crossroads serve` subprocess and the ports the test chose for it."""

    process: subprocess.Popen[bytes]
    http_port: int
    stun_port: int
    coordinator_port: int
    log: Path

    def metrics(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.http_port}/metrics", timeout=10).text

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def _all_ports_zero() -> dict[str, str]:
    from crossroads.config import env_name, iter_settings
    from crossroads.services import load_service_modules

    load_service_modules()
    return {
        env_name(section, f): "0"
        for section, f, info in iter_settings()
        if info.kind == "port"
    }


@contextlib.contextmanager
def serve_with_fd_limit(nofile: int, *args: str) -> Iterator[ServeProcess]:
    """Run `crossroads serve --host 127.0.0.1 ARGS` with RLIMIT_NOFILE soft and
    hard set to ``nofile`` (as `ulimit -n` does), every port OS-chosen but HTTP,
    STUN and the OpenTTD coordinator's; stopped (and killed if need be) on exit."""
    http_port = free_port()
    stun_port = free_udp_tcp_port()
    coordinator_port = free_port()
    env = {
        **os.environ,
        **_all_ports_zero(),
        "CROSSROADS_HTTP_PORT": str(http_port),
        "CROSSROADS_STUN_PORT": str(stun_port),
        "CROSSROADS_OPENTTD_COORDINATOR_PORT": str(coordinator_port),
    }

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    with tempfile.TemporaryDirectory() as directory:
        log = Path(directory) / "serve.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "crossroads", "serve", "--host", "127.0.0.1"]
                + list(args),
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=limit,
            )
        server = ServeProcess(process, http_port, stun_port, coordinator_port, log)
        try:
            deadline = time.monotonic() + 30
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"crossroads serve exited:\n{server.output()}")
                try:
                    url = f"http://127.0.0.1:{http_port}/healthz"
                    if httpx.get(url, timeout=5).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"crossroads serve not ready:\n{server.output()}"
                    )
                time.sleep(0.1)
            yield server
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)  # at once (SIGTERM drains)
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def loopback_sources(count: int) -> list[str]:
    """``count`` loopback source addresses (127.0.1.1, 127.0.1.2, ...): the
    whole 127/8 is local on Linux, so one test can be many clients."""
    return [f"127.0.{1 + i // 250}.{1 + i % 250}" for i in range(count)]


async def open_half_requests(
    port: int, sources: list[str], per_source: int, first_bytes: bytes = HALF_REQUEST
) -> list[asyncio.StreamWriter]:
    """Connect ``per_source`` times from each source to 127.0.0.1:``port`` and
    send ``first_bytes`` (never the rest). Connections the server refuses or
    cannot accept still count: the caller closes every writer returned."""
    writers: list[asyncio.StreamWriter] = []

    async def one(source: str) -> None:
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0)), 10
            )
        except (OSError, TimeoutError):
            return
        writers.append(writer)
        with contextlib.suppress(OSError):
            writer.write(first_bytes)

    for _ in range(per_source):
        await asyncio.gather(*(one(source) for source in sources))
    return writers


def close_all(writers: list[asyncio.StreamWriter]) -> None:
    for writer in writers:
        writer.transport.abort()


async def closed_by_server(reader: asyncio.StreamReader, timeout: float) -> bool:
    """True once the server closed the connection (EOF or reset) within
    ``timeout`` seconds; the data before EOF is discarded."""
    try:
        async with asyncio.timeout(timeout):
            while await reader.read(65536):
                pass
    except TimeoutError:
        return False
    except OSError:
        return True
    return True
