"""A TURN REST username valid for years is
refused; an Allocate replayed on the same 5-tuple after Refresh 0 does not bring
the allocation back; a MasterServer2 game id cannot be squatted by the first
poster's passwords."""

from __future__ import annotations

import json
import os
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from crossroads.client.turn import TurnClient, TurnClientError, rest_credentials
from crossroads.proto.stun import (
    Class,
    Lifetime,
    Message,
    Method,
    RequestedTransport,
)
from crossroads.proto.turn.auth import rest_password
from crossroads.proto.turn.credentials import LongTermSession
from crossroads.proto.turn.server import error_code_of
from crossroads.services.p2p_master import MasterServer, make_master_router
from crossroads.store.memory import MemoryStore
from tests.proto.turn.conftest import EPOCH, Harness, udp
from tests.services.test_turn import (  # noqa: F401 (fixture)
    SECRET,
    RawClient,
    turn_fixture,
)

pytestmark = pytest.mark.timeout(60)

# ------------------------------------------------------------------ credential TTL


def test_rest_username_valid_for_years_is_refused() -> None:
    harness = Harness(secrets=("s3cr3t",))
    harness.server.credentials = type(harness.server.credentials)(
        "example.org", {}, ("s3cr3t",), max_ttl=86400.0
    )
    ten_years = f"{int(EPOCH + 10 * 365 * 86400)}:mallory"
    session = LongTermSession(ten_years, rest_password("s3cr3t", ten_years))
    assert error_code_of(harness.allocate(udp(), session)) == 401
    assert harness.server.counters.drops["auth-ttl-too-long"] >= 1
    one_hour = f"{int(EPOCH + 3600)}:carol"
    session = LongTermSession(one_hour, rest_password("s3cr3t", one_hour))
    assert error_code_of(harness.allocate(udp(1), session)) is None


async def test_max_credential_ttl_flag(turn: Any) -> None:
    service = await turn()
    assert service.core.credentials.max_ttl == 86400
    server = service.stun.primary
    username, password = rest_credentials(SECRET, "mallory", ttl=5 * 365 * 86400)
    client = await TurnClient.connect(server, username, password)
    try:
        with pytest.raises(TurnClientError) as excinfo:
            await client.allocate()
        assert excinfo.value.code == 401
    finally:
        await client.close()
    username, password = rest_credentials(SECRET, "carol", ttl=86400)
    async with await TurnClient.connect(server, username, password) as good:
        await good.allocate()
    longer = await turn(turn__max_credential_ttl=10 * 365 * 86400)
    username, password = rest_credentials(SECRET, "mallory", ttl=5 * 365 * 86400)
    async with await TurnClient.connect(longer.stun.primary, username, password) as ok:
        await ok.allocate()


# ------------------------------------------------------------------ replayed Allocate


def test_allocate_replayed_after_refresh_zero_does_not_resurrect() -> None:
    harness = Harness()
    session = LongTermSession("alice", "secret")
    txid = os.urandom(12)
    allocate = Message(Class.REQUEST, Method.ALLOCATE, txid, (RequestedTransport(17),))
    challenge = harness.raw(session.sign(allocate), udp())
    assert challenge is not None
    session.learn(challenge)
    signed = session.sign(allocate)
    first = harness.raw(signed, udp())
    assert first is not None and error_code_of(first) is None
    # While it exists, a retransmission gets the same answer (RFC 8656 §7.2).
    again = harness.raw(signed, udp())
    assert again is not None and again.transaction_id == txid
    assert error_code_of(again) is None
    release = harness.request(Method.REFRESH, [Lifetime(0)], udp(), session)
    assert release is not None and error_code_of(release) is None
    assert harness.server.allocations == {}
    # The same bytes again (a late retransmission or a replay, nonce still
    # fresh): 437, nothing allocated.
    harness.advance(1)
    replay = harness.raw(signed, udp())
    assert replay is not None and error_code_of(replay) == 437
    assert harness.server.allocations == {}
    assert harness.binder.open_count == 0
    # A new Allocate (new transaction) on the same 5-tuple works.
    assert error_code_of(harness.allocate(udp(), session)) is None
    # The memory of freed allocations is dropped once no nonce could sign a
    # replay any more.
    harness.request(Method.REFRESH, [Lifetime(0)], udp(), session)
    assert harness.server.freed_count == 1
    harness.advance(harness.server.nonces.lifetime + 10)
    assert harness.server.freed_count == 0


async def test_allocate_replay_on_the_real_service(turn: Any) -> None:
    service = await turn()
    raw = RawClient(service.stun.primary)
    try:
        session = LongTermSession("alice", "secret123")
        allocate = Message(
            Class.REQUEST, Method.ALLOCATE, os.urandom(12), (RequestedTransport(17),)
        )
        challenge = await raw.request(session.sign(allocate))
        assert challenge is not None
        session.learn(challenge)
        signed = session.sign(allocate)
        assert error_code_of(await _ask(raw, signed)) is None
        release = Message(Class.REQUEST, Method.REFRESH, os.urandom(12), (Lifetime(0),))
        assert error_code_of(await _ask(raw, session.sign(release))) is None
        assert service.core.allocations == {}
        assert error_code_of(await _ask(raw, signed)) == 437
        assert service.core.allocations == {}
    finally:
        raw.close()


async def _ask(raw: RawClient, data: bytes) -> Message:
    answer = await raw.request(data)
    assert answer is not None
    assert isinstance(answer, Message)
    return answer


# ------------------------------------------------------------------ MasterServer2


async def test_a_game_id_cannot_be_squatted_by_the_first_posters_passwords() -> None:
    store = MemoryStore()
    master = MasterServer(
        store, max_timeout=300, rows_per_ip=10, registry=CollectorRegistry()
    )
    app = FastAPI()
    app.include_router(make_master_router(master, "/testServer"))

    def client(ip: str) -> httpx.AsyncClient:
        transport = httpx.ASGITransport(app=app, client=(ip, 5555))
        return httpx.AsyncClient(transport=transport, base_url="http://ms2.test")

    async with client("203.0.113.66") as squatter, client("198.51.100.7") as game:
        # The squatter posts first, with passwords only it knows.
        body = {"__gameId": "popular", "__updatePW": "mine", "__readPW": "mine"}
        assert (
            await squatter.post("/testServer", content=json.dumps(body))
        ).status_code == 200
        # The real game still lists its servers under its own id (with a
        # password of its own) ...
        body = {
            "__gameId": "popular",
            "__clientReqId": "1",
            "__updatePW": "ours",
            "name": "real server",
        }
        posted = await game.post("/testServer", content=json.dumps(body))
        assert posted.status_code == 200
        row_id = posted.json()["POST"]["__rowId"]
        listed = await game.get("/testServer", params={"__gameId": "popular"})
        assert listed.status_code == 200
        assert [r["name"] for r in listed.json()["GET"]] == ["real server"]
        # ... and the squatter's passwords give it no power over that row.
        overwrite = {"__gameId": "popular", "__rowId": row_id, "__updatePW": "mine"}
        refused = await squatter.post("/testServer", content=json.dumps(overwrite))
        assert refused.status_code == 401
        params = {"__gameId": "popular", "__rowId": str(row_id), "__updatePW": "mine"}
        assert (await squatter.delete("/testServer", params=params)).status_code == 401
        listed = await game.get("/testServer", params={"__gameId": "popular"})
        assert [r["name"] for r in listed.json()["GET"]] == ["real server"]
