"""One registered OpenTTD server as every coordinator instance sees it.

The record is what the Store's ``openttd:servers`` hash holds per invite code
(services/openttd/registry.py describes the key layout): written by the
instance holding the server's connection, read by every instance for listings
and joins. Pure data and its JSON form; no I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from crossroads.proto import jsontext
from crossroads.proto.openttd.coordinator import ConnectionType, ServerGameType
from crossroads.proto.openttd.gameinfo import (
    GameInfo,
    game_info_from_json,
    game_info_to_json,
)


@dataclass(slots=True)
class ServerRecord:
    """What every instance knows about one registered server."""

    code: str
    owner: str
    #: Identifies the owning connection, so a stale close cannot delete a newer
    #: registration of the same code.
    session: str
    protocol: int
    game_type: int
    connection_type: int
    source: str
    port: int
    direct: list[tuple[str, int]]
    registered: float
    expires: float
    game_info_version: int = 0
    info: GameInfo | None = None
    updated: float = 0.0

    @property
    def public(self) -> bool:
        """Listed: public, reachable somehow, and has sent its game info."""
        return (
            self.game_type == ServerGameType.PUBLIC
            and self.connection_type != ConnectionType.ISOLATED
            and self.info is not None
        )

    @property
    def connection_string(self) -> str:
        return self.code

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "code": self.code,
                "owner": self.owner,
                "session": self.session,
                "protocol": self.protocol,
                "game_type": self.game_type,
                "connection_type": self.connection_type,
                "source": self.source,
                "port": self.port,
                "direct": [list(a) for a in self.direct],
                "registered": self.registered,
                "expires": self.expires,
                "game_info_version": self.game_info_version,
                "info": None if self.info is None else game_info_to_json(self.info),
                "updated": self.updated,
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> ServerRecord:
        """Parse a stored record; raises ValueError (or KeyError, TypeError)
        when corrupt. JSON that is not an object, or a number no float holds,
        is corrupt too: they escaped as AttributeError and OverflowError and
        failed every listing refresh."""
        try:
            return cls._from_json(raw)
        except OverflowError:
            raise ValueError("a number in the record is out of range") from None

    @classmethod
    def _from_json(cls, raw: bytes) -> ServerRecord:
        data = jsontext.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("a server record is a JSON object")
        info = data.get("info")
        if info is not None and not isinstance(info, dict):
            raise ValueError("a record's game info is a JSON object")
        return cls(
            code=str(data["code"]),
            owner=str(data["owner"]),
            session=str(data["session"]),
            protocol=int(data["protocol"]),
            game_type=int(data["game_type"]),
            connection_type=int(data["connection_type"]),
            source=str(data["source"]),
            port=int(data["port"]),
            direct=[(str(h), int(p)) for h, p in data["direct"]],
            registered=float(data["registered"]),
            expires=float(data["expires"]),
            game_info_version=int(data.get("game_info_version", 0)),
            info=None if info is None else game_info_from_json(info),
            updated=float(data.get("updated", 0.0)),
        )

    def to_api(self) -> dict[str, object]:
        """The HTTP API view (no owner/session internals)."""
        return {
            "invite_code": self.code,
            "game_type": ServerGameType(self.game_type).name.lower().replace("_", "-"),
            "connection_type": ConnectionType(self.connection_type).name.lower(),
            "protocol": self.protocol,
            "game_info_version": self.game_info_version,
            "direct": [
                f"{h}:{p}" if ":" not in h else f"[{h}]:{p}" for h, p in self.direct
            ],
            "registered": self.registered,
            "updated": self.updated or None,
            "info": None if self.info is None else game_info_to_json(self.info),
        }
