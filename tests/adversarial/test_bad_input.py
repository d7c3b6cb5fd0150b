"""Bad input is a 4xx, never a 500.

A 5,000-digit integer (beyond CPython's int/str conversion limit) or 2,700
nested brackets (beyond the recursion limit) in a JSON body gave 500 with a
traceback on every JSON-taking endpoint. Now every such body is a 400 with the
error envelope, and random or malicious bodies never get a 5xx.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import websockets
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from crossroads.proto.openttd.bus import BusMessage, DropSession
from crossroads.runtime import Runtime
from crossroads.services.openttd.bus import Bus
from crossroads.services.openttd.registry import channel
from crossroads.store.memory import MemoryStore
from tests.adversarial.store_faults_support import (
    http_base,
    next_frame,
    runtime_in_thread,
)
from tests.conftest import runtime  # noqa: F401 - the fixture
from tests.strategies import json_values as any_json

pytestmark = pytest.mark.timeout(120)

API_KEY = "bad-input-test-key-0123"
#: The JSON-taking HTTP endpoints: the relay allocations API and the
#: MasterServer2 listing (POST and PUT).
ENDPOINTS = [
    ("POST", "/v1/allocate"),
    ("POST", "/v1/joincode"),
    ("POST", "/v1/join"),
    ("POST", "/testServer"),
    ("PUT", "/testServer"),
]
HUGE_NUMBER = b"9" * 5000
DEEP_ARRAY = b"[" * 2700 + b"]" * 2700
DEEP_OBJECT = b'{"a":' * 2700 + b"1" + b"}" * 2700
MALICIOUS = {
    "huge-int-value": b'{"maxConnections": ' + HUGE_NUMBER + b"}",
    "huge-int-code": b'{"joinCode": ' + HUGE_NUMBER + b', "__gameId": "g"}',
    "huge-int-lenient": b"{'__gameId': 'g', '__rowId': " + HUGE_NUMBER + b"}",
    "huge-negative": b"-" + HUGE_NUMBER,
    "deep-array": DEEP_ARRAY,
    "deep-object": DEEP_OBJECT,
    "not-utf8": b'{"joinCode": "\xff\xfe"}',
    "nan": b'{"maxConnections": NaN, "__gameId": NaN}',
    "infinity": b'{"maxConnections": 1e99999}',
}


@pytest.fixture(scope="module")
def server() -> Iterator[Runtime]:
    with runtime_in_thread(
        core__only="relay,p2p",
        relay__api_keys=API_KEY,
        relay__api_rate=0,
    ) as rt:
        yield rt


@pytest.fixture(scope="module")
def http(server: Runtime) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=http_base(server),
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=10,
    ) as client:
        yield client


def assert_envelope(response: httpx.Response, status: int) -> None:
    assert response.status_code == status, response.text
    body: dict[str, Any] = response.json()
    assert isinstance(body["code"], str | int) and body["message"]


@pytest.mark.parametrize("method,path", ENDPOINTS)
@pytest.mark.parametrize("name", sorted(MALICIOUS))
def test_malicious_body_is_400_with_the_error_envelope(
    http: httpx.Client, method: str, path: str, name: str
) -> None:
    response = http.request(method, path, content=MALICIOUS[name])
    assert_envelope(response, 400)


json_values = any_json(
    text_size=40,
    width=5,
    max_leaves=20,
    keys=st.sampled_from(
        ["maxConnections", "region", "allocationId", "joinCode", "__gameId"]
    ),
)
bodies = (
    st.binary(max_size=2000)
    | json_values.map(lambda v: json.dumps(v).encode())
    | st.builds(
        lambda depth, opener: opener * depth,
        st.integers(1, 5000),
        st.sampled_from([b"[", b'{"a":', b"{'a':"]),
    )
    | st.builds(
        lambda digits, key: b'{"%s": %s}' % (key.encode(), b"7" * digits),
        st.integers(1, 6000),
        st.sampled_from(["maxConnections", "joinCode", "__rowId", "__timeoutSec"]),
    )
)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(endpoint=st.sampled_from(ENDPOINTS), body=bodies)
def test_random_bodies_never_get_a_5xx(
    http: httpx.Client, endpoint: tuple[str, str], body: bytes
) -> None:
    method, path = endpoint
    response = http.request(method, path, content=body)
    assert response.status_code < 500, (body[:80], response.text[:200])
    if response.status_code >= 400:
        assert_envelope(response, response.status_code)


async def test_malicious_websocket_frames_get_the_protocols_error(
    runtime: Runtime,  # noqa: F811 - the fixture
) -> None:
    host, port = runtime.http_address
    hello = {"type": "hello", "v": 1, "key": base64.b64encode(bytes(32)).decode()}
    async with websockets.connect(f"ws://{host}:{port}/p2p/v1/ws") as ws:
        await ws.send(json.dumps(hello))
        await next_frame(ws, "welcome")
        for frame in (
            '{"type": "ping", "id": ' + "9" * 5000 + "}",
            "[" * 2700 + "]" * 2700,
        ):
            await ws.send(frame)
            assert (await next_frame(ws, "error"))["code"] == "bad_json"
        await ws.send(json.dumps({"type": "ping", "id": 5}))
        assert (await next_frame(ws, "pong"))["id"] == 5


async def test_a_deeply_nested_bus_message_is_dropped_and_the_bus_goes_on() -> None:
    store = MemoryStore()
    received: list[BusMessage] = []
    metrics = CollectorRegistry()
    bus = Bus(store, "abcd1234", metrics)
    await bus.start(received.append)
    try:
        await store.publish(channel("abcd1234"), b"[" * 5000 + b"]" * 5000)
        await store.publish(channel("abcd1234"), b'{"t": "after"}')
        await store.publish(channel("abcd1234"), DropSession("+abc", "s").encode())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while not received and loop.time() < deadline:
            await asyncio.sleep(0.02)
        assert received == [DropSession("+abc", "s")]
        dropped = "crossroads_openttd_bus_dropped_total"
        for reason in ("too-deep", "unknown-message"):
            assert metrics.get_sample_value(dropped, {"reason": reason}) == 1
    finally:
        await bus.close()
