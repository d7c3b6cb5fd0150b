"""The route table on the socket plane (tests/transport/test_kernelroutes.py
has it with the kernel plane, in namespaces): it writes a tap's routes, its
handles count what the tap forwarded and outlive removal, removal and
restoration act on the next datagram, and a table's owner can clear it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from crossroads.transport.routes import RouteTable
from tests.transport.test_dataplane import IMPLEMENTATIONS, Rig, recv


@pytest.fixture(params=IMPLEMENTATIONS)
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    made = Rig(request.param)
    yield made
    made.close()


def test_install_remove_restore_on_the_tap(rig: Rig) -> None:
    table = RouteTable()
    route = table.install(rig.routes, rig.a.getsockname(), rig.route(), via=rig.relay)
    assert route.twin is None  # no kernel plane
    rig.send(rig.a, b"one")
    rig.tap.readable()
    assert recv(rig.dest) is not None
    assert (route.packets, route.octets) == (1, 3)
    route.remove()
    assert rig.routes == {}
    rig.send(rig.a, b"two")
    rig.tap.readable()
    assert rig.fallen == [(b"two", rig.a.getsockname())]  # to the control plane
    assert (route.packets, route.octets) == (1, 3)  # kept
    route.restore()
    rig.send(rig.a, b"three")
    rig.tap.readable()
    assert recv(rig.dest) is not None
    assert (route.packets, route.octets) == (2, 8)  # carried on


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_a_header_keys_the_route_by_source_and_prefix(impl: Any) -> None:
    other = Rig(impl, prefix=2)
    try:
        table = RouteTable()
        route = table.install(
            other.routes,
            other.a.getsockname(),
            other.route(),
            via=other.relay,
            header=b"hi",
        )
        assert list(other.routes) == [(other.a.getsockname(), b"hi")]
        other.send(other.a, b"hi there")
        other.send(other.a, b"no route")
        other.tap.readable()
        assert recv(other.dest) == (b"hi there", other.out.getsockname())
        assert [data for data, _ in other.fallen] == [b"no route"]
        assert route.packets == 1
    finally:
        other.close()


def test_clear_removes_one_tables_routes_only(rig: Rig) -> None:
    table = RouteTable()
    theirs: dict[Any, Any] = {}
    mine = [
        table.install(rig.routes, sock.getsockname(), rig.route(), via=rig.relay)
        for sock in (rig.a, rig.b)
    ]
    kept = table.install(theirs, rig.a.getsockname(), rig.route(), via=None)
    table.clear(rig.routes)
    assert rig.routes == {} and not any(r.live for r in mine)
    assert theirs == {rig.a.getsockname(): kept.entry} and kept.live


def test_a_second_install_on_a_key_replaces_the_first_everywhere(rig: Rig) -> None:
    table = RouteTable()
    first = table.install(rig.routes, rig.a.getsockname(), rig.route(), via=rig.relay)
    second = table.install(rig.routes, rig.a.getsockname(), rig.route(), via=rig.relay)
    assert not first.live and second.live
    assert rig.routes == {rig.a.getsockname(): second.entry}
    first.remove()  # already out: it does not take the second with it
    assert rig.routes == {rig.a.getsockname(): second.entry}
