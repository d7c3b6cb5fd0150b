"""The operator's view of OpenTTD servers (console, admin API): a registered
server is listed by invite code, and revoking it unregisters it."""

from __future__ import annotations

import pytest

from crossroads.client.openttd import GameInfoResponder
from crossroads.proto.openttd.coordinator import ErrorType, GcError
from crossroads.runtime import Runtime
from tests.services.openttd.helpers import (
    closed_soon,
    register,
    service,
    until_gone,
)

pytestmark = pytest.mark.timeout(60)


async def test_registered_server_is_listed_and_revoke_unregisters_it(
    ottd: Runtime, game_server: GameInfoResponder
) -> None:
    registered = await register(ottd, game_server.port)
    try:
        svc = service(ottd)
        sessions = svc.sessions()
        assert [s.id for s in sessions] == [registered.code]
        assert sessions[0].client.startswith("127.0.0.1:")
        assert f"game port {game_server.port}" in sessions[0].detail
        assert not svc.revoke("+NoSuchCode")
        assert svc.revoke(registered.code)
        error = await registered.client.recv(10)
        assert isinstance(error, GcError)
        assert error.error == ErrorType.REGISTRATION_FAILED
        assert await closed_soon(registered.client)
        await until_gone(ottd, registered.code)
        assert svc.sessions() == []
    finally:
        await registered.close()
