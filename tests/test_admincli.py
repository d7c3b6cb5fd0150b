"""The admin CLI against a real ``crossroads serve`` process: found through the
state directory, credentials that a TURN client and the relay API accept,
sessions and revoke, reload (SIGHUP) without dropping a live allocation, doctor."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner, Result

from crossroads.admincli import UDP_CHECKS, UDP_HINT
from crossroads.cli import main
from crossroads.client.relay import RelayApi
from crossroads.client.turn import TurnClient, TurnClientError
from crossroads.runtime import SERVER_FILE
from tests.conftest import free_port
from tests.test_firstrun import _all_ports_any
from tests.tls_support import write_certificates

pytestmark = pytest.mark.timeout(120)


class Server:
    def __init__(self, state_home: Path, *args: str) -> None:
        self.state_home = state_home
        self.state_dir = state_home / "crossroads"
        self.log = state_home / "serve.log"
        self.http_port = free_port()
        env = {
            **os.environ,
            **_all_ports_any(),
            "XDG_STATE_HOME": str(state_home),
            "CROSSROADS_HTTP_PORT": str(self.http_port),
        }
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "crossroads",
                    "serve",
                    "--host",
                    "127.0.0.1",
                    *args,
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 45
        while not (self.state_dir / SERVER_FILE).exists():
            assert self.process.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, "serve wrote no server.json"
            time.sleep(0.05)

    def output(self) -> str:
        return self.log.read_text()

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def cli_env(tmp_path: Path) -> dict[str, str]:
    # The CLI finds the server and its secrets through XDG_STATE_HOME only.
    return {
        "XDG_STATE_HOME": str(tmp_path),
        "CROSSROADS_STATE_DIR": "",
        "CROSSROADS_ADMIN_TOKEN": "",
        "CROSSROADS_TURN_SECRET": "",
        "CROSSROADS_API_KEYS": "",
    }


@pytest.fixture
def users_file(tmp_path: Path) -> Path:
    path = tmp_path / "turn-users"
    path.write_text("alice:first-password\ncarol:carols-password\n")
    return path


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    """A first run: no credential flag (development secret and API key)."""
    running = Server(tmp_path)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def users_server(tmp_path: Path, users_file: Path) -> Iterator[Server]:
    """TURN users from a file (what a reload re-reads)."""
    running = Server(tmp_path, "--turn-users-file", str(users_file))
    try:
        yield running
    finally:
        running.stop()


def cli(env: dict[str, str], *args: str) -> Result:
    result = CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)
    return result


def turn_port(env: dict[str, str]) -> int:
    status = json.loads(cli(env, "status", "--json").output)
    stun = next(s for s in status["services"] if s["name"] == "stun")
    return int(stun["listens"][0].split(":")[-1])


def test_status_and_sessions_find_the_server(
    server: Server, cli_env: dict[str, str]
) -> None:
    result = cli(cli_env, "status")
    assert result.exit_code == 0, result.output
    assert "turn allocations" in result.output.lower()
    assert f"udp 127.0.0.1:{turn_port(cli_env)}" in result.output
    sessions = cli(cli_env, "sessions", "turn")
    assert sessions.exit_code == 0 and sessions.output.strip() == "turn: 0"
    unknown = cli(cli_env, "sessions", "gopher")
    assert unknown.exit_code != 0 and "kinds:" in unknown.output
    wrong = cli(cli_env, "sessions", "--admin-token", "wrong")
    assert wrong.exit_code != 0 and "refused the admin token" in wrong.output


def test_turn_credentials_list_turns_with_the_certificates_dns_name(
    tmp_path: Path, cli_env: dict[str, str]
) -> None:
    """With a certificate, ``turns:`` (TURN over TLS) is listed
    with the certificate's DNS name (Firefox refuses ``turns:`` with an IP)."""
    _, cert, key = write_certificates(tmp_path, "turn.crossroads.test")
    running = Server(tmp_path, "--tls-cert", str(cert), "--tls-key", str(key))
    try:
        result = cli(cli_env, "credentials", "turn", "dave")
        assert result.exit_code == 0, result.output
        urls = json.loads(result.stdout)["iceServers"][0]["urls"]
        status = json.loads(cli(cli_env, "status", "--json").stdout)
        tls_port = status["tls"]["port"]
        assert urls[-1] == f"turns:turn.crossroads.test:{tls_port}?transport=tcp"
        assert urls[0] == f"stun:127.0.0.1:{turn_port(cli_env)}"
        assert result.stderr == ""
    finally:
        running.stop()


