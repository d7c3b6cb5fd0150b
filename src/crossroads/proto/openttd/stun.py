"""The OpenTTD STUN service protocol (TCP 3975).

One packet, peer to service, never answered (reference ``openttd-coordinator.md``
section 6; OpenTTD ``src/network/core/tcp_stun.h``, ``network_stun.cpp``)::

    SERCLI_STUN (0): u8 protocol, str token, u8 interface_number

``interface_number`` is the raw ``AF_*`` value of the socket the peer used (2 for
IPv4 everywhere; 10 for IPv6 on Linux, 23 on Windows, 30 on macOS), so it is an
opaque byte that the coordinator echoes back in GC_STUN_CONNECT. What the service
contributes is the address it *sees* the packet come from.
"""

from __future__ import annotations

from enum import IntEnum

from crossroads.proto.openttd.coordinator import VERSION_STUN, open_service_packet
from crossroads.proto.openttd.wire import TOKEN_LENGTH, Writer
from crossroads.types import frozen


class StunPacketType(IntEnum):
    """``PacketStunType``."""

    SERCLI_STUN = 0


@frozen
class StunRequest:
    """A peer announces itself under ``token`` on a socket of ``family``."""

    protocol: int
    token: str
    family: int


def decode_stun_packet(packet_type: int, payload: bytes) -> StunRequest:
    """Decode the only packet the STUN service receives."""
    # STUN arrived with coordinator protocol 3 (PR #9443).
    r, version = open_service_packet(
        packet_type, payload, StunPacketType.SERCLI_STUN, VERSION_STUN, "STUN"
    )
    request = StunRequest(version, r.string(TOKEN_LENGTH), r.u8())
    r.end()
    return request


def encode_stun_packet(request: StunRequest) -> bytes:
    w = Writer(StunPacketType.SERCLI_STUN)
    w.u8(request.protocol).string(request.token, TOKEN_LENGTH).u8(request.family)
    return w.finish()
