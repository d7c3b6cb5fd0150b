"""How ``--workers`` is planned and what each worker runs (crossroads.workers).

The processes themselves (SO_REUSEPORT, restarts, signals, real traffic) are in
tests/e2e/test_workers.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from typing import Any

import pytest

from crossroads.config import Config, default_config
from crossroads.errors import ConfigError
from crossroads.services import load_service_modules
from crossroads.services.relay import Config as RelayConfig
from crossroads.services.stun import Config as StunConfig
from crossroads.transport.reuseport import CHANNEL_ENV, READY
from crossroads.workers import (
    SUPERVISOR_PID_ENV,
    WORKER_COUNT_ENV,
    WORKER_INDEX_ENV,
    Supervisor,
    WorkerPlan,
    WorkerSlot,
    current_worker,
    plan_workers,
    sibling_ports,
    worker_config,
)
from tests.conftest import eventually

load_service_modules()

REDIS = "redis://127.0.0.1:6379/0"


def config(**overrides: Any) -> Config:
    return default_config({k.replace("__", "."): v for k, v in overrides.items()})


def test_auto_stays_at_one_worker_with_the_memory_store() -> None:
    plan = plan_workers(config(), cpu_count=8)
    assert plan.count == 1
    assert "in-memory store" in plan.reason and "redis" in plan.reason


def test_auto_is_one_worker_per_core_with_redis() -> None:
    plan = plan_workers(config(core__store=REDIS), cpu_count=4)
    assert plan.count == 4
    assert plan.extra_services == ("stun", "turn", "relay")


def test_auto_needs_a_fixed_port_to_share() -> None:
    # Port 0: each worker would get a different port, nothing is shared.
    plan = plan_workers(
        config(core__store=REDIS, stun__port=0, relay__port=0), cpu_count=4
    )
    assert plan.count == 1 and "fixed --stun-port" in plan.reason
    only_relay = plan_workers(
        config(core__store=REDIS, core__only="relay", relay__port=0), cpu_count=4
    )
    assert only_relay.count == 1


def test_explicit_workers_with_memory_spread_only_stun_and_turn() -> None:
    plan = plan_workers(config(core__workers=2), cpu_count=1)
    assert plan.count == 2
    assert plan.extra_services == ("stun", "turn")
    assert "in-memory store is not shared" in plan.reason


def test_explicit_workers_with_nothing_to_spread_is_refused() -> None:
    with pytest.raises(ConfigError, match="workers: 2 workers need"):
        plan_workers(config(core__workers=2, core__only="natneg"))
    assert plan_workers(config(core__workers=1)).count == 1


def test_worker_zero_runs_the_whole_configuration() -> None:
    base = config(core__store=REDIS, core__workers=3)
    assert worker_config(base, 0, plan_workers(base)) is base


def test_extra_workers_run_udp_stun_turn_and_their_own_relay_node() -> None:
    base = config(
        core__store=REDIS,
        core__workers=3,
        core__http_port=8080,
        relay__port=7780,
        relay__node_id="eu-1",
        relay__api_keys="k",
    )
    second = worker_config(base, 2, plan_workers(base))
    assert second.core.only == ("stun", "turn", "relay")
    assert second.core.http_port == 8082
    assert second.section("stun", StunConfig).tcp is False
    assert second.section("stun", StunConfig).port == 3478  # shared
    relay = second.section("relay", RelayConfig)
    assert (relay.port, relay.node_only, relay.node_id) == (7782, True, "eu-1-w2")
    assert not second.enabled("natneg") and not second.enabled("openttd")


def test_only_worker_zero_orders_the_acme_certificate() -> None:
    base = config(
        core__store=REDIS, core__workers=2, core__acme_domain=["turn.example.org"]
    )
    plan = plan_workers(base)
    assert worker_config(base, 0, plan).core.acme_domain == ("turn.example.org",)
    assert worker_config(base, 1, plan).core.acme_domain == ()


def test_worker_relay_dtls_and_websocket_ports_never_collide() -> None:
    base = config(core__store=REDIS, core__workers=3, relay__websocket=True)
    plan = plan_workers(base)
    udp: list[int] = []
    for index in range(3):
        relay = worker_config(base, index, plan).section("relay", RelayConfig)
        udp += [relay.port, relay.dtls_port] if relay.dtls else [relay.port]
        # ws/wss are TCP listeners: worker 0 only, as every TCP listener.
        assert relay.websocket is (index == 0)
    assert len(udp) == len(set(udp)) == 6


def test_ports_past_65535_are_a_config_error() -> None:
    base = config(core__store=REDIS, core__workers=3, core__http_port=65535)
    with pytest.raises(ConfigError, match="http_port"):
        worker_config(base, 1, plan_workers(base))


def test_current_worker_from_the_environment() -> None:
    assert current_worker({}) is None
    env = {WORKER_INDEX_ENV: "1", WORKER_COUNT_ENV: "2", SUPERVISOR_PID_ENV: "42"}
    assert current_worker(env) == WorkerSlot(1, 2, 42)
    with pytest.raises(ConfigError):
        current_worker({WORKER_INDEX_ENV: "1"})


def test_sibling_ports_are_the_other_workers_fixed_ports() -> None:
    base = config(
        core__store=REDIS,
        core__workers=2,
        core__http_port=8080,
        relay__port=7780,
        natneg__port=27901,
    )
    plan = plan_workers(base)
    of_worker_1 = sibling_ports(base, 1, plan)
    # Worker 0 runs everything: its HTTP port, relay node, natneg, OpenTTD.
    assert {8080, 7780, 27901, 3976} <= of_worker_1
    of_worker_0 = sibling_ports(base, 0, plan)
    assert {8081, 7781} <= of_worker_0
    assert not {8080, 7780, 27901, 3976} & of_worker_0


async def test_a_dying_worker_is_restarted_with_a_growing_delay(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A real child that exits at once (code 1): restarted after 0.5 s, then
    1 s, ... (crossroads.workers.RESTART_MIN), until the supervisor stops."""
    plan = WorkerPlan(1, (), "")
    supervisor = Supervisor(plan, [sys.executable, "-c", "raise SystemExit(1)"], {})
    caplog.set_level(logging.INFO, logger="crossroads.workers")
    running = asyncio.create_task(supervisor.run())

    async def restarted_twice() -> bool:
        return "restarting in 1.0 s" in caplog.text

    await eventually(restarted_twice, "a second restart, after a longer delay", 20)
    assert "exited with 1; restarting in 0.5 s" in caplog.text
    supervisor.stop()
    assert await asyncio.wait_for(running, 20) == 0


async def test_workers_start_after_worker_0_and_a_first_start_exit_2_stops_all() -> (
    None
):
    """Worker 0 (a real child) says it is ready over the hand-over channel;
    only then is worker 1 started, which fails like a bad configuration (exit
    2): the supervisor stops worker 0 and returns 2."""
    plan = WorkerPlan(2, ("stun",), "")
    command = [
        sys.executable,
        "-c",
        "import os, socket, sys, time\n"
        f"if os.environ['{WORKER_INDEX_ENV}'] == '1':\n"
        "    sys.exit(2)\n"
        f"channel = socket.socket(fileno=int(os.environ['{CHANNEL_ENV}']))\n"
        f"channel.send({READY!r})\n"
        "time.sleep(60)\n",
    ]
    supervisor = Supervisor(plan, command, dict(os.environ))
    assert await asyncio.wait_for(supervisor.run(), 30) == 2
    assert set(supervisor.processes) == {0, 1}
    assert all(p.returncode is not None for p in supervisor.processes.values())
