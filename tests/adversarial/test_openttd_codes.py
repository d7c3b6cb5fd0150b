"""OpenTTD invite-code reservations have a global cap
(``--openttd-max-invite-codes``).

Each new server reserves an invite code for 30 days. The per-source limits
(registrations per minute, servers per address) bound one address; before,
nothing bounded them all, so many sources (IPv6 /64s are cheap) could grow the
store by a key per registration for a month. Now a new server beyond the cap
is refused with GC_ERROR and counted, while a server that comes back with its
code and secret still gets its own code.
"""

from __future__ import annotations

import pytest

from crossroads.client.openttd import GameInfoResponder
from crossroads.proto.openttd.coordinator import ErrorType, GcError
from tests.services.openttd.helpers import (
    gc,
    metric_value,
    metrics,
    register,
    running,
)

pytestmark = pytest.mark.timeout(60)

CAP = 2


async def test_new_servers_beyond_the_code_cap_are_refused() -> None:
    game_server = GameInfoResponder()  # answers the registration's probe
    await game_server.start()
    try:
        await refused_beyond_the_cap(game_server)
    finally:
        await game_server.close()


async def refused_beyond_the_cap(game_server: GameInfoResponder) -> None:
    async with running(max_invite_codes=CAP) as rt:
        first, second = [await register(rt, game_server.port) for _ in range(CAP)]
        third = await gc(rt)
        back = None
        try:
            assert first.code and second.code and first.code != second.code
            # SERVER_REGISTER, protocol 6, game type PUBLIC, port 3979, no code.
            await third.send(b"\x09\x00\x01\x06\x01\x8b\x0f\x00\x00")
            assert await third.recv() == GcError(
                ErrorType.REGISTRATION_FAILED,
                "no invite codes left on this coordinator, try again later",
            )
            assert await third.at_eof(5)
            refused = metric_value(
                await metrics(rt),
                "crossroads_openttd_registrations_total",
                connection_type="none",
                result="codes-exhausted",
            )
            assert refused == 1
            # A server that returns with its code and secret is not a new code.
            code, secret = first.code, first.ack.invite_code_secret
            await first.close()
            back = await register(rt, game_server.port, code=code, secret=secret)
            assert back.code == code
        finally:
            for registered in (first, second, back):
                if registered is not None:
                    await registered.close()
            await third.close()
