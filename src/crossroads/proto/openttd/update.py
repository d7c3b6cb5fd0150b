"""A registered server's SERVER_UPDATE, and its leaving, as Store flows (sans-I/O).

Theory of operation
-------------------
Like a join's :class:`~crossroads.proto.openttd.lookup.CodeLookup`, each flow
here emits typed Store requests (:class:`StoreWrite`, with a correlation id,
:mod:`crossroads.proto.openttd.store`) and takes the answers back as inputs
(``store_result(request, answer)``, or ``store_failed(request)`` when the
Store could not answer); it ends with one outcome for the service to count.
Only the answer to the request a flow waits for is taken.

:class:`ServerUpdateFlow`: a seated server sends SERVER_UPDATE every 30 s
(reference ``openttd-coordinator.md`` section 3) with its current game info.

1. When the info names NewGRFs and the server's session still has NewGRF
   budget, index them (:class:`IndexNewgrfs`, answer: how many were new; the
   budget bounds how far one server can grow the shared lookup table);
2. then the record takes the new info, and its ``updated`` / ``expires``
   stamps move to the update's wall time (``expires`` one ``server_ttl``
   later), and is written (:class:`PutServer`);
3. :class:`Updated` ends it: count the update, spend the budget, and refresh
   the listing when this was the server's first game info (it becomes
   listable).

A Store failure at either step ends with :class:`UpdateFailed` (counted; the
connection stays: the next update or heartbeat writes the record again). A
failure in step 1 leaves the record as it was.

:class:`ServerLeavingFlow`: a seated server's connection closed. Its record is
deleted if it still belongs to the closed session (:class:`DeleteServer`: a
newer registration of the same code elsewhere keeps its own), then
:class:`Left` says whether the Store answered; either way the listing is
refreshed (the record expires by itself otherwise).

:class:`InstanceBeat`: every ``instance_heartbeat`` seconds the coordinator
renews its liveness key (:class:`AnnounceInstance`). When the key had been
missing, the Store lost this instance's state (a Redis restarted empty): for
every server seated here, renew its code's reservation (:class:`KeepCode`)
and write its record again (:class:`PutServer`), one after the other; then
:class:`Beat` says how many were put back (the service refreshes the listing
and logs it). A Store failure stops the beat (:class:`BeatFailed`); the next
beat finds the key missing again and starts over.

The record is the caller's: :class:`ServerUpdateFlow` updates it in place, as
the seated server's live record is what joins and heartbeats read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from crossroads.proto.openttd.coordinator import ServerUpdate
from crossroads.proto.openttd.gameinfo import NewGRF
from crossroads.proto.openttd.record import ServerRecord
from crossroads.proto.openttd.store import (
    AnnounceInstance,
    AwaitedRequest,
    DeleteServer,
    IndexNewgrfs,
    KeepCode,
    PutServer,
    StoreWrite,
)
from crossroads.types import frozen


@frozen
class Updated:
    """The record is stored: count it, spend ``newgrfs_indexed`` of the
    session's NewGRF budget; refresh the listing when ``became_listable``."""

    newgrfs_indexed: int
    became_listable: bool


@frozen
class UpdateFailed:
    """The Store failed: count it (``newgrfs_indexed`` were indexed before)."""

    newgrfs_indexed: int


@frozen
class Left:
    """The record is gone (``store_failed``: the Store could not say)."""

    store_failed: bool = False


@frozen
class Beat:
    """The beat is done; ``restored`` records were put back."""

    restored: int


@frozen
class BeatFailed:
    """The Store failed during the beat (the next one tries again)."""


UpdateCommand = StoreWrite | Updated | UpdateFailed
LeavingCommand = StoreWrite | Left
BeatCommand = StoreWrite | Beat | BeatFailed

#: The requests of the flows, in order (each flow makes each at most once).
_INDEX = 1
_PUT = 2
_DELETE = 3


@dataclass(eq=False)
class ServerUpdateFlow:
    """One SERVER_UPDATE; see the module docstring."""

    record: ServerRecord
    message: ServerUpdate
    newgrf_budget: int
    wall: float
    server_ttl: float
    indexed: int = field(default=0, init=False)
    _became_listable: bool = field(default=False, init=False)
    _awaited: AwaitedRequest = field(default_factory=AwaitedRequest, init=False)

    def start(self) -> list[UpdateCommand]:
        newgrfs: tuple[NewGRF, ...] = self.message.info.newgrfs
        if newgrfs and self.newgrf_budget > 0:
            return [
                self._awaited.write(_INDEX, IndexNewgrfs(newgrfs, self.newgrf_budget))
            ]
        return self._put()

    def store_result(self, request: int, answer: object) -> list[UpdateCommand]:
        if not self._awaited.answered(request):
            return []
        if request == _INDEX:
            # An answer that is not a count is the Store's fault, not the
            # server's: nothing was spent that we can tell.
            if isinstance(answer, int) and not isinstance(answer, bool):
                self.indexed = max(0, min(answer, self.newgrf_budget))
            return self._put()
        return [Updated(self.indexed, self._became_listable)]

    def store_failed(self, request: int) -> list[UpdateCommand]:
        if not self._awaited.answered(request):
            return []
        return [UpdateFailed(self.indexed)]

    def _put(self) -> list[UpdateCommand]:
        record = self.record
        self._became_listable = record.info is None
        record.info = self.message.info
        record.game_info_version = self.message.game_info_version
        record.updated = self.wall
        record.expires = self.wall + self.server_ttl
        return [self._awaited.write(_PUT, PutServer(record))]


class ServerLeavingFlow:
    """A seated server's connection closed; see the module docstring."""

    def __init__(self, code: str, session: str) -> None:
        self.code = code
        self.session = session
        self._awaited = AwaitedRequest()

    def start(self) -> list[LeavingCommand]:
        return [self._awaited.write(_DELETE, DeleteServer(self.code, self.session))]

    def store_result(self, request: int, answer: object) -> list[LeavingCommand]:
        return [Left(False)] if self._awaited.answered(request) else []

    def store_failed(self, request: int) -> list[LeavingCommand]:
        return [Left(True)] if self._awaited.answered(request) else []


class InstanceBeat:
    """One liveness beat of the coordinator; see the module docstring.
    ``records`` are the servers seated here when the beat started."""

    def __init__(self, instance: str, records: list[ServerRecord]) -> None:
        self.instance = instance
        self.records = records
        # The writes after the announcement, in order: the requests 1, 2 ...
        self._writes = [
            update
            for record in records
            for update in (KeepCode(record.code), PutServer(record))
        ]
        self._awaited = AwaitedRequest()

    def start(self) -> list[BeatCommand]:
        return [self._awaited.write(0, AnnounceInstance(self.instance))]

    def store_result(self, request: int, answer: object) -> list[BeatCommand]:
        if not self._awaited.answered(request):
            return []
        if request == 0 and answer is not True:
            return [Beat(0)]  # the key was there: the Store has our state
        if request == len(self._writes):
            return [Beat(len(self.records))]
        return [self._awaited.write(request + 1, self._writes[request])]

    def store_failed(self, request: int) -> list[BeatCommand]:
        return [BeatFailed()] if self._awaited.answered(request) else []
