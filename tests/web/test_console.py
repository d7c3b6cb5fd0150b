"""The web console over HTTP: public data is public and nothing more, the admin
API needs the token, revoke ends real sessions (TURN, relay)."""

from __future__ import annotations

import html
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from crossroads.client.relay import RelayApi, RelayConnection
from crossroads.client.turn import TurnClient, TurnClientError
from crossroads.config import default_config
from crossroads.runtime import Runtime, start
from crossroads.services.stun import StunService
from crossroads.services.turn import TurnService
from crossroads.state import MATRIX_FILE, results_dir
from crossroads.web.console import NO_TURNS_NAME, TurnTls, ice_urls, turns_name
from tests.conftest import eventually, loopback_config
from tests.e2e.relay_support import base_url
from tests.tls_support import write_certificates

pytestmark = pytest.mark.timeout(60)

ADMIN_TOKEN = "console-admin-token-for-tests"
API_KEY = "console-relay-key"
USER, PASSWORD = "alice", "wonderland"


def console_overrides(**extra: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "core__only": ["stun", "turn", "relay"],
        "core__admin_token": ADMIN_TOKEN,
        "turn__user": [f"{USER}:{PASSWORD}"],
        "turn__allow_loopback_peers": True,
        "relay__api_keys": [API_KEY],
        "relay__allow_private_peers": True,
    }
    values.update(extra)
    return loopback_config(**values)


@pytest.fixture
async def console_runtime(tmp_path: Path) -> AsyncIterator[Runtime]:
    rt = await start(
        default_config(console_overrides(core__state_dir=str(tmp_path / "state")))
    )
    try:
        yield rt
    finally:
        await rt.close()


