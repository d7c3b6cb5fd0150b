"""Field readers for the JSON messages instances exchange over Store pub/sub.

Every bus (the OpenTTD coordinators' in :mod:`crossroads.proto.openttd.bus`,
the RakNet relay nodes' in :mod:`crossroads.proto.raknet.nodebus`) encodes its
messages as one flat JSON object whose ``"t"`` names the message. The Store is
trusted (it holds every secret of the deployment) but what comes out of it is
still checked like network input: these readers raise :class:`DecodeError`
with a reason the bus counts, and nothing else.
"""

from __future__ import annotations

import json
from typing import Any

from crossroads.errors import DecodeError
from crossroads.proto import jsontext

#: Longest string field accepted (codes, tokens, ids and hosts are < 100
#: characters; a base64 packet is read with its own limit).
MAX_TEXT = 255


def load_object(raw: bytes, limit: int, reason: str = "bad-message") -> dict[str, Any]:
    """The JSON object in ``raw`` (at most ``limit`` bytes)."""
    if len(raw) > limit:
        raise DecodeError("bus message too large", "too-large")
    message = jsontext.loads(raw)
    if not isinstance(message, dict):
        raise DecodeError("bus message is not an object", reason)
    return message


def dump_object(fields: dict[str, Any]) -> bytes:
    return json.dumps(fields, separators=(",", ":")).encode()


def text(message: dict[str, Any], key: str, reason: str, limit: int = MAX_TEXT) -> str:
    value = message.get(key)
    if not isinstance(value, str) or len(value) > limit:
        raise DecodeError(f"bad {key!r}", reason)
    return value


def integer(message: dict[str, Any], key: str, reason: str, low: int, high: int) -> int:
    """An int in ``low..high`` (booleans are not numbers here)."""
    value = message.get(key)
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or not low <= value <= high
    ):
        raise DecodeError(f"bad {key!r}", reason)
    return value


def boolean(message: dict[str, Any], key: str, reason: str) -> bool:
    value = message.get(key)
    if not isinstance(value, bool):
        raise DecodeError(f"bad {key!r}", reason)
    return value
