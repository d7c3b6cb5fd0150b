"""The asyncio STUN client against crossroads' own server (real sockets)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from crossroads.client.stun import (
    FilteringBehavior,
    MappingBehavior,
    StunClient,
    StunErrorResponse,
    StunTimeout,
    TransactionTimers,
    discover_nat,
    stun_binding,
)
from crossroads.config import default_config
from crossroads.runtime import Runtime, start
from crossroads.services.stun import StunService
from tests.conftest import loopback_config

pytestmark = pytest.mark.timeout(60)


def _primary(runtime: Runtime) -> tuple[str, int]:
    service = runtime.services["stun"]
    assert isinstance(service, StunService)
    return service.primary


async def test_binding_udp_and_tcp(runtime: Runtime) -> None:
    server = _primary(runtime)
    udp = await stun_binding(server, local=("127.0.0.1", 0))
    assert udp.mapped[0] == "127.0.0.1" and udp.mapped == udp.local
    assert udp.response_origin == server and udp.other_address is None
    assert udp.software and udp.software.startswith("crossroads")
    assert udp.transmissions == 1
    tcp = await stun_binding(server, transport="tcp")
    assert tcp.mapped == tcp.local and tcp.mapped[0] == "127.0.0.1"


async def test_error_response_raises(runtime: Runtime) -> None:
    async with await StunClient.open(("127.0.0.1", 0)) as client:
        with pytest.raises(StunErrorResponse) as info:
            await client.binding(_primary(runtime), change_ip=True)
    assert info.value.code == 420


async def test_timeout() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:
        silent.bind(("127.0.0.1", 0))
        quick = TransactionTimers(rto=0.05, rc=2, rm=2)
        with pytest.raises(StunTimeout):
            await stun_binding(silent.getsockname(), timers=quick)


async def test_discovery_on_loopback_with_two_addresses() -> None:
    runtime = await start(default_config(loopback_config(stun__alt_host="127.0.0.2")))
    try:
        behavior = await discover_nat(_primary(runtime), local_host="127.0.0.1")
    finally:
        await runtime.close()
    assert behavior.rfc5780_supported and not behavior.behind_nat
    assert behavior.mapping is MappingBehavior.ENDPOINT_INDEPENDENT
    assert behavior.filtering is FilteringBehavior.ENDPOINT_INDEPENDENT
    assert behavior.hairpinning is True


async def test_discovery_without_rfc5780_server(runtime: Runtime) -> None:
    behavior = await discover_nat(
        _primary(runtime), timers=TransactionTimers(rto=0.05, rc=2, rm=2)
    )
    assert not behavior.rfc5780_supported
    assert behavior.mapping is None and behavior.filtering is None
    assert not behavior.behind_nat and behavior.local[0] == "127.0.0.1"


async def test_many_concurrent_requests_on_one_socket(runtime: Runtime) -> None:
    server = _primary(runtime)
    async with await StunClient.open(("127.0.0.1", 0)) as client:
        results = await asyncio.gather(*(client.binding(server) for _ in range(20)))
    assert {r.mapped for r in results} == {client.local}