def test_turn_credentials_without_a_dns_name_say_why_no_turns(
    tmp_path: Path, cli_env: dict[str, str]
) -> None:
    _, cert, key = write_certificates(tmp_path, "127.0.0.1")
    running = Server(tmp_path, "--tls-cert", str(cert), "--tls-key", str(key))
    try:
        result = cli(cli_env, "credentials", "turn", "dave")
        assert result.exit_code == 0, result.output
        urls = json.loads(result.stdout)["iceServers"][0]["urls"]
        assert not [url for url in urls if url.startswith("turns:")]
        assert "Firefox refuses turns: with an IP address" in result.stderr
    finally:
        running.stop()


def test_turn_credentials_sessions_and_revoke(
    server: Server, cli_env: dict[str, str]
) -> None:
    # No --turn-secret was given: the first run's development secret signs.
    result = cli(cli_env, "credentials", "turn", "carol", "--ttl", "600")
    assert result.exit_code == 0, result.output
    ice = json.loads(result.output)["iceServers"][0]
    port = turn_port(cli_env)
    assert ice["urls"][0] == f"stun:127.0.0.1:{port}"
    assert ice["username"].endswith(":carol")
    assert 0 < int(ice["username"].split(":")[0]) - time.time() <= 600

    async def allocate_then_revoke() -> None:
        async with await TurnClient.connect(
            ("127.0.0.1", port), ice["username"], ice["credential"]
        ) as client:
            await client.allocate()
            listed = await asyncio.to_thread(cli, cli_env, "sessions", "turn")
            assert "turn: 1" in listed.output and "user " in listed.output
            session_id = listed.output.splitlines()[1].split()[0]
            revoked = await asyncio.to_thread(
                cli, cli_env, "revoke", "turn", session_id
            )
            assert revoked.exit_code == 0, revoked.output
            with pytest.raises(TurnClientError) as excinfo:
                await client.refresh()
            assert excinfo.value.code == 437

    asyncio.run(allocate_then_revoke())


def test_api_key_works_with_the_relay_api(
    server: Server, cli_env: dict[str, str]
) -> None:
    key = cli(cli_env, "credentials", "api-key").output.strip()
    assert key and key in server.output()

    async def allocate() -> None:
        async with RelayApi(f"http://127.0.0.1:{server.http_port}", key) as api:
            allocation = await api.allocate(max_connections=2)
            assert allocation.allocation_id

    asyncio.run(allocate())


def test_reload_applies_new_users_and_keeps_live_allocations(
    users_server: Server, cli_env: dict[str, str], users_file: Path
) -> None:
    server = users_server
    port = turn_port(cli_env)

    async def scenario() -> None:
        async with await TurnClient.connect(
            ("127.0.0.1", port), "alice", "first-password"
        ) as alice:
            await alice.allocate()
            # carol leaves, bob arrives; alice is unchanged.
            users_file.write_text("alice:first-password\nbob:bobs-password\n")
            result = await asyncio.to_thread(cli, cli_env, "reload")
            assert result.exit_code == 0, result.output
            deadline = time.monotonic() + 20
            while "reload done" not in server.output():
                assert time.monotonic() < deadline, server.output()[-2000:]
                await asyncio.sleep(0.05)
            assert "reloaded turn: 2 users" in server.output()
            # The live allocation was not dropped: it refreshes as before.
            assert await alice.refresh() > 0
            async with await TurnClient.connect(
                ("127.0.0.1", port), "bob", "bobs-password"
            ) as bob:
                await bob.allocate()
            async with await TurnClient.connect(
                ("127.0.0.1", port), "carol", "carols-password"
            ) as stale:
                with pytest.raises(TurnClientError) as excinfo:
                    await stale.allocate()
                assert excinfo.value.code == 401

    asyncio.run(scenario())
    assert server.process.poll() is None


def test_reload_with_a_broken_users_file_keeps_the_old_users(
    users_server: Server, cli_env: dict[str, str], users_file: Path
) -> None:
    server = users_server
    users_file.write_text("not a user line\n")
    assert cli(cli_env, "reload").exit_code == 0
    deadline = time.monotonic() + 20
    while "reload refused" not in server.output():
        assert time.monotonic() < deadline, server.output()[-2000:]
        time.sleep(0.05)
    assert server.process.poll() is None

    async def alice_still_works() -> None:
        async with await TurnClient.connect(
            ("127.0.0.1", turn_port(cli_env)), "alice", "first-password"
        ) as alice:
            await alice.allocate()

    asyncio.run(alice_still_works())


