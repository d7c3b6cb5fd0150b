"""MasterServer2-compatible listing: every documented field and error, TTL expiry."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from crossroads.services.p2p_master import MasterServer, make_master_router
from crossroads.store.memory import MemoryStore


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
    body = "{'__gameId': 'mygame', '__clientReqId': '0', '__timeoutSec': '30', '__rowId': 12345678901234567890, 'routerIsOpen': 1 }"
    r = await post(api, body)
    assert r.json()["POST"]["__rowId"] == 12345678901234567890
    (row,) = await rows(api)
    assert row["__timeoutSec"] == 30 and row["routerIsOpen"] == 1


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
        ({"__gameId": "g", "col": {"nested": 1}}, "bad_type"),
        ({"__gameId": "g", "col": "x" * 2000}, "bad_type"),
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
    r = await api.get("/testServer", params={"__gameId": "nosuchgame"})
    assert r.status_code == 400 and r.json()["code"] == "unknown_game"
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
