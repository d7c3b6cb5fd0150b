"""MasterServer2-compatible listing: every documented field and error, TTL expiry."""

from __future__ import annotations

import asyncio
import json
import re
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from crossroads.config import default_config
from crossroads.runtime import start
from crossroads.services.p2p_master import MasterServer, make_master_router
from crossroads.store.memory import MemoryStore
from tests.conftest import loopback_config


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def api(clock: Clock) -> AsyncIterator[httpx.AsyncClient]:
    store = MemoryStore(clock=clock)
    master = MasterServer(
        store,
        max_timeout=300,
        rows_per_ip=10,
        registry=CollectorRegistry(),
        clock=clock,
    )
    app = FastAPI()
    app.include_router(make_master_router(master, "/testServer"))
    transport = httpx.ASGITransport(app=app, client=("198.51.100.20", 5555))
    async with httpx.AsyncClient(
        transport=transport, base_url="http://ms2.test"
    ) as client:
        yield client


async def post(
    api: httpx.AsyncClient, body: object, method: str = "POST"
) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return await api.request(method, "/testServer", content=content)


async def rows(api: httpx.AsyncClient, **params: str) -> list[dict[str, object]]:
    response = await api.get("/testServer", params={"__gameId": "mygame", **params})
    assert response.status_code == 200, response.text
    result = response.json()
    assert "requestURL" in result
    return list(result["GET"])


async def test_post_echoes_client_req_id_and_get_lists_the_row(
    api: httpx.AsyncClient,
) -> None:
    r = await post(
        api,
        {
            "__gameId": "mygame",
            "__clientReqId": "0",
            "mapname": "dust",
            "gameport": 7777,
        },
    )
    assert r.status_code == 200
    assert r.json() == {
        "POST": {"__rowId": 0, "__clientReqId": "0", "__gameId": "mygame"}
    }
    assert await rows(api) == [
        {
            "__rowId": 0,
            "__timeoutSec": 60,
            "__addr": "198.51.100.20",
            "__gameId": "mygame",
            "mapname": "dust",
            "gameport": 7777,
        }
    ]


async def test_post_without_client_req_id_has_an_empty_body(
    api: httpx.AsyncClient,
) -> None:
    r = await post(api, {"__gameId": "mygame"})
    assert r.status_code == 200 and r.content == b""


async def test_raknet_sample_single_quoted_body(api: httpx.AsyncClient) -> None:
    body = "{'__gameId': 'mygame', '__clientReqId': '0', '__timeoutSec': '30', '__rowId': 9223372036854775807, 'routerIsOpen': 1 }"
    r = await post(api, body)
    assert r.json()["POST"]["__rowId"] == 2**63 - 1
    (row,) = await rows(api)
    assert row["__timeoutSec"] == 30 and row["routerIsOpen"] == 1


async def test_row_id_above_the_signed_64_bit_range_is_refused(
    api: httpx.AsyncClient,
) -> None:
    """jansson 2.4 (RakNet's samples) fails a whole GET on one integer above
    2^63-1, so such a row would hide the game from every reader."""
    for row_id in (2**63, 12345678901234567890, str(2**63)):
        r = await post(api, {"__gameId": "mygame", "__rowId": row_id})
        assert r.status_code == 400 and r.json()["code"] == "bad_value"
    assert await rows(api) == []


async def test_columns_may_hold_arrays_and_objects(api: httpx.AsyncClient) -> None:
    body = "{'__gameId': 'mygame', 'natTypes' : [ {'type': 5}, {'type': 2} ], 'map': {'name': 'dust', 'size': [64, 64]} }"
    assert (await post(api, body)).status_code == 200
    (row,) = await rows(api)
    assert row["natTypes"] == [{"type": 5}, {"type": 2}]
    assert row["map"] == {"name": "dust", "size": [64, 64]}


