"""Guessing is bounded per source and globally.

Before: /v1/join answered 678 guesses/s from 100 IPs, wrong API keys were
unlimited, p2p invite codes could be tried at 1,272/s from one IP over 64
WebSockets and OpenTTD's coordinator answered every unknown invite code on the
same connection. Now each kind of secret has a budget of failures per source
and per instance (proto/budget.py); beyond it the answer is 429 or the
protocol's error, and a right guess costs nothing. Sources are distinct
loopback addresses (127.0.0.0/8), so no traffic leaves the machine.
"""

from __future__ import annotations

import base64
import json
import os
import time

import httpx
import pytest
import websockets

from crossroads.client.openttd import GcClient
from crossroads.config import default_config
from crossroads.proto.openttd.coordinator import ClientConnect, ErrorType, GcError
from crossroads.runtime import Runtime, start
from crossroads.services.openttd import OpenTTDService
from tests.adversarial.store_faults_support import next_frame
from tests.conftest import loopback_config
from tests.e2e.relay_support import API_KEY, api, base_url, relay_runtime

pytestmark = pytest.mark.timeout(60)

PER_SOURCE = 12  # failures a minute, all of them in a row
WRONG_CODE = "BBBBBB"  # the right shape, never issued (the test draws no codes)


def client_at(rt: Runtime, source: str, key: str = API_KEY) -> httpx.AsyncClient:
    """An HTTP client whose requests come from loopback address ``source``."""
    return httpx.AsyncClient(
        base_url=base_url(rt),
        headers={"Authorization": f"Bearer {key}"},
        transport=httpx.AsyncHTTPTransport(local_address=source),
        timeout=10,
    )


async def live_join_code(rt: Runtime) -> str:
    async with api(rt) as http:
        allocated = await http.post("/v1/allocate", json={"maxConnections": 100})
        allocation_id = allocated.json()["data"]["allocation"]["allocationId"]
        code = await http.post("/v1/joincode", json={"allocationId": allocation_id})
        return str(code.json()["data"]["joinCode"])


async def test_join_code_guesses_from_one_source_stop_at_its_budget() -> None:
    async with relay_runtime(
        core__guess_per_source=PER_SOURCE, core__guess_global=0, relay__api_rate=0
    ) as rt:
        code = await live_join_code(rt)
        async with client_at(rt, "127.0.0.2") as guesser:
            # Right guesses cost nothing: many in a row all succeed.
            for _ in range(3 * PER_SOURCE):
                ok = await guesser.post("/v1/join", json={"joinCode": code})
                assert ok.status_code == 200, ok.text
            statuses = [
                (await guesser.post("/v1/join", json={"joinCode": WRONG_CODE}))
                for _ in range(3 * PER_SOURCE)
            ]
            codes = [r.status_code for r in statuses]
            assert set(codes) == {404, 429}
            # At most the burst plus what refilled meanwhile (a minute's budget
            # over the time the loop took).
            assert codes.count(404) >= PER_SOURCE
            refused = statuses[-1]
            assert refused.json()["code"] == 15429
            assert refused.headers["retry-after"]
            # While refused, even the right code is refused: the answer must
            # not tell a guesser that a guess was right.
            blocked = await guesser.post("/v1/join", json={"joinCode": code})
            assert blocked.status_code == 429
        async with client_at(rt, "127.0.0.3") as other:
            assert (
                await other.post("/v1/join", json={"joinCode": code})
            ).status_code == 200


async def test_join_code_guesses_spread_over_many_sources_hit_the_global_budget() -> (
    None
):
    global_rate = 0.5  # a second; ten seconds' worth (5) in a row
    async with relay_runtime(
        core__guess_per_source=1000, core__guess_global=global_rate, relay__api_rate=0
    ) as rt:
        started = time.monotonic()
        answered: list[int] = []
        for index in range(2, 42):  # 40 sources, 3 guesses each
            async with client_at(rt, f"127.0.0.{index}") as guesser:
                for _ in range(3):
                    response = await guesser.post(
                        "/v1/join", json={"joinCode": WRONG_CODE}
                    )
                    answered.append(response.status_code)
        elapsed = time.monotonic() - started
        assert set(answered) <= {404, 429}
        # The bound is the budget's, computed from the time the guesses took.
        assert answered.count(404) <= 5 + global_rate * elapsed + 1
        assert answered.count(429) >= len(answered) - 5 - global_rate * elapsed - 1


async def test_wrong_api_keys_are_bounded_and_then_even_the_right_key_waits() -> None:
    async with relay_runtime(
        core__guess_per_source=PER_SOURCE, core__guess_global=0
    ) as rt:
        async with client_at(rt, "127.0.0.4", key="wrong-key-000000") as guesser:
            codes = [
                (await guesser.get("/v1/regions")).status_code
                for _ in range(3 * PER_SOURCE)
            ]
        assert codes.count(401) >= PER_SOURCE and codes[-1] == 429
        async with client_at(rt, "127.0.0.4") as same_source:
            assert (await same_source.get("/v1/regions")).status_code == 429
        async with client_at(rt, "127.0.0.5") as elsewhere:
            for _ in range(3 * PER_SOURCE):  # a right key costs nothing
                assert (await elsewhere.get("/v1/regions")).status_code == 200


async def test_p2p_invite_code_guesses_are_bounded_across_websockets() -> None:
    rt = await start(
        default_config(
            loopback_config(
                core__only="p2p",
                core__guess_per_source=PER_SOURCE,
                core__guess_global=0,
            )
        )
    )
    try:
        host, port = rt.http_address
        answers: list[str] = []
        for _ in range(4):  # fresh sockets do not bring fresh budgets
            async with websockets.connect(f"ws://{host}:{port}/p2p/v1/ws") as ws:
                key = base64.b64encode(os.urandom(32)).decode()
                await ws.send(json.dumps({"type": "hello", "v": 1, "key": key}))
                await next_frame(ws, "welcome")
                for _ in range(PER_SOURCE):
                    await ws.send(json.dumps({"type": "join", "code": "ZZZZ-ZZZZ"}))
                    answers.append((await next_frame(ws, "error"))["code"])
        assert set(answers) == {"unknown_code", "rate_limited"}
        assert answers.count("unknown_code") >= PER_SOURCE
        assert answers[-1] == "rate_limited"
    finally:
        await rt.close()


async def test_openttd_unknown_invite_codes_are_bounded() -> None:
    rt = await start(
        default_config(
            loopback_config(
                core__only="openttd",
                core__guess_per_source=PER_SOURCE,
                core__guess_global=0,
            )
        )
    )
    try:
        svc = rt.services["openttd"]
        assert isinstance(svc, OpenTTDService)
        port = svc.address("coordinator")[1]
        client = await GcClient.connect("127.0.0.1", port, 6)
        try:
            for _ in range(PER_SOURCE):
                await client.send_message(ClientConnect(6, "+nothere"))
                assert await client.recv() == GcError(
                    ErrorType.INVALID_INVITE_CODE, "+nothere"
                )
            await client.send_message(ClientConnect(6, "+nothere"))
            refused = await client.recv()
            assert isinstance(refused, GcError)
            assert refused.error == ErrorType.UNKNOWN
        finally:
            await client.close()
    finally:
        await rt.close()
