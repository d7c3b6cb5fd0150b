"""The OpenTTD TURN service protocol (TCP 3974).

Reference ``openttd-coordinator.md`` section 6; OpenTTD
``src/network/core/tcp_turn.h`` and ``network_turn.cpp``::

    TURN_ERROR     (0): no fields; the peer gives up this TURN attempt
    SERCLI_CONNECT (1): u8 protocol, str ticket      (peer -> service)
    TURN_CONNECTED (2): str peer hostname (IP, no port)  (service -> peer)

After TURN_CONNECTED the socket stops being a TURN socket: both peers speak the
game protocol through it and the service copies bytes without looking at them.
"""

from __future__ import annotations

from enum import IntEnum

from crossroads.errors import DecodeError
from crossroads.proto.openttd.coordinator import VERSION_TURN, open_service_packet
from crossroads.proto.openttd.wire import HOSTNAME_LENGTH, TOKEN_LENGTH, Reader, Writer
from crossroads.types import frozen


class TurnPacketType(IntEnum):
    """``PacketTurnType``."""

    TURN_ERROR = 0
    SERCLI_CONNECT = 1
    TURN_CONNECTED = 2


@frozen
class TurnConnect:
    """A peer presents its ticket."""

    protocol: int
    ticket: str


@frozen
class TurnConnected:
    """Both sides arrived: from now on the socket relays the game protocol."""

    hostname: str


@frozen
class TurnError:
    """The service refuses the ticket."""


TurnMessage = TurnConnect | TurnConnected | TurnError


def decode_turn_connect(packet_type: int, payload: bytes) -> TurnConnect:
    """Decode the only packet the TURN service receives before relaying."""
    # TURN arrived with coordinator protocol 5 (PR #9447).
    r, version = open_service_packet(
        packet_type, payload, TurnPacketType.SERCLI_CONNECT, VERSION_TURN, "TURN"
    )
    message = TurnConnect(version, r.string(TOKEN_LENGTH))
    r.end()
    return message


def decode_turn_reply(packet_type: int, payload: bytes) -> TurnConnected | TurnError:
    """Decode what the service answers (used by clients and tests)."""
    r = Reader(payload)
    if packet_type == TurnPacketType.TURN_ERROR:
        r.end()
        return TurnError()
    if packet_type == TurnPacketType.TURN_CONNECTED:
        message = TurnConnected(r.string(HOSTNAME_LENGTH))
        r.end()
        return message
    raise DecodeError(f"TURN packet type {packet_type}", "bad-type")


def encode_turn_packet(message: TurnMessage) -> bytes:
    match message:
        case TurnConnect():
            w = Writer(TurnPacketType.SERCLI_CONNECT)
            w.u8(message.protocol).string(message.ticket, TOKEN_LENGTH)
        case TurnConnected():
            w = Writer(TurnPacketType.TURN_CONNECTED)
            w.string(message.hostname, HOSTNAME_LENGTH)
        case TurnError():
            w = Writer(TurnPacketType.TURN_ERROR)
    return w.finish()
