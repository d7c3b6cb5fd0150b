"""P2P SDK data path on loopback: what end-to-end encryption and the WebSocket
relay cost, against plain asyncio UDP on the same load.

Three runs, same sender loop, same payload (1000-byte datagrams for ROUND_S
seconds, at most WINDOW in flight so that no run measures kernel drops; the
receiver counts):

- ``udp``:   two plain asyncio datagram endpoints (the peer: no crossroads code);
- ``sealed``: two SDK peers on a direct link (ChaCha20-Poly1305 per datagram);
- ``relay``:  the same SDK peers with ``relay="force"``: every datagram goes
  through the p2p service's WebSocket relay (``0x01 | peer | datagram`` frames).

Prints received datagrams/s per run (median of ROUNDS) and the ratios to ``udp``.
Run: ``.venv/bin/python benchmarks/p2p.py``.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from crossroads.client.p2p import P2PClient  # noqa: E402
from crossroads.config import default_config  # noqa: E402
from crossroads.runtime import start  # noqa: E402
from crossroads.services import load_service_modules  # noqa: E402

ROUNDS = 3
ROUND_S = 2.0
WINDOW = 32
PAYLOAD = b"x" * 1000


async def pump(send: object, count: list[int]) -> float:
    """Send bursts for ROUND_S seconds; return datagrams/s received."""
    before = count[0]
    sent = 0
    started = time.monotonic()
    idle_since = started
    while time.monotonic() - started < ROUND_S:
        if sent - (count[0] - before) < WINDOW:
            send(PAYLOAD)  # type: ignore[operator]
            sent += 1
            idle_since = time.monotonic()
        else:
            await asyncio.sleep(0)
            if time.monotonic() - idle_since > 0.05:
                sent = count[0] - before  # a datagram was lost: reopen the window
    return (count[0] - before) / (time.monotonic() - started)


async def udp_round() -> float:
    loop = asyncio.get_running_loop()
    count = [0]

    class Receiver(asyncio.DatagramProtocol):
        def datagram_received(self, data: bytes, addr: object) -> None:
            count[0] += 1

    rx, _ = await loop.create_datagram_endpoint(Receiver, local_addr=("127.0.0.1", 0))
    address = rx.get_extra_info("sockname")
    tx, _ = await loop.create_datagram_endpoint(
        asyncio.DatagramProtocol, remote_addr=address
    )
    try:
        return await pump(tx.sendto, count)
    finally:
        tx.close()
        rx.close()


async def sdk_round(url: str, relay: str) -> tuple[float, str]:
    # IPv4 only, like the plain-UDP baseline it is compared with
    a = P2PClient(url, bind=("127.0.0.1", 0), bind6=None)
    b = P2PClient(url, bind=("127.0.0.1", 0), bind6=None, relay=relay)
    await a.start()
    await b.start()
    try:
        await b.join(await a.host())
        count = [0]

        async def drain() -> None:
            while True:
                await a.recv()
                count[0] += 1

        task = asyncio.create_task(drain())
        try:
            rate = await pump(lambda data: b.send(a.peer_id, data), count)
        finally:
            task.cancel()
        return rate, b.links[a.peer_id].step
    finally:
        await b.close()
        await a.close()


async def main() -> None:
    load_service_modules()
    overrides = {"core.host": "127.0.0.1", "core.http_port": 0, "core.only": "p2p"}
    overrides.update({"p2p.port": 0, "p2p.alt_port": 0, "p2p.alt_port2": 0})
    # Measure the relay's data plane, not its default per-connection budget.
    overrides["p2p.relay_bytes_per_second"] = 1 << 30
    runtime = await start(default_config(overrides))
    host, port = runtime.http_address
    url = f"ws://{host}:{port}/p2p/v1/ws"
    results: dict[str, list[float]] = {"udp": [], "sealed": [], "relay": []}
    try:
        for _ in range(ROUNDS):
            results["udp"].append(await udp_round())
            rate, step = await sdk_round(url, "allow")
            results["sealed"].append(rate)
            rate, step = await sdk_round(url, "force")
            assert step == "relay", step
            results["relay"].append(rate)
    finally:
        await runtime.close()
    base = statistics.median(results["udp"])
    print(
        f"1000-byte datagrams received per second, median of {ROUNDS} x {ROUND_S:.0f} s"
    )
    for name, rates in results.items():
        median = statistics.median(rates)
        print(
            f"  {name:<7} {median:10.0f}/s  ({median * 8 * 1000 / 1e6:7.1f} Mbit/s)  ratio to udp {median / base:.2f}"
        )


if __name__ == "__main__":
    asyncio.run(main())
