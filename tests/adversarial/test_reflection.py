"""No UDP service is an amplifier.

A spoofer names a victim's address as the source of a burst of unauthenticated
requests; the victim must get back at most what the burst cost plus the
reflection allowance (docs/security.md, "Reflection budget"). Before the budget,
every one of these bursts came back larger: STUN Binding 4.4x, TURN 401 6x,
natneg INIT with its delayed error CONNECTs, the relay's ERROR to a CLOSE.
"""

from __future__ import annotations

import os

import httpx
import pytest

from crossroads.proto.reflection import (
    DEFAULT_ALLOWANCE,
    DROP_REFLECTION,
    ReflectionBudget,
)
from crossroads.proto.relay import messages as m
from crossroads.proto.relay.server import RelayServer, RelayServerConfig
from crossroads.proto.relay.token import TokenSealer
from crossroads.services.stun import StunService
from tests.adversarial.reflection_support import PROBES, reflect, start_for

pytestmark = pytest.mark.timeout(60)


#: Each service's drop metric (its ``reflection-budget`` reason counts refusals).
DROP_METRICS = {
    "stun": "crossroads_stun_dropped_total",
    "turn": "crossroads_turn_dropped_total",
    "natneg": "crossroads_natneg_dropped_total",
}


@pytest.mark.parametrize("name", ["stun", "turn", "natneg"])
async def test_a_spoofed_burst_gets_back_at_most_what_it_cost(name: str) -> None:
    probe = PROBES[name]
    rt = await start_for(probe)
    try:
        exchange = await reflect(rt, probe, probe.count)
        host, port = rt.http_address
        async with httpx.AsyncClient() as http:
            metrics = (await http.get(f"http://{host}:{port}/metrics")).text
    finally:
        await rt.close()
    assert exchange.replies > 0, "the service answered nothing at all"
    assert exchange.bytes_out <= exchange.bytes_in + DEFAULT_ALLOWANCE, exchange
    refused = [
        line
        for line in metrics.splitlines()
        if line.startswith(DROP_METRICS[name]) and f'"{DROP_REFLECTION}"' in line
    ]
    assert refused and float(refused[0].rsplit(" ", 1)[1]) > 0, refused


@pytest.mark.parametrize("name", ["stun", "turn", "natneg"])
async def test_without_the_budget_the_same_burst_amplifies(name: str) -> None:
    """The probes are strong enough to see an amplifier: with
    ``--no-reflection-budget`` (the code as it was) each burst comes back larger
    than it cost plus the allowance. If a rate limit changes so that this no
    longer holds, the test above would pass without proving anything."""
    probe = PROBES[name]
    rt = await start_for(probe, core__reflection_budget=False)
    try:
        exchange = await reflect(rt, probe, probe.count)
    finally:
        await rt.close()
    assert exchange.bytes_out > exchange.bytes_in + DEFAULT_ALLOWANCE, exchange


def test_relay_errors_stay_within_the_budget_whatever_the_error_rate() -> None:
    """The relay's ERROR (21 B) to a CLOSE (20 B) is one byte larger; its ERROR
    rate limit (20/s) hides that in a short burst, but not over minutes. With
    the rate limit out of the way, 10,000 CLOSEs show the sustained ratio: the
    budget holds the answers to what came in plus the allowance."""
    core = RelayServer(
        RelayServerConfig(
            node_id="n1",
            slow_path_rate=1e9,
            slow_path_burst=1e9,
            error_rate=1e9,
            error_burst=1e9,
        ),
        TokenSealer(os.urandom(32), os.urandom),
        reflection=ReflectionBudget(),
    )
    victim = ("203.0.113.5", 4000)
    bytes_in = bytes_out = 0
    for i in range(10_000):
        close = m.Close(os.urandom(16)).encode()
        now = i * 0.0005  # 10,000 CLOSEs in 5 s: one reflection window
        core.receive_datagram(close, victim, now)
        bytes_in += len(close)
        bytes_out += sum(len(d) for d, _ in core.datagrams_to_send(now))
    assert bytes_out > 0
    assert bytes_out <= bytes_in + DEFAULT_ALLOWANCE
    assert core.drops[DROP_REFLECTION] > 0


async def test_a_legitimate_stun_client_is_still_answered() -> None:
    """The allowance is what lets a real client through: a client asking ten
    times (ICE against one server) gets ten answers, each larger than its
    request, even right after a spoofed burst named another address."""
    probe = PROBES["stun"]
    rt = await start_for(probe)
    try:
        await reflect(rt, probe, probe.count)
        service = rt.services["stun"]
        assert isinstance(service, StunService)
        refused_before = service.reflection.refused
        exchange = await reflect(rt, probe, 10, source="127.0.0.3")
        assert exchange.replies == 10
        assert exchange.bytes_out > exchange.bytes_in
        assert service.reflection.refused == refused_before
        assert service.stats.drops.get(DROP_REFLECTION, 0) == refused_before > 0
    finally:
        await rt.close()
