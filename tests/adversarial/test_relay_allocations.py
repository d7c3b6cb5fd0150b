"""The Unity relay's allocations are a table of the process's resource budget
("relay-allocations"): the UDP listener names it, one source with many valid
tokens holds at most its share, and the table drains when the allocations
end (every per-client table registers with the one budget)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.e2e.relay_support import (
    BIND_RECEIVED,
    RawPeer,
    allocate,
    allocation_id,
    api,
    endpoint_address,
    raw_bind,
    relay_runtime,
)

pytestmark = pytest.mark.timeout(60)

#: The table's name (crossroads.services.relay.ALLOCATIONS_TABLE).
TABLE = "relay-allocations"

#: Seats of the node: the table's total is twice that (16), and one source
#: may hold an eighth of it (2).
CAPACITY = 8


def table_row(snapshot: dict[str, Any]) -> dict[str, Any]:
    rows = [t for t in snapshot["tables"] if t["table"] == TABLE]
    assert len(rows) == 1, snapshot["tables"]
    return rows[0]


def raw_close(allocation: bytes) -> bytes:
    return b"\xda\x72\x00\x0b" + allocation


async def bound(peer: RawPeer, allocation: dict[str, Any]) -> bool:
    """Whether a BIND from ``peer`` gets BIND_RECEIVED (resent on loss)."""
    try:
        return await peer.request(raw_bind(allocation, 1), timeout=0.3) == (
            BIND_RECEIVED
        )
    except TimeoutError:
        return False


async def test_one_source_holds_its_share_of_allocations_and_they_drain() -> None:
    async with relay_runtime(relay__capacity=CAPACITY) as rt, api(rt) as http:
        # One source (127.0.0.1), four hosts with valid tokens each.
        allocations = [await allocate(http, 1) for _ in range(4)]
        server = endpoint_address(allocations[0], "udp")
        peers = [RawPeer(server) for _ in allocations]
        try:
            results = [
                await bound(p, a) for p, a in zip(peers, allocations, strict=True)
            ]
            assert results == [True, True, False, False]
            snapshot = rt.resources.snapshot()
            row = table_row(snapshot)
            assert (row["max"], row["max_per_source"]) == (2 * CAPACITY, 2)
            assert row["pool"] == "none" and row["preauth_deadline"] is None
            assert row["live"] == row["largest_source"] == 2
            assert row["refused"].get("over-ip-limit", 0) >= 2
            udp = [
                x
                for x in snapshot["listeners"]
                if x["service"] == "relay" and x["kind"] == "relay"
            ]
            assert [(x["transport"], x["table"]) for x in udp] == [("udp", TABLE)]

            # Both end (CLOSE): the table drains, and the source's next
            # allocation fits again.
            for peer, allocation in zip(peers[:2], allocations[:2], strict=True):
                peer.send(raw_close(allocation_id(allocation)))
            for _ in range(100):
                if table_row(rt.resources.snapshot())["live"] == 0:
                    break
                await asyncio.sleep(0.02)
            assert table_row(rt.resources.snapshot())["live"] == 0
            assert await bound(peers[2], allocations[2])
            assert table_row(rt.resources.snapshot())["live"] == 1
        finally:
            for peer in peers:
                peer.close()
    assert TABLE not in {t["table"] for t in rt.resources.snapshot()["tables"]}
