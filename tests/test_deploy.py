"""deploy/: the Grafana dashboard and the Prometheus alert rules name only
metrics crossroads exports (and promtool accepts the rules); the systemd unit
passes ``systemd-analyze verify`` and keeps its exposure level low."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from crossroads.config import default_config
from crossroads.runtime import Runtime, start
from tests.conftest import loopback_config

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "crossroads-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "crossroads-alerts.yml"
UNIT = DEPLOY / "systemd" / "crossroads.service"
METRIC = re.compile(r"\bcrossroads_[a-z0-9_]+")
#: Suffixes Prometheus adds to a family's samples.
SUFFIXES = ("_total", "_created", "_bucket", "_sum", "_count")


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} missing: make install")
    return path


@pytest.fixture
async def every_service() -> AsyncIterator[Runtime]:
    rt = await start(default_config(loopback_config()))
    try:
        yield rt
    finally:
        await rt.close()


async def exported_names(rt: Runtime) -> set[str]:
    host, port = rt.http_address
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"http://{host}:{port}/metrics")).text
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            names.add(line.split()[2])
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def referenced(text: str) -> set[str]:
    return set(METRIC.findall(text))


async def test_dashboard_and_alerts_name_only_exported_metrics(
    every_service: Runtime,
) -> None:
    exported = await exported_names(every_service)
    dashboard = json.loads(DASHBOARD.read_text())
    expressions = [
        target["expr"] for panel in dashboard["panels"] for target in panel["targets"]
    ]
    alerts_text = ALERTS.read_text()
    wanted = referenced("\n".join(expressions)) | referenced(alerts_text)
    assert len(wanted) >= 20
    missing = {
        name
        for name in wanted
        if name not in exported
        and not any(name + suffix in exported for suffix in SUFFIXES)
    }
    assert missing == set(), f"not exported by crossroads: {sorted(missing)}"
    # And the negative control: a made-up name is caught.
    assert "crossroads_made_up_total" not in exported


def test_alert_rules_pass_promtool() -> None:
    result = subprocess.run(
        [tool("promtool"), "check", "rules", str(ALERTS)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 8 rules found" in result.stdout


def unit_copy(tmp_path: Path) -> Path:
    """The shipped unit, with ExecStart pointing at this checkout's crossroads
    (verify insists that the executable exists); nothing else changes."""
    venv_binary = Path(__file__).resolve().parents[1] / ".venv" / "bin" / "crossroads"
    binary = str(venv_binary) if venv_binary.exists() else tool("crossroads")
    text = UNIT.read_text()
    assert "ExecStart=/opt/crossroads/bin/crossroads serve" in text
    copy = tmp_path / UNIT.name
    copy.write_text(text.replace("/opt/crossroads/bin/crossroads", binary))
    return copy


def test_systemd_unit_verifies(tmp_path: Path) -> None:
    result = subprocess.run(
        [tool("systemd-analyze"), "verify", str(unit_copy(tmp_path))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    # verify exits 0 on unknown keys too; it only warns on stderr.
    assert result.returncode == 0 and result.stderr == "", result.stderr


def test_systemd_unit_exposure_is_low(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            tool("systemd-analyze"),
            "security",
            "--offline=true",
            str(unit_copy(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    match = re.search(r"Overall exposure level for \S+: ([\d.]+) (\w+)", result.stdout)
    assert match is not None, result.stdout[-2000:] + result.stderr
    # systemd rates 0-10, 10 the most exposed; "OK" is its best band.
    assert float(match.group(1)) <= 2.0 and match.group(2) == "OK", match.group(0)
