"""The coordinator's direct probe: a real game-protocol exchange.

Connect to the server's game port, send CLIENT_GAME_INFO, and expect a
SERVER_GAME_INFO packet back (reference ``openttd-coordinator.md`` section 7;
the game packet ids 6 and 7 are frozen in every OpenTTD release). A listening
port that is not an OpenTTD server does not pass.

Whom it connects to: only addresses the registering server itself connected
from -- the source of its coordinator connection, or the source the STUN
service saw on a connection carrying the server's secret ``V`` token. The port
is the server's to choose (it is its game port), the address is not, so the
probe cannot be aimed at a third party; the per-address registration limit
bounds how often it runs. One probe is one small request and one answer.
"""

from __future__ import annotations

import asyncio
import contextlib

from crossroads.proto.openttd.game import CLIENT_GAME_INFO, GamePacketType
from crossroads.proto.openttd.wire import HEADER_SIZE, TCP_MTU

#: Per-probe limit (reference section 7: the reference GC allows 3 s).
PROBE_TIMEOUT = 3.0


async def probe_game_server(
    host: str, port: int, timeout: float = PROBE_TIMEOUT
) -> bool:
    """True when ``host:port`` answers a game-info query like an OpenTTD server."""
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(CLIENT_GAME_INFO)
            await writer.drain()
            header = await reader.readexactly(HEADER_SIZE)
            size = header[0] | (header[1] << 8)
            if header[2] != GamePacketType.SERVER_GAME_INFO:
                return False
            if not HEADER_SIZE < size <= TCP_MTU:
                return False
            # Read the game info to the end: a server that stops mid-packet is
            # not healthy. Its content is not needed (SERVER_UPDATE brings it),
            # and newer game-info versions must not fail the probe.
            await reader.readexactly(size - HEADER_SIZE)
            return True
    except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError):
        return False
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
