"""The relay service: configuration, node registration, node choice, split roles."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from crossroads.cli import config_from_cli, main
from crossroads.config import build_config
from crossroads.errors import ConfigError
from crossroads.proto.relay.token import TokenSealer
from crossroads.services import load_service_modules
from crossroads.services.relay import Config, resolve_secret
from crossroads.services.relay_allocations import (
    AllocationError,
    Allocator,
    NodeInfo,
    node_key,
)
from crossroads.store.memory import MemoryStore
from tests.e2e.relay_support import api, base_url, relay_runtime

pytestmark = pytest.mark.timeout(60)


def relay_config(**flags: object) -> Config:
    load_service_modules()
    config = build_config(flags={f"relay.{k}": v for k, v in flags.items()}, env={})
    return config.section("relay", Config)


def test_defaults_follow_the_reference() -> None:
    cfg = relay_config()
    assert cfg.port == 7780
    assert (cfg.bind_timeout, cfg.idle_timeout, cfg.host_alone_timeout) == (
        10.0,
        10.0,
        60.0,
    )
    assert cfg.max_connections == 150
    assert cfg.api_keys == ()
    assert not cfg.allow_private_peers


def test_api_keys_from_flags_env_and_file(tmp_path: Path) -> None:
    load_service_modules()
    params = {"cfg__relay__api_keys": ("alpha", "beta,gamma")}
    config = config_from_cli(None, params)
    assert config.section("relay", Config).api_keys == ("alpha", "beta", "gamma")
    env = build_config(env={"CROSSROADS_API_KEYS": "one, two"})
    assert env.section("relay", Config).api_keys == ("one", "two")
    toml = tmp_path / "crossroads.toml"
    toml.write_text('[relay]\napi_keys = ["from-file"]\nregion = "eu"\n')
    from_file = config_from_cli(toml, {})
    assert from_file.section("relay", Config).api_keys == ("from-file",)
    assert from_file.section("relay", Config).region == "eu"


def test_cli_flags_exist() -> None:
    result = CliRunner().invoke(main, ["serve", "--help"])
    assert result.exit_code == 0
    for flag in (
        "--api-key",
        "--relay-port",
        "--relay-region",
        "--relay-public-host",
        "--relay-node-only",
        "--relay-api-only",
        "--relay-secret",
        "--relay-capacity",
    ):
        assert flag in result.output


def test_inconsistent_config_is_refused() -> None:
    load_service_modules()
    with pytest.raises(ConfigError, match="node_only and api_only"):
        build_config(flags={"relay.node_only": True, "relay.api_only": True}, env={})
    with pytest.raises(ConfigError, match="secret"):
        build_config(flags={"relay.secret": "short"}, env={})
    with pytest.raises(ConfigError, match="join_code_length"):
        build_config(flags={"relay.join_code_length": 5}, env={})


async def test_secret_is_shared_through_the_store() -> None:
    store = MemoryStore()
    first = await resolve_secret(relay_config(), store)
    second = await resolve_secret(relay_config(), store)
    assert first == second and len(first) >= 32
    configured = await resolve_secret(relay_config(secret="s" * 20), store)
    assert configured == b"s" * 20


def allocator(store: MemoryStore, **flags: object) -> Allocator:
    return Allocator(store, TokenSealer(b"x" * 32, os.urandom), relay_config(**flags))


async def register(
    store: MemoryStore, node_id: str, region: str, load: int = 0
) -> None:
    info = NodeInfo(node_id, region, region.upper(), "192.0.2.1", 7780, 100, load)
    await store.set(node_key(node_id), info.to_json(), ttl=30)


async def test_allocations_spread_over_equal_nodes() -> None:
    store = MemoryStore()
    await register(store, "a", "eu")
    await register(store, "b", "eu")
    chosen = [
        (await allocator(store).allocate(4, "eu")).node.node_id for _ in range(10)
    ]
    assert sorted(chosen) == ["a"] * 5 + ["b"] * 5


async def test_least_loaded_node_wins_and_regions_are_respected() -> None:
    store = MemoryStore()
    await register(store, "busy", "eu", load=60)
    await register(store, "idle", "eu", load=10)
    await register(store, "us-1", "us", load=0)
    alloc = allocator(store)
    assert (await alloc.allocate(4, "eu")).node.node_id == "idle"
    assert (await alloc.allocate(4, "us")).node.node_id == "us-1"
    assert await alloc.regions() == [("eu", "EU"), ("us", "US")]
    with pytest.raises(AllocationError) as info:
        await alloc.allocate(4, "mars")
    assert info.value.code == 15007


async def test_capacity_counts_pending_allocations() -> None:
    store = MemoryStore()
    await register(store, "a", "eu", load=90)
    alloc = allocator(store)
    await alloc.allocate(4, "eu")  # 95 of 100 seats
    with pytest.raises(AllocationError) as info:
        await alloc.allocate(5, "eu")
    assert info.value.status == 503 and info.value.code == 15010


async def test_expired_pending_allocations_stop_counting() -> None:
    store = MemoryStore()
    await register(store, "a", "eu", load=90)
    clock = [1000.0]
    alloc = Allocator(
        store,
        TokenSealer(b"x" * 32, os.urandom),
        relay_config(),
        clock=lambda: clock[0],
    )
    await alloc.allocate(9, "eu")
    with pytest.raises(AllocationError):
        await alloc.allocate(9, "eu")
    clock[0] += 11  # past the bind deadline: never bound, seat is free again
    await alloc.allocate(9, "eu")


async def test_dead_node_is_not_chosen() -> None:
    store = MemoryStore()
    await register(store, "a", "eu")
    await register(store, "b", "eu")
    await store.delete(node_key("b"))  # its heartbeat key expired
    chosen = {(await allocator(store).allocate(1, "eu")).node.node_id for _ in range(4)}
    assert chosen == {"a"}


async def test_default_region_and_record() -> None:
    store = MemoryStore()
    await register(store, "a", "eu")
    await register(store, "b", "us")
    alloc = allocator(store, default_region="us")
    grant = await alloc.allocate(3, None)
    assert grant.node.node_id == "b"
    record = await store.hgetall(f"relay:alloc:{grant.allocation_id}")
    assert record["maxConnections"] == b"3" and record["node"] == b"b"
    assert record["connectionData"] == grant.connection_data


async def test_join_refuses_unknown_and_dead_hosts() -> None:
    store = MemoryStore()
    await register(store, "a", "eu")
    alloc = allocator(store)
    grant = await alloc.allocate(2, "eu")
    code = await alloc.join_code(grant.allocation_id)
    joined = await alloc.join(code)
    assert joined.host_connection_data == grant.connection_data
    await store.delete(node_key("a"))
    with pytest.raises(AllocationError) as info:
        await alloc.join(code)
    assert info.value.code == 15009
    with pytest.raises(AllocationError) as info:
        await alloc.join_code(uuid.uuid4())
    assert info.value.code == 15008


async def test_node_registers_and_unregisters() -> None:
    async with relay_runtime(relay__node_id="node-x", relay__region="ap") as rt:
        raw = await rt.store.get(node_key("node-x"))
        assert raw is not None
        record = json.loads(raw)
        assert record["region"] == "ap" and record["capacity"] == 5000
        store = rt.store
    assert await store.get(node_key("node-x")) is None


async def test_node_only_and_api_only() -> None:
    async with relay_runtime(relay__node_only=True) as rt:
        assert rt.services["relay"].describe()[0].startswith("udp 127.0.0.1:")
        async with api(rt) as http:
            assert (await http.get("/v1/regions")).status_code == 404
    async with relay_runtime(relay__api_only=True) as rt:
        assert rt.services["relay"].describe() == [
            "http /v1/allocate /v1/joincode /v1/join /v1/regions"
        ]
        async with api(rt) as http:
            response = await http.post("/v1/allocate", json={"maxConnections": 1})
            assert response.status_code == 503  # no relay node anywhere
            assert response.json()["code"] == 15010


async def test_public_address_is_advertised() -> None:
    async with relay_runtime(
        relay__public_host="203.0.113.7", relay__public_port=17780
    ) as rt:
        async with api(rt) as http:
            allocation = (
                await http.post("/v1/allocate", json={"maxConnections": 1})
            ).json()["data"]["allocation"]
            assert allocation["relayServer"] == {"ipV4": "203.0.113.7", "port": 17780}


async def test_metrics_are_exported() -> None:
    async with relay_runtime() as rt, httpx.AsyncClient(base_url=base_url(rt)) as http:
        text = (await http.get("/metrics")).text
        for name in (
            "crossroads_relay_allocations",
            "crossroads_relay_relayed_packets_total",
            "crossroads_relay_load_seats",
        ):
            assert name in text


async def test_a_remnant_record_is_not_a_session() -> None:
    store = MemoryStore()
    await register(store, "a", "eu")
    alloc = allocator(store)
    ghost = uuid.uuid4()
    # Only what a node writes (live connections), none of the API's fields.
    await store.hset(f"relay:alloc:{ghost}", {"connections": b"1"})
    await store.set("relay:joincode:BCDFGH", str(ghost).encode())
    with pytest.raises(AllocationError) as info:
        await alloc.join("BCDFGH")
    assert info.value.code == 15009
    with pytest.raises(AllocationError) as info:
        await alloc.join_code(ghost)
    assert info.value.code == 15008
