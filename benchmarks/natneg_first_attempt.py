"""natneg first attempts over many delay draws: timed CONNECTs against CONNECTs
sent together (the original GameSpy service's behaviour), side by side, on the
cells where timing can matter (a remapping router) and on the rest.

Runs in the NAT lab (root; ``crossroads lab``'s namespaces and real kernel NAT)
with the SDK-faithful client (``crossroads.lab.natneg_sdk``: protocol v4, its
timers, ``NNThink`` every 10 ms as the SDK's sample). Each server mode is a natneg
server of its own in the lab's server namespace, identical but for its CONNECT
timing, with the relay off so that a failure cannot turn into a relayed success:

* ``timed``: ``--natneg-timed-connect`` (the ERT round trip, then the lead);
* ``together``: ``--no-natneg-timed-connect`` (both CONNECTs at once).

Cells (host A-a <-> host B-b):

* *remap*: ``port-restricted-remap`` against ``port-restricted-remap`` and against
  ``port-restricted-cone``: a port-restricted router that accepts unsolicited
  input, so a ping that knocks before its own client pinged makes it remap,
  against a partner that filters by port: the first attempt fails;
* *rest*: ``port-restricted-cone`` <-> ``port-restricted-cone``, ``full-cone``
  <-> ``restricted-cone``, ``open`` <-> ``cgnat``: a knock is dropped or let in,
  never remembered, and the SDK answers the partner's first ping at once, so
  timing can only cost (the wait for the later client's round trip).

For each draw and cell, the cell's three paths (server <-> a, server <-> b,
a <-> b) get a random one-way delay, uniform in [--min-ms, --max-ms], from the
lab's delay lines (``crossroads.lab.delay``); with those delays every mode
negotiates once, one after the other (paired runs, the order rotating), after
both routers' NAT state was flushed, and only the first attempt counts. The time
is from the start until both clients have their result (success or not).

    .venv/bin/python benchmarks/natneg_first_attempt.py [--draws 20] [--seed 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time

from crossroads.lab.methods.natneg import (
    extra_server_args,
    negotiate,
    servers_at,
    succeeded,
)
from crossroads.lab.natneg_sdk import SdkNegotiator
from crossroads.lab.topology import Lab

#: (class, site a, site b) of the cells.
CELLS = (
    ("remap", "port-restricted-remap-a", "port-restricted-remap-b"),
    ("remap", "port-restricted-cone-a", "port-restricted-remap-b"),
    ("rest", "port-restricted-cone-a", "port-restricted-cone-b"),
    ("rest", "full-cone-a", "restricted-cone-b"),
    ("rest", "open-a", "cgnat-b"),
)
#: (name, natneg port, HTTP port, extra ``crossroads serve`` args) per mode.
MODES: tuple[tuple[str, int, int, list[str]], ...] = (
    ("timed", 27921, 8093, extra_server_args(27921, timed=True, relay="never")),
    ("together", 27931, 8094, extra_server_args(27931, timed=False, relay="never")),
)


async def timed_negotiation(
    lab: Lab, a_name: str, b_name: str, port: int, cookie: int
) -> tuple[bool, float]:
    """One first attempt: (connected, seconds until both clients had a result)."""
    a, b = lab.site(a_name), lab.site(b_name)
    await asyncio.gather(lab.reset_nat(a), lab.reset_nat(b))
    started = time.monotonic()
    finished: list[float] = []
    negotiation = asyncio.ensure_future(negotiate(lab, a, b, cookie, servers_at(port)))
    # Both results, not the REPORT round trip the v4 client adds after success.
    watched: list[SdkNegotiator] = []
    while not negotiation.done():
        watched = [n for n in SdkNegotiator.instances[-2:]]
        if len(watched) == 2 and all(n.outcome is not None for n in watched):
            finished.append(time.monotonic())
            break
        await asyncio.sleep(0.002)
    host, guest = await negotiation
    end = finished[0] if finished else time.monotonic()
    ok = succeeded(host, guest)
    SdkNegotiator.close_all()
    return ok, end - started


def summary(rows: list[tuple[bool, float]]) -> str:
    wins = [seconds for ok, seconds in rows if ok]
    median = statistics.median(wins) if wins else float("nan")
    return (
        f"{len(wins):3d}/{len(rows):<3d} first time, median {median:.3f} s"
        f" (connected), all {statistics.median(s for _, s in rows):.3f} s"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--draws", type=int, default=20)
    parser.add_argument("--min-ms", type=float, default=5.0)
    parser.add_argument("--max-ms", type=float, default=150.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--prefix", default="nbfa", help="lab prefix (built if down)")
    parser.add_argument("--keep", action="store_true", help="leave the lab up")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    lab = Lab(args.prefix)
    built = await lab.up()
    modes = [name for name, *_ in MODES]
    classes = list(dict.fromkeys(kind for kind, *_ in CELLS))
    #: (mode, class) -> [(connected, seconds)]; (class) -> [outcome per mode]
    results: dict[tuple[str, str], list[tuple[bool, float]]] = {
        (m, c): [] for m in modes for c in classes
    }
    paired: dict[str, list[dict[str, bool]]] = {c: [] for c in classes}
    started = time.monotonic()
    load = os.getloadavg()[0]
    try:
        for name, _port, http, server_args in MODES:
            await lab.start_extra_server(f"natneg-{name}", server_args, http)
        run = 0
        for draw in range(args.draws):
            for kind, a_name, b_name in CELLS:
                sa, sb, ab = (
                    rng.uniform(args.min_ms, args.max_ms) / 1000 for _ in "xyz"
                )
                order = MODES[run % len(MODES) :] + MODES[: run % len(MODES)]
                run += 1
                outcome: dict[str, bool] = {}
                async with (
                    lab.path_delay(a_name, "server", sa, table=77),
                    lab.path_delay(b_name, "server", sb, table=78),
                    lab.path_delay(a_name, b_name, ab, table=79),
                ):
                    for name, port, _http, _args in order:
                        cookie = rng.getrandbits(32)
                        ok, seconds = await timed_negotiation(
                            lab, a_name, b_name, port, cookie
                        )
                        results[(name, kind)].append((ok, seconds))
                        outcome[name] = ok
                paired[kind].append(outcome)
                print(
                    f"draw {draw + 1:3d} {a_name} <-> {b_name}: s-a {sa * 1000:5.1f},"
                    f" s-b {sb * 1000:5.1f}, a-b {ab * 1000:5.1f} ms: "
                    + ", ".join(
                        f"{m} {'ok' if outcome[m] else 'FAIL'}"
                        f" {results[(m, kind)][-1][1]:.3f}s"
                        for m in modes
                    ),
                    flush=True,
                )
    finally:
        for name, *_ in MODES:
            await lab.stop_extra_server(f"natneg-{name}")
        if built and not args.keep:
            await lab.down()
    wall = time.monotonic() - started
    print()
    print(
        f"natneg first attempt, {args.draws} delay draws per cell, one-way delays"
        f" uniform {args.min_ms:g}-{args.max_ms:g} ms per path (seed {args.seed});"
        f" {wall:.0f} s wall, load average {load:.2f} at start,"
        f" {os.getloadavg()[0]:.2f} at the end"
    )
    for kind in classes:
        cells = [f"{a} <-> {b}" for k, a, b in CELLS if k == kind]
        print(f"{kind} cells ({'; '.join(cells)}):")
        for mode in modes:
            print(f"  {mode:9s} {summary(results[(mode, kind)])}")
        for mode in modes:
            saved = sum(
                o[mode] and not all(o[m] for m in modes if m != mode)
                for o in paired[kind]
            )
            print(f"  cells only {mode} connected: {saved}")


if __name__ == "__main__":
    asyncio.run(main())
