"""natneg first-attempt success behind remapping routers: timed CONNECTs against
CONNECTs sent together (the original GameSpy service's behaviour), side by side.

Runs in the NAT lab (root; ``crossroads lab``'s namespaces and real kernel NAT):
two ``port-restricted-remap`` sites (port-restricted cones whose routers accept
unsolicited input, so a ping that knocks first makes the router remap)
negotiate through two natneg servers in the lab's server namespace, identical but
for ``--natneg-timed-connect``. Before each run the three paths (server <-> a,
server <-> b, a <-> b) get a random one-way delay, uniform in [--min-ms, --max-ms],
from the lab's delay lines (``crossroads.lab.delay``); with those delays both
servers negotiate once, one after the other (paired runs, the order alternating),
and only the first attempt counts: no retry, and the servers' relay is off so a
failure cannot turn into a relayed success.

    .venv/bin/python benchmarks/natneg_first_attempt.py [--runs 40] [--seed 1]
"""

from __future__ import annotations

import argparse
import asyncio
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

SITES = ("port-restricted-remap-a", "port-restricted-remap-b")
#: (name, natneg port, HTTP port, timed?) of the two servers compared.
SERVERS = (
    ("timed", 27921, 8093, True),
    ("together", 27931, 8094, False),
)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--min-ms", type=float, default=5.0)
    parser.add_argument("--max-ms", type=float, default=150.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--prefix", default="nbfa", help="lab prefix (built if down)")
    parser.add_argument("--keep", action="store_true", help="leave the lab up")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    lab = Lab(args.prefix)
    built = await lab.up()
    a, b = (lab.site(name) for name in SITES)
    results: dict[str, list[tuple[bool, float]]] = {name: [] for name, *_ in SERVERS}
    triangle_broken = 0
    try:
        for name, port, http, timed in SERVERS:
            await lab.start_extra_server(
                f"natneg-{name}",
                extra_server_args(port, timed=timed, relay="never"),
                http,
            )
        for run in range(args.runs):
            sa, sb, ab = (rng.uniform(args.min_ms, args.max_ms) / 1000 for _ in "xyz")
            # Where |d(s,a) - d(s,b)| > d(a,b) the client nearer to the server
            # pings first and its ping knocks on the other router before that one
            # sends, if the CONNECTs leave together.
            triangle_broken += abs(sa - sb) > ab
            order = SERVERS if run % 2 == 0 else SERVERS[::-1]
            async with (
                lab.path_delay(a, "server", sa, table=77),
                lab.path_delay(b, "server", sb, table=78),
                lab.path_delay(a, b, ab, table=79),
            ):
                for name, port, _http, _timed in order:
                    await asyncio.gather(lab.reset_nat(a), lab.reset_nat(b))
                    cookie = rng.getrandbits(32)
                    started = time.monotonic()
                    host, guest = await negotiate(lab, a, b, cookie, servers_at(port))
                    ok = succeeded(host, guest)
                    results[name].append((ok, time.monotonic() - started))
                    SdkNegotiator.close_all()
            print(
                f"run {run + 1:3d}: s-a {sa * 1000:5.1f} ms, s-b {sb * 1000:5.1f} ms,"
                f" a-b {ab * 1000:5.1f} ms: "
                + ", ".join(
                    f"{name} {'ok' if results[name][-1][0] else 'FAIL'}"
                    for name, *_ in SERVERS
                ),
                flush=True,
            )
    finally:
        for name, *_ in SERVERS:
            await lab.stop_extra_server(f"natneg-{name}")
        if built and not args.keep:
            await lab.down()
    print()
    print(
        f"natneg first attempt, {args.runs} paired runs, port-restricted-remap <->"
        f" port-restricted-remap, one-way delays uniform {args.min_ms:g}-"
        f"{args.max_ms:g} ms per path (seed {args.seed}); {triangle_broken} runs"
        " with |d(s,a) - d(s,b)| > d(a,b)"
    )
    for name, *_ in SERVERS:
        rows = results[name]
        wins = [seconds for ok, seconds in rows if ok]
        median = statistics.median(wins) if wins else float("nan")
        p90 = statistics.quantiles(wins, n=10)[-1] if len(wins) >= 2 else median
        print(
            f"  CONNECTs {name:8s}: {len(wins):3d}/{len(rows)} connected first time"
            f" ({100 * len(wins) / len(rows):5.1f} %), median {median:.2f} s,"
            f" p90 {p90:.2f} s"
        )


if __name__ == "__main__":
    asyncio.run(main())
