"""Port mapping against a real miniupnpd in network namespaces: PCP, NAT-PMP and
UPnP-IGD mappings make the host behind the gateway reachable, and disappear on
close; an SDK host behind the gateway is then reached by the direct step."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from crossroads.client.p2p import P2PClient
from crossroads.client.portmap import PortMapper
from tests.client.gateway_lab import (
    GW_WAN_IP,
    LAN_IP,
    WAN_IP,
    WAN_IP2,
    GatewayLab,
    available,
    inside,
)
from tests.conftest import serve_command

pytestmark = [
    pytest.mark.interop,
    pytest.mark.lab,
    pytest.mark.timeout(120),
    pytest.mark.skipif(available() is not None, reason=str(available())),
]


@pytest.fixture(scope="module")
def gateway() -> Iterator[GatewayLab]:
    lab = GatewayLab()
    try:
        lab.up()
        yield lab
    finally:
        lab.down()


async def receive(sock: object, timeout: float) -> bytes | None:
    loop = asyncio.get_running_loop()
    try:
        return await asyncio.wait_for(loop.sock_recv(sock, 100), timeout)  # type: ignore[arg-type]
    except TimeoutError:
        return None


@pytest.mark.parametrize("method", ["pcp", "natpmp", "upnp"])
async def test_mapping_makes_the_host_reachable_and_close_removes_it(
    gateway: GatewayLab, method: str
) -> None:
    lan = gateway.socket(gateway.lan, LAN_IP)
    outsider = gateway.socket(gateway.wan, WAN_IP)
    try:
        port = lan.getsockname()[1]
        with inside(gateway.lan):
            mapper = PortMapper(port, methods=(method,))
            mapping = await mapper.start()
        assert mapping is not None, gateway.log("miniupnpd.log")[-3000:]
        assert mapping.method == method and mapping.external_ip == GW_WAN_IP
        assert f"{LAN_IP}" in gateway.redirects()
        # Unsolicited traffic from the internet now reaches the host.
        outsider.sendto(b"knock", (mapping.external_ip, mapping.external_port))
        assert await receive(lan, 2) == b"knock"
        with inside(gateway.lan):
            await mapper.close()
        assert f"dport {mapping.external_port}" not in gateway.redirects()
        # A new flow (new source port, so no conntrack entry) is not forwarded.
        other = gateway.socket(gateway.wan, WAN_IP)
        other.sendto(b"again", (mapping.external_ip, mapping.external_port))
        assert await receive(lan, 0.5) is None
        other.close()
    finally:
        lan.close()
        outsider.close()


def test_no_gateway_service_means_no_mapping(gateway: GatewayLab) -> None:
    async def attempt() -> object:
        with inside(gateway.wan):
            # In the wan namespace the default gateway runs no miniupnpd.
            return await PortMapper(
                4000, gateway=WAN_IP2, methods=("pcp", "natpmp")
            ).start()

    assert asyncio.run(attempt()) is None


@pytest.fixture(scope="module")
def server(gateway: GatewayLab) -> Iterator[str]:
    port = 8700 + int(gateway.tag, 16) % 1000
    gateway.spawn(
        gateway.wan,
        *serve_command(
            "p2p",
            "--p2p-port",
            "3490",
            "--p2p-alt-port",
            "3491",
            "--p2p-alt-port2",
            "3492",
            host=WAN_IP,
            http_port=port,
        ),
        log="serve.log",
    )
    url = f"http://{WAN_IP}:{port}/healthz"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        out = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                gateway.wan,
                sys.executable,
                "-c",
                f"import httpx; print(httpx.get('{url}').status_code)",
            ],
            capture_output=True,
            text=True,
        ).stdout
        if out.strip() == "200":
            break
        time.sleep(0.2)
    else:
        raise RuntimeError(
            "crossroads serve did not start: " + gateway.log("serve.log")
        )
    yield f"ws://{WAN_IP}:{port}/p2p/v1/ws"


@pytest.fixture
async def peers(gateway: GatewayLab, server: str) -> AsyncIterator[list[P2PClient]]:
    made: list[P2PClient] = []
    yield made
    for client in made:
        with inside(gateway.lan):
            await client.close()


@pytest.mark.parametrize("portmap", [False, True])
async def test_sdk_host_behind_miniupnpd(
    gateway: GatewayLab, server: str, peers: list[P2PClient], portmap: bool
) -> None:
    with inside(gateway.lan):
        host = P2PClient(server, bind=(LAN_IP, 0), portmap=portmap)
        peers.append(host)
        await host.start()
        code = await host.host()
    with inside(gateway.wan):
        guest = P2PClient(server, bind=(WAN_IP2, 0))
        peers.append(guest)
        await guest.start()
        await guest.join(code)
    step = guest.links[host.peer_id].step
    if portmap:
        assert host.mapped is not None and host.mapped.host == GW_WAN_IP
        # the mapped port is open: the one-sided direct step (or the mapping
        # step) reaches the host, no punching needed
        assert step in ("direct", "mapping")
    else:
        # without a mapping the gateway filters unsolicited traffic: the guest
        # needs a simultaneous open
        assert step == "punch"
    guest.send(host.peer_id, b"through the gateway")
    assert await asyncio.wait_for(host.recv(), 5) == (
        guest.peer_id,
        b"through the gateway",
    )
    assert httpx  # imported for the server check
