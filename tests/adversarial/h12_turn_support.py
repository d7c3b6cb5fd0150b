"""Shared helpers of the h12-turn adversarial tests (TURN quotas, credentials,
churn): a fixture that starts the turn service on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from crossroads.config import default_config
from crossroads.runtime import Runtime, start
from crossroads.services.turn import TurnService
from tests.conftest import loopback_config

USER, PASSWORD, SECRET = "alice", "secret123", "s3cr3t"

TurnFactory = Callable[..., Awaitable[TurnService]]


@pytest.fixture(name="turn_service")
async def turn_service_fixture() -> AsyncIterator[TurnFactory]:
    """``await turn_service(**overrides)``: a running turn service (with STUN)."""
    runtimes: list[Runtime] = []

    async def make(**overrides: Any) -> TurnService:
        values: dict[str, Any] = {
            "core__only": ["stun", "turn"],
            "turn__user": [f"{USER}:{PASSWORD}"],
            "turn__secret": [SECRET],
            "turn__allow_loopback_peers": True,
            "turn__relay_ports": (44000, 44999),
        }
        values.update(overrides)
        runtime = await start(default_config(loopback_config(**values)))
        runtimes.append(runtime)
        service = runtime.services["turn"]
        assert isinstance(service, TurnService)
        return service

    try:
        yield make
    finally:
        for runtime in runtimes:
            await runtime.close()
