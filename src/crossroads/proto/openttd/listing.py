"""The server list: which stored records are live, and their GC_LISTING packets.

Theory of operation. The service (``ListingCache`` in
services/openttd/listing.py) runs a :class:`ListingRefresh` at most every few
seconds; like every coordinator flow it emits typed Store requests
(:mod:`crossroads.proto.openttd.store`) and takes the answers back:

1. read the ``openttd:servers`` hash (:class:`AllServers`) and hand the raw
   values to :func:`sort_records` with what the previous refresh parsed: only
   values whose bytes changed are parsed again, and records that are corrupt
   or past their ``expires`` (wall clock) are named for sweeping;
2. ask which owners stopped heartbeating (:class:`DeadInstances`);
   :func:`without_owners` drops their records, to sweep too;
3. delete everything named for sweeping (:class:`SweepServers`), if anything;
4. read the NewGRF counter (:class:`NewgrfCounter`) and, when another
   instance handed out indexes we have not seen, reload the lookup table
   (:class:`LoadNewgrfs`);
5. :class:`Refreshed` carries the survivors, oldest registration first, which
   the service hands to :meth:`ListingPacker.refresh`.

A Store failure at any step ends it with :class:`RefreshFailed`: the service
keeps serving the previous list. A client at protocol 4 or later first gets
the NewGRF lookup entries it lacks (:func:`lookup_packets`).

:class:`ListingPacker` turns the public records into the GC_LISTING packets of
one listing shape (game-info version, NewGRF serialization, invite codes or
not, client revision first): each shape is packed once per refresh and then
sent as is; each server's entry bytes are kept across refreshes while the
record's ``updated`` stamp is unchanged. Everything here is pure: no Store, no
clock, no sockets.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from enum import IntEnum

from crossroads.proto.openttd.coordinator import (
    ListingEntry,
    encode_listing_entry,
    newgrf_lookup_packets,
    pack_listing,
)
from crossroads.proto.openttd.gameinfo import NewGRF, NewGRFSerialization
from crossroads.proto.openttd.record import ServerRecord
from crossroads.proto.openttd.store import (
    AllServers,
    AwaitedRequest,
    DeadInstances,
    LoadNewgrfs,
    NewgrfCounter,
    StoreRead,
    StoreWrite,
    SweepServers,
)
from crossroads.types import frozen

#: Listing shapes kept packed at once: revisions are client input, so the
#: cache of shapes is bounded and starts over when full.
MAX_SHAPES = 64
#: Added to the NewGRF serialization in an entry's cache key for the
#: no-invite-code form (serializations are 0..3, protocol 6 and earlier).
NO_INVITE_CODES = 16

Parsed = dict[str, tuple[bytes, ServerRecord]]


def sort_records(
    raw: Mapping[str, bytes], previous: Parsed, wall: float
) -> tuple[Parsed, list[str]]:
    """The live records among ``raw`` (by code, with their bytes) and the codes
    to sweep (corrupt or expired at wall-clock time ``wall``)."""
    parsed: Parsed = {}
    dead: list[str] = []
    for code, value in raw.items():
        known = previous.get(code)
        if known is not None and known[0] == value:
            record = known[1]
        else:
            try:
                record = ServerRecord.from_json(value)
            except (ValueError, KeyError, TypeError):
                dead.append(code)
                continue
        if record.expires < wall:
            dead.append(code)
            continue
        parsed[code] = (value, record)
    return parsed, dead


def without_owners(parsed: Parsed, gone: Collection[str]) -> list[str]:
    """Remove from ``parsed`` the records owned by a ``gone`` instance (a
    record whose instance stopped heartbeating names a server nobody holds a
    connection to); returns their codes, to sweep."""
    dead = [code for code, (_, record) in parsed.items() if record.owner in gone]
    for code in dead:
        del parsed[code]
    return dead


def lookup_packets(table: Mapping[int, NewGRF], cursor: int) -> list[bytes]:
    """The GC_NEWGRF_LOOKUP packets a client whose table ends at ``cursor``
    needs before a listing: the entries after its cursor, or all of them when
    the cursor is beyond ours (another deployment's table, or ours was reset).
    Reference sections 4-5: the packets carry our highest index as the
    client's next cursor."""
    top = max(table, default=0)
    if cursor > top:
        cursor = 0
    fresh = sorted((index, grf) for index, grf in table.items() if index > cursor)
    return newgrf_lookup_packets(fresh, top)


@frozen
class Refreshed:
    """The live records, oldest registration first; ``parsed`` (with their
    bytes) and ``newgrf_max`` are the next refresh's starting point."""

    records: list[ServerRecord]
    parsed: Parsed
    newgrf_max: int


@frozen
class RefreshFailed:
    """The Store failed: keep the previous list."""


RefreshCommand = StoreRead | StoreWrite | Refreshed | RefreshFailed


class Step(IntEnum):
    """The requests of a refresh, in order (each made at most once)."""

    ALL_SERVERS = 1
    DEAD_INSTANCES = 2
    SWEEP = 3
    NEWGRF_COUNTER = 4
    LOAD_NEWGRFS = 5


@dataclass(eq=False)
class ListingRefresh:
    """One re-read of the server list; see the module docstring. ``wall`` is
    the wall-clock time records expire against."""

    previous: Parsed
    newgrf_max: int
    wall: float
    parsed: Parsed = field(default_factory=dict, init=False)
    dead: list[str] = field(default_factory=list, init=False)
    _awaited: AwaitedRequest = field(default_factory=AwaitedRequest, init=False)

    def start(self) -> list[RefreshCommand]:
        return [self._awaited.read(Step.ALL_SERVERS, AllServers())]

    def store_result(self, request: int, answer: object) -> list[RefreshCommand]:
        if not self._awaited.answered(request):
            return []
        match request:
            case Step.ALL_SERVERS if isinstance(answer, Mapping):
                raw = {
                    code: value
                    for code, value in answer.items()
                    if isinstance(code, str) and isinstance(value, bytes)
                }
                self.parsed, self.dead = sort_records(raw, self.previous, self.wall)
                owners = frozenset(r.owner for _, r in self.parsed.values())
                return [self._awaited.read(Step.DEAD_INSTANCES, DeadInstances(owners))]
            case Step.DEAD_INSTANCES if isinstance(
                answer, Collection
            ) and not isinstance(answer, str | bytes):
                self.dead += without_owners(self.parsed, answer)
                if self.dead:
                    sweep = SweepServers(tuple(self.dead))
                    return [self._awaited.write(Step.SWEEP, sweep)]
                return [self._awaited.read(Step.NEWGRF_COUNTER, NewgrfCounter())]
            case Step.SWEEP:
                return [self._awaited.read(Step.NEWGRF_COUNTER, NewgrfCounter())]
            case Step.NEWGRF_COUNTER:
                counter = _counter(answer)
                if counter is not None and counter > self.newgrf_max:
                    self.newgrf_max = counter
                    return [self._awaited.write(Step.LOAD_NEWGRFS, LoadNewgrfs())]
                return [self._refreshed()]
            case Step.LOAD_NEWGRFS:
                return [self._refreshed()]
        return [RefreshFailed()]  # an answer of the wrong type

    def store_failed(self, request: int) -> list[RefreshCommand]:
        return [RefreshFailed()] if self._awaited.answered(request) else []

    def _refreshed(self) -> Refreshed:
        live = sorted((r for _, r in self.parsed.values()), key=lambda r: r.registered)
        return Refreshed(live, self.parsed, self.newgrf_max)


def _counter(raw: object) -> int | None:
    """The NewGRF counter's value; None when absent or not a number (a
    corrupt key must not stop the listing)."""
    if not isinstance(raw, bytes) or not raw.isdigit() or len(raw) > 20:
        return None
    return int(raw)


class ListingPacker:
    """GC_LISTING packets of the public servers (module docstring)."""

    def __init__(self, newgrf_index: Mapping[tuple[int, bytes], int]) -> None:
        #: The shared NewGRF lookup table (filled in place by the registry).
        self.newgrf_index = newgrf_index
        self.public: list[ServerRecord] = []
        self._entries: dict[tuple[str, float, int, int], bytes] = {}
        self._packed: dict[tuple[int, int, bool, str], list[bytes]] = {}

    def refresh(self, public: list[ServerRecord]) -> None:
        """A new list of public servers: repack every shape on demand, keep
        the entries of servers whose record did not change."""
        self.public = public
        keep = {(r.code, r.updated) for r in public}
        self._entries = {k: v for k, v in self._entries.items() if k[:2] in keep}
        self._packed = {}

    def packets(
        self,
        version: int,
        nst: NewGRFSerialization,
        invite_codes: bool,
        revision: str,
    ) -> list[bytes]:
        """The GC_LISTING packets for one listing shape (cached until refresh).

        Servers of the client's own revision come first, as with the reference
        coordinator, so a client sees the servers it can join at the top.
        """
        key = (version, int(nst), invite_codes, revision)
        packed = self._packed.get(key)
        if packed is not None:
            return packed
        same: list[bytes] = []
        other: list[bytes] = []
        for record in self.public:
            entry = self.entry(record, version, nst, invite_codes)
            if entry is None:
                continue
            assert record.info is not None
            (same if record.info.server_revision == revision else other).append(entry)
        packed = pack_listing(same + other)
        if len(self._packed) >= MAX_SHAPES:
            self._packed.clear()
        self._packed[key] = packed
        return packed

    def entry(
        self,
        record: ServerRecord,
        version: int,
        nst: NewGRFSerialization,
        invite_codes: bool = True,
    ) -> bytes | None:
        """One server's listing bytes; None when it cannot be listed this way.

        A client below protocol 2 knows no invite codes: it gets the server's
        first direct address as ``ip:port``, or nothing.
        """
        key = (
            record.code,
            record.updated,
            version,
            int(nst) + (0 if invite_codes else NO_INVITE_CODES),
        )
        cached = self._entries.get(key)
        if cached is not None:
            return cached
        assert record.info is not None
        connection_string = record.connection_string
        if not invite_codes:
            if not record.direct:
                return None
            host, port = record.direct[0]
            connection_string = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            data = encode_listing_entry(
                ListingEntry(connection_string, record.info),
                version,
                nst,
                self.newgrf_index,
            )
        except Exception:
            return None  # e.g. a NewGRF without a lookup index: leave it out
        self._entries[key] = data
        return data
