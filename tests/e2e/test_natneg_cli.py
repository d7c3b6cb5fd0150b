"""`crossroads serve` as a real process, configured by a seed-style config.json,
negotiating two SDK-like clients (single IP: natneg1/2/3 on one socket)."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import free_port, serve_command
from tests.services.natneg_sdk import negotiate_on_loopback

pytestmark = pytest.mark.timeout(60)


def wait_for_line(process: subprocess.Popen[str], needle: str, timeout: float) -> str:
    assert process.stderr is not None
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        if not line:
            if process.poll() is not None:
                break
            continue
        seen.append(line)
        if needle in line:
            return line
    raise AssertionError(f"{needle!r} not logged; got:\n{''.join(seen)}")


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[tuple[int, subprocess.Popen[str]]]:
    port = free_port(socket.SOCK_DGRAM)
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "natneg": {
                    "host": "127.0.0.1",
                    "port": port,
                    "enabled": True,
                    "session_timeout": 5,
                    "force_lan_mode": False,
                }
            }
        )
    )
    process = subprocess.Popen(
        serve_command(
            "natneg", "--natneg-probe-port", "0", "--natneg-config-json", str(config)
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_line(process, f"127.0.0.1:{port} (natneg1)", 20)
        yield port, process
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def test_negotiation_against_the_real_process(
    serve: tuple[int, subprocess.Popen[str]],
) -> None:
    port, _ = serve
    await negotiate_on_loopback(port, 0xC0FFEE)


def test_bad_config_json_exits_with_code_2(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"natneg": {"port": "not a port"}}))
    result = subprocess.run(
        serve_command("natneg", "--natneg-config-json", str(config)),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert "natneg.port" in result.stderr
