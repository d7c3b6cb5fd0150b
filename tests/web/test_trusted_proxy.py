"""``--trusted-proxy``: X-Forwarded-For is believed only from a trusted reverse
proxy, and then the per-IP limits of the HTTP app see the real client.

The per-IP limit used is the relay API's rate (``--relay-api-rate 1``: a burst
of 3 calls per client IP, then 429), on a real runtime over real sockets."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.conftest import eventually
from tests.e2e.relay_support import api, relay_runtime

pytestmark = pytest.mark.timeout(60)

#: --relay-api-rate 1 gives a burst of max(1, 3 * rate) = 3 calls.
BURST = 3


async def allocate(http: httpx.AsyncClient, forwarded_for: str) -> int:
    response = await http.post(
        "/v1/allocate",
        json={"maxConnections": 1},
        headers={"X-Forwarded-For": forwarded_for},
    )
    return response.status_code


async def test_a_spoofed_header_from_an_untrusted_source_is_ignored() -> None:
    """Without --trusted-proxy (and with one that does not match the source),
    a client cannot pick its address: every call counts against 127.0.0.1."""
    for trusted in ((), ("192.0.2.0/24",)):
        extra = {"core__trusted_proxies": list(trusted)} if trusted else {}
        async with relay_runtime(relay__api_rate=1, **extra) as rt, api(rt) as http:
            statuses = [
                await allocate(http, f"198.51.100.{n}") for n in range(BURST + 1)
            ]
            assert statuses == [201] * BURST + [429], trusted


async def test_a_trusted_proxys_header_is_used_by_the_per_ip_limit() -> None:
    async with (
        relay_runtime(relay__api_rate=1, core__trusted_proxies=["127.0.0.0/8"]) as rt,
        api(rt) as http,
    ):
        # One client behind the proxy spends its own burst...
        for _ in range(BURST):
            assert await allocate(http, "198.51.100.1") == 201
        assert await allocate(http, "198.51.100.1") == 429
        # ...and cannot dodge it by prepending an address of its choice: the
        # client is the rightmost address the proxy did not vouch for.
        assert await allocate(http, "203.0.113.9, 198.51.100.1") == 429
        # Another client behind the same proxy still has its own.
        assert await allocate(http, "198.51.100.2") == 201
        # A chain through a second trusted proxy names the client before it.
        assert await allocate(http, "198.51.100.3, 127.0.0.2") == 201


async def open_connections(
    host: str, port: int, count: int
) -> list[asyncio.StreamWriter]:
    writers = []
    for _ in range(count):
        _, writer = await asyncio.open_connection(host, port)
        writers.append(writer)
    return writers


async def healthz_on_new_connection(host: str, port: int) -> int:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        status_line = await asyncio.wait_for(reader.readline(), 10)
        return int(status_line.split()[1])
    finally:
        writer.close()


@pytest.mark.parametrize(("trusted", "expected"), [(False, 503), (True, 200)])
async def test_a_trusted_proxy_is_not_held_to_the_per_ip_connection_cap(
    trusted: bool, expected: int
) -> None:
    """A proxy's connections carry many clients: the per-IP connection cap
    (2 here) applies to everyone else, not to it."""
    extra = {"core__trusted_proxies": ["127.0.0.1"]} if trusted else {}
    async with relay_runtime(core__http_max_connections_per_ip=2, **extra) as rt:
        host, port = rt.http_address
        held = await open_connections(host, port, 2)
        try:
            # The first two are admitted once the server has seen them.
            async def admitted() -> bool:
                return rt.resources.admissions["http"].live == 2

            await eventually(admitted, "two connections admitted")
            assert await healthz_on_new_connection(host, port) == expected
        finally:
            for writer in held:
                writer.close()


@pytest.mark.parametrize(
    ("trusted", "listed"), [((), "127.0.0.1"), (("127.0.0.1",), "198.51.100.20")]
)
async def test_the_game_listing_records_the_address_a_trusted_proxy_names(
    trusted: tuple[str, ...], listed: str
) -> None:
    """The address the HTTP app hands back to others (a RakNet game's
    ``__addr`` in the listing) is the client's behind a trusted proxy, and
    the connection's own otherwise."""
    extra = {"core__trusted_proxies": list(trusted)} if trusted else {}
    async with relay_runtime(core__only="p2p", **extra) as rt:
        host, port = rt.http_address
        async with httpx.AsyncClient(base_url=f"http://{host}:{port}") as http:
            posted = await http.post(
                "/testServer",
                content=b"{'__gameId': 'mygame', '__timeoutSec': '30'}",
                headers={"X-Forwarded-For": "198.51.100.20"},
            )
            assert posted.status_code == 200
            rows = (await http.get("/testServer?__gameId=mygame")).json()["GET"]
        assert [row["__addr"] for row in rows] == [listed]
