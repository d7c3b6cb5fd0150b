"""First run: development credentials when none are given, refused on a public
address; the printed commands work as printed (coturn's uclient, the Unity
relay flow with the printed API key)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import stat
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from crossroads.client.relay import RelayApi, RelayConnection
from crossroads.config import default_config
from crossroads.errors import ConfigError
from crossroads.firstrun import prepare
from crossroads.services import load_service_modules
from crossroads.services.relay import Config as RelayConfig
from crossroads.services.turn import Config as TurnConfig
from crossroads.state import CREDENTIALS_FILE, default_state_dir
from tests.conftest import free_port
from tests.interop.test_turn import assert_no_loss, tool
from tests.test_runtime import _all_ports_any as all_ports_any

pytestmark = pytest.mark.timeout(90)

load_service_modules()  # the turn and relay sections exist in default_config()


def test_default_state_dir_follows_xdg() -> None:
    assert default_state_dir({"XDG_STATE_HOME": "/srv/state"}) == Path(
        "/srv/state/crossroads"
    )
    # A relative XDG_STATE_HOME is invalid (XDG Base Directory spec): ignored.
    assert default_state_dir({"XDG_STATE_HOME": "rel", "HOME": "/home/u"}) == Path(
        "/home/u/.local/state/crossroads"
    )


def test_missing_credentials_are_created_once_and_kept(tmp_path: Path) -> None:
    config = default_config({"core.state_dir": str(tmp_path / "state")})
    first = prepare(config)
    assert first.created and first.dev_turn and first.dev_relay
    turn = first.config.section("turn", TurnConfig)
    relay = first.config.section("relay", RelayConfig)
    assert turn.secret == (first.credentials.turn_secret,)
    assert turn.same_host_loopback_peers and not turn.allow_loopback_peers
    assert relay.api_keys == (first.credentials.relay_api_key,)
    assert relay.allow_private_peers
    path = tmp_path / "state" / CREDENTIALS_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    again = prepare(config)
    assert not again.created and again.credentials == first.credentials
    secrets = {
        first.credentials.turn_secret,
        first.credentials.relay_api_key,
        first.credentials.admin_token,
    }
    assert len(secrets) == 3 and all(len(s) >= 43 for s in secrets)


def test_explicit_credentials_are_never_replaced(tmp_path: Path) -> None:
    config = default_config(
        {
            "core.state_dir": str(tmp_path),
            "turn.user": ["alice:pw"],
            "relay.api_keys": ["real-key"],
        }
    )
    result = prepare(config)
    assert not result.development
    # No loopback relaxation either; only the admin token comes from the state.
    assert result.config.sections == config.sections
    assert result.config.core.admin_token == result.credentials.admin_token


def test_public_address_refuses_development_credentials(tmp_path: Path) -> None:
    # 192.88.99.1 is globally reachable (RFC 7526 keeps 192.88.99.0/24
    # allocated); the check runs before anything binds, nothing is sent.
    config = default_config(
        {"core.state_dir": str(tmp_path), "core.public_host": "192.88.99.1"}
    )
    with pytest.raises(ConfigError) as excinfo:
        prepare(config)
    message = str(excinfo.value)
    assert "--public-host 192.88.99.1" in message
    assert "--turn-secret" in message and "--api-key" in message
    assert not (tmp_path / CREDENTIALS_FILE).exists()
    # One of the two given: the message names only the other.
    with pytest.raises(ConfigError, match="--api-key") as excinfo:
        prepare(
            default_config(
                {
                    "core.state_dir": str(tmp_path),
                    "core.public_host": "192.88.99.1",
                    "turn.secret": ["s"],
                }
            )
        )
    assert "--turn-secret" not in str(excinfo.value)
    # Documentation ranges (the NAT lab's "internet") are not global.
    lab = default_config(
        {"core.state_dir": str(tmp_path), "core.public_host": "203.0.113.1"}
    )
    assert prepare(lab).development


def test_damaged_state_file_is_not_replaced(tmp_path: Path) -> None:
    (tmp_path / CREDENTIALS_FILE).write_text("{not json")
    with pytest.raises(ConfigError, match="damaged"):
        prepare(default_config({"core.state_dir": str(tmp_path)}))
    assert (tmp_path / CREDENTIALS_FILE).read_text() == "{not json"


def test_cli_refuses_public_host_without_credentials(tmp_path: Path) -> None:
    import subprocess

    result = subprocess.run(
        [sys.executable, "-m", "crossroads", "serve", "--public-host", "192.88.99.1"],
        env={**os.environ, "XDG_STATE_HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert "--turn-secret" in result.stderr and "--api-key" in result.stderr


# ------------------------------------------------------- the printed commands

BANNER_END = "=" * 72


@asynccontextmanager
async def serve_fresh(state_home: Path) -> AsyncIterator[list[str]]:
    """``crossroads serve`` with no credential flag, every port OS-chosen, a
    fresh XDG_STATE_HOME; yields the development banner it printed."""
    env = {**os.environ, **_all_ports_any(), "XDG_STATE_HOME": str(state_home)}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "crossroads", "serve", "--host", "127.0.0.1",
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    assert process.stdout is not None
    try:
        lines: list[str] = []
        async with asyncio.timeout(45):
            while lines.count(BANNER_END) < 2:
                line = (await process.stdout.readline()).decode()
                assert line, "serve exited:\n" + "".join(lines)
                lines.append(line.rstrip("\n"))
        start = lines.index(BANNER_END)
        yield lines[start:]
    finally:
        process.terminate()
        try:
            async with asyncio.timeout(15):
                await process.wait()
        except TimeoutError:
            process.kill()
            await process.wait()


def _all_ports_any() -> dict[str, str]:
    """Every port OS-chosen (services through their variables, HTTP free now)."""
    return {**all_ports_any(), "CROSSROADS_HTTP_PORT": str(free_port())}


def printed(banner: list[str], program: str) -> list[str]:
    for line in banner:
        if line.strip().startswith(program + " "):
            return shlex.split(line)
    raise AssertionError(f"no {program} command in:\n" + "\n".join(banner))


async def test_printed_commands_work_from_a_fresh_state_dir(tmp_path: Path) -> None:
    async with serve_fresh(tmp_path) as banner:
        text = "\n".join(banner)
        assert "development credentials (created in" in text
        assert "WARNING: development mode" in text
        uclient = printed(banner, "turnutils_uclient")
        process = await asyncio.create_subprocess_exec(
            tool(uclient[0]),
            *uclient[1:],
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        output, _ = await asyncio.wait_for(process.communicate(), 60)
        assert_no_loss(output.decode(errors="replace"))

        curl = printed(banner, "curl")
        authorization = curl[curl.index("-H") + 1]
        key = re.fullmatch(r"Authorization: Bearer (\S+)", authorization)
        assert key is not None
        base_url = curl[-1].removesuffix("/v1/allocate")
        await unity_relay_flow(base_url, key.group(1))
        first_secret = uclient[uclient.index("-W") + 1]

    # A restart keeps the same credentials: the printed commands stay valid.
    async with serve_fresh(tmp_path) as banner:
        assert "development credentials (kept in" in "\n".join(banner)
        uclient = printed(banner, "turnutils_uclient")
        assert uclient[uclient.index("-W") + 1] == first_secret


async def unity_relay_flow(base_url: str, api_key: str) -> None:
    """Allocate, join code, join, BIND, CONNECT and data both ways."""
    async with RelayApi(base_url, api_key) as api:
        allocation = await api.allocate(max_connections=2)
        code = await api.join_code(allocation.allocation_id)
        host = await RelayConnection.open(allocation)
        try:
            await host.bind()
            player = await RelayConnection.open(await api.join(code))
            try:
                await player.bind()
                assert await player.connect() == allocation.allocation_id_bytes
                player.send(host.allocation_id, b"hello host")
                assert await host.recv(timeout=5) == (
                    player.allocation_id,
                    b"hello host",
                )
                host.send(player.allocation_id, b"hello player")
                assert await player.recv(timeout=5) == (
                    host.allocation_id,
                    b"hello player",
                )
            finally:
                await player.close()
        finally:
            await host.close()


def test_two_first_runs_at_once_agree_on_one_file(tmp_path: Path) -> None:
    """Another process creates credentials.json while this one is generating
    its own (simulated through the injected randomness): this one adopts the
    file that won instead of replacing it."""
    from crossroads.state import load_or_create_credentials

    other = {
        "turn_secret": "other-turn",
        "relay_api_key": "other-key",
        "admin_token": "other-admin",
    }

    def racing_random(size: int) -> bytes:
        path = tmp_path / CREDENTIALS_FILE
        if not path.exists():
            tmp_path.mkdir(exist_ok=True)
            path.write_text(json.dumps(other))
        return b"\x01" * size

    credentials, created = load_or_create_credentials(tmp_path, random=racing_random)
    assert not created
    assert credentials.turn_secret == "other-turn"
    assert json.loads((tmp_path / CREDENTIALS_FILE).read_text()) == other
    assert sorted(p.name for p in tmp_path.iterdir()) == [CREDENTIALS_FILE]


def test_state_directory_is_only_needed_for_what_is_missing(tmp_path: Path) -> None:
    explicit = {
        "turn.user": ["alice:pw"],
        "relay.api_keys": ["real-key"],
        "core.admin_token": "admin",
    }
    state = tmp_path / "state"
    result = prepare(default_config({**explicit, "core.state_dir": str(state)}))
    assert result.credentials is None and result.config.core.admin_token == "admin"
    assert not state.exists()
    # An unusable state directory (a file stands where it should be): with every
    # credential given the server still runs, only without admin pages ...
    blocked = tmp_path / "blocked"
    blocked.write_text("not a directory")
    without_admin = {k: v for k, v in explicit.items() if k != "core.admin_token"}
    result = prepare(
        default_config({**without_admin, "core.state_dir": str(blocked / "x")})
    )
    assert result.credentials is None and result.config.core.admin_token == ""
    # ... while development mode, which needs it, says so.
    with pytest.raises(ConfigError, match="state_dir: cannot"):
        prepare(default_config({"core.state_dir": str(blocked / "x")}))
