"""`crossroads host` / `crossroads join CODE`: two real processes chat through a
real `crossroads serve` process."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port

pytestmark = pytest.mark.timeout(90)

CROSSROADS = [sys.executable, "-m", "crossroads"]


class Proc:
    def __init__(self, *args: str) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.p = subprocess.Popen(
            [*CROSSROADS, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.put(line.rstrip("\n"))

    def wait_for(self, text: str, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.p.poll() is not None:
                    break
                continue
            self.seen.append(line)
            if text in line:
                return line
        raise AssertionError(f"{text!r} not seen; output so far: {self.seen}")

    def type(self, line: str) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(5)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


@pytest.fixture
def server() -> Iterator[str]:
    http = free_port()
    proc = Proc(
        "serve",
        "--only",
        "p2p",
        "--host",
        "127.0.0.1",
        "--http-port",
        str(http),
        "--p2p-port",
        "0",
        "--p2p-alt-port",
        "0",
        "--p2p-alt-port2",
        "0",
    )
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{http}/healthz").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        yield f"ws://127.0.0.1:{http}/p2p/v1/ws"
    finally:
        proc.stop()


def test_host_and_join_chat(server: str) -> None:
    # --bind: loopback only (the IPv6 socket follows: ::1)
    host = Proc("host", "--server", server, "--bind", "127.0.0.1")
    join = None
    try:
        code = host.wait_for("invite code:").split(":", 1)[1].strip()
        join = Proc("join", code, "--server", server, "--bind", "127.0.0.1")
        join.wait_for("Type lines to chat")
        connected = join.wait_for("connected to")
        assert " via " in connected and " ms" in connected
        # IPv6 host candidates go first (sent 30 ms before the IPv4 ones)
        assert "via lan (IPv6 [::1]:" in connected, connected
        host.wait_for("joined")
        join.type("hello from the joiner")
        line = host.wait_for("hello from the joiner")
        assert " via " in line
        host.type("hello back")
        assert "via" in join.wait_for("hello back")
    finally:
        host.stop()
        if join is not None:
            join.stop()


def test_join_with_bad_code_fails_cleanly(server: str) -> None:
    join = Proc("join", "NOPE-NOPE", "--server", server, "--bind", "127.0.0.1")
    try:
        line = join.wait_for("crossroads join:")
        assert "unknown_code" in line
        assert join.p.wait(10) == 1
    finally:
        join.stop()


def test_cli_help_lists_the_demo() -> None:
    out = subprocess.run(
        [*CROSSROADS, "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "host" in out and "join" in out
    assert Path(__file__).exists()
