"""The joins under way on one coordinator instance, indexed three ways.

Theory of operation. A join (one :class:`~crossroads.proto.openttd.ladder.ConnectAttempt`
and whatever drives it) is filed under its attempt key, the invite code of the
server it joins, and the client connection that asked. Reports find it by key
(the token carries it); when the server's connection closes, every join to
that code learns it (``peer_gone(SERVER)``), when the client's closes, every
join of that client (``peer_gone(CLIENT)``); a client may have at most a few
under way (:data:`~crossroads.proto.openttd.admission.MAX_ATTEMPTS_PER_CONNECTION`).
A join leaves all three indexes at once when it finishes, and empty index
entries are dropped, so the book holds nothing for a code or a client without
a join under way. Pure bookkeeping: the driver type and the client handle are
the caller's (any hashable handle; the service uses its connection objects).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

Driver = TypeVar("Driver")
Client = TypeVar("Client", bound=Hashable)


@dataclass(slots=True)
class _Filed(Generic[Driver, Client]):
    driver: Driver
    code: str
    client: Client


@dataclass(slots=True)
class AttemptBook(Generic[Driver, Client]):
    """Joins by attempt key, by invite code and by client (module docstring)."""

    _by_key: dict[str, _Filed[Driver, Client]] = field(default_factory=dict)
    _by_code: dict[str, set[str]] = field(default_factory=dict)
    _by_client: dict[Client, set[str]] = field(default_factory=dict)

    def add(self, key: str, code: str, client: Client, driver: Driver) -> None:
        self._by_key[key] = _Filed(driver, code, client)
        self._by_code.setdefault(code, set()).add(key)
        self._by_client.setdefault(client, set()).add(key)

    def get(self, key: str) -> Driver | None:
        filed = self._by_key.get(key)
        return None if filed is None else filed.driver

    def remove(self, key: str) -> None:
        filed = self._by_key.pop(key, None)
        if filed is None:
            return
        _discard(self._by_code, filed.code, key)
        _discard(self._by_client, filed.client, key)

    def of_code(self, code: str) -> list[Driver]:
        """The joins to the server registered as ``code``."""
        return [self._by_key[key].driver for key in self._by_code.get(code, ())]

    def of_client(self, client: Client) -> list[Driver]:
        return [self._by_key[key].driver for key in self._by_client.get(client, ())]

    def count_of_client(self, client: Client) -> int:
        return len(self._by_client.get(client, ()))

    def drivers(self) -> list[Driver]:
        return [filed.driver for filed in self._by_key.values()]

    def clear(self) -> None:
        self._by_key.clear()
        self._by_code.clear()
        self._by_client.clear()

    def __len__(self) -> int:
        return len(self._by_key)


K = TypeVar("K", bound=Hashable)


def _discard(index: dict[K, set[str]], name: K, key: str) -> None:
    keys = index.get(name)
    if keys is not None:
        keys.discard(key)
        if not keys:
            del index[name]
