"""A secret every instance sharing one store must agree on.

Theory of operation
-------------------
Relay tokens and OpenTTD invite-code secrets are signed with a key that every
instance must hold, created once in the store (``SET NX``) when none is
configured. The store may lose it: a Redis restarted without persistence
(``--save ''``) comes back empty. Before, the next instance to start then drew a
new key and the cluster split in two: tokens from one half failed on the other
and OpenTTD servers lost their invite codes.

So every instance that holds the key re-publishes it on each heartbeat with
``SET NX``: the first write after the store came back wins, and every other
instance reads the winner. An instance whose key lost *adopts* the winner's and
logs that it did; it keeps the keys it held before (:attr:`previous`) so what it
signed with them still verifies. In the common case (surviving instances
re-publish within one heartbeat, before anybody restarts) the winner is the key
everybody already holds and nothing changes.

The key is never logged. Configure it explicitly (``--relay-secret``,
``--openttd-secret``) to take the store out of the picture entirely.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from crossroads.store.base import Store

log = logging.getLogger("crossroads.store")

#: Keys kept after an adoption, newest first: enough for a few adoptions in a
#: row (a flapping store) without keeping every key ever held.
MAX_PREVIOUS = 4


@dataclass(eq=False)
class SharedSecret:
    """The key at ``key`` in ``store``; :meth:`resolve` once, then
    :meth:`republish` on every heartbeat."""

    store: Store
    key: str
    what: str
    random_bytes: Callable[[int], bytes] = os.urandom
    current: bytes = field(default=b"", init=False, repr=False)
    #: Keys this instance held before an adoption, newest first.
    previous: list[bytes] = field(default_factory=list, init=False, repr=False)
    #: Times the store had lost the key and this instance put it back.
    restored: int = field(default=0, init=False)
    #: Times this instance adopted another instance's key.
    adopted: int = field(default=0, init=False)

    async def resolve(self) -> bytes:
        """The store's key, created (``SET NX``) when there is none."""
        candidate = self.random_bytes(32).hex().encode()
        await self.store.set(self.key, candidate, only_if_absent=True)
        stored = await self.store.get(self.key)
        self.current = stored or candidate
        return self.current

    async def republish(self) -> bytes | None:
        """Put our key back if the store lost it; returns the key adopted when
        another instance's re-publication won (None: nothing changed)."""
        if await self.store.set(self.key, self.current, only_if_absent=True):
            self.restored += 1
            log.warning(
                "%s: the store had lost the shared secret; re-published it", self.what
            )
            return None
        stored = await self.store.get(self.key)
        if stored is None or stored == self.current:
            return None
        self.previous = [self.current, *self.previous][:MAX_PREVIOUS]
        self.current = stored
        self.adopted += 1
        log.warning(
            "%s: another instance re-published a different shared secret first; "
            "adopted it (what this instance signed before still verifies here)",
            self.what,
        )
        return stored