async def test_get_for_a_game_without_rows_is_an_empty_list(
    api: httpx.AsyncClient, clock: Clock
) -> None:
    """ComprehensivePCGame shows its menu only after a response with "GET"."""
    assert await rows(api) == []
    await post(api, {"__gameId": "mygame", "__timeoutSec": 15})
    clock.now += 10_000  # the row and the game record are long gone
    assert await rows(api) == []


async def test_put_updates_the_row_with_row_id(api: httpx.AsyncClient) -> None:
    await post(api, {"__gameId": "mygame", "__rowId": 42, "players": 1})
    await post(api, {"__gameId": "mygame", "__rowId": 42, "players": 2}, method="PUT")
    assert [(r["__rowId"], r["players"]) for r in await rows(api)] == [(42, 2)]


async def test_rows_expire_after_timeout_sec(
    api: httpx.AsyncClient, clock: Clock
) -> None:
    await post(api, {"__gameId": "mygame", "__timeoutSec": 15, "a": 1})
    await post(api, {"__gameId": "mygame", "__timeoutSec": 40, "a": 2})
    clock.now += 14.9
    assert len(await rows(api)) == 2
    clock.now += 0.2
    assert [r["a"] for r in await rows(api)] == [2]
    clock.now += 25
    assert await rows(api) == []


async def test_refresh_extends_the_ttl(api: httpx.AsyncClient, clock: Clock) -> None:
    await post(api, {"__gameId": "mygame", "__rowId": 1, "__timeoutSec": 30})
    clock.now += 29
    await post(api, {"__gameId": "mygame", "__rowId": 1, "__timeoutSec": 30})
    clock.now += 29
    assert len(await rows(api)) == 1


@pytest.mark.parametrize("timeout", [14, 301, "0"])
async def test_timeout_out_of_range_is_403(
    api: httpx.AsyncClient, timeout: object
) -> None:
    r = await post(api, {"__gameId": "mygame", "__timeoutSec": timeout})
    assert r.status_code == 403 and r.json()["code"] == "timeout_out_of_range"


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ("", "bad_json"),
        ("{not json", "bad_json"),
        ("[1,2]", "bad_json"),
        ({"mapname": "x"}, "missing_field"),
        ({"__gameId": ""}, "empty_field"),
        ({"__gameId": ["x"]}, "bad_type"),
        ({"__gameId": "g", "__timeoutSec": "soon"}, "bad_type"),
        ({"__gameId": "g", "__rowId": -1}, "bad_value"),
        ({"__gameId": "g", "__rowId": 2**64}, "bad_value"),
        ({"__gameId": "g", "col": {"nested": "x" * 1100}}, "bad_type"),
        ({"__gameId": "g", "col": ["x"] * 300}, "bad_type"),
        ({"__gameId": "g", "col": "x" * 2000}, "bad_type"),
        ({"__gameId": "g", "col": [1, {"deep": 2**63}]}, "bad_value"),
        ({"__gameId": "g", "col": -(2**63) - 1}, "bad_value"),
        ('{"__gameId": "g", "col": [NaN]}', "bad_value"),
        ('{"__gameId": "g", "col": 1e400}', "bad_value"),
        ('{"__gameId": "g", "col": "\\u0000"}', "bad_value"),
        ('{"__gameId": "g", "col": {"\\ud800": 1}}', "bad_value"),
        ('{"__gameId": "g\\u0000"}', "bad_value"),
        ({"__gameId": "g", "__clientReqId": 2**64}, "bad_value"),
        ({"__gameId": "g", **{f"c{i}": i for i in range(65)}}, "too_many_columns"),
    ],
)
async def test_bad_posts_are_400(
    api: httpx.AsyncClient, body: object, code: str
) -> None:
    r = await post(api, body)
    assert r.status_code == 400 and r.json()["code"] == code


async def test_oversized_body_is_413(api: httpx.AsyncClient) -> None:
    r = await post(api, "{" + " " * 200_000 + "}")
    assert r.status_code == 413


