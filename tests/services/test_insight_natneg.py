"""natneg negotiations write connection-insight records: winner, cause, the
two sides' NAT kinds, and (relayed) the bytes the pair carried."""

from __future__ import annotations

import asyncio

import pytest

from crossroads.insight import AttemptFilter
from crossroads.proto.insight import Attempt
from crossroads.runtime import Runtime
from tests.conftest import eventually
from tests.services.test_natneg import (
    Starter,
    both,
    game_host_and_guest,
    game_socket,
    natneg,  # noqa: F401 (the fixture)
    negotiators,
    servers,
)

pytestmark = pytest.mark.timeout(60)

#: What each side sends through the relay: enough that the negotiation's own
#: pings through it are well under 1 % of the bytes.
DATAGRAMS = 100
SIZE = 1000


async def records(rt: Runtime, **selection: str) -> list[Attempt]:
    return await rt.insight.attempts(AttemptFilter(**selection))  # type: ignore[arg-type]


async def test_forced_relay_record_counts_the_bytes_sent(natneg: Starter) -> None:  # noqa: F811
    rt = await natneg(natneg__relay_mode="always", natneg__relay_idle_timeout=1.0)
    host_game = game_socket()
    try:
        host, guest = await game_host_and_guest(servers(rt), 910, host_game)
        assert host.outcome and guest.outcome
        assert host.outcome.sock and guest.outcome.sock
        assert host.outcome.remote and guest.outcome.remote
        received = {"host": 0, "guest": 0}
        loop = asyncio.get_running_loop()

        async def drain(name: str, sock: object) -> None:
            while received[name] < DATAGRAMS * SIZE:
                data = await loop.sock_recv(sock, 65536)  # type: ignore[arg-type]
                received[name] += len(data)

        readers = [
            asyncio.create_task(drain("host", host.outcome.sock)),
            asyncio.create_task(drain("guest", guest.outcome.sock)),
        ]
        for n in range(DATAGRAMS):
            guest.outcome.sock.sendto(b"g" * SIZE, guest.outcome.remote)
            host.outcome.sock.sendto(b"h" * SIZE, host.outcome.remote)
            if n % 10 == 9:
                await asyncio.sleep(0.005)
        async with asyncio.timeout(10):
            await asyncio.gather(*readers)

        # Recorded when the pair is released (idle for 1 s), with its usage.
        async def recorded() -> bool:
            return bool(await records(rt, family="natneg"))

        await eventually(recorded, "the natneg record", timeout=10)
        [record] = await records(rt, family="natneg")
        assert record.session == f"{910:08x}"
        assert record.outcome == "relayed" and record.winner == "relay"
        assert record.cause == "forced"
        assert [s.name for s in record.steps] == ["punch", "relay"]
        assert record.steps[0].outcome == "skipped"
        assert len(record.sides) == 2
        assert all(len(side.id) == 16 for side in record.sides)
        assert record.usage is not None
        # Client 0 (the guest) -> client 1 is "up"; each within 1 % of what
        # the test sent (the rest: the SDK's CONNECT_PINGs through the relay).
        sent = DATAGRAMS * SIZE
        assert sent <= record.usage.bytes_up <= sent * 1.01
        assert sent <= record.usage.bytes_down <= sent * 1.01
        assert record.usage.packets_up >= DATAGRAMS
        labels = {"family": "natneg", "outcome": "relayed", "cause": "forced"}
        value = rt.metrics.get_sample_value("crossroads_insight_attempts_total", labels)
        assert value == 1
    finally:
        host_game.close()


async def test_two_symmetric_mappings_recorded_as_the_cause(natneg: Starter) -> None:  # noqa: F811
    rt = await natneg(natneg__relay_idle_timeout=1.0)
    srv = servers(rt)
    host, guest = negotiators(
        srv,
        3,
        911,
        host={"bind_ip": "127.0.0.6"},
        guest={"bind_ip": "127.0.0.5"},
        split_mappings=True,
        finished_idle=0.2,
    )
    await both(host, guest)
    # One symmetric side alone: punched directly.
    h2, g2 = negotiators(
        srv,
        3,
        912,
        host={"bind_ip": "127.0.0.6", "split_mappings": True},
        guest={"bind_ip": "127.0.0.5"},
        finished_idle=0.2,
    )
    await both(h2, g2)

    async def two() -> bool:
        return len(await records(rt, family="natneg")) == 2

    # The relayed one waits for its pair's release (unused: at the session's end).
    await eventually(two, "both natneg records", timeout=15)
    relayed = (await records(rt, code=f"{911:08x}"))[0]
    assert relayed.outcome == "relayed" and relayed.cause == "both-symmetric"
    assert [side.nat for side in relayed.sides] == ["symmetric", "symmetric"]
    assert relayed.steps[0].outcome == "predicted-to-fail"
    direct = (await records(rt, code=f"{912:08x}"))[0]
    assert direct.outcome == "direct" and direct.winner == "punch"
    assert direct.cause == "" and direct.usage is None
    assert sorted(side.nat for side in direct.sides) == ["cone", "symmetric"]
    assert all(side.rtt_ms is not None for side in direct.sides)
