"""--log-format json: every line ``crossroads serve`` logs is one JSON object."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

from crossroads.logs import JsonFormatter
from tests.conftest import free_port
from tests.test_firstrun import _all_ports_any


def test_json_formatter_keeps_exceptions_and_unicode() -> None:
    try:
        raise ValueError("bad ✓")
    except ValueError:
        record = logging.LogRecord(
            "crossroads.x", logging.ERROR, __file__, 1, "failed %s", ("é",),
            sys.exc_info(),
        )  # fmt: skip
    entry = json.loads(JsonFormatter().format(record))
    assert entry["level"] == "ERROR" and entry["logger"] == "crossroads.x"
    assert entry["message"] == "failed é"
    assert "ValueError: bad ✓" in entry["exception"]
    assert entry["time"].endswith("+00:00")


def test_serve_logs_json_lines(tmp_path: Path) -> None:
    env = {
        **os.environ,
        **_all_ports_any(),
        "XDG_STATE_HOME": str(tmp_path),
        "CROSSROADS_HTTP_PORT": str(free_port()),
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "crossroads", "serve", "--host", "127.0.0.1",
         "--only", "stun", "--log-format", "json"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert process.stderr is not None
    lines = []
    try:
        for line in process.stderr:
            lines.append(line)
            if "http: tcp 127.0.0.1:" in line:
                break
        process.send_signal(signal.SIGTERM)
        _, rest = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    lines += rest.splitlines()
    entries = [json.loads(line) for line in lines if line.strip()]
    assert {e["logger"] for e in entries} >= {"crossroads"}
    messages = [e["message"] for e in entries]
    assert any(m.startswith("stun: udp 127.0.0.1:") for m in messages)
    assert "stopped" in messages