async def test_more_than_ten_rows_from_one_ip_is_403(
    api: httpx.AsyncClient, clock: Clock
) -> None:
    for i in range(10):
        assert (
            await post(api, {"__gameId": "mygame", "__timeoutSec": 15, "i": i})
        ).status_code == 200
    r = await post(api, {"__gameId": "othergame"})
    assert r.status_code == 403 and r.json()["code"] == "too_many_rows"
    # updating an existing row is still allowed
    assert (
        await post(api, {"__gameId": "mygame", "__rowId": 3, "i": 33})
    ).status_code == 200
    clock.now += 16
    assert (await post(api, {"__gameId": "othergame"})).status_code == 200


async def test_update_and_read_passwords_guard_their_rows(
    api: httpx.AsyncClient,
) -> None:
    created = await post(
        api,
        {
            "__gameId": "mygame",
            "__rowId": 1,
            "__updatePW": "up",
            "__readPW": "rd",
            "a": 1,
        },
    )
    assert created.status_code == 200
    # Updating the row needs its __updatePW ...
    r = await post(api, {"__gameId": "mygame", "__rowId": 1, "a": 2})
    assert r.status_code == 401 and r.json()["code"] == "wrong_password"
    assert (
        await post(api, {"__gameId": "mygame", "__rowId": 1, "__updatePW": "up"})
    ).status_code == 200
    # ... and listing it its __readPW.
    assert await rows(api) == []
    assert len(await rows(api, __readPW="rd")) == 1


async def test_row_password(api: httpx.AsyncClient) -> None:
    await post(api, {"__gameId": "mygame", "__rowId": 5, "__rowPW": "secret", "a": 1})
    r = await post(api, {"__gameId": "mygame", "__rowId": 5, "a": 2})
    assert r.status_code == 401
    assert (
        await post(
            api, {"__gameId": "mygame", "__rowId": 5, "__rowPW": "secret", "a": 2}
        )
    ).status_code == 200
    r = await api.delete("/testServer", params={"__gameId": "mygame", "__rowId": "5"})
    assert r.status_code == 401
    (row,) = await rows(api)
    assert "__rowPW" not in row and row["a"] == 2


async def test_get_errors(api: httpx.AsyncClient) -> None:
    r = await api.get("/testServer")
    assert r.status_code == 400 and r.json()["code"] == "missing_field"
    await post(api, {"__gameId": "mygame"})
    r = await api.get(
        "/testServer", params={"__gameId": "mygame", "__minResultsHint": "lots"}
    )
    assert r.status_code == 400


async def test_exclude_cols_and_results_hint(api: httpx.AsyncClient) -> None:
    for i in range(10):
        await post(
            api, {"__gameId": "mygame", "__timeoutSec": 15, "i": i, "big": "x" * 10}
        )
    listed = await rows(api, __excludeCols="big,__addr", __minResultsHint="3")
    # the hint is clamped to at least 10
    assert len(listed) == 10
    assert all("big" not in r and "__addr" not in r and "i" in r for r in listed)
    assert len(await rows(api, __geoIP="203.0.113.5", __includeDist="1")) == 10


async def test_results_are_capped_at_10000_bytes(api: httpx.AsyncClient) -> None:
    for i in range(10):
        await post(
            api,
            {
                "__gameId": "mygame",
                "__rowId": i,
                "blob": "y" * 1000,
                "more": "z" * 1000,
            },
        )
    response = await api.get("/testServer", params={"__gameId": "mygame"})
    assert len(json.dumps(response.json()["GET"])) <= 10_000
    assert 0 < len(response.json()["GET"]) < 10


async def test_delete(api: httpx.AsyncClient) -> None:
    await post(api, {"__gameId": "mygame", "__rowId": 9, "__updatePW": "up"})
    r = await api.delete("/testServer", params={"__gameId": "mygame", "__rowId": "9"})
    assert r.status_code == 401
    r = await api.delete(
        "/testServer", params={"__gameId": "mygame", "__rowId": "9", "__updatePW": "up"}
    )
    assert r.status_code == 200
    assert await rows(api) == []
    # 200 even when the row is not there
    r = await api.delete(
        "/testServer", params={"__gameId": "mygame", "__rowId": "9", "__updatePW": "up"}
    )
    assert r.status_code == 200
    r = await api.delete("/testServer", params={"__gameId": "mygame"})
    assert r.status_code == 400
    r = await api.delete("/testServer", params={"__rowId": "1"})
    assert r.status_code == 400


