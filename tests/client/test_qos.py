"""The SDK picks its relay region by measurement: two regions, each a real
crossroads STUN/TURN server with its QoS listener, one of them 40 ms away
(a UDP delay line in front of its QoS port); the p2p SDK's TURN factory
measures both and allocates in the near one, and two peers relay through it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from crossroads.client.p2p import P2PClient, _TurnTransport
from crossroads.client.qos import MeasuredChoice, measure_servers
from crossroads.client.turnrelay import TurnClientRelay
from crossroads.config import default_config
from crossroads.runtime import Runtime, start
from crossroads.types import Address
from tests.conftest import loopback_config
from tests.qos_client import UdpDelay

pytestmark = pytest.mark.timeout(60)

USER, PASSWORD = "qos-user", "qos-password-0123"
DELAY = 0.040


def port_of(rt: Runtime, kind: str, transport: str = "udp") -> int:
    rows = rt.resources.snapshot()["listeners"]
    (row,) = [x for x in rows if x["kind"] == kind and x["transport"] == transport]
    return int(row["port"])


@asynccontextmanager
async def regions() -> AsyncIterator[dict[str, tuple[Runtime, Address]]]:
    """{"far": (runtime, measured QoS address), "near": ...} and the p2p server."""
    loop = asyncio.get_running_loop()
    line_transport, line = await loop.create_datagram_endpoint(
        UdpDelay.factory(DELAY), local_addr=("127.0.0.1", 0)
    )
    started: list[Runtime] = []
    try:
        for _ in range(2):
            started.append(
                await start(
                    default_config(
                        loopback_config(
                            core__only="stun,turn,qos,p2p",
                            turn__user=[f"{USER}:{PASSWORD}"],
                            turn__allow_private_peers=True,
                        )
                    )
                )
            )
        far, near = started
        line.target = ("127.0.0.1", port_of(far, "qos"))
        line_port = line_transport.get_extra_info("sockname")[1]
        yield {
            "far": (far, ("127.0.0.1", line_port)),
            "near": (near, ("127.0.0.1", port_of(near, "qos"))),
        }
    finally:
        for rt in started:
            await rt.close()
        line_transport.close()


async def test_qos_measurement_of_two_servers() -> None:
    async with regions() as found:
        measured = await measure_servers([(r, a) for r, (_, a) in found.items()])
        by_region = {m.region: m for m in measured}
        assert by_region["far"].min_latency_ms >= 2 * DELAY * 1000
        assert by_region["near"].min_latency_ms < 2 * DELAY * 1000
        assert all(m.packet_loss == 0.0 and m.flows == [0] * 5 for m in measured)


async def test_the_p2p_sdk_relays_through_the_measured_region() -> None:
    async with regions() as found:
        opened: list[str] = []

        def factory(region: str) -> object:
            rt = found[region][0]
            server = ("127.0.0.1", port_of(rt, "stun"))

            async def make() -> TurnClientRelay:
                opened.append(region)
                return await TurnClientRelay.open(server, USER, PASSWORD)

            return make

        choice: MeasuredChoice[TurnClientRelay] = MeasuredChoice(
            {
                region: ([address], factory(region))  # type: ignore[misc]
                for region, (_, address) in found.items()
            }
        )
        host, port = found["far"][0].http_address
        url = f"ws://{host}:{port}/p2p/v1/ws"
        a = P2PClient(url, bind=("127.0.0.1", 0), relay="force", turn=choice)
        b = P2PClient(url, bind=("127.0.0.1", 0), relay="force", turn=choice)
        try:
            await a.start()
            await b.start()
            await b.join(await a.host())
            assert await choice.region() == "near"
            assert opened and set(opened) == {"near"}
            assert isinstance(b.links[a.peer_id].via, _TurnTransport)
            b.send(a.peer_id, b"through the near region")
            assert await asyncio.wait_for(a.recv(), 5) == (
                b.peer_id,
                b"through the near region",
            )
        finally:
            await a.close()
            await b.close()
