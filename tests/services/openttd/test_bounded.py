"""Losing Redis: connections close cleanly (no GC_ERROR that would make OpenTTD
give up), registered servers stay connected, and work resumes when Redis is back."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time

import pytest

from crossroads.client.openttd import GameInfoResponder
from crossroads.proto.openttd.coordinator import ServerRegister
from tests.conftest import free_port
from tests.services.openttd.helpers import gc, register, start_openttd

pytestmark = [pytest.mark.timeout(90), pytest.mark.redis]


def start_redis(port: int, directory: str) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            directory,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return process
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise RuntimeError("redis-server did not start")


def stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    process.wait(10)


async def test_redis_outage_and_recovery(game_server: GameInfoResponder) -> None:
    port = free_port()
    directory = tempfile.mkdtemp(prefix="crossroads-redis-outage-")
    redis = start_redis(port, directory)
    rt = await start_openttd(store=f"redis://127.0.0.1:{port}/0", secret="outage")
    try:
        before = await register(rt, game_server.port)
        stop(redis)
        newcomer = await gc(rt)
        await newcomer.send_message(ServerRegister(6, 1, game_server.port, "", ""))
        # Closed without a GC_ERROR: OpenTTD will retry with back-off.
        assert await newcomer.reader.read(100) == b""
        await newcomer.close()
        assert not before.client.reader.at_eof()
        redis = start_redis(port, directory)
        after = await register(rt, game_server.port + 1)
        assert after.code
        await after.close()
        await before.close()
    finally:
        await rt.close()
        stop(redis)
        shutil.rmtree(directory, ignore_errors=True)
