"""Session advertising on the MasterServer2 listing: the host posts the invite
code, a player finds it and joins, the new host keeps the row after migration."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from crossroads.client.listing import (
    ListingClient,
    ListingError,
    advertise,
    session_row,
)
from crossroads.client.p2p import HostChanged, P2PClient
from crossroads.config import default_config
from crossroads.runtime import Runtime, start
from tests.conftest import loopback_config

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def rt() -> AsyncIterator[Runtime]:
    runtime = await start(default_config(loopback_config(core__only="p2p")))
    try:
        yield runtime
    finally:
        await runtime.close()


async def wait_rows(
    listing: ListingClient, predicate: object, timeout: float = 5
) -> list[dict[str, object]]:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            rows = await listing.get("chess")
        except ListingError:
            rows = []
        if predicate(rows):  # type: ignore[operator]
            return rows
        assert asyncio.get_running_loop().time() < deadline, rows
        await asyncio.sleep(0.05)


async def test_listing_client_round_trip(rt: Runtime) -> None:
    host, port = rt.http_address
    listing = ListingClient(f"http://{host}:{port}/testServer")
    try:
        row = await listing.post("chess", {"map": "e4"}, timeout=15, row_pw="pw")
        assert (await listing.get("chess"))[0]["map"] == "e4"
        with pytest.raises(ListingError) as info:
            await listing.delete("chess", row)
        assert info.value.status == 401
        await listing.delete("chess", row, row_pw="pw")
        assert await listing.get("chess") == []
    finally:
        await listing.close()


async def test_advertise_find_join_and_migrate(rt: Runtime) -> None:
    host, port = rt.http_address
    url = f"ws://{host}:{port}/p2p/v1/ws"
    listing = ListingClient(f"http://{host}:{port}/testServer")
    a = P2PClient(url, bind=("127.0.0.1", 0))
    b = P2PClient(url, bind=("127.0.0.1", 0))
    c = P2PClient(url, bind=("127.0.0.1", 0))
    tasks = []
    try:
        for client in (a, b, c):
            await client.start()
        await a.host()
        tasks.append(
            asyncio.create_task(
                advertise(a, listing, "chess", {"map": "e4"}, timeout=15)
            )
        )
        rows = await wait_rows(listing, lambda rows: len(rows) == 1)
        assert rows[0]["code"] == a.code and rows[0]["map"] == "e4"
        row_id = rows[0]["__rowId"]
        assert row_id == session_row(a.session)[0]
        # a player finds the game in the listing and joins with its code
        await b.join(str(rows[0]["code"]))
        await c.join(str(rows[0]["code"]))
        for client in (b, c):
            tasks.append(
                asyncio.create_task(
                    advertise(client, listing, "chess", {"map": "e4"}, timeout=15)
                )
            )
        await wait_rows(listing, lambda rows: rows and rows[0]["members"] == 3)
        # the host leaves: b becomes host and refreshes the same row
        tasks[0].cancel()
        await asyncio.gather(tasks[0], return_exceptions=True)
        await a.close()
        while not isinstance(await asyncio.wait_for(b.events.get(), 5), HostChanged):
            pass
        rows = await wait_rows(listing, lambda rows: rows and rows[0]["members"] == 2)
        assert rows[0]["__rowId"] == row_id and len(rows) == 1
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for client in (a, b, c):
            await client.close()
        await listing.close()
