"""Helpers of the peer-policy and reply-address adversarial tests (h12 items 2, 7)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from crossroads.config import default_config
from crossroads.proto.stun import Class, Message, Method, encode
from crossroads.runtime import Runtime, start
from crossroads.services.turn import TurnService
from tests.conftest import loopback_config

USER, PASSWORD = "alice", "secret123"


@asynccontextmanager
async def turn_runtime(**extra: Any) -> AsyncIterator[Runtime]:
    """STUN + TURN on 127.0.0.1 with OS-chosen ports and one static user."""
    values: dict[str, Any] = {
        "core__only": ["stun", "turn"],
        "turn__user": [f"{USER}:{PASSWORD}"],
        **extra,
    }
    runtime = await start(default_config(loopback_config(**values)))
    try:
        yield runtime
    finally:
        await runtime.close()


def turn_of(runtime: Runtime) -> TurnService:
    service = runtime.services["turn"]
    assert isinstance(service, TurnService)
    return service


def binding_request() -> bytes:
    """A STUN Binding request: what a relay must never carry to our own port."""
    return encode(Message(Class.REQUEST, Method.BINDING, os.urandom(12), ()))
