"""The route table on the socket plane (tests/transport/test_kernelroutes.py
has it with the kernel plane, in namespaces): it writes a tap's routes, its
handles count what the tap forwarded and outlive removal, removal and
restoration act on the next datagram, and a table's owner can clear it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from crossroads.transport.dataplane import make_budget, make_route
from crossroads.transport.kernelplane import RouteKind
from crossroads.transport.routes import RouteTable, kernel_kind
from crossroads.transport.turnplane import (
    SEND_INDICATION_KEY,
    channel_key,
    data_route,
    send_route,
    to_client_route,
    to_peer_route,
)
from tests.transport.test_dataplane import IMPLEMENTATIONS, Rig, recv, udp


@pytest.fixture(params=IMPLEMENTATIONS)
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    made = Rig(request.param)
    yield made
    made.close()


def test_install_remove_reinstate_on_the_tap(rig: Rig) -> None:
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
    route.reinstate()
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


def test_a_routes_kernel_twin_does_what_the_tap_route_does() -> None:
    """The kernel's kind follows the tap's route: a plain rewrite (with a
    header: the Unity relay's RELAY frames), TURN's ChannelData unwrapped
    (keyed by the channel number in the listening side's key) or wrapped (on
    the route's channel); Send and Data indications are parsed and written
    in user space, so they have no kernel twin."""
    sock, peer, client = udp(), ("192.0.2.9", 5000), ("198.51.100.9", 6000)
    budget = make_budget(0)
    try:
        assert kernel_kind(make_route(sock, peer), None) == (RouteKind.REWRITE, 0)
        assert kernel_kind(make_route(sock, peer), b"h" * 36) == (RouteKind.RELAY, 0)
        header = channel_key(client, 0x4001)[1]
        unwrap = to_peer_route(sock, peer, budget)
        assert kernel_kind(unwrap, header) == (RouteKind.UNWRAP_CHANNEL, 0x4001)
        wrap = to_client_route(sock, client, 0x4002, budget)
        assert kernel_kind(wrap, None) == (RouteKind.WRAP_CHANNEL, 0x4002)
        data = data_route(sock, client, peer, bytes(8), budget)
        assert kernel_kind(data, None) is None
        send = send_route(sock, {}, set(), budget)
        assert kernel_kind(send, SEND_INDICATION_KEY) is None
    finally:
        sock.close()
