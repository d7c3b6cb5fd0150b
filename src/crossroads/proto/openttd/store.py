"""The Store requests of the coordinator's flows (sans-I/O).

Theory of operation
-------------------
No OpenTTD core touches the Store. A flow that needs it emits a
:class:`StoreRead` (a query and its answer) or a :class:`StoreWrite` (an
update; an answer only where the update names one), each with a correlation
id, and waits; the service runs the request (services/openttd/runners.py,
``run_store_request``) and feeds the answer back to the flow's
``store_result(request, answer, ...)``, or calls its ``store_failed(request,
...)`` when the Store could not answer. Each request type's docstring names
its answer. A flow takes only the answer to the request it waits for; an
answer of the wrong type is the Store's failure, never a crash.

Who asks what: a registration (:mod:`.registration`) reads codes and records
and writes the record; a join's lookup (:mod:`.lookup`) reads a record; a
server's update and leaving (:mod:`.update`) index NewGRFs, write and delete
the record; a listing refresh (:mod:`.listing`) reads every record, sweeps
the dead ones and reloads the NewGRF lookup table; the instance's beat
(:mod:`.update`) renews its liveness and puts back what a Store that lost
everything no longer holds; a join stores a TURN ticket, and the TURN
listener checks it (:mod:`.lobby`) and drops it once used.
"""

from __future__ import annotations

from crossroads.proto.openttd.gameinfo import NewGRF
from crossroads.proto.openttd.record import ServerRecord
from crossroads.types import frozen


@frozen
class GetServer:
    """Read the record of ``code`` (answer: ``ServerRecord | None``)."""

    code: str


@frozen
class InstanceAlive:
    """Does coordinator ``instance`` still beat? (answer: ``bool``)."""

    instance: str


@frozen
class NewCode:
    """Reserve a fresh invite code (answer: ``str``, or None when the
    deployment's invite-code cap is reached)."""


@frozen
class KeepCode:
    """Renew the reservation of ``code`` (answer: None)."""

    code: str


@frozen
class PutServer:
    """Write the server's record (answer: None)."""

    record: ServerRecord


@frozen
class IndexNewgrfs:
    """Give each of ``newgrfs`` a lookup index, creating at most ``budget``
    new ones (answer: ``int``, how many were new; proto/openttd/update.py)."""

    newgrfs: tuple[NewGRF, ...]
    budget: int


@frozen
class DeleteServer:
    """Delete the record of ``code`` if it still belongs to ``session``
    (answer: None; proto/openttd/update.py)."""

    code: str
    session: str


@frozen
class AllServers:
    """Read every stored record (answer: ``Mapping[str, bytes]``, code ->
    raw record)."""


@frozen
class DeadInstances:
    """Which of ``owners`` stopped beating? (answer: ``Collection[str]``)."""

    owners: frozenset[str]


@frozen
class NewgrfCounter:
    """Read the highest NewGRF lookup index handed out (answer: ``bytes | None``,
    a decimal number)."""


@frozen
class SweepServers:
    """Delete the records of ``codes`` (corrupt, expired or orphaned; answer:
    None)."""

    codes: tuple[str, ...]


@frozen
class LoadNewgrfs:
    """Reload the NewGRF lookup table from the Store into the service's
    cache (answer: None)."""


@frozen
class AnnounceInstance:
    """Renew coordinator ``instance``'s liveness key (answer: ``bool``, True
    when the key had been missing: first start, or the Store lost it)."""

    instance: str


@frozen
class GetTicket:
    """Read the secret half of TURN ticket ``ticket_id`` (answer: ``str |
    None``)."""

    ticket_id: str


@frozen
class PutTicket:
    """Store TURN ticket ``ticket_id`` -> ``secret`` for whichever instance's
    TURN listener the peers reach (answer: None)."""

    ticket_id: str
    secret: str


@frozen
class DropTicket:
    """Delete a TURN ticket both sides used (single use; answer: None)."""

    ticket_id: str


StoreQuery = (
    GetServer
    | InstanceAlive
    | NewCode
    | AllServers
    | DeadInstances
    | NewgrfCounter
    | GetTicket
)
StoreUpdate = (
    KeepCode
    | PutServer
    | IndexNewgrfs
    | DeleteServer
    | SweepServers
    | LoadNewgrfs
    | AnnounceInstance
    | PutTicket
    | DropTicket
)


@frozen
class StoreRead:
    """Run ``query``; feed the answer to ``store_result(request, answer)``."""

    request: int
    query: StoreQuery


@frozen
class StoreWrite:
    """Run ``update``; feed ``store_result(request, answer)`` when done (the
    answer is None unless the update's docstring names one)."""

    request: int
    update: StoreUpdate


class AwaitedRequest:
    """The one Store request a flow waits for, by correlation id: a flow sends
    each request through :meth:`read` / :meth:`write` and takes an answer only
    when :meth:`answered` says it is the awaited one (a late, repeated or
    foreign answer is ignored)."""

    __slots__ = ("_request",)

    def __init__(self) -> None:
        self._request: int | None = None

    def read(self, request: int, query: StoreQuery) -> StoreRead:
        self._request = request
        return StoreRead(request, query)

    def write(self, request: int, update: StoreUpdate) -> StoreWrite:
        self._request = request
        return StoreWrite(request, update)

    def answered(self, request: int) -> bool:
        """Is ``request`` the awaited one? If so, nothing is awaited any more."""
        if self._request is None or request != self._request:
            return False
        self._request = None
        return True
