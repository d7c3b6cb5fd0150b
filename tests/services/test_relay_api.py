"""The allocations REST API: Unity's shapes, authentication and error bodies."""

from __future__ import annotations

import base64
import uuid
from typing import Any

import httpx
import pytest

from crossroads.proto.relay import joincode
from crossroads.runtime import Runtime
from crossroads.services.relay import RelayService
from tests.conftest import running_service
from tests.e2e.relay_support import API_KEY, api, base_url, relay_runtime

pytestmark = pytest.mark.timeout(60)

ERROR_KEYS = {"status", "title", "detail", "type", "code", "message"}


def assert_error(response: httpx.Response, status: int, code: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body: dict[str, Any] = response.json()
    assert set(body) == ERROR_KEYS
    assert body["status"] == status and body["code"] == code
    assert body["detail"] == body["message"] and body["detail"]
    return body


async def test_no_configured_key_refuses_everything(runtime: Runtime) -> None:
    async with httpx.AsyncClient(base_url=base_url(runtime)) as http:
        response = await http.post(
            "/v1/allocate",
            json={"maxConnections": 2},
            headers={"Authorization": "Bearer anything"},
        )
        body = assert_error(response, 401, 15401)
        assert "--api-key" in body["detail"]
        assert response.headers["www-authenticate"] == "Bearer"


async def test_missing_or_wrong_key_is_401() -> None:
    async with relay_runtime() as rt, httpx.AsyncClient(base_url=base_url(rt)) as http:
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": f"Basic {API_KEY}"},
            {"Authorization": "Bearer"},
        ):
            response = await http.get("/v1/regions", headers=headers)
            assert_error(response, 401, 15401)
        ok = await http.get(
            "/v1/regions", headers={"Authorization": f"Bearer {API_KEY}"}
        )
        assert ok.status_code == 200


async def test_several_keys_each_work() -> None:
    async with relay_runtime(relay__api_keys="one-key,two-key") as rt:
        async with httpx.AsyncClient(base_url=base_url(rt)) as http:
            for key in ("one-key", "two-key"):
                response = await http.get(
                    "/v1/regions", headers={"Authorization": f"Bearer {key}"}
                )
                assert response.status_code == 200


async def test_allocate_response_has_unitys_shape() -> None:
    async with relay_runtime(
        relay__region="eu-west", relay__region_description="Europe"
    ) as rt:
        async with api(rt) as http:
            response = await http.post(
                "/v1/allocate", json={"maxConnections": 3, "region": "eu-west"}
            )
            assert response.status_code == 201
            body = response.json()
            assert set(body) == {"meta", "data"}
            assert body["meta"]["status"] == 201
            uuid.UUID(body["meta"]["requestId"])
            allocation = body["data"]["allocation"]
            assert set(allocation) == {
                "allocationId",
                "allocationIdBytes",
                "key",
                "connectionData",
                "serverEndpoints",
                "relayServer",
                "region",
            }
            aid = uuid.UUID(allocation["allocationId"])
            assert base64.b64decode(allocation["allocationIdBytes"]) == aid.bytes
            assert len(base64.b64decode(allocation["key"])) == 64
            assert 0 < len(base64.b64decode(allocation["connectionData"])) <= 255
            assert allocation["region"] == "eu-west"
            node = running_service(rt, "relay", RelayService).node
            port = node.endpoint.sock.getsockname()[1]
            assert allocation["relayServer"] == {"ipV4": "127.0.0.1", "port": port}
            endpoints = {e["connectionType"]: e for e in allocation["serverEndpoints"]}
            assert endpoints["udp"] == {
                "connectionType": "udp",
                "network": "udp",
                "reliable": False,
                "secure": False,
                "host": "127.0.0.1",
                "port": port,
            }
            dtls_port = node.dtls.endpoint.sock.getsockname()[1]
            assert endpoints["dtls"] == {
                "connectionType": "dtls",
                "network": "udp",
                "reliable": False,
                "secure": True,
                "host": "127.0.0.1",
                "port": dtls_port,
            }
            regions = (await http.get("/v1/regions")).json()
            assert regions == {
                "data": {"regions": [{"id": "eu-west", "description": "Europe"}]}
            }


async def test_join_code_and_join() -> None:
    async with relay_runtime(relay__join_code_length=8) as rt, api(rt) as http:
        host = (await http.post("/v1/allocate", json={"maxConnections": 2})).json()[
            "data"
        ]["allocation"]
        first = await http.post(
            "/v1/joincode", json={"allocationId": host["allocationId"]}
        )
        assert first.status_code == 200
        code = first.json()["data"]["joinCode"]
        assert len(code) == 8 and set(code) <= set(joincode.ALPHABET)
        again = await http.post(
            "/v1/joincode", json={"allocationId": host["allocationId"]}
        )
        assert again.json()["data"]["joinCode"] == code
        joined = await http.post("/v1/join", json={"joinCode": f" {code.lower()} "})
        assert joined.status_code == 200
        allocation = joined.json()["data"]["allocation"]
        assert allocation["hostConnectionData"] == host["connectionData"]
        assert allocation["allocationId"] != host["allocationId"]
        assert allocation["relayServer"] == host["relayServer"]


