"""compose.yaml and deploy/kubernetes/, validated offline.

Compose: the file against the Compose specification's JSON schema (the copy
check-jsonschema vendors), then what a schema cannot see: every service,
volume and file it names exists, no two services publish one host port, every
``CROSSROADS_*`` variable is one crossroads reads and each node's settings
build a valid configuration whose ports are the ones published and scraped;
Prometheus' configuration passes ``promtool check config``.

Kubernetes: every manifest against the Kubernetes API schemas that
kubernetes-validate bundles (strict: unknown fields fail), then the drain and
probe wiring (preStop ``crossroads drain``, terminationGracePeriodSeconds =
drain timeout + 30 s, /readyz and /healthz), selectors that select, and the
autoscaling metric, which crossroads must export.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from crossroads.cli import config_from_cli, serve
from crossroads.config import Config, env_name, iter_settings
from crossroads.runtime import Runtime
from crossroads.services import load_service_modules
from tests.test_deploy import every_service, exported_names  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose.yaml"
KUBERNETES = ROOT / "deploy" / "kubernetes"
PROMETHEUS = ROOT / "deploy" / "compose" / "prometheus.yml"
#: Read by crossroads outside the settings table (click, the image).
OTHER_VARIABLES = {"CROSSROADS_CONFIG", "CROSSROADS_STATE_DIR"}
#: Sample values for what an operator sets (.env, the Secret, the downward API).
SAMPLE_SECRET = "s" * 43
SAMPLE_ADDRESS = "203.0.113.10"
NODES = ("crossroads-1", "crossroads-2")


def known_variables() -> set[str]:
    load_service_modules()
    names = {env_name(section, f) for section, f, _ in iter_settings()}
    return names | OTHER_VARIABLES


def interpolate(value: str) -> str:
    """Compose's ``${NAME:?message}`` / ``${NAME}`` with sample values."""

    def sample(match: re.Match[str]) -> str:
        name = match.group(1)
        return SAMPLE_ADDRESS if name.endswith("PUBLIC_HOST") else SAMPLE_SECRET

    return re.sub(r"\$\{([A-Z0-9_]+)(?::?[?-][^}]*)?\}", sample, value)


def parse_config(args: list[str], env: dict[str, str], monkeypatch: Any) -> Config:
    """What ``crossroads serve ARGS`` builds with this environment (and no
    other CROSSROADS_* variable)."""
    import os

    for name in list(os.environ):
        if name.startswith("CROSSROADS_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert args[0] == "serve"
    context = serve.make_context("serve", args[1:])
    return config_from_cli(None, context.params)


# ------------------------------------------------------------------ Compose


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return data


def compose_schema() -> dict[str, Any]:
    text = (
        resources.files("check_jsonschema")
        / "builtin_schemas"
        / "vendor"
        / "compose-spec.json"
    ).read_text()
    schema: dict[str, Any] = json.loads(text)
    return schema


def schema_errors(document: dict[str, Any]) -> list[str]:
    schema = compose_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validator.iter_errors(document)
    ]


def test_compose_matches_the_compose_schema(compose: dict[str, Any]) -> None:
    assert schema_errors(compose) == []
    # The negative control: a misspelt key is caught.
    broken = copy.deepcopy(compose)
    broken["services"]["redis"]["volume"] = broken["services"]["redis"].pop("volumes")
    assert schema_errors(broken) != []


