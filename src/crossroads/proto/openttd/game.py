"""The two game-protocol packets the coordinator uses to probe a server.

OpenTTD ``src/network/core/tcp_game.h``: the first four pairs of game packet
types are frozen across releases so that any version can ask any server for its
game info; 15.x inserts its new (encrypted) packets after type 7. The
coordinator's direct probe is exactly this exchange (reference section 7)::

    CLIENT_GAME_INFO (7): no fields                 (prober -> server)
    SERVER_GAME_INFO (6): NetworkGameInfo           (server -> prober)
"""

from __future__ import annotations

from enum import IntEnum

from crossroads.errors import DecodeError
from crossroads.proto.openttd.gameinfo import VersionedGameInfo, decode_game_info
from crossroads.proto.openttd.wire import Reader, packet


class GamePacketType(IntEnum):
    SERVER_FULL = 0
    SERVER_BANNED = 1
    CLIENT_JOIN = 2
    SERVER_ERROR = 3
    SERVER_GAME_INFO = 6
    CLIENT_GAME_INFO = 7


#: The whole probe request: size 3, type 7.
CLIENT_GAME_INFO = packet(GamePacketType.CLIENT_GAME_INFO)


def decode_server_game_info(packet_type: int, payload: bytes) -> VersionedGameInfo:
    """Decode a probe answer; anything but a well-formed SERVER_GAME_INFO fails."""
    if packet_type != GamePacketType.SERVER_GAME_INFO:
        raise DecodeError(f"game packet type {packet_type}", "bad-type")
    r = Reader(payload)
    info = decode_game_info(r)
    r.end()
    return info