async def test_deleted_rows_free_the_ip_quota(api: httpx.AsyncClient) -> None:
    for i in range(10):
        await post(api, {"__gameId": "mygame", "__rowId": i})
    await api.delete("/testServer", params={"__gameId": "mygame", "__rowId": "0"})
    assert (await post(api, {"__gameId": "mygame"})).status_code == 200


@pytest.mark.redis
async def test_listing_on_redis(redis_url: str) -> None:
    from crossroads.store.redis import RedisStore

    store = RedisStore(redis_url)
    try:
        master = MasterServer(
            store, max_timeout=300, rows_per_ip=10, registry=CollectorRegistry()
        )
        app = FastAPI()
        app.include_router(make_master_router(master, "/testServer"))
        transport = httpx.ASGITransport(app=app, client=("198.51.100.20", 5555))
        async with httpx.AsyncClient(
            transport=transport, base_url="http://ms2.test"
        ) as client:
            r = await post(
                client,
                {"__gameId": "mygame", "__clientReqId": 7, "__timeoutSec": 20, "x": 1},
            )
            assert r.json() == {
                "POST": {"__rowId": 0, "__clientReqId": 7, "__gameId": "mygame"}
            }
            assert [row["x"] for row in await rows(client)] == [1]
            assert 19 <= (await store.ttl("ms2:row:mygame:0") or 0) <= 20
    finally:
        await store.close()


# --- RakNet's own client, byte for byte -------------------------------------
#
# RakNet 4.081's HTTPConnection2 (Source/HTTPConnection2.cpp, OnReceive) appends
# each TCP read to a string and looks for the case-sensitive text
# "Content-Length: " followed by digits and CR/LF. With it, the request
# completes once the body after "\r\n\r\n" has that many bytes; without it, the
# request completes at the first read that holds "\r\n\r\n" -- whatever part of
# the body came in later segments is lost. The samples then hand the body to
# jansson 2.4's json_loads(JSON_REJECT_DUPLICATES) and walk its keys looking
# for "GET" or "POST". The requests below are what RakString::FormatForPOST /
# FormatForGET / FormatForDELETE produce for ComprehensivePCGame.


def raknet_request(method: str, path: str, body: str | None = None) -> bytes:
    """The text of RakString::FormatFor{POST,GET,DELETE} (no extra headers)."""
    if body is None:
        return f"{method} {path} HTTP/1.1\r\nHost: ms2.test\r\n\r\n".encode()
    return (
        f"{method} {path} HTTP/1.1\r\nHost: ms2.test\r\n"
        "Content-Type: text/plain; charset=UTF-8\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}"
    ).encode()


def raknet_read(sock: socket.socket) -> str | None:
    """One response as HTTPConnection2 sees it: the body, or None when the
    response carried no usable "Content-Length: " (contentOffset -1 there)."""
    received = b""
    content_length = -1
    while True:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed mid-response: {received!r}"
        received += chunk
        marker = received.find(b"Content-Length: ")
        if content_length == -1 and marker != -1:
            digits = re.match(rb"([0-9]+)[\r\n]", received[marker + 16 :])
            if digits:
                content_length = int(digits.group(1))
        head_end = received.find(b"\r\n\r\n")
        if content_length == -1:
            assert head_end == -1 or received.startswith(b"HTTP/1.1"), received
            if head_end != -1:
                raise AssertionError(
                    f"no exact 'Content-Length: ' header; RakNet stops here: {received!r}"
                )
            continue
        if content_length == 0 and head_end != -1:
            return None
        if head_end != -1 and len(received) - head_end - 4 >= content_length:
            return received[head_end + 4 :].decode()