def test_compose_references_exist(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(NODES) | {"redis", "redis-replica", "prometheus", "grafana"} <= set(
        services
    )
    assert sum(name.startswith("sentinel-") for name in services) == 3
    declared = set(compose["volumes"])
    used = set()
    for name, service in services.items():
        for dependency in service.get("depends_on", []):
            assert dependency in services, (name, dependency)
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (ROOT / source).exists(), (name, source)
            else:
                assert source in declared, (name, source)
                used.add(source)
    assert used == declared
    published: dict[tuple[int, str], str] = {}
    for name, service in services.items():
        for port in service.get("ports", []):
            spec, _, protocol = str(port).partition("/")
            host = spec.split(":")[-2]
            first, _, last = host.partition("-")
            for number in range(int(first), int(last or first) + 1):
                key = (number, protocol or "tcp")
                assert key not in published, (name, published.get(key), key)
                published[key] = name


def node_ports(service: dict[str, Any]) -> set[tuple[int, str]]:
    """(container port, protocol) of every mapping a service publishes."""
    found = set()
    for port in service["ports"]:
        spec, _, protocol = str(port).partition("/")
        first, _, last = spec.split(":")[-1].partition("-")
        found |= {(n, protocol) for n in range(int(first), int(last or first) + 1)}
    return found


def test_compose_nodes_configure_what_they_publish(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    known = known_variables()
    scraped = set(yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"][0][
        "static_configs"
    ][0]["targets"])  # fmt: skip
    relay_ranges = []
    for name in NODES:
        service = compose["services"][name]
        env = {k: interpolate(str(v)) for k, v in service["environment"].items()}
        assert set(env) - known == set(), f"{name}: unknown variables"
        config = parse_config(["serve", "--host", "0.0.0.0"], env, monkeypatch)
        assert set(config.core.only) == {"stun", "turn", "relay"}
        assert config.core.store.startswith("redis+sentinel://")
        published = node_ports(service)
        stun_config = config.sections["stun"]
        stun, alt = stun_config.port, stun_config.alt_port
        wanted = {(stun, "udp"), (stun, "tcp"), (alt, "udp"), (alt, "tcp")}
        relay = config.sections["relay"]
        wanted |= {(relay.port, "udp"), (config.core.http_port, "tcp")}
        if relay.dtls:
            wanted.add((relay.dtls_port, "udp"))
        first, last = config.sections["turn"].relay_ports
        wanted |= {(n, "udp") for n in range(first, last + 1)}
        assert published == wanted, name
        assert f"{name}:{config.core.http_port}" in scraped
        relay_ranges.append(range(first, last + 1))
        # Compose waits for the drain (and 30 s to close) before it kills.
        assert (
            service["stop_grace_period"]
            == f"{int(env['CROSSROADS_DRAIN_TIMEOUT']) + 30}s"
        )
    assert not set(relay_ranges[0]) & set(relay_ranges[1])


def test_compose_prometheus_config_passes_promtool(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool missing: make install")
    rules = ROOT / "deploy" / "prometheus" / "crossroads-alerts.yml"
    text = PROMETHEUS.read_text()
    # The path inside the container (compose.yaml mounts the rules there).
    assert "/etc/prometheus/rules/crossroads-alerts.yml" in text
    copy_path = tmp_path / "prometheus.yml"
    copy_path.write_text(
        text.replace("/etc/prometheus/rules/crossroads-alerts.yml", str(rules))
    )
    result = subprocess.run(
        [promtool, "check", "config", str(copy_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 8 rules found" in result.stdout


def test_compose_grafana_provisions_the_dashboard(compose: dict[str, Any]) -> None:
    mounts = dict(
        volume.split(":")[:2] for volume in compose["services"]["grafana"]["volumes"]
    )
    dashboard_target = mounts["./deploy/grafana/crossroads-dashboard.json"]
    provider = yaml.safe_load(
        (ROOT / "deploy/compose/grafana/dashboards.yml").read_text()
    )
    assert Path(dashboard_target).parent == Path(
        provider["providers"][0]["options"]["path"]
    )
    sources = yaml.safe_load(
        (ROOT / "deploy/compose/grafana/datasources.yml").read_text()
    )
    (source,) = sources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    dashboard = json.loads(
        (ROOT / "deploy/grafana/crossroads-dashboard.json").read_text()
    )
    variable = dashboard["templating"]["list"][0]
    assert (variable["type"], variable["query"]) == ("datasource", "prometheus")


# --------------------------------------------------------------- Kubernetes


def manifests() -> list[dict[str, Any]]:
    documents = []
    for path in sorted(KUBERNETES.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        documents += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return documents


def find(kind: str, name: str) -> dict[str, Any]:
    (found,) = [
        d for d in manifests() if d["kind"] == kind and d["metadata"]["name"] == name
    ]
    return found


def test_kubernetes_manifests_validate() -> None:
    version = kubernetes_validate.latest_version()
    documents = manifests()
    assert {d["kind"] for d in documents} >= {
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "ConfigMap",
    }
    for document in documents:
        kubernetes_validate.validate(document, version, strict=True)
    # The negative control: an unknown field fails strict validation.
    broken = copy.deepcopy(find("Deployment", "crossroads-node"))
    broken["spec"]["template"]["spec"]["terminationGracePeriod"] = 3630
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    files = {p.name for p in KUBERNETES.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files


def pod_environment(container: dict[str, Any]) -> dict[str, str]:
    config_map = find("ConfigMap", "crossroads")["data"]
    env = {}
    for source in container.get("envFrom", []):
        assert source["configMapRef"]["name"] == "crossroads"
        env.update(config_map)
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        elif "fieldRef" in item["valueFrom"]:
            env[item["name"]] = SAMPLE_ADDRESS
        else:
            env[item["name"]] = SAMPLE_SECRET
    return env


@pytest.mark.parametrize("name", ["crossroads-node", "crossroads-api"])
def test_kubernetes_pods_configure_crossroads(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pod = find("Deployment", name)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = pod_environment(container)
    assert set(env) - known_variables() == set()
    config = parse_config(container["args"], env, monkeypatch)
    assert config.core.store.startswith("redis+sentinel://")
    http_port = config.core.http_port
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    for probe in ("readinessProbe", "livenessProbe"):
        port = container[probe]["httpGet"]["port"]
        named = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert named.get(port, port) == http_port
    assert pod["securityContext"]["runAsUser"] == 10001


def test_kubernetes_relay_nodes_drain_before_they_go() -> None:
    node = find("Deployment", "crossroads-node")
    pod = node["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["hostNetwork"] is True
    assert container["lifecycle"]["preStop"]["exec"]["command"] == [
        "crossroads",
        "drain",
    ]
    drain_timeout = int(
        find("ConfigMap", "crossroads")["data"]["CROSSROADS_DRAIN_TIMEOUT"]
    )
    assert pod["terminationGracePeriodSeconds"] == drain_timeout + 30
    labels = node["spec"]["template"]["metadata"]["labels"]
    budget = find("PodDisruptionBudget", "crossroads-node")
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert node["spec"]["selector"]["matchLabels"].items() <= labels.items()
    service = find("Service", "crossroads-api")
    api = find("Deployment", "crossroads-api")["spec"]["template"]
    assert service["spec"]["selector"].items() <= api["metadata"]["labels"].items()
    (api_container,) = api["spec"]["containers"]
    port_names = {p["name"] for p in api_container["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names


async def test_autoscaling_metric_is_exported(
    every_service: Runtime,  # noqa: F811
) -> None:
    autoscaler = find("HorizontalPodAutoscaler", "crossroads-node")
    target = autoscaler["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "crossroads-node")
    (metric,) = autoscaler["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    assert name == "crossroads_turn_allocations"
    assert name in await exported_names(every_service)
