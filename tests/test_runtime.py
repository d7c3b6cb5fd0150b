from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from crossroads.runtime import Runtime
from tests.conftest import free_port


async def test_healthz_and_metrics(runtime: Runtime) -> None:
    host, port = runtime.http_address
    async with httpx.AsyncClient(base_url=f"http://{host}:{port}") as client:
        health = await client.get("/healthz")
        assert health.status_code == 200
        assert health.json()["status"] == "ok"
        metrics = await client.get("/metrics")
        assert metrics.status_code == 200
        assert metrics.headers["content-type"].startswith("text/plain")
        missing = await client.get("/nope")
        assert missing.status_code == 404
        assert missing.json() == {"code": "not_found", "message": "Not Found"}


def test_serve_logs_services_and_stops_on_sigterm() -> None:
    http_port = free_port()
    env = {**os.environ, **_all_ports_any(), "CROSSROADS_HTTP_PORT": str(http_port)}
    process = subprocess.Popen(
        [sys.executable, "-m", "crossroads", "serve", "--host", "127.0.0.1"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        ready = False
        while time.monotonic() < deadline and not ready:
            try:
                ready = (
                    httpx.get(f"http://127.0.0.1:{http_port}/healthz").status_code
                    == 200
                )
            except httpx.TransportError:
                time.sleep(0.1)
        assert ready, "crossroads serve did not answer /healthz"
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=15)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, output
    assert f"http: tcp 127.0.0.1:{http_port}" in output
    assert "stopped" in output


def _all_ports_any() -> dict[str, str]:
    """Every service port as 0 (OS-chosen), through CROSSROADS_* variables."""
    from crossroads.config import env_name, iter_settings
    from crossroads.services import load_service_modules

    load_service_modules()
    return {
        env_name(section, f): "0"
        for section, f, info in iter_settings()
        if info.kind == "port"
    }
