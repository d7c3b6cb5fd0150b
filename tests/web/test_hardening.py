"""The admin token inside the guessing budget, the API
documentation off by default, and HSTS on answers sent over HTTPS."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from crossroads.config import default_config
from crossroads.runtime import Runtime, start
from tests.conftest import loopback_config
from tests.web.test_https import https_runtime

pytestmark = pytest.mark.timeout(60)

TOKEN = "the-admin-token-0123456789"


@asynccontextmanager
async def runtime(**extra: Any) -> AsyncIterator[Runtime]:
    values: dict[str, Any] = {"core__only": ["stun"], "core__admin_token": TOKEN}
    values.update(extra)
    rt = await start(default_config(loopback_config(**values)))
    try:
        yield rt
    finally:
        await rt.close()


def client(rt: Runtime, source: str = "127.0.0.1") -> httpx.AsyncClient:
    host, port = rt.http_address
    return httpx.AsyncClient(
        base_url=f"http://{host}:{port}",
        transport=httpx.AsyncHTTPTransport(local_address=source),
        timeout=10,
    )


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_wrong_admin_tokens_spend_the_guess_budget() -> None:
    """Before, 188 wrong tokens a second got 401 without end. Now each wrong
    token spends the --guess-* budget (30 a minute per source here): then
    429, for a right token too (answering it would confirm a guess), while
    another source with the right token is served."""
    async with runtime(core__guess_per_source=30) as rt:
        async with client(rt) as http:
            codes = [
                (
                    await http.get(
                        "/console/api/admin/errors", headers=bearer(f"guess-{i}")
                    )
                ).status_code
                for i in range(40)
            ]
            assert codes == [401] * 30 + [429] * 10
            refused = await http.get("/console/api/admin/errors", headers=bearer(TOKEN))
            assert refused.status_code == 429
            assert refused.json()["code"] == "rate_limited"
            assert "retry-after" in refused.headers
        async with client(rt, "127.0.0.2") as other:
            for _ in range(50):  # a right token costs nothing
                answer = await other.get(
                    "/console/api/admin/errors", headers=bearer(TOKEN)
                )
                assert answer.status_code == 200
            # No bearer token at all is no guess: 401, budget untouched.
            assert (await other.get("/console/api/admin/errors")).status_code == 401


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json"])
async def test_api_docs_are_off_unless_asked_for(path: str) -> None:
    async with runtime() as rt, client(rt) as http:
        assert (await http.get(path)).status_code == 404
    async with runtime(core__api_docs=True) as rt, client(rt) as http:
        assert (await http.get(path)).status_code == 200


async def test_hsts_on_https_answers_only(tmp_path: Path) -> None:
    async with https_runtime(tmp_path, core__only=["stun"]) as (rt, port, context):
        async with httpx.AsyncClient(verify=context, timeout=10) as https:
            answer = await https.get(f"https://localhost:{port}/healthz")
            assert answer.status_code == 200
            assert answer.headers["strict-transport-security"] == "max-age=31536000"
            page = await https.get(f"https://localhost:{port}/")
            assert "strict-transport-security" in page.headers
        async with client(rt) as http:
            plain = await http.get("/healthz")
            assert plain.status_code == 200
            assert "strict-transport-security" not in plain.headers
