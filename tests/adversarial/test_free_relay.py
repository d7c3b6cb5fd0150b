"""No free relay.

The p2p WebSocket ``welcome`` used to hand every anonymous socket TURN
credentials valid for an hour; with them one IP made 3,000 allocations in 28 s.
Now credentials go only to peers in a session (``hosted``, ``join_start``,
``turn_refresh``), and TURN has default quotas per user, per client IP and in
total.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import websockets

from crossroads.client.p2p import P2PClient
from crossroads.client.turn import TurnClient, rest_credentials
from crossroads.client.turnrelay import TurnClientRelay
from crossroads.config import default_config
from crossroads.errors import ConfigError
from crossroads.proto.stun import Lifetime, Method
from crossroads.proto.turn.auth import rest_password
from crossroads.proto.turn.credentials import LongTermSession
from crossroads.proto.turn.server import error_code_of
from crossroads.runtime import Runtime, start
from crossroads.services.turn import (
    ALLOCATION_WEIGHT,
    BYTES_PER_ALLOCATION,
    DEFAULT_IP_QUOTA,
    DEFAULT_USER_QUOTA,
    DESCRIPTORS_PER_ALLOCATION,
    TurnService,
)
from crossroads.transport.admission import (
    MIN_RESERVE,
    PER_SOURCE_FRACTION,
    ResourceBudget,
)
from tests.adversarial.turn_quota_support import DirectClient, p2p_with_turn
from tests.conftest import eventually, loopback_config
from tests.proto.turn.conftest import EPOCH, Harness, udp
from tests.services.test_p2p import hello, ws_url
from tests.services.test_turn import SECRET, turn_fixture  # noqa: F401 (fixture)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def rt() -> AsyncIterator[Runtime]:
    async with p2p_with_turn() as runtime:
        yield runtime


async def _until(ws: Any, kind: str) -> dict[str, Any]:
    while True:
        frame = json.loads(await asyncio.wait_for(ws.recv(), 5))
        if frame["type"] in (kind, "error"):
            return dict(frame)


async def test_anonymous_sockets_get_no_turn_credentials(rt: Runtime) -> None:
    async with websockets.connect(ws_url(rt)) as ws:
        await ws.send(hello())
        welcome = await _until(ws, "welcome")
        assert welcome["type"] == "welcome" and welcome["turn"] is None
        await ws.send(json.dumps({"type": "turn_refresh"}))
        refused = await _until(ws, "turn")
        assert refused["type"] == "error" and refused["code"] == "not_in_session"


async def test_session_members_get_working_refreshable_credentials(
    rt: Runtime,
) -> None:
    turn = rt.services["turn"]
    assert isinstance(turn, TurnService)
    async with (
        websockets.connect(ws_url(rt)) as host,
        websockets.connect(ws_url(rt)) as guest,
    ):
        await host.send(hello())
        await _until(host, "welcome")
        await host.send(json.dumps({"type": "host"}))
        hosted = await _until(host, "hosted")
        # Alone in its session, the host has nobody to relay to.
        assert hosted["turn"] is None
        await guest.send(hello())
        await _until(guest, "welcome")
        await guest.send(json.dumps({"type": "join", "code": hosted["code"]}))
        join_start = await _until(guest, "join_start")
        assert join_start["turn"] is not None
        assert (await _until(host, "turn"))["turn"] is not None
        await host.send(json.dumps({"type": "turn_refresh"}))
        fresh = (await _until(host, "turn"))["turn"]
        server = tuple(fresh["servers"][0])
        assert server == turn.stun.primary
        # The credentials allocate on the TURN service of this process.
        client = await TurnClient.connect(
            (str(server[0]), int(server[1])), fresh["username"], fresh["password"]
        )
        async with client:
            await client.allocate()
            assert len(turn.core.allocations) == 1


async def test_default_quotas_stop_one_ip_from_taking_the_relay(
    turn: Any,
) -> None:
    # (401s are rate-limited per IP: lifted here, each client needs one.)
    service: TurnService = await turn(turn__unauthenticated_rate=100000)
    settings = service.core.settings
    table = service.allocation_table
    low, high = service.config.relay_ports
    assert settings.user_quota == DEFAULT_USER_QUOTA
    # The budget's table holds the total and per-IP caps: the configured ones
    # (the relay port range when --turn-total-quota is 0), the descriptor and
    # memory shares, and an eighth of the total per source.
    assert table.configured_max == high - low + 1
    assert table.configured_per_source == DEFAULT_IP_QUOTA
    assert table.max_items <= table.budget.relay_pool() // DESCRIPTORS_PER_ALLOCATION
    assert table.max_per_source == min(
        DEFAULT_IP_QUOTA, int(table.max_items * PER_SOURCE_FRACTION)
    )
    assert (
        f"quotas: {DEFAULT_USER_QUOTA} per user, {table.max_per_source} per IP, "
        f"{table.max_items} in total" in service.describe()
    )
    # One IP, many users (one credential each, as minted by an application):
    # the per-IP quota ends it; the per-user quota ends one user sooner.
    clients: list[DirectClient] = []
    codes: list[int | None] = []
    try:
        limit = table.max_per_source
        for index in range(limit + 5):
            username, password = rest_credentials(SECRET, f"player{index}")
            client = DirectClient(service, username, password)
            clients.append(client)
            codes.append(client.allocate())
        assert codes[:limit] == [None] * limit
        assert codes[limit:] == [486] * 5
        assert len(service.core.allocations) == limit
    finally:
        for client in clients:
            client.release()
            client.close()
    assert service.core.allocations == {}


async def test_user_quota_counts_the_user_part(turn: Any) -> None:
    service: TurnService = await turn(turn__user_quota=2)
    clients = []
    try:
        for _ in range(3):
            username, password = rest_credentials(SECRET, "mallory")
            clients.append(DirectClient(service, username, password))
        assert [c.allocate() for c in clients] == [None, None, 486]
    finally:
        for client in clients:
            client.release()
            client.close()


def test_allocation_caps_come_from_the_budget() -> None:
    """The TURN allocation table's caps, derived as the budget derives every
    table's (docs/security.md): alone in the relay pool at ulimit -n 1024 it
    gets (1024 - 64 - 512) / 2 = 224 allocations, 28 per IP."""
    for fd_limit, ports, total, per_ip in (
        (1024, 16384, 224, 28),
        (65536, 16384, 16352, DEFAULT_IP_QUOTA),
        (1_048_576, 16384, 16384, DEFAULT_IP_QUOTA),
    ):
        budget = ResourceBudget(fd_limit, memory=1 << 40)
        table = budget.table(
            "turn-allocations",
            max_items=ports,
            max_per_source=DEFAULT_IP_QUOTA,
            descriptors_per_item=DESCRIPTORS_PER_ALLOCATION,
            bytes_per_item=BYTES_PER_ALLOCATION,
            weight=ALLOCATION_WEIGHT,
        )
        assert (fd_limit - MIN_RESERVE) // 2 >= budget.relay_pool()
        assert (table.max_items, table.max_per_source) == (total, per_ip)


async def test_p2p_credentials_longer_than_the_turn_cap_refuse_to_start() -> None:
    config = default_config(
        loopback_config(
            core__only=["p2p", "stun", "turn"],
            turn__secret=[SECRET],
            p2p__turn_ttl=2 * 86400,
        )
    )
    with pytest.raises(ConfigError, match="max_credential_ttl"):
        runtime = await start(config)
        await runtime.close()


def test_a_later_credential_of_the_same_user_takes_the_allocation_over() -> None:
    harness = Harness()
    first = f"{int(EPOCH + 600)}:peer1"
    session = LongTermSession(first, rest_password("s3cr3t", first))
    assert error_code_of(harness.allocate(udp(), session, [Lifetime(3600)])) is None
    harness.advance(700)  # the first credentials expired
    refused = harness.request(Method.REFRESH, [Lifetime(600)], udp(), session)
    assert refused is not None and error_code_of(refused) == 401
    later = f"{int(EPOCH + 4000)}:peer1"
    session.renew(later, rest_password("s3cr3t", later))
    renewed = harness.request(Method.REFRESH, [Lifetime(600)], udp(), session)
    assert renewed is not None and error_code_of(renewed) is None
    assert harness.server.allocations[udp()].username == later
    assert harness.server.counters.credential_renewals == 1
    # Another user's credentials (or an older one of the same user) do not.
    for other in (f"{int(EPOCH + 5000)}:peer2", f"{int(EPOCH + 3000)}:peer1"):
        stranger = LongTermSession(other, rest_password("s3cr3t", other))
        answer = harness.request(Method.REFRESH, [Lifetime(600)], udp(), stranger)
        assert answer is not None and error_code_of(answer) == 441


async def test_the_sdk_renews_its_allocation_with_refreshed_credentials() -> None:
    # Credentials that live 4 s: the SDK asks for fresh ones after half of it
    # and its allocation goes on with them after the first ones expired.
    async with p2p_with_turn(p2p__turn_ttl=4) as runtime:
        turn = runtime.services["turn"]
        assert isinstance(turn, TurnService)
        me = P2PClient(ws_url(runtime), bind=("127.0.0.1", 0))
        guest = P2PClient(ws_url(runtime), bind=("127.0.0.1", 0))
        try:
            await me.start()
            code = await me.host()
            assert me.turn is None  # nobody to relay to yet
            await guest.start()
            await guest.join(code)

            async def allocated() -> bool:
                return me.turn is not None

            # The host allocates on the credentials pushed with the joiner.
            await eventually(allocated, "the host's allocation")
            relay = me.turn
            assert isinstance(relay, TurnClientRelay)
            first = relay.client.session.username
            expiry = int(first.partition(":")[0])

            async def renewed_and_expired() -> bool:
                return relay.client.session.username != first and time.time() > (
                    expiry + 1
                )

            await eventually(
                renewed_and_expired, "fresh credentials in use", timeout=30
            )
            assert await relay.client.refresh() > 0
            assert turn.core.counters.credential_renewals >= 1
        finally:
            await guest.close()
            await me.close()
