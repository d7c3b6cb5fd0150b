"""What a running service shows the layers around it: :class:`Service` (its
name, where it listens, how it stops) and, for services with sessions an
operator may end, :class:`SessionAdmin` and its :class:`SessionInfo` rows.

Services implement these (:mod:`crossroads.services.base` documents the rest
of a service module's contract); the web console and the admin CLI read them.
They live below both because web/ and services/ stand beside each other and
neither imports the other (the layer order in tests/test_imports.py).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from crossroads.types import frozen


class Service(Protocol):
    """A running service."""

    name: str

    def describe(self) -> list[str]:
        """Where it listens, one string each (``"udp 0.0.0.0:3478"``)."""
        ...

    async def close(self) -> None:
        """Stop listening and release every socket and task. Idempotent."""
        ...


@frozen
class SessionInfo:
    """One live session as admin tools show it (web console, ``crossroads
    sessions``). Plain strings and numbers: it is sent as JSON."""

    #: Stable while the session lives; what :meth:`SessionAdmin.revoke` takes.
    id: str
    #: The client's transport address, ``host:port`` (``[v6]:port``).
    client: str
    #: User name, or "" when the protocol has none.
    user: str = ""
    #: One short line: relayed addresses, peers, region ...
    detail: str = ""
    #: Seconds until it expires unless refreshed (None: no deadline).
    expires_in: float | None = None
    #: False for sessions that end on their own within seconds (natneg
    #: negotiations): listed, never revoked.
    revocable: bool = True


@runtime_checkable
class SessionAdmin(Protocol):
    """A service whose live sessions an operator can list and end."""

    def sessions(self) -> list[SessionInfo]:
        """Every live session of this process."""
        ...

    def revoke(self, session_id: str) -> bool:
        """End one session now; False when no such session is live."""
        ...


@frozen
class Impairment:
    """QA impairment of one relayed session's frames, both ways (admin only,
    off unless set): each frame is lost with probability ``loss``, else sent
    ``delay`` seconds later, plus or minus up to ``jitter`` (uniform; frames
    may then arrive out of order, as on a real jittery path)."""

    delay: float = 0.0
    jitter: float = 0.0
    loss: float = 0.0

    @property
    def active(self) -> bool:
        return bool(self.delay or self.jitter or self.loss)


@runtime_checkable
class Impairable(Protocol):
    """A service whose relayed sessions an operator may impair for QA (delay,
    jitter, loss; the console's ``/console/api/admin/impair``)."""

    def impair(self, session_id: str, impairment: Impairment | None) -> bool:
        """Impair one live session (None: stop); False when no such session."""
        ...
