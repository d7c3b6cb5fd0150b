"""NAT type detection for the SDK: RFC 5780 behaviour, named in RakNet's terms.

:func:`detect_nat` runs RFC 5780 behaviour discovery (``discover_nat`` of
``crossroads.client.stun``, the STUN area's client) against a crossroads STUN
server with an alternate address, and reports the result three ways: RFC 4787
mapping/filtering behaviour, RakNet's ``NATTypeDetectionResult`` with its
strings ("Port restricted" / "Moderate"), and — when combined with the p2p
rendezvous — the port allocation (``independent``/``sequential`` + stride /
``random``). :func:`crossroads.proto.punch.nattype.can_connect` then tells a game,
before it tries, whether RakNet would expect two players to connect directly.

The STUN client is imported when first used, so this module (and the SDK) works
in an installation whose STUN area is absent; :func:`detect_nat` then raises
:class:`NatDetectionUnavailable`.
"""

from __future__ import annotations

import importlib
from typing import Any

from crossroads.errors import CrossroadsError
from crossroads.proto.punch.nattype import (
    NatType,
    from_behaviour,
    to_string,
    to_string_friendly,
)
from crossroads.types import Address, frozen


class NatDetectionUnavailable(CrossroadsError):
    """crossroads.client.stun is not installed in this build."""


@frozen
class NatReport:
    """What :func:`detect_nat` found."""

    #: RFC 4787 behaviours ("endpoint-independent", ...) or "" when untested.
    mapping: str
    filtering: str
    behind_nat: bool
    mapped: Address | None
    #: RakNet's type, ``ToString`` and ``ToStringFriendly``.
    raknet: NatType
    name: str
    friendly: str
    notes: tuple[str, ...] = ()


def report_from(behaviour: Any, *, upnp: bool = False) -> NatReport:
    """Build a report from a ``NatBehavior`` (anything with the same fields)."""
    mapping = str(behaviour.mapping.value) if behaviour.mapping is not None else ""
    filtering = (
        str(behaviour.filtering.value) if behaviour.filtering is not None else ""
    )
    raknet = from_behaviour(
        mapping, filtering, behind_nat=bool(behaviour.behind_nat), upnp=upnp
    )
    return NatReport(
        mapping=mapping,
        filtering=filtering,
        behind_nat=bool(behaviour.behind_nat),
        mapped=tuple(behaviour.mapped) if behaviour.mapped else None,
        raknet=raknet,
        name=to_string(raknet),
        friendly=to_string_friendly(raknet),
        notes=tuple(behaviour.notes),
    )


async def detect_nat(
    stun_server: Address, *, local_host: str | None = None, upnp: bool = False
) -> NatReport:
    """RFC 5780 discovery against ``stun_server``; UDP that never gets an answer
    is reported as RakNet's UNKNOWN ("Unknown")."""
    try:
        stun = importlib.import_module("crossroads.client.stun")
    except ImportError as exc:
        raise NatDetectionUnavailable(f"no RFC 5780 client: {exc}") from None
    try:
        behaviour = await stun.discover_nat(stun_server, local_host=local_host)
    except stun.StunTimeout:
        return NatReport(
            "", "", True, None, NatType.UNKNOWN, "Unknown", "Unknown", ("no answer",)
        )
    return report_from(behaviour, upnp=upnp)
