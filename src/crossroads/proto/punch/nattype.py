"""NAT types in RakNet's terms, and RakNet's ``CanConnect`` matrix (reference §2.2).

RFC 5780 describes a NAT by two behaviours — how it *maps* (endpoint-independent,
address-dependent, address-and-port-dependent) and how it *filters* (the same
three). RakNet's NatTypeDetection names the classic cone/symmetric types;
:func:`from_behaviour` translates, so a game can show "Moderate" and decide with
:func:`can_connect` whether two players may try a direct connection at all.
"""

from __future__ import annotations

from enum import IntEnum


class NatType(IntEnum):
    """RakNet's ``NATTypeDetectionResult`` with its wire values."""

    NONE = 0
    FULL_CONE = 1
    ADDRESS_RESTRICTED = 2
    PORT_RESTRICTED = 3
    SYMMETRIC = 4
    UNKNOWN = 5
    DETECTION_IN_PROGRESS = 6
    SUPPORTS_UPNP = 7


_NAMES = {
    NatType.NONE: ("None", "Open"),
    NatType.FULL_CONE: ("Full cone", "Relaxed"),
    NatType.ADDRESS_RESTRICTED: ("Address restricted", "Relaxed"),
    NatType.PORT_RESTRICTED: ("Port restricted", "Moderate"),
    NatType.SYMMETRIC: ("Symmetric", "Strict"),
    NatType.UNKNOWN: ("Unknown", "Unknown"),
    NatType.DETECTION_IN_PROGRESS: ("In Progress", "In Progress"),
    NatType.SUPPORTS_UPNP: ("Supports UPNP", "Supports UPNP"),
}


def to_string(nat: NatType) -> str:
    """RakNet's ``NATTypeDetectionResultToString``."""
    return _NAMES[nat][0]


def to_string_friendly(nat: NatType) -> str:
    """RakNet's ``NATTypeDetectionResultToStringFriendly`` (Open/Relaxed/Moderate/Strict)."""
    return _NAMES[nat][1]


_OPEN = {
    NatType.NONE,
    NatType.FULL_CONE,
    NatType.ADDRESS_RESTRICTED,
    NatType.SUPPORTS_UPNP,
}


def can_connect(a: NatType, b: NatType) -> bool:
    """RakNet's ``CanConnect(a, b)`` (symmetric in its arguments).

    Unknown and in-progress never connect; open-ish types (none, full cone,
    address-restricted, UPnP) connect to anything known; port-restricted fails
    only against symmetric; symmetric connects only to open-ish types.
    """
    unusable = {NatType.UNKNOWN, NatType.DETECTION_IN_PROGRESS}
    if a in unusable or b in unusable:
        return False
    if a in _OPEN or b in _OPEN:
        return True
    # both in {PORT_RESTRICTED, SYMMETRIC}
    return a == b == NatType.PORT_RESTRICTED


#: RFC 5780 behaviour names as crossroads' STUN client reports them.
INDEPENDENT = "endpoint-independent"
ADDRESS = "address-dependent"
ADDRESS_AND_PORT = "address-and-port-dependent"


def from_behaviour(
    mapping: str, filtering: str, *, behind_nat: bool = True, upnp: bool = False
) -> NatType:
    """RakNet's type for an RFC 5780 classification.

    Endpoint-dependent mapping is "symmetric" whatever the filtering; with an
    endpoint-independent mapping the filtering decides full cone / address
    restricted / port restricted. A host whose mapped address is its own is
    NONE; a working UPnP mapping is SUPPORTS_UPNP (RakNet reports it that way).
    """
    if upnp:
        return NatType.SUPPORTS_UPNP
    if not behind_nat:
        return NatType.NONE
    if mapping not in (INDEPENDENT, ADDRESS, ADDRESS_AND_PORT) or filtering not in (
        INDEPENDENT,
        ADDRESS,
        ADDRESS_AND_PORT,
    ):
        return NatType.UNKNOWN
    if mapping != INDEPENDENT:
        return NatType.SYMMETRIC
    return {
        INDEPENDENT: NatType.FULL_CONE,
        ADDRESS: NatType.ADDRESS_RESTRICTED,
        ADDRESS_AND_PORT: NatType.PORT_RESTRICTED,
    }[filtering]
