"""The runtime's drain, in process: every service that holds relayed sessions
takes part, OpenTTD's listeners refuse new connections, the console says so,
and with no live session the drain is over at once."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from crossroads.runtime import Runtime
from crossroads.services.openttd import OpenTTDService
from tests.conftest import running_service


async def test_drain_every_service(runtime: Runtime) -> None:
    host, port = runtime.http_address
    openttd = running_service(runtime, "openttd", OpenTTDService)
    coordinator = openttd.address("coordinator")
    async with httpx.AsyncClient(base_url=f"http://{host}:{port}") as http:
        assert (await http.get("/readyz")).status_code == 200
        assert "data-draining" not in (await http.get("/")).text
        runtime.drain()
        async with asyncio.timeout(10):
            await runtime.drained.wait()  # nothing live: over at once
        assert set(runtime.live_sessions()) >= {"turn", "relay", "raknet", "openttd"}
        ready = await http.get("/readyz")
        assert (ready.status_code, ready.json()) == (503, {"status": "draining"})
        assert (await http.get("/healthz")).status_code == 200
        assert "crossroads_draining 1.0" in (await http.get("/metrics")).text
        assert "data-draining" in (await http.get("/")).text
        assert (await http.get("/console/api/status")).json()["draining"] is True
    # OpenTTD has no redirect: a new connection is refused (clients go to
    # another instance); the coordinator's listener is closed.
    with pytest.raises(OSError):
        _, writer = await asyncio.open_connection(*coordinator)
        writer.close()
