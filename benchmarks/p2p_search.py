"""The SDK's random searches through real kernel NAT: the prediction spray
(symmetric-random against symmetric-sequential, both host orders) and the
birthday technique (port-restricted cone against symmetric-random).

No other program implements these searches, so the comparison is against their
arithmetic: a random-side mapping hits with P = 1/64 512 (Linux NAT's port range
1024-65535), so the spray's random side should send a mean of 64 512 datagrams
and a median of 64 512 x ln 2 = 44 716 before the hit. Prints, per pair, the runs
connected by ``punch``, the median and range of the time from ``join`` to the
link, and for the spray the datagrams the random side sent (``PeerLink.sprayed``)
with the ratio to theory.

Needs root (it builds its own NAT lab, removed at the end).
Run: ``.venv/bin/python benchmarks/p2p_search.py --runs 20``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from crossroads.lab.matrix import Attempt, load_methods, run_attempt  # noqa: E402
from crossroads.lab.topology import Lab  # noqa: E402

NAT_PORTS = 65536 - 1024
PAIRS = (
    ("symmetric-sequential", "symmetric-random", "spray"),
    ("symmetric-random", "symmetric-sequential", "spray"),
    ("port-restricted-cone", "symmetric-random", "birthday"),
)
SPRAYED = re.compile(r"sprayed A (\d+), B (\d+)")


async def main(runs: int, prefix: str) -> None:
    method = load_methods()["sdk"]
    lab = Lab(prefix)
    print(f"building lab {prefix} ...", flush=True)
    await lab.up()
    sprayed: list[int] = []
    try:
        for a, b, technique in PAIRS:
            seconds: list[float] = []
            punched = 0
            for i in range(runs):
                attempt = Attempt(
                    lab, lab.site(f"{a}-a"), lab.site(f"{b}-b"), {"cleanups": []}
                )
                result = await run_attempt(method, attempt)
                print(
                    f"  {a} <-> {b} run {i + 1}/{runs}: "
                    f"{result.via} {result.seconds:.2f} s  {result.detail}",
                    flush=True,
                )
                if result.via != "punch":
                    continue
                punched += 1
                seconds.append(result.seconds)
                match = SPRAYED.search(result.detail)
                if technique == "spray" and match is not None:
                    side = 2 if b == "symmetric-random" else 1
                    sprayed.append(int(match.group(side)))
            if seconds:
                print(
                    f"{technique:8} {a} <-> {b}: punch {punched}/{runs}, "
                    f"median {statistics.median(seconds):.2f} s, "
                    f"range {min(seconds):.2f}-{max(seconds):.2f} s",
                    flush=True,
                )
            else:
                print(f"{technique:8} {a} <-> {b}: punch 0/{runs}", flush=True)
    finally:
        await lab.down()
    if sprayed:
        mean, median = statistics.mean(sprayed), statistics.median(sprayed)
        print(
            f"spray, random side, datagrams before the hit (n={len(sprayed)}): "
            f"mean {mean:.0f} (theory {NAT_PORTS}, ratio {mean / NAT_PORTS:.2f}), "
            f"median {median:.0f} (theory {NAT_PORTS * math.log(2):.0f}, "
            f"ratio {median / (NAT_PORTS * math.log(2)):.2f}), "
            f"range {min(sprayed)}-{max(sprayed)}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="attempts per pair")
    parser.add_argument("--prefix", default="xbs", help="lab namespace prefix")
    args = parser.parse_args()
    asyncio.run(main(args.runs, args.prefix))
