"""Reflection table: bytes out / bytes in per unauthenticated request, per UDP
service, with the reflection budget off (what crossroads did before it) and on.

Real datagrams on loopback against a real runtime per service. For each service
it measures one request from a fresh source address (every answer it causes,
delayed ones included) and a spoofed burst from one address (the burst sizes of
``tests/adversarial/reflection_support.py``: as large as each service's own
rate limit lets through at once). Prints a Markdown table for docs/security.md.
Run: ``.venv/bin/python benchmarks/reflection.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.adversarial.reflection_support import (  # noqa: E402
    P2P_SETTINGS,
    PROBES,
    Exchange,
    Probe,
    p2p_reflect,
    reflect,
    start_for,
)

from crossroads.proto.reflection import DEFAULT_ALLOWANCE  # noqa: E402
from crossroads.services import load_service_modules  # noqa: E402

#: A source address per measurement, so each starts with a fresh ledger.
SINGLE_SOURCE = "127.0.0.21"
BURST_SOURCE = "127.0.0.22"


async def measure(
    probe: Probe | None, budget: bool, burst: int
) -> tuple[Exchange, Exchange]:
    settings: dict[str, Any] = {"core__reflection_budget": budget}
    if probe is None:
        rt = await start_for(
            Probe("p2p", "", lambda n: [], lambda rt: ("", 0), P2P_SETTINGS), **settings
        )
    else:
        rt = await start_for(probe, **settings)
    try:
        if probe is None:
            one = await p2p_reflect(rt, 1, SINGLE_SOURCE)
            many = await p2p_reflect(rt, burst, BURST_SOURCE)
        else:
            one = await reflect(rt, probe, 1, SINGLE_SOURCE)
            many = await reflect(rt, probe, burst, BURST_SOURCE)
    finally:
        await rt.close()
    return one, many


def _cell(exchange: Exchange) -> str:
    return f"{exchange.bytes_out} / {exchange.bytes_in} = {exchange.ratio:.2f}x"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.parse_args()
    load_service_modules()
    rows = [
        "| service | unauthenticated request | one request: bytes out / in | "
        "spoofed burst | budget off (before) | budget on (after) |",
        "|---|---|---|---|---|---|",
    ]
    cases: list[tuple[str, str, Probe | None, int]] = [
        (p.name, p.request, p, p.count) for p in PROBES.values()
    ]
    cases.append(("p2p", "rendezvous probe with a valid token", None, 20))
    for name, request, probe, count in cases:
        one, before = await measure(probe, False, count)
        _one_after, after = await measure(probe, True, count)
        rows.append(
            f"| {name} | {request}, {one.bytes_in // one.requests} B | {_cell(one)} | "
            f"{count} requests | {_cell(before)} | {_cell(after)} |"
        )
    print("\n".join(rows))
    print(f"\nallowance: {DEFAULT_ALLOWANCE} B per source IP per service per 10 s")


if __name__ == "__main__":
    asyncio.run(main())
