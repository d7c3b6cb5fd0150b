"""Where a TURN side waits for its peer (sans-I/O).

Theory of operation
-------------------
Both peers of a join connect to the TURN service (TCP 3974) and present the
same ticket ``<id>:<secret>`` (reference ``openttd-coordinator.md`` section 6).
The first to arrive waits in the :class:`TurnLobby` under the ticket's id, for
at most ``wait_timeout`` (the reference service's 20 s); the second is
:meth:`~TurnLobby.pair`-ed with it when it presents the same secret (compared
in constant time), and the service then relays between the two. A second side
with another secret is a :data:`MISMATCH` (the service closes it: a guess).

Every wait's deadline is kept in one
:class:`~crossroads.proto.openttd.deadlines.DeadlineBook` under the lobby's one
timer (the core API, :mod:`crossroads.proto.core`): when a side's wait runs
out, :meth:`~TurnLobby.handle_timer` removes it and queues it for
:meth:`~TurnLobby.pop_events`; the service closes it ("peer-never-came").

Before a first side waits, its ticket is checked against the one the
coordinator stored (:class:`TicketCheck`: a :class:`GetTicket` read, the
secret compared in constant time; the service runs it like every Store flow).

Bounded: at most ``max_waiting`` sides wait at once (each is an open socket);
:meth:`~TurnLobby.wait` refuses more. A side that goes away
(:meth:`~TurnLobby.leave`) takes its entry and its deadline with it.
Connections are the caller's handles.
"""

from __future__ import annotations

import hmac
from collections.abc import Hashable
from enum import Enum
from typing import Generic, TypeVar

from crossroads.proto.core import EventQueue
from crossroads.proto.openttd.deadlines import DeadlineBook
from crossroads.proto.openttd.store import AwaitedRequest, GetTicket, StoreRead
from crossroads.types import frozen

Conn = TypeVar("Conn", bound=Hashable)


class Mismatch(Enum):
    """A side waits under this ticket id with another secret."""

    MISMATCH = "mismatch"


MISMATCH = Mismatch.MISMATCH


@frozen
class _Waiting(Generic[Conn]):
    conn: Conn
    secret: str


class TurnLobby(EventQueue[Conn], Generic[Conn]):
    """Sides waiting for their peer, by ticket id (see the module docstring).
    :meth:`pop_events` returns the sides whose wait ran out."""

    def __init__(self, wait_timeout: float, max_waiting: int) -> None:
        super().__init__()
        self.wait_timeout = wait_timeout
        self.max_waiting = max_waiting
        self._waiting: dict[str, _Waiting[Conn]] = {}
        self._deadlines: DeadlineBook[str] = DeadlineBook()

    def __len__(self) -> int:
        return len(self._waiting)

    def pair(self, ticket_id: str, secret: str) -> Conn | Mismatch | None:
        """The side waiting under ``ticket_id`` with ``secret``, taken out of
        the lobby; :data:`MISMATCH` when it waits with another secret (it
        stays); None when nobody waits."""
        waiting = self._waiting.get(ticket_id)
        if waiting is None:
            return None
        if not hmac.compare_digest(waiting.secret, secret):
            return MISMATCH
        self._remove(ticket_id)
        return waiting.conn

    def wait(self, ticket_id: str, secret: str, conn: Conn, now: float) -> bool:
        """``conn`` waits for its peer until ``now + wait_timeout``; False
        when the lobby is full (or another side waits under this id)."""
        if len(self._waiting) >= self.max_waiting or ticket_id in self._waiting:
            return False
        self._waiting[ticket_id] = _Waiting(conn, secret)
        self._deadlines.update(ticket_id, now + self.wait_timeout)
        return True

    def leave(self, ticket_id: str, conn: Conn) -> None:
        """``conn`` went away: forget its wait (if it is the one waiting)."""
        waiting = self._waiting.get(ticket_id)
        if waiting is not None and waiting.conn == conn:
            self._remove(ticket_id)

    def clear(self) -> None:
        for ticket_id in list(self._waiting):
            self._remove(ticket_id)

    # ----------------------------------------------------------- core API

    def get_timer(self) -> float | None:
        return self._deadlines.get_timer()

    def handle_timer(self, now: float) -> None:
        """The sides whose wait ran out leave; they go to :meth:`pop_events`."""
        for ticket_id in self._deadlines.due(now):
            waiting = self._waiting.pop(ticket_id, None)
            if waiting is not None:
                self._events.append(waiting.conn)

    def _remove(self, ticket_id: str) -> None:
        del self._waiting[ticket_id]
        self._deadlines.discard(ticket_id)


class TicketVerdict(Enum):
    """What a :class:`TicketCheck` found."""

    #: The coordinator stored this ticket: the side may wait.
    VALID = "valid"
    #: No such ticket, or another secret: close the side (a guess).
    INVALID = "invalid"
    #: The Store did not answer: close the side without judging it.
    STORE_ERROR = "store-error"


TicketCommand = StoreRead | TicketVerdict


class TicketCheck:
    """Is ``ticket_id``:``secret`` a ticket the coordinator stored? One Store
    read, then a :class:`TicketVerdict`."""

    def __init__(self, ticket_id: str, secret: str) -> None:
        self.ticket_id = ticket_id
        self.secret = secret
        self._awaited = AwaitedRequest()

    def start(self) -> list[TicketCommand]:
        return [self._awaited.read(1, GetTicket(self.ticket_id))]

    def store_result(self, request: int, answer: object) -> list[TicketCommand]:
        if not self._awaited.answered(request):
            return []
        if isinstance(answer, str) and hmac.compare_digest(answer, self.secret):
            return [TicketVerdict.VALID]
        return [TicketVerdict.INVALID]

    def store_failed(self, request: int) -> list[TicketCommand]:
        if not self._awaited.answered(request):
            return []
        return [TicketVerdict.STORE_ERROR]
