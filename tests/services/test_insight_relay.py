"""Unity relay sessions write connection-insight records with the bytes each
way read from the link's route counters; /v1/insight/* serves them."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from crossroads.runtime import Runtime
from tests.e2e.relay_support import (
    api,
    base_url,
    raw_relay,
    relay_runtime,
)
from tests.e2e.test_relay import session

pytestmark = pytest.mark.timeout(60)

ADMIN = "insight-admin-token-0123456789"
FRAMES = 100
SIZE = 1000


def admin(rt: Runtime) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=base_url(rt),
        headers={"Authorization": f"Bearer {ADMIN}"},
        timeout=10,
    )


async def test_relay_session_record_counts_the_frames_sent() -> None:
    async with relay_runtime(core__admin_token=ADMIN) as rt, api(rt) as http:
        host, joiner, hid, jid, _h, _j = await session(http)
        try:
            sent_up = sent_down = 0
            for n in range(FRAMES):
                up = raw_relay(jid, hid, bytes([n % 256]) * SIZE)
                down = raw_relay(hid, jid, bytes([n % 256]) * (SIZE // 2))
                joiner.send(up)
                assert await host.recv() == up
                host.send(down)
                assert await joiner.recv() == down
                sent_up += len(up)
                sent_down += len(down)
            host.send(b"\xda\x72\x00\x0b" + hid)  # CLOSE: the session ends
            assert (await joiner.recv())[:4] == b"\xda\x72\x00\x09"
        finally:
            host.close()
            joiner.close()
        async with admin(rt) as console:
            for _ in range(50):
                answer = await console.get("/v1/insight/attempts?family=relay")
                assert answer.status_code == 200
                found = answer.json()["attempts"]
                if found:
                    break
                await asyncio.sleep(0.1)
            [record] = found
            assert record["winner"] == "relay" and record["outcome"] == "relayed"
            assert record["cause"] == "relay-only"
            assert record["steps"][0]["outcome"] == "closed"
            usage = record["usage"]
            # Exact: the route counts every frame it forwarded, nothing else.
            assert usage["bytes_up"] == sent_up and usage["packets_up"] == FRAMES
            assert usage["bytes_down"] == sent_down
            assert usage["packets_down"] == FRAMES
            assert "127.0.0.1" not in json.dumps(record)  # pseudonymous
            assert record["sides"][0]["prefix"] == "127.0.0.0/24"
            # The day's usage and the JSON-lines export.
            totals = (await console.get("/v1/insight/usage")).json()
            [game] = totals["per_game"]
            assert game["family"] == "relay" and game["sessions"] == 1
            assert game["bytes_up"] == sent_up
            [code] = totals["per_code"]
            assert code["code"] == record["session"]
            export = await console.get("/v1/insight/export")
            assert export.headers["content-type"].startswith("application/x-ndjson")
            lines = export.text.splitlines()
            assert [json.loads(line) for line in lines] == [record]
            # Filters, and refusals.
            empty = await console.get("/v1/insight/attempts?family=turn")
            assert empty.json() == {"attempts": []}
            assert (
                await console.get("/v1/insight/attempts?family=x")
            ).status_code == 400
            assert (
                await console.get("/v1/insight/attempts?limit=0")
            ).status_code == 400
        async with httpx.AsyncClient(base_url=base_url(rt)) as anonymous:
            for path in ("attempts", "usage", "export"):
                refused = await anonymous.get(f"/v1/insight/{path}")
                assert refused.status_code == 401
        metric = rt.metrics.get_sample_value(
            "crossroads_insight_relayed_bytes_total", {"family": "relay"}
        )
        assert metric == sent_up + sent_down
