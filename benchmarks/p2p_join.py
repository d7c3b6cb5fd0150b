"""What a redirect costs a p2p join: two p2p instances on one real Redis, on
loopback; a host registers its session on instance A, then a guest joins it
either through A (no redirect) or through B (``redirect``: a second WebSocket,
``hello``/``welcome`` and rendezvous probes to A before the ``join``).

Measured: time from ``start()`` of a fresh guest to the accepted join (what a
player waits for after typing the code), alternating the two ways ``--runs``
times each on the same machine in the same run. Prints the medians and their
ratio. Needs ``redis-server`` (``make install``).
Run: ``.venv/bin/python benchmarks/p2p_join.py --runs 20``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.conftest import RedisServer  # noqa: E402

from crossroads.client.p2p import P2PClient  # noqa: E402
from crossroads.config import default_config  # noqa: E402
from crossroads.runtime import Runtime, start  # noqa: E402
from crossroads.services import load_service_modules  # noqa: E402


async def instance(store: str) -> Runtime:
    load_service_modules()
    return await start(
        default_config(
            {
                "core.host": "127.0.0.1",
                "core.http_port": 0,
                "core.only": "p2p",
                "core.store": store,
                "p2p.port": 0,
                "p2p.alt_port": 0,
                "p2p.alt_port2": 0,
            }
        )
    )


def url_of(rt: Runtime) -> str:
    host, port = rt.http_address
    return f"ws://{host}:{port}/p2p/v1/ws"


async def one_join(url: str, code: str, expect: str) -> float:
    guest = P2PClient(url, bind=("127.0.0.1", 0), bind6=None)
    started = time.perf_counter()
    try:
        await guest.start()
        await guest.join(code)
        took = time.perf_counter() - started
        assert guest.url == expect, (guest.url, expect)  # joined where the host is
        return took
    finally:
        await guest.close()


async def main(runs: int) -> None:
    redis = RedisServer()  # a real redis-server on a free port, its own folder
    a = b = None
    try:
        a, b = await instance(redis.url), await instance(redis.url)
        times: dict[str, list[float]] = {"same instance": [], "redirected": []}
        for run in range(runs):
            # A fresh host per run: one host taking dozens of joins in seconds
            # meets its signalling frame budget (20/s, bursts of 60) and would
            # measure that instead.
            host = P2PClient(url_of(a), bind=("127.0.0.1", 0), bind6=None)
            await host.start()
            code = await host.host()
            times["same instance"].append(await one_join(url_of(a), code, url_of(a)))
            times["redirected"].append(await one_join(url_of(b), code, url_of(a)))
            await host.close()
            print(f"run {run + 1}/{runs}", file=sys.stderr, end="\r")
        print(file=sys.stderr)
        medians = {k: statistics.median(v) for k, v in times.items()}
        for name, median in medians.items():
            low, high = min(times[name]), max(times[name])
            print(
                f"{name:14} median {median * 1000:7.1f} ms over {runs} joins"
                f" (range {low * 1000:.1f}-{high * 1000:.1f} ms)"
            )
        ratio = medians["redirected"] / medians["same instance"]
        print(f"redirected / same instance: {ratio:.2f}")
    finally:
        for rt in (a, b):
            if rt is not None:
                await rt.close()
        redis.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    asyncio.run(main(parser.parse_args().runs))