def admin_headers(token: str = ADMIN_TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def turn_server(rt: Runtime) -> tuple[str, int]:
    stun = rt.services["stun"]
    assert isinstance(stun, StunService)
    return stun.primary


async def test_public_pages_show_services_but_no_session_data(
    console_runtime: Runtime,
) -> None:
    rt = console_runtime
    async with (
        httpx.AsyncClient(base_url=base_url(rt)) as http,
        await TurnClient.connect(turn_server(rt), USER, PASSWORD) as client,
    ):
        relayed = await client.allocate()
        page = await http.get("/")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert "<main" in page.text and 'lang="en"' in page.text
        assert f"udp 127.0.0.1:{turn_server(rt)[1]}" in page.text
        status = (await http.get("/console/api/status")).json()
        assert status["current"]["turn_allocations"] == 1
        assert {s["name"] for s in status["services"]} == {"stun", "turn", "relay"}
        # Relay nodes per region, from the store (what /v1/regions offers).
        [node] = status["relay_nodes"]
        assert node["region"] == "local" and node["capacity"] == 5000
        assert node["address"].startswith("127.0.0.1:")
        assert "Relay nodes" in page.text and node["node"] in page.text
        # The QoS server clients measure the region with, and its port.
        assert node["qos"].startswith("127.0.0.1:") and node["qos"] in page.text
        assert "QoS (UDP)" in page.text
        # Snippets carry the ports this server really listens on.
        stun_port = turn_server(rt)[1]
        assert f"turn:127.0.0.1:{stun_port}?transport=udp" in page.text
        assert f"relay node UDP {node['address'].split(':')[1]}" in page.text
        http_port = rt.http_address[1]
        assert f"http://127.0.0.1:{http_port}/v1/allocate" in page.text
        local_port = str(client.local_address[1])
        for text in (page.text, str(status)):
            assert USER not in text and PASSWORD not in text
            assert ADMIN_TOKEN not in text and API_KEY not in text
            assert str(relayed[1]) not in text and local_port not in text
        for path in ("/console/static/console.js", "/console/static/console.css"):
            assert (await http.get(path)).status_code == 200
        assert (await http.get("/console/static/..%2fconsole.py")).status_code == 404


async def test_admin_api_needs_the_token(console_runtime: Runtime) -> None:
    async with httpx.AsyncClient(base_url=base_url(console_runtime)) as http:
        for headers in ({}, admin_headers("wrong"), {"Authorization": ADMIN_TOKEN}):
            for path in ("/console/api/admin/sessions", "/console/api/admin/errors"):
                answer = await http.get(path, headers=headers)
                assert answer.status_code == 401
                assert answer.json()["code"] == "forbidden"
            revoke = await http.post(
                "/console/api/admin/revoke",
                json={"kind": "turn", "id": "x"},
                headers=headers,
            )
            assert revoke.status_code == 401
        ok = await http.get("/console/api/admin/sessions", headers=admin_headers())
        assert ok.status_code == 200 and ok.json() == {"turn": [], "relay": []}


async def test_without_an_admin_token_admin_is_closed(tmp_path: Path) -> None:
    rt = await start(default_config(console_overrides(core__admin_token="")))
    try:
        async with httpx.AsyncClient(base_url=base_url(rt)) as http:
            for token in ("x", "anything"):
                answer = await http.get(
                    "/console/api/admin/sessions", headers=admin_headers(token)
                )
                assert answer.status_code == 401
    finally:
        await rt.close()


async def test_revoke_ends_a_turn_allocation(console_runtime: Runtime) -> None:
    rt = console_runtime
    turn = rt.services["turn"]
    assert isinstance(turn, TurnService)
    async with (
        httpx.AsyncClient(base_url=base_url(rt), headers=admin_headers()) as http,
        await TurnClient.connect(turn_server(rt), USER, PASSWORD) as client,
    ):
        relayed = await client.allocate()
        listed = (await http.get("/console/api/admin/sessions")).json()["turn"]
        assert len(listed) == 1
        session = listed[0]
        assert session["user"] == USER
        assert session["client"] == f"127.0.0.1:{client.local_address[1]}"
        assert f"127.0.0.1:{relayed[1]}" in session["detail"]
        assert 0 < session["expires_in"] <= 600
        unknown = await http.post(
            "/console/api/admin/revoke", json={"kind": "turn", "id": "nope"}
        )
        assert unknown.status_code == 404
        bad = await http.post("/console/api/admin/revoke", content=b"not json")
        assert bad.status_code == 400
        answer = await http.post(
            "/console/api/admin/revoke", json={"kind": "turn", "id": session["id"]}
        )
        assert answer.status_code == 200
        assert turn.sessions() == []
        # The allocation is really gone: its Refresh gets 437 (RFC 8656 §7.3).
        with pytest.raises(TurnClientError) as excinfo:
            await client.refresh()
        assert excinfo.value.code == 437
        metrics = (await http.get("/metrics")).text
        assert 'crossroads_turn_allocations_deleted_total{reason="revoked"} 1.0' in (
            metrics
        )


async def test_revoke_user_ends_all_of_its_allocations(
    console_runtime: Runtime,
) -> None:
    turn = console_runtime.services["turn"]
    assert isinstance(turn, TurnService)
    server = turn_server(console_runtime)
    async with (
        await TurnClient.connect(server, USER, PASSWORD) as first,
        await TurnClient.connect(server, USER, PASSWORD) as second,
    ):
        await first.allocate()
        await second.allocate()
        assert len(turn.sessions()) == 2
        assert turn.revoke_user("nobody") == 0
        assert turn.revoke_user(USER) == 2
        assert turn.sessions() == []


async def test_revoke_kicks_a_relay_allocation(console_runtime: Runtime) -> None:
    rt = console_runtime
    async with (
        httpx.AsyncClient(base_url=base_url(rt), headers=admin_headers()) as http,
        RelayApi(base_url(rt), API_KEY) as api,
    ):
        allocation = await api.allocate(max_connections=2)
        host = await RelayConnection.open(allocation)
        try:
            await host.bind()
            listed = (await http.get("/console/api/admin/sessions")).json()["relay"]
            assert [s["id"] for s in listed] == [str(allocation.allocation_id)]
            assert "host" in listed[0]["detail"]
            answer = await http.post(
                "/console/api/admin/revoke",
                json={"kind": "relay", "id": str(allocation.allocation_id)},
            )
            assert answer.status_code == 200

            async def gone() -> bool:
                sessions = await http.get("/console/api/admin/sessions")
                return sessions.json()["relay"] == []

            await eventually(gone, "the kicked allocation left the list")
        finally:
            await host.close()


async def test_recent_errors_are_kept_for_the_admin(console_runtime: Runtime) -> None:
    import logging

    logging.getLogger("crossroads.test").error("boom %s", "x" * 2000)
    async with httpx.AsyncClient(base_url=base_url(console_runtime)) as http:
        status = (await http.get("/console/api/status")).json()
        assert status["errors"] >= 1
        errors = (
            await http.get("/console/api/admin/errors", headers=admin_headers())
        ).json()["errors"]
        record = errors[-1]
        assert record["level"] == "ERROR" and record["logger"] == "crossroads.test"
        assert record["message"].startswith("boom x") and len(record["message"]) <= 500


async def test_nat_matrix_is_shown_when_present(tmp_path: Path) -> None:
    state = tmp_path / "state"
    results = results_dir(state)
    results.mkdir(parents=True)
    (results / MATRIX_FILE).write_text(
        "# NAT matrix\n\n| method | full-cone | <script> |\n|---|---|---|\n"
        "| stun | yes | no |\n"
    )
    rt = await start(default_config(console_overrides(core__state_dir=str(state))))
    try:
        async with httpx.AsyncClient(base_url=base_url(rt)) as http:
            page = (await http.get("/")).text
        assert "Latest NAT-lab matrix" in page
        assert '<th scope="row">stun</th><td>yes</td>' in page
        assert "&lt;script&gt;" in page and "<script>" not in page
    finally:
        await rt.close()


# ------------------------------------------------------------------ turns:


def test_turns_urls_name_the_certificates_dns_name_never_an_ip() -> None:
    tls = TurnTls(5349, ("turn.example.test", "*.example.test"))
    urls, note = ice_urls("192.0.2.1", 3478, tls)
    assert note is None
    assert urls == [
        "stun:192.0.2.1:3478",
        "turn:192.0.2.1:3478?transport=udp",
        "turn:192.0.2.1:3478?transport=tcp",
        "turns:turn.example.test:5349?transport=tcp",
    ]
    # The name the client used, when the certificate covers it (or a wildcard).
    assert turns_name("relay.example.test", tls.dns_names) == "relay.example.test"
    assert turns_name("a.b.example.test", tls.dns_names) == "turn.example.test"
    assert turns_name("192.0.2.1", ("*.example.test",)) is None
    # IP names only: no turns: (Firefox refuses an IP literal), and a note.
    urls, note = ice_urls("192.0.2.1", 3478, TurnTls(5349, ()))
    assert not [url for url in urls if url.startswith("turns:")]
    assert note == NO_TURNS_NAME
    # No TLS served: the three plain URLs, nothing to say.
    assert ice_urls("::1", 3478, None) == (
        [
            "stun:[::1]:3478",
            "turn:[::1]:3478?transport=udp",
            "turn:[::1]:3478?transport=tcp",
        ],
        None,
    )


@pytest.mark.parametrize("name", ["turn.crossroads.test", "127.0.0.1"])
async def test_webrtc_snippet_lists_turns_with_the_certificates_dns_name(
    tmp_path: Path, name: str
) -> None:
    _, cert, key = write_certificates(tmp_path, name)
    rt = await start(
        default_config(
            console_overrides(
                core__only=["stun", "turn"],
                core__tls_cert=str(cert),
                core__tls_key=str(key),
            )
        )
    )
    try:
        stun = rt.services["stun"]
        assert isinstance(stun, StunService) and stun.tls_addresses
        tls_port = stun.tls_addresses[0][1]
        async with httpx.AsyncClient(base_url=base_url(rt)) as http:
            page = (await http.get("/")).text
            status = (await http.get("/console/api/status")).json()
        if name == "127.0.0.1":
            assert status["tls"] == {"port": tls_port, "dns_names": []}
            assert "&quot;turns:" not in page  # no turns: URL in the snippet
            assert html.escape(NO_TURNS_NAME) in page
        else:
            assert status["tls"] == {"port": tls_port, "dns_names": [name]}
            assert f"turns:{name}:{tls_port}?transport=tcp" in page
            assert NO_TURNS_NAME not in page
    finally:
        await rt.close()
