"""NetworkGameInfo: the server description in SERVER_UPDATE, GC_LISTING and the
game protocol's SERVER_GAME_INFO (reference ``openttd-coordinator.md`` section 5;
OpenTTD ``src/network/core/network_game_info.cpp``).

The writer starts with the version byte and then writes the *newest* fields
first, each version's block placed before the older layout::

    7+   u64 ticks_playing
    6+   u8  NewGRF serialization type (NST)
    5+   u32 gamescript version, str gamescript name
    4+   u8 count, then per NewGRF: u32 grfid + 16-byte md5 [+ str name] | u32 lookup id
    3+   u32 game_date, u32 start_date              (days since year 0)
    2+   u8 companies_max, u8 companies_on, u8 spectators_max
    1+   str server_name, str server_revision
    1-5  u8 server_lang (unused)
    1+   bool use_password, u8 clients_max, u8 clients_on, u8 spectators_on
    1-2  u16 game_date, u16 start_date              (days since 1920)
    1-5  str map_name (unused)
    1+   u16 map_width, u16 map_height, u8 landscape, bool dedicated

:class:`GameInfo` holds the content independent of the version; the version and
NST travel beside it, because the coordinator re-encodes one server's info in
whatever version each listing client asks for.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from enum import IntEnum
from typing import get_type_hints

from crossroads.errors import DecodeError, LocalProtocolError
from crossroads.proto.openttd.wire import (
    GRF_NAME_LENGTH,
    NAME_LENGTH,
    REVISION_LENGTH,
    Reader,
    Writer,
)
from crossroads.types import frozen

#: Newest game-info version we read and write (OpenTTD 14+; PR #11886).
MAX_GAME_INFO_VERSION = 7
#: Days from year 0 to 1920-01-01: versions 1-2 carried dates as uint16 days
#: since 1920 (``DAYS_TILL_ORIGINAL_BASE_YEAR``).
DAYS_TILL_1920 = 701265
#: Game ticks per day, used to estimate ``ticks_playing`` for versions < 7
#: (``Ticks::DAY_TICKS``; reference section 5).
DAY_TICKS = 74
#: ``NETWORK_MAX_GRF_COUNT``: the NewGRF count is a uint8.
MAX_NEWGRFS = 255
#: Landscapes 0..3 (temperate, arctic, tropic, toyland); OpenTTD maps anything
#: else to temperate on receipt.
NUM_LANDSCAPES = 4
#: A gamescript version of -1 (as uint32) means "no gamescript".
NO_GAMESCRIPT = 0xFFFFFFFF


class NewGRFSerialization(IntEnum):
    """How NewGRFs are written (``NewGRFSerializationType``)."""

    GRFID_MD5 = 0
    GRFID_MD5_NAME = 1
    LOOKUP_ID = 2


@frozen
class NewGRF:
    """One NewGRF: its id, the MD5 of its file and, when known, its name."""

    grfid: int
    md5: bytes
    name: str | None = None

    @property
    def key(self) -> tuple[int, bytes]:
        return (self.grfid, self.md5)


@frozen
class GameInfo:
    """What a server tells about its game (version-independent content)."""

    server_name: str = ""
    server_revision: str = ""
    use_password: bool = False
    clients_max: int = 0
    clients_on: int = 0
    spectators_on: int = 0
    map_width: int = 0
    map_height: int = 0
    landscape: int = 0
    dedicated: bool = False
    companies_max: int = 0
    companies_on: int = 0
    spectators_max: int = 0
    game_date: int = 0
    start_date: int = 0
    newgrfs: tuple[NewGRF, ...] = ()
    gamescript_version: int = NO_GAMESCRIPT
    gamescript_name: str = ""
    #: Only carried by version 7+; None when the sender did not have it.
    ticks_playing: int | None = None

    @property
    def estimated_ticks_playing(self) -> int:
        """Ticks played, estimated from the dates when the sender was < 7."""
        if self.ticks_playing is not None:
            return self.ticks_playing
        return max(0, self.game_date - self.start_date) * DAY_TICKS


@frozen
class VersionedGameInfo:
    """A decoded NetworkGameInfo with the version and NST it was written in."""

    version: int
    serialization: NewGRFSerialization
    info: GameInfo


def decode_game_info(
    r: Reader, lookup: Mapping[int, NewGRF] | None = None
) -> VersionedGameInfo:
    """Read one NetworkGameInfo.

    ``lookup`` resolves NST 2 lookup ids (the client side of a GC listing); an
    id missing from it is a :class:`DecodeError`.
    """
    version = r.u8()
    if not 1 <= version <= MAX_GAME_INFO_VERSION:
        raise DecodeError(f"game info version {version}", "game-info-version")
    ticks: int | None = None
    nst = NewGRFSerialization.GRFID_MD5
    gs_version, gs_name = NO_GAMESCRIPT, ""
    newgrfs: list[NewGRF] = []
    game_date = start_date = 0
    companies_max = companies_on = spectators_max = 0
    if version >= 7:
        ticks = r.u64()
    if version >= 6:
        nst = r.u8_enum(NewGRFSerialization, "bad-nst")
    if version >= 5:
        gs_version = r.u32()
        gs_name = r.string(NAME_LENGTH, truncate=True)
    if version >= 4:
        count = r.u8()
        for _ in range(count):
            if nst is NewGRFSerialization.LOOKUP_ID:
                index = r.u32()
                grf = None if lookup is None else lookup.get(index)
                if grf is None:
                    raise DecodeError(f"unknown NewGRF lookup id {index}", "bad-lookup")
                newgrfs.append(grf)
                continue
            grfid = r.u32()
            md5 = r.raw(16)
            name = None
            if nst is NewGRFSerialization.GRFID_MD5_NAME:
                name = r.string(GRF_NAME_LENGTH, truncate=True)
            newgrfs.append(NewGRF(grfid, md5, name))
    if version >= 3:
        game_date = r.u32()
        start_date = r.u32()
    if version >= 2:
        companies_max = r.u8()
        companies_on = r.u8()
        spectators_max = r.u8()
    server_name = r.string(NAME_LENGTH, truncate=True)
    server_revision = r.string(REVISION_LENGTH, truncate=True)
    if version < 6:
        r.u8()  # server_lang, unused since 1.x
    use_password = r.boolean()
    clients_max = r.u8()
    clients_on = r.u8()
    spectators_on = r.u8()
    if version < 3:
        game_date = r.u16() + DAYS_TILL_1920
        start_date = r.u16() + DAYS_TILL_1920
    if version < 6:
        r.string(NAME_LENGTH, truncate=True)  # map_name, unused
    map_width = r.u16()
    map_height = r.u16()
    landscape = r.u8()
    dedicated = r.boolean()
    info = GameInfo(
        server_name=server_name,
        server_revision=server_revision,
        use_password=use_password,
        clients_max=clients_max,
        clients_on=clients_on,
        spectators_on=spectators_on,
        map_width=map_width,
        map_height=map_height,
        landscape=landscape if landscape < NUM_LANDSCAPES else 0,
        dedicated=dedicated,
        companies_max=companies_max,
        companies_on=companies_on,
        spectators_max=spectators_max,
        game_date=game_date,
        start_date=start_date,
        newgrfs=tuple(newgrfs),
        gamescript_version=gs_version,
        gamescript_name=gs_name,
        ticks_playing=ticks,
    )
    return VersionedGameInfo(version, nst, info)


def encode_game_info(
    w: Writer,
    info: GameInfo,
    version: int,
    serialization: NewGRFSerialization = NewGRFSerialization.GRFID_MD5,
    lookup_ids: Mapping[tuple[int, bytes], int] | None = None,
) -> None:
    """Append ``info`` in game-info ``version`` to ``w``.

    Fields the version does not have are left out; dates are clamped into the
    uint16-since-1920 range for versions 1-2; below version 6 the NewGRFs go
    without names (NST 0), as those versions had no NST byte.
    """
    if not 1 <= version <= MAX_GAME_INFO_VERSION:
        raise LocalProtocolError(f"game info version {version}")
    nst = serialization if version >= 6 else NewGRFSerialization.GRFID_MD5
    w.u8(version)
    if version >= 7:
        w.u64(info.estimated_ticks_playing)
    if version >= 6:
        w.u8(nst)
    if version >= 5:
        w.u32(info.gamescript_version)
        w.string(info.gamescript_name, NAME_LENGTH)
    if version >= 4:
        if len(info.newgrfs) > MAX_NEWGRFS:
            raise LocalProtocolError(f"{len(info.newgrfs)} NewGRFs")
        w.u8(len(info.newgrfs))
        for grf in info.newgrfs:
            if nst is NewGRFSerialization.LOOKUP_ID:
                if lookup_ids is None or grf.key not in lookup_ids:
                    raise LocalProtocolError(f"NewGRF {grf.grfid:08x} has no lookup id")
                w.u32(lookup_ids[grf.key])
                continue
            w.u32(grf.grfid)
            if len(grf.md5) != 16:
                raise LocalProtocolError("NewGRF md5 must be 16 bytes")
            w.raw(grf.md5)
            if nst is NewGRFSerialization.GRFID_MD5_NAME:
                w.string(grf.name or "", GRF_NAME_LENGTH)
    if version >= 3:
        w.u32(info.game_date)
        w.u32(info.start_date)
    if version >= 2:
        w.u8(info.companies_max)
        w.u8(info.companies_on)
        w.u8(info.spectators_max)
    w.string(info.server_name, NAME_LENGTH)
    w.string(info.server_revision, REVISION_LENGTH)
    if version < 6:
        w.u8(0)  # server_lang
    w.boolean(info.use_password)
    w.u8(info.clients_max)
    w.u8(info.clients_on)
    w.u8(info.spectators_on)
    if version < 3:
        w.u16(min(0xFFFF, max(0, info.game_date - DAYS_TILL_1920)))
        w.u16(min(0xFFFF, max(0, info.start_date - DAYS_TILL_1920)))
    if version < 6:
        w.string("", NAME_LENGTH)  # map_name
    w.u16(info.map_width)
    w.u16(info.map_height)
    w.u8(info.landscape)
    w.boolean(info.dedicated)


#: :class:`GameInfo`'s integer fields (the counts, sizes and dates), by name,
#: the same in the JSON form; the others are read one by one.
_INTEGER_FIELDS = tuple(k for k, t in get_type_hints(GameInfo).items() if t is int)


def game_info_to_json(info: GameInfo) -> dict[str, object]:
    """A JSON-able dict (store records and the HTTP API): every field under its
    own name, NewGRFs as objects of hex strings."""
    data: dict[str, object] = {f.name: getattr(info, f.name) for f in fields(info)}
    data["newgrfs"] = [
        {"grfid": f"{g.grfid:08x}", "md5": g.md5.hex(), "name": g.name}
        for g in info.newgrfs
    ]
    return data


def game_info_from_json(data: Mapping[str, object]) -> GameInfo:
    """Inverse of :func:`game_info_to_json`; raises ValueError on bad input."""

    def integer(key: str) -> int:
        value = data[key]
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{key} is not an integer")
        return value

    def text(key: str) -> str:
        value = data[key]
        if not isinstance(value, str):
            raise ValueError(f"{key} is not a string")
        return value

    raw_grfs = data.get("newgrfs", [])
    if not isinstance(raw_grfs, list):
        raise ValueError("newgrfs is not a list")
    grfs = []
    for item in raw_grfs:
        if not isinstance(item, dict):
            raise ValueError("bad NewGRF entry")
        name = item.get("name")
        grfs.append(
            NewGRF(
                int(str(item["grfid"]), 16),
                bytes.fromhex(str(item["md5"])),
                None if name is None else str(name),
            )
        )
    ticks = data.get("ticks_playing")
    return GameInfo(
        use_password=bool(data["use_password"]),
        dedicated=bool(data["dedicated"]),
        newgrfs=tuple(grfs),
        ticks_playing=ticks if isinstance(ticks, int) else None,
        server_name=text("server_name"),
        server_revision=text("server_revision"),
        gamescript_name=text("gamescript_name"),
        **{key: integer(key) for key in _INTEGER_FIELDS},
    )