def jansson_loads(text: str) -> dict[str, Any]:
    """json.loads with jansson 2.4's limits: integers are long long, no
    NaN/Infinity, no \\u0000, no duplicate keys."""

    def integer(token: str) -> int:
        value = int(token)
        assert -(2**63) <= value < 2**63, f"jansson: too big integer {token}"
        return value

    def constant(token: str) -> None:
        raise AssertionError(f"jansson: invalid token {token}")

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in pairs]
        assert len(keys) == len(set(keys)), f"jansson: duplicate key in {keys}"
        return dict(pairs)

    assert "\\u0000" not in text
    result = json.loads(
        text,
        parse_int=integer,
        parse_constant=constant,
        object_pairs_hook=no_duplicates,
    )
    assert isinstance(result, dict)
    return result


@pytest.fixture
async def http_port() -> AsyncIterator[int]:
    runtime = await start(default_config(loopback_config(core__only="p2p")))
    try:
        yield runtime.http_address[1]
    finally:
        await runtime.close()


def exchange(port: int, request: bytes) -> str | None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        return raknet_read(sock)


async def test_comprehensive_pc_game_through_raknet_s_http_client(
    http_port: int,
) -> None:
    """The sample's own requests, read the way HTTPConnection2 + jansson do."""
    loop = asyncio.get_running_loop()

    async def send(request: bytes) -> str | None:
        return await loop.run_in_executor(None, exchange, http_port, request)

    search = raknet_request("GET", "/testServer?__gameId=comprehensivePCGame")
    # SearchForGames() before anyone hosted: the menu needs a "GET" key.
    body = await send(search)
    assert body is not None
    listing = jansson_loads(body)
    assert next(iter(listing)) == "GET" and listing["GET"] == []

    # PostRoomToMaster() the first time (masterServerRow == -1): no "__rowId".
    guid = str(2**64 - 2)  # RakNetGUID::ToString() is the unsigned decimal
    first = (
        "{'__gameId': 'comprehensivePCGame', '__clientReqId': '0',  "
        "'__timeoutSec': '30', 'roomName': 'Default room name', "
        f"'guid': '{guid}', 'natTypes' : [ {{'type': 5}} ]  }}"
    )
    body = await send(raknet_request("POST", "/testServer", first))
    assert body is not None
    posted = jansson_loads(body)
    assert next(iter(posted)) == "POST"
    row_id = posted["POST"]["__rowId"]
    assert isinstance(row_id, int)

    # The refresh 29 s later, with the row it was given and a second player.
    refresh = (
        "{'__gameId': 'comprehensivePCGame', '__clientReqId': '0', "
        f'"__rowId": {row_id}, '
        "'__timeoutSec': '30', 'roomName': 'Default room name', "
        f"'guid': '{guid}', 'natTypes' : [ {{'type': 5}}, {{'type': 2}} ]  }}"
    )
    body = await send(raknet_request("POST", "/testServer", refresh))
    assert body is not None and jansson_loads(body)["POST"]["__rowId"] == row_id

    body = await send(search)
    assert body is not None
    (room,) = jansson_loads(body)["GET"]
    assert room["roomName"] == "Default room name" and room["guid"] == guid
    assert room["natTypes"] == [{"type": 5}, {"type": 2}]

    # ReleaseRoomFromCloud(): 200 with an empty body (contentOffset -1).
    release = f"/testServer?__gameId=comprehensivePCGame&__rowId={row_id}"
    assert await send(raknet_request("DELETE", release)) is None
    body = await send(search)
    assert body is not None and jansson_loads(body)["GET"] == []


async def test_errors_are_readable_by_raknet_s_http_client(http_port: int) -> None:
    loop = asyncio.get_running_loop()
    body = await loop.run_in_executor(
        None,
        exchange,
        http_port,
        raknet_request("POST", "/testServer", "{'__gameId': 'g', '__rowId': -1}"),
    )
    assert body is not None and jansson_loads(body)["code"] == "bad_value"
