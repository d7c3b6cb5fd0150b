"""Every sans-I/O core in proto/ has the one core API (proto/core.py).

proto/cores.py is the table: mypy --strict checks the type of each entry
against its Protocol; these tests check, at run time, that the table names
every class of proto/ with an input or output of the API (so a new core
cannot be left out, nor an old shape come back), that each listed core has
its Protocol's methods with the API's parameter names, and that every timer
in proto/ has the API's signature.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Iterator

import pytest

import crossroads.proto
from crossroads.proto import core as api
from crossroads.proto import cores
from crossroads.types import Address

#: The methods of the core API, by Protocol (TimedCore's are in every one).
API: dict[type, tuple[str, ...]] = {
    api.TimedCore: ("get_timer", "handle_timer"),
    api.DatagramCore: ("receive_datagram", "datagrams_to_send"),
    api.MultiSocketCore: ("receive_datagram", "datagrams_to_send"),
    api.StreamCore: ("receive_data", "data_to_send"),
    api.EventSource: ("pop_events",),
}
#: Names of the shapes the cores had before the one API: none may come back.
OLD_SHAPES = {"handle", "handle_message", "events", "receive_text", "frames_to_send"}


def _proto_classes() -> Iterator[type]:
    """Every class defined in a module of crossroads.proto, but the API's own."""
    for info in pkgutil.walk_packages(
        crossroads.proto.__path__, crossroads.proto.__name__ + "."
    ):
        if info.name in (api.__name__, cores.__name__):
            continue
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if inspect.isclass(value) and value.__module__ == module.__name__:
                yield value


def _table() -> list[tuple[type, type]]:
    """(core, Protocol) for every entry of proto/cores.py."""
    rows: list[tuple[type, type]] = []
    for protocol, listed in (
        (api.DatagramCore, cores.DATAGRAM_CORES),
        (api.MultiSocketCore, cores.MULTI_SOCKET_CORES),
        (api.StreamCore, cores.STREAM_CORES),
        (api.TimedCore, cores.TIMED_CORES),
        (api.EventSource, cores.EVENT_SOURCES),
    ):
        rows.extend((core, protocol) for core in listed)
    return rows


def test_the_table_names_every_core_in_proto() -> None:
    """Every class with an input or output of the API (not the timer alone)
    is listed, but a base class that listed cores inherit it from."""
    io = {
        name
        for protocol, names in API.items()
        if protocol is not api.TimedCore
        for name in names
    }
    listed = {core for core, _ in _table()} | set(cores.DEVIATIONS)
    bases = {base for core in listed for base in core.__mro__[1:]}
    found = {cls for cls in _proto_classes() if io & set(vars(cls))} - bases
    assert found - listed == set(), "a core missing from proto/cores.py"
    timed = {
        cls
        for cls in _proto_classes()
        if {"get_timer", "handle_timer"} & set(vars(cls))
    }
    assert listed - found - timed == set(), "proto/cores.py lists a class with no API"
    # A deviation is a core that is in no Protocol's list, with a reason.
    assert not set(cores.DEVIATIONS) & {core for core, _ in _table()}
    assert all(reason for reason in cores.DEVIATIONS.values())


def test_every_timer_has_the_api_signature() -> None:
    """get_timer() and handle_timer(now) wherever they are, listed or not
    (flows with a timer and no datagrams need no entry in the table)."""
    for cls in _proto_classes():
        if "get_timer" in vars(cls):
            assert _parameters(cls.get_timer) == [], cls  # type: ignore[attr-defined]
        if "handle_timer" in vars(cls):
            names = [p.name for p in _parameters(cls.handle_timer)]  # type: ignore[attr-defined]
            assert names == ["now"], cls


def test_no_core_keeps_an_old_shape() -> None:
    for cls in _proto_classes():
        kept = OLD_SHAPES & set(vars(cls))
        assert not kept, f"{cls.__module__}.{cls.__name__} still has {kept}"


def _parameters(function: object) -> list[inspect.Parameter]:
    return list(inspect.signature(function).parameters.values())[1:]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("core", "protocol"),
    _table(),
    ids=[f"{core.__name__}-{protocol.__name__}" for core, protocol in _table()],
)
def test_core_has_its_protocols_methods(core: type, protocol: type) -> None:
    # Every input shape comes with the timer (get_timer / handle_timer).
    names = API[protocol] + (
        API[api.TimedCore] if protocol is not api.EventSource else ()
    )
    for name in names:
        expected = _parameters(getattr(protocol, name))
        actual = _parameters(getattr(core, name))
        assert len(actual) >= len(expected), (core, name)
        # Extra parameters only with defaults (the driver passes the API's).
        assert all(p.default is not p.empty for p in actual[len(expected) :])
        for want, have in zip(expected, actual, strict=False):
            assert have.kind in (have.POSITIONAL_ONLY, have.POSITIONAL_OR_KEYWORD)
            assert have.name == want.name, (core, name, have.name, want.name)


#: Cores that keep a queue of their own instead of proto/core.py's, and why.
OWN_QUEUES: dict[str, str] = {
    "RakNetNode": "its datagrams are its RakNetServer's; its events are a "
    "bounded deque, so nobody has to read them",
}


def test_every_core_uses_the_one_outbox_and_event_queue() -> None:
    """The pull methods are written once (proto/core.py): a core inherits
    Outbox / EventQueue rather than swapping a list of its own."""
    for core, protocol in _table():
        if core.__name__ in OWN_QUEUES:
            continue
        if protocol in (api.DatagramCore, api.MultiSocketCore):
            assert issubclass(core, api.Outbox), core
        if protocol is api.EventSource:
            assert issubclass(core, api.EventQueue), core


class _Echo(api.Outbox[api.Datagram], api.EventQueue[str]):
    """Both queues on one core, as most cores have them."""

    def receive_datagram(self, data: bytes, addr: Address, now: float) -> None:
        self._outbox.append((data, addr))
        self._events.append(f"echoed {len(data)}")


def test_outbox_and_event_queue_give_everything_once_oldest_first() -> None:
    core = _Echo()
    peer = ("192.0.2.1", 4000)
    core.receive_datagram(b"a", peer, 1.0)
    core.receive_datagram(b"bb", peer, 1.0)
    assert core.datagrams_to_send(1.0) == [(b"a", peer), (b"bb", peer)]
    assert core.pop_events() == ["echoed 1", "echoed 2"]
    assert core.datagrams_to_send(1.0) == []
    assert core.pop_events() == []
    core.receive_datagram(b"c", peer, 2.0)
    assert core.datagrams_to_send(2.0) == [(b"c", peer)]
