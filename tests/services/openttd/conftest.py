from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from crossroads.client.openttd import GameInfoResponder
from crossroads.runtime import Runtime
from tests.services.openttd.helpers import start_openttd


@pytest.fixture
async def ottd() -> AsyncIterator[Runtime]:
    """The openttd service alone, on loopback, OS-chosen ports, in-memory store."""
    rt = await start_openttd(secret="test-secret")
    try:
        yield rt
    finally:
        await rt.close()


@pytest.fixture
async def game_server() -> AsyncIterator[GameInfoResponder]:
    """Something that answers the coordinator's game-info probe like OpenTTD."""
    responder = GameInfoResponder()
    await responder.start()
    try:
        yield responder
    finally:
        await responder.close()