BAD_REQUESTS: list[tuple[str, Any, int, int]] = [
    ("/v1/allocate", {}, 400, 15001),
    ("/v1/allocate", {"maxConnections": "3"}, 400, 15001),
    ("/v1/allocate", {"maxConnections": 2.5}, 400, 15001),
    ("/v1/allocate", {"maxConnections": True}, 400, 15001),
    ("/v1/allocate", {"maxConnections": 0}, 400, 15001),
    ("/v1/allocate", {"maxConnections": 151}, 400, 15001),
    ("/v1/allocate", {"maxConnections": 2, "region": 5}, 400, 15001),
    ("/v1/allocate", {"maxConnections": 2, "region": "mars"}, 400, 15007),
    ("/v1/allocate", [1, 2], 400, 15001),
    ("/v1/joincode", {}, 400, 15001),
    ("/v1/joincode", {"allocationId": "not-a-uuid"}, 400, 15001),
    ("/v1/joincode", {"allocationId": str(uuid.uuid4())}, 404, 15008),
    ("/v1/join", {}, 400, 15001),
    ("/v1/join", {"joinCode": "AEIOU0"}, 400, 15001),
    ("/v1/join", {"joinCode": "BCD"}, 400, 15001),
    ("/v1/join", {"joinCode": "BCDFGH"}, 404, 15009),
]


async def test_bad_requests_get_clear_errors() -> None:
    async with relay_runtime() as rt, api(rt) as http:
        for path, body, status, code in BAD_REQUESTS:
            response = await http.post(path, json=body)
            assert response.status_code == status, (path, body, response.text)
            assert_error(response, status, code)


async def test_body_that_is_not_json() -> None:
    async with relay_runtime() as rt, api(rt) as http:
        response = await http.post(
            "/v1/allocate",
            content=b"{nope",
            headers={"content-type": "application/json"},
        )
        body = assert_error(response, 400, 15001)
        assert "JSON" in body["detail"]
        assert_error(await http.post("/v1/allocate"), 400, 15001)


async def test_error_names_the_bad_field() -> None:
    async with relay_runtime() as rt, api(rt) as http:
        body = assert_error(await http.post("/v1/allocate", json={}), 400, 15001)
        assert "maxConnections" in body["detail"]


async def test_full_node_answers_no_suitable_relay() -> None:
    async with relay_runtime(relay__capacity=10) as rt, api(rt) as http:
        ok = await http.post("/v1/allocate", json={"maxConnections": 9})
        assert ok.status_code == 201
        assert_error(
            await http.post("/v1/allocate", json={"maxConnections": 1}), 503, 15010
        )


async def test_openapi_documents_the_relay_api() -> None:
    async with (
        relay_runtime(core__api_docs=True) as rt,
        httpx.AsyncClient(base_url=base_url(rt)) as http,
    ):
        document = (await http.get("/openapi.json")).json()
        paths = document["paths"]
        for path in ("/v1/allocate", "/v1/joincode", "/v1/join"):
            assert "post" in paths[path]
        assert "get" in paths["/v1/regions"]
        allocate = paths["/v1/allocate"]["post"]
        schema = allocate["requestBody"]["content"]["application/json"]["schema"]
        assert "maxConnections" in schema["properties"]
        assert schema["required"] == ["maxConnections"]
        assert "201" in allocate["responses"] and "401" in allocate["responses"]
        assert "AllocationModel" in document["components"]["schemas"]
        # Generated clients name their calls after the operation ids.
        operation_ids = {
            path: next(iter(ops.values()))["operationId"]
            for path, ops in paths.items()
            # (/v1/insight/ is the operator's API, documented in README.)
            if path.startswith("/v1/") and not path.startswith("/v1/insight/")
        }
        assert operation_ids == {
            "/v1/allocate": "allocate_v1_allocate_post",
            "/v1/joincode": "create_join_code_v1_joincode_post",
            "/v1/join": "join_v1_join_post",
            "/v1/regions": "regions_v1_regions_get",
            "/v1/services/{service}/servers": (
                "qos_service_servers_v1_services__service__servers_get"
            ),
            "/v1/servers": "qos_servers_v1_servers_get",
            "/v1/ping/estimate": "ping_estimate_v1_ping_estimate_post",
        }
        # The body is documented once, by the model, not as a parameter.
        assert "parameters" not in paths["/v1/join"]["post"]


async def test_allocations_are_rate_limited_per_client() -> None:
    async with relay_runtime(relay__api_rate=1.0) as rt, api(rt) as http:
        statuses = [
            (await http.post("/v1/allocate", json={"maxConnections": 1})).status_code
            for _ in range(6)
        ]
        assert statuses[:3] == [201, 201, 201]  # a burst of three seconds' worth
        assert 429 in statuses[3:]
        limited = await http.post("/v1/allocate", json={"maxConnections": 1})
        assert_error(limited, 429, 15429)
        assert limited.headers["retry-after"] == "1"
        # Reading regions is not limited.
        assert (await http.get("/v1/regions")).status_code == 200


async def test_oversized_body_is_refused() -> None:
    async with relay_runtime() as rt, api(rt) as http:
        response = await http.post(
            "/v1/join",
            content=b'{"joinCode": "' + b"B" * 20000 + b'"}',
            headers={"content-type": "application/json"},
        )
        assert_error(response, 413, 15413)
