"""``crossroads stun binding|nat`` against a real `crossroads serve`."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Callable

import pytest

from crossroads.cli.stun import parse_server
from tests.interop.stun_support import (  # noqa: F401 (fixture)
    CrossroadsProcess,
    crossroads_serve_fixture,
)

pytestmark = pytest.mark.timeout(60)


def test_parse_server() -> None:
    assert parse_server("stun.example.net") == ("stun.example.net", 3478)
    assert parse_server("192.0.2.1:3479") == ("192.0.2.1", 3479)
    assert parse_server("[2001:db8::1]:5000") == ("2001:db8::1", 5000)
    assert parse_server("[2001:db8::1]") == ("2001:db8::1", 3478)
    assert parse_server("2001:db8::1") == ("2001:db8::1", 3478)


def _cli(*args: str) -> tuple[int, dict[str, object]]:
    done = subprocess.run(
        [sys.executable, "-m", "crossroads", "stun", *args],
        capture_output=True,
        text=True,
        timeout=45,
    )
    return done.returncode, json.loads(done.stdout)


def test_binding_and_nat_commands(
    crossroads_serve: Callable[..., CrossroadsProcess],
) -> None:
    server = crossroads_serve("--stun-alt-host", "127.0.0.2")
    target = f"127.0.0.1:{server.stun_port}"
    code, out = _cli("binding", target)
    assert code == 0 and out["mapped"] == out["local"], out
    assert out["other_address"] == "127.0.0.2:{}".format(
        server.endpoint("udp", "alt host, alt port")[1]
    )
    code, out = _cli("binding", target, "--tcp")
    assert code == 0 and str(out["mapped"]).startswith("127.0.0.1:"), out
    code, out = _cli("nat", target)
    assert code == 0, out
    assert out["mapping"] == out["filtering"] == "endpoint-independent", out
    assert out["behind_nat"] is False and out["hairpinning"] is True, out


def test_unreachable_server_prints_the_error_and_exits_1() -> None:
    # A port bound but not listening: the TCP connect is refused at once.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        code, out = _cli("binding", f"127.0.0.1:{port}", "--tcp")
    assert code == 1
    assert list(out) == ["server", "error"], out
    assert out["server"] == f"127.0.0.1:{port}"
    assert "refused" in str(out["error"]).lower() or "111" in str(out["error"]), out


@pytest.mark.parametrize("bad", ["192.0.2.1:abc", ":3478", "192.0.2.1:70000"])
def test_a_bad_server_argument_is_a_usage_error(bad: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "crossroads", "stun", "binding", bad],
        capture_output=True,
        text=True,
        timeout=45,
    )
    assert done.returncode == 2, done.stderr
    assert "Invalid value for 'SERVER'" in done.stderr
    assert "Traceback" not in done.stderr
