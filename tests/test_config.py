from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass, fields, make_dataclass
from pathlib import Path

import pytest

from crossroads.config import (
    CoreConfig,
    Kind,
    build_config,
    register_section,
    setting,
    setting_info,
)
from crossroads.errors import ConfigError


@dataclass(frozen=True, slots=True)
class DemoConfig:
    port: int = setting(3478, kind="port", help="demo port")
    ports: tuple[int, int] = setting(
        (49152, 65535), kind="port_range", flag="--relay-ports", help="range"
    )
    users: tuple[str, ...] = setting((), help="users")
    enabled: bool = setting(True, help="on/off")
    ratio: float = setting(0.5, help="ratio")


SECTIONS = {"core": CoreConfig, "demo": DemoConfig}


def build(**kwargs: object) -> object:
    return build_config(sections=SECTIONS, **kwargs)  # type: ignore[arg-type]


def test_defaults() -> None:
    config = build_config(sections=SECTIONS, env={})
    assert config.core.host == "0.0.0.0"
    assert config.core.http_port == 8080
    assert config.section("demo", DemoConfig).port == 3478


def test_precedence_flag_over_env_over_file() -> None:
    file_data = {"http_port": 1000, "demo": {"port": 1001}}
    env = {"CROSSROADS_HTTP_PORT": "2000", "CROSSROADS_DEMO_PORT": "2001"}
    config = build_config(
        sections=SECTIONS,
        env=env,
        file_data=file_data,
        flags={"core.http_port": "3000"},
    )
    assert config.core.http_port == 3000  # flag
    assert config.section("demo", DemoConfig).port == 2001  # env beats file
    config = build_config(sections=SECTIONS, env={}, file_data=file_data)
    assert config.section("demo", DemoConfig).port == 1001  # file beats default


def test_custom_flag_names_drive_env_names() -> None:
    config = build_config(
        sections=SECTIONS, env={"CROSSROADS_RELAY_PORTS": "5000-6000"}
    )
    assert config.section("demo", DemoConfig).ports == (5000, 6000)


def test_lists_and_bools_from_env() -> None:
    config = build_config(
        sections=SECTIONS,
        env={"CROSSROADS_DEMO_USERS": "a:1, b:2", "CROSSROADS_DEMO_ENABLED": "no"},
    )
    demo = config.section("demo", DemoConfig)
    assert demo.users == ("a:1", "b:2")
    assert demo.enabled is False


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"flags": {"core.http_port": "70000"}},
            "http_port (--http-port): 70000 is not a port",
        ),
        (
            {"env": {"CROSSROADS_HOST": "nope"}},
            "host (CROSSROADS_HOST): 'nope' is not an IP",
        ),
        ({"file_data": {"colour": 1}}, "unknown key colour"),
        ({"file_data": {"demo": {"prot": 1}}}, "unknown key demo.prot"),
        (
            {"file_data": {"demo": {"port": "x"}}},
            "demo.port (config file): 'x' is not a port",
        ),
        (
            {"flags": {"demo.ports": "9-3"}},
            "demo.ports (--relay-ports): 9-3 is not a port range",
        ),
        ({"flags": {"core.only": ["demo", "nope"]}}, "only: unknown service 'nope'"),
        ({"flags": {"core.store": "mysql://x"}}, "store (--store)"),
        (
            {"flags": {"core.tls_cert": "cert.pem"}},
            "tls_cert: --tls-cert and --tls-key go together",
        ),
        # The shared checks (config.check_*), which the services use too.
        (
            {"flags": {"core.http_max_connections": "0"}},
            "http_max_connections (--http-max-connections): must be > 0",
        ),
        (
            {"flags": {"core.http_request_timeout": "-1.5"}},
            "http_request_timeout (--http-request-timeout): must be > 0",
        ),
        (
            {"flags": {"core.reflection_allowance": "-1"}},
            "reflection_allowance (--reflection-allowance): must be >= 0",
        ),
        (
            {"flags": {"core.trusted_proxies": ["10.0.0.0/8", "proxy"]}},
            "'proxy' is not an address or CIDR range",
        ),
    ],
)
def test_errors_name_the_key(kwargs: dict[str, object], message: str) -> None:
    kwargs.setdefault("env", {})
    with pytest.raises(ConfigError) as info:
        build_config(sections=SECTIONS, **kwargs)  # type: ignore[arg-type]
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def run_cli(
    *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "crossroads", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_cli_bad_port_exits_2_with_one_line() -> None:
    result = run_cli("serve", "--http-port", "99999")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "crossroads: config error: http_port (--http-port): 99999 is not a port number (0-65535)"
    ]


def test_cli_unknown_file_key_exits_2(tmp_path: Path) -> None:
    config_file = tmp_path / "crossroads.toml"
    config_file.write_text('host = "127.0.0.1"\nbogus = 1\n')
    result = run_cli("serve", "--config", str(config_file))
    assert result.returncode == 2
    assert f"unknown key bogus in {config_file}" in result.stderr


def test_kind_follows_from_the_annotation() -> None:
    kinds = {f.name: setting_info(f).kind for f in fields(DemoConfig)}
    assert kinds == {
        "port": "port",
        "ports": "port_range",
        "users": "list",
        "enabled": "bool",
        "ratio": "float",
    }
    config = build_config(
        sections=SECTIONS,
        env={"CROSSROADS_DEMO_RATIO": "0.25", "CROSSROADS_DEMO_ENABLED": "no"},
    )
    demo = config.section("demo", DemoConfig)
    assert (demo.ratio, demo.enabled) == (0.25, False)


@pytest.mark.parametrize(
    ("annotation", "kind", "reason"),
    [
        ("int", "float", "kind float does not fit type int"),
        ("str", "port", "kind port does not fit type str"),
        ("tuple[int, int]", None, "no kind for type tuple[int, int]"),
    ],
)
def test_a_kind_that_contradicts_the_annotation_is_refused(
    annotation: str, kind: Kind | None, reason: str
) -> None:
    broken = make_dataclass(
        "Broken", [("value", annotation, setting(1, kind=kind, help="x"))]
    )
    with pytest.raises(TypeError, match=re.escape(reason)):
        register_section("broken", broken)