def test_doctor(server: Server, cli_env: dict[str, str]) -> None:
    result = cli(cli_env, "doctor")
    assert result.exit_code == 0, result.output
    assert "[ok] STUN udp" in result.output and "[ok] STUN tcp" in result.output
    assert "no NAT between" in result.output
    assert "[ok] clock" in result.output
    assert "openttd tcp" in result.output and "[FAIL]" not in result.output
    # Every UDP service answered its own protocol's probe.
    assert "ADDRESS_CHECK seen as 127.0.0.1:" in result.output  # natneg1
    assert "Unity Relay answers a PING (ERROR 4)" in result.output
    assert "[ok] p2p signalling /p2p/v1/ws: welcome" in result.output
    for index in (1, 2, 3):
        assert f"(rendezvous {index}): seen as 127.0.0.1:" in result.output
    assert "(RakNet): unconnected ping answered (GUID" in result.output
    assert "(RakNet port-stride): NAT_PING answered (source port" in result.output
    # The resource budget in force, table by table, with the HTTP listener's.
    assert "resource budget:" in result.output
    assert re.search(r"^http +tcp \d+ http", result.output, re.MULTILINE)
    dead = cli(cli_env, "doctor", "--url", f"http://127.0.0.1:{free_port()}")
    assert dead.exit_code == 1 and "[FAIL] HTTP" in dead.output


@pytest.mark.parametrize("service", ["relay", "natneg", "raknet"])
def test_doctor_fails_a_udp_service_where_nothing_listens(service: str) -> None:
    """The probes are connected UDP sockets: the ICMP port unreachable of a
    port nobody listens on fails the check at once, with the firewall hint."""
    port = free_port(socket.SOCK_DGRAM)
    role = {"relay": "", "natneg": "natneg1", "raknet": "RakNet"}[service]
    lines = asyncio.run(
        UDP_CHECKS[service]("127.0.0.1", "http://127.0.0.1:1", [(port, role)])
    )
    assert len(lines) == 1
    ok, text = lines[0]
    assert not ok and f"127.0.0.1:{port}" in text
    assert "port unreachable" in text and UDP_HINT in text


def test_doctor_fails_p2p_without_signalling() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    lines = asyncio.run(UDP_CHECKS["p2p"]("127.0.0.1", url, []))
    assert len(lines) == 1 and not lines[0][0]
    assert "p2p signalling /p2p/v1/ws" in lines[0][1] and "Upgrade" in lines[0][1]


def test_without_a_running_server_the_cli_says_how_to_point_it(
    cli_env: dict[str, str],
) -> None:
    result = cli(cli_env, "status")
    assert result.exit_code != 0
    assert "give --url or --http-port" in result.output


def test_reload_rotates_relay_api_keys_from_the_config_file(
    tmp_path: Path, cli_env: dict[str, str]
) -> None:
    config = tmp_path / "crossroads.toml"
    config.write_text('[relay]\napi_keys = ["old-key"]\n')
    server = Server(tmp_path, "--config", str(config))
    base = f"http://127.0.0.1:{server.http_port}"

    async def allocate(key: str) -> int:
        async with httpx.AsyncClient(base_url=base) as http:
            answer = await http.post(
                "/v1/allocate",
                json={"maxConnections": 1},
                headers={"Authorization": f"Bearer {key}"},
            )
            return answer.status_code

    try:
        assert asyncio.run(allocate("old-key")) == 201
        config.write_text('[relay]\napi_keys = ["new-key"]\n')
        assert cli(cli_env, "reload").exit_code == 0
        deadline = time.monotonic() + 20
        while "relay: 1 API key(s)" not in server.output():
            assert time.monotonic() < deadline, server.output()[-2000:]
            time.sleep(0.05)
        assert asyncio.run(allocate("new-key")) == 201
        assert asyncio.run(allocate("old-key")) == 401
    finally:
        server.stop()


def test_server_file_belongs_to_the_last_server_started(tmp_path: Path) -> None:
    first = Server(tmp_path)
    server_file = first.state_dir / SERVER_FILE
    (first.state_dir / SERVER_FILE).unlink()  # wait for the second's own file
    second = Server(tmp_path)
    try:
        assert json.loads(server_file.read_text())["pid"] == second.process.pid
        first.stop()
        # The first one leaves the second's file alone ...
        assert json.loads(server_file.read_text())["pid"] == second.process.pid
    finally:
        first.stop()
        second.stop()
    # ... and the second removes its own.
    assert not server_file.exists()


def test_budget_lists_every_table_and_the_listeners_that_feed_it(
    server: Server, cli_env: dict[str, str]
) -> None:
    raw = cli(cli_env, "budget", "--json")
    assert raw.exit_code == 0, raw.output
    snapshot = json.loads(raw.output)
    tables = {t["table"]: t for t in snapshot["tables"]}
    http = tables["http"]
    # Derived, not configured: the share of the TCP pool, and a source at most
    # an eighth of it.
    assert 1 <= http["max"] <= snapshot["connection_pool"]
    assert http["max_per_source"] <= max(1, http["max"] // 8)
    ports = {(e["transport"], e["port"]) for e in snapshot["listeners"]}
    assert ("tcp", server.http_port) in ports
    text = cli(cli_env, "budget", "--markdown")
    assert text.exit_code == 0, text.output
    assert "| table | listeners | pool |" in text.output
    assert f"tcp {server.http_port} http" in text.output
