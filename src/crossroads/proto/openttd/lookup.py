"""Resolving a join's invite code to a server record (sans-I/O).

Theory of operation
-------------------
CLIENT_CONNECT names an invite code (reference ``openttd-coordinator.md``
section 4). :class:`CodeLookup` decides where its record comes from and emits
what it needs, like every coordinator flow (the Store request types are the
coordinator's, :mod:`crossroads.proto.openttd.store`):

- a string that does not have the shape of a code is never looked up: it is
  unknown at once, so a guesser sending junk costs no Store read;
- a code seated on this instance is answered from memory (its live record);
- any other code is read from the Store (:class:`StoreRead` of
  :class:`GetServer`) and the answer fed back
  (:meth:`CodeLookup.store_result`); an answer that is not a record means
  the code is unknown.

The flow ends with one :class:`Resolved`. A Store failure resolves to no
record with ``store_failed`` set: the join is refused as an unknown code (the
client may retry), but the guess is not the client's fault, so the caller
refunds the guess budget (:class:`~crossroads.proto.budget.FailureBudget`).
"""

from __future__ import annotations

from crossroads.proto.openttd.codes import looks_like_invite_code
from crossroads.proto.openttd.record import ServerRecord
from crossroads.proto.openttd.store import (
    AwaitedRequest,
    GetServer,
    StoreRead,
)
from crossroads.types import frozen


@frozen
class Resolved:
    """The code's record (None: unknown)."""

    record: ServerRecord | None
    #: The Store could not answer (refund the guess; count a store error).
    store_failed: bool = False


LookupCommand = StoreRead | Resolved

#: The one request a lookup makes.
_READ = 1


class CodeLookup:
    """One invite code's lookup; see the module docstring."""

    def __init__(self, code: str, local: ServerRecord | None) -> None:
        self.code = code
        self.local = local
        self.done = False
        self._awaited = AwaitedRequest()

    def start(self) -> list[LookupCommand]:
        if not looks_like_invite_code(self.code):
            return self._resolve(None)
        if self.local is not None:
            return self._resolve(self.local)
        return [self._awaited.read(_READ, GetServer(self.code))]

    def store_result(self, request: int, answer: object) -> list[LookupCommand]:
        if not self._awaited.answered(request):
            return []
        return self._resolve(answer if isinstance(answer, ServerRecord) else None)

    def store_failed(self, request: int) -> list[LookupCommand]:
        if not self._awaited.answered(request):
            return []
        return self._resolve(None, store_failed=True)

    def _resolve(
        self, record: ServerRecord | None, store_failed: bool = False
    ) -> list[LookupCommand]:
        self.done = True
        return [Resolved(record, store_failed)]
