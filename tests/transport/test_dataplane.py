"""The relay data plane's route taps, C and pure Python, on real loopback sockets.

Both implementations run the same cases and must make the same decisions:
forward a routed datagram unchanged and count it on its route, hand everything
else to the fallback in arrival order, honour the key prefix, the length check
and the size cap, and stop reading once closed.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crossroads.transport import dataplane
from crossroads.transport.pktinfo import enable_pktinfo, reply_control

IMPLEMENTATIONS: list[Any] = [
    pytest.param((dataplane.PyRouteTap, dataplane.PyRoute), id="python")
]
try:
    from crossroads.transport import _turnfast
except ImportError:  # pragma: no cover - built by `make install`
    _turnfast = None  # type: ignore[assignment]
else:
    IMPLEMENTATIONS.append(pytest.param((_turnfast.RouteTap, _turnfast.Route), id="c"))


NEEDS_C = pytest.mark.skipif(_turnfast is None, reason="C data plane not built")
#: Hypothesis runs of C against the twin: real sockets per example, so few.
AGAINST_THE_TWIN = settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


def udp() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    return sock


def recv(sock: socket.socket, timeout: float = 2.0) -> tuple[bytes, Any] | None:
    sock.settimeout(timeout)
    try:
        return sock.recvfrom(70000)
    except TimeoutError:
        return None
    finally:
        sock.setblocking(False)


class Rig:
    """A tap on ``relay``, forwarding to ``dest`` from ``out``; ``a``/``b`` send."""

    def __init__(self, impl: tuple[Any, Any], **options: Any) -> None:
        self.tap_type, self.route_type = impl
        self.relay, self.out, self.dest, self.a, self.b = (udp() for _ in range(5))
        self.routes: dict[Any, Any] = {}
        self.fallen: list[tuple[bytes, Any]] = []
        self.tap = self.tap_type(self.relay, self.routes, self.on_fallback, **options)

    def on_fallback(self, data: bytes, addr: Any) -> None:
        self.fallen.append((data, addr))

    def route(self) -> Any:
        return self.route_type(self.out, self.dest.getsockname())

    def send(self, sock: socket.socket, data: bytes) -> None:
        # Loopback queues the datagram on the receiver within sendto.
        sock.sendto(data, self.relay.getsockname())

    def close(self) -> None:
        for sock in (self.relay, self.out, self.dest, self.a, self.b):
            sock.close()


@pytest.fixture(params=IMPLEMENTATIONS)
def impl(request: pytest.FixtureRequest) -> tuple[Any, Any]:
    value: tuple[Any, Any] = request.param
    return value


@pytest.fixture
def rig(impl: tuple[Any, Any]) -> Iterator[Rig]:
    made = Rig(impl)
    yield made
    made.close()


def test_routed_datagrams_go_out_unchanged_and_count_on_the_route(rig: Rig) -> None:
    route = rig.route()
    rig.routes[rig.a.getsockname()] = route
    rig.send(rig.a, b"hello")
    rig.send(rig.a, b"x" * 1200)
    rig.tap.readable()
    assert recv(rig.dest) == (b"hello", rig.out.getsockname())
    assert recv(rig.dest) == (b"x" * 1200, rig.out.getsockname())
    assert (route.packets, route.octets) == (2, 1205)
    assert (rig.tap.forwarded, rig.tap.forwarded_bytes) == (2, 1205)
    assert rig.fallen == []
    assert route.dest == rig.dest.getsockname()


def test_unrouted_datagrams_fall_back_in_order_and_a_new_route_applies_next(
    rig: Rig,
) -> None:
    def learn(data: bytes, addr: Any) -> None:
        rig.fallen.append((data, addr))
        rig.routes[addr] = rig.route()

    rig.tap = rig.tap_type(rig.relay, rig.routes, learn)
    rig.send(rig.b, b"first")
    rig.send(rig.b, b"second")
    rig.tap.readable()
    assert rig.fallen == [(b"first", rig.b.getsockname())]
    assert recv(rig.dest) == (b"second", rig.out.getsockname())
    assert rig.routes[rig.b.getsockname()].packets == 1


def test_forwarded_and_fallen_back_datagrams_keep_their_order(rig: Rig) -> None:
    rig.routes[rig.a.getsockname()] = rig.route()

    def relay_by_hand(data: bytes, addr: Any) -> None:
        rig.out.sendto(data, rig.dest.getsockname())

    rig.tap = rig.tap_type(rig.relay, rig.routes, relay_by_hand)
    for index in range(10):
        rig.send(rig.a if index % 3 else rig.b, bytes([index]))
    rig.tap.readable()
    assert [recv(rig.dest) for _ in range(10)] == [
        (bytes([index]), rig.out.getsockname()) for index in range(10)
    ]


def test_a_removed_route_stops_forwarding(rig: Rig) -> None:
    rig.routes[rig.a.getsockname()] = rig.route()
    rig.send(rig.a, b"one")
    rig.tap.readable()
    del rig.routes[rig.a.getsockname()]
    rig.send(rig.a, b"two")
    rig.tap.readable()
    assert recv(rig.dest) == (b"one", rig.out.getsockname())
    assert rig.fallen == [(b"two", rig.a.getsockname())]
    assert recv(rig.dest, timeout=0.05) is None


def test_prefix_key_and_length_check(impl: tuple[Any, Any]) -> None:
    # A Unity-relay-shaped frame: 4 header + 16 from + 16 to, u16 length, payload.
    rig = Rig(impl, prefix=36, length_at=36)
    try:
        head = bytes(range(36))
        rig.routes[(rig.a.getsockname(), head)] = rig.route()
        good = head + (3).to_bytes(2, "big") + b"abc"
        wrong_length = head + (4).to_bytes(2, "big") + b"abc"
        other_route = bytes(36) + (3).to_bytes(2, "big") + b"abc"
        short = head[:20]
        for data in (good, wrong_length, other_route, short):
            rig.send(rig.a, data)
        rig.send(rig.b, good)  # right frame, wrong source
        rig.tap.readable()
        assert recv(rig.dest) == (good, rig.out.getsockname())
        assert rig.fallen == [
            (wrong_length, rig.a.getsockname()),
            (other_route, rig.a.getsockname()),
            (short, rig.a.getsockname()),
            (good, rig.b.getsockname()),
        ]
    finally:
        rig.close()


def test_oversized_datagrams_are_dropped_and_counted(impl: tuple[Any, Any]) -> None:
    rig = Rig(impl, max_size=1500)
    try:
        rig.routes[rig.a.getsockname()] = rig.route()
        rig.send(rig.a, b"y" * 1501)
        rig.send(rig.b, b"z" * 1501)
        rig.send(rig.a, b"y" * 1500)
        rig.tap.readable()
        assert recv(rig.dest) == (b"y" * 1500, rig.out.getsockname())
        assert rig.tap.malformed == 2
        assert rig.fallen == []
    finally:
        rig.close()


def test_a_closed_tap_reads_nothing(rig: Rig) -> None:
    rig.routes[rig.a.getsockname()] = rig.route()
    rig.tap.close()
    rig.send(rig.a, b"late")
    rig.tap.readable()
    assert rig.tap.fd == -1
    assert recv(rig.dest, timeout=0.05) is None
    assert rig.fallen == []


def test_a_fallback_that_closes_the_tap_ends_the_drain(rig: Rig) -> None:
    def release(data: bytes, addr: Any) -> None:
        rig.fallen.append((data, addr))
        rig.tap.close()

    rig.tap = rig.tap_type(rig.relay, rig.routes, release)
    rig.send(rig.b, b"bye")
    rig.send(rig.b, b"unread")
    rig.tap.readable()
    assert rig.fallen == [(b"bye", rig.b.getsockname())]


def test_bad_options_are_refused(impl: tuple[Any, Any]) -> None:
    tap_type, route_type = impl
    sock = udp()
    try:
        for options in ({"prefix": 65}, {"length_at": -2}, {"max_size": 70000}):
            with pytest.raises(ValueError):
                tap_type(sock, {}, print, **options)
        with pytest.raises(ValueError):
            route_type(sock, ("not an address", 1))
        with pytest.raises(ValueError):
            route_type(sock, ("127.0.0.1", 1), (0, 8, b""))
        with pytest.raises(ValueError):
            route_type(sock, ("127.0.0.1", 1), (0, 8, bytes(21)))
    finally:
        sock.close()


@NEEDS_C
@AGAINST_THE_TWIN
@given(
    frames=st.lists(
        st.tuples(st.booleans(), st.binary(min_size=0, max_size=80)), max_size=12
    )
)
def test_c_and_python_make_the_same_decisions(frames: list[tuple[bool, bytes]]) -> None:
    outcomes = []
    for impl in (
        (dataplane.PyRouteTap, dataplane.PyRoute),
        (_turnfast.RouteTap, _turnfast.Route),
    ):
        rig = Rig(impl, prefix=4, length_at=4, max_size=60)
        try:
            head = b"\x00\x01\x02\x03"
            rig.routes[(rig.a.getsockname(), head)] = rig.route()
            for from_a, body in frames:
                # Half the frames carry the routed header, with a random length.
                rig.send(rig.a if from_a else rig.b, head + body if from_a else body)
            rig.tap.readable()
            forwarded = []
            while (got := recv(rig.dest, timeout=0.01)) is not None:
                forwarded.append(got[0])
            names = {rig.a.getsockname(): "a", rig.b.getsockname(): "b"}
            fallen = [(data, names[addr]) for data, addr in rig.fallen]
            outcomes.append((forwarded, fallen, rig.tap.malformed))
        finally:
            rig.close()
    assert outcomes[0] == outcomes[1]


def test_ancillary_data_reaches_the_fallback_and_routes_send_from_a_chosen_source(
    impl: tuple[Any, Any],
) -> None:
    # A wildcard bind (pktinfo.py): the fallback learns where a datagram was
    # sent to; a route carrying that as its control message leaves from there.
    tap_type, route_type = impl
    relay = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    relay.bind(("0.0.0.0", 0))
    relay.setblocking(False)
    enable_pktinfo(relay)
    client, dest = udp(), udp()
    routes: dict[Any, Any] = {}
    seen: list[Any] = []

    def learn(data: bytes, addr: Any, ancdata: Any) -> None:
        control = reply_control(ancdata)
        seen.append((data, addr, control))
        routes[addr] = route_type(relay, dest.getsockname(), control)

    tap = tap_type(relay, routes, learn, ancillary=True)
    try:
        port = relay.getsockname()[1]
        client.sendto(b"learn me", ("127.0.0.3", port))
        client.sendto(b"routed", ("127.0.0.3", port))
        tap.readable()
        assert len(seen) == 1
        data, addr, control = seen[0]
        assert (data, addr) == (b"learn me", client.getsockname())
        assert control is not None and control[2][4:8] == socket.inet_aton("127.0.0.3")
        assert recv(dest) == (b"routed", ("127.0.0.3", port))
        assert routes[addr].control == control
    finally:
        for sock in (relay, client, dest):
            sock.close()


async def test_tap_readers_drain_every_registered_tap_until_removed() -> None:
    # One epoll set for all taps with the accelerator, one reader each without.
    readers = dataplane.TapReaders()
    socks = [udp() for _ in range(5)]
    first, second, out, dest, client = socks
    tables: list[dict[Any, Any]] = [{}, {}]
    fallen: list[bytes] = []
    taps = [
        dataplane.make_tap(sock, table, lambda data, addr: fallen.append(data))
        for sock, table in zip((first, second), tables, strict=True)
    ]
    try:
        for tap, table in zip(taps, tables, strict=True):
            table[client.getsockname()] = dataplane.make_route(out, dest.getsockname())
            readers.add(tap)
        client.sendto(b"one", first.getsockname())
        client.sendto(b"two", second.getsockname())
        loop = asyncio.get_running_loop()

        async def relayed() -> bytes:
            data, _ = await asyncio.wait_for(loop.sock_recvfrom(dest, 100), 5)
            return data

        assert {await relayed(), await relayed()} == {b"one", b"two"}
        readers.remove(taps[0])
        taps[0].close()
        client.sendto(b"unread", first.getsockname())
        client.sendto(b"three", second.getsockname())
        assert await relayed() == b"three"
        assert fallen == [] and taps[0].forwarded == 1
    finally:
        readers.close()
        for sock in socks:
            sock.close()


def test_a_batch_interleaving_two_out_sockets_keeps_each_flows_order(
    rig: Rig,
) -> None:
    # ``a``'s flow leaves by ``out``, ``b``'s by another socket, interleaved in
    # one drain of more than one recvmmsg batch: every datagram arrives, each
    # flow in its order (the order across the two sockets is not a flow's).
    other_out = udp()
    try:
        rig.routes[rig.a.getsockname()] = rig.route()
        rig.routes[rig.b.getsockname()] = rig.route_type(
            other_out, rig.dest.getsockname()
        )
        count = 30  # 60: two recvmmsg batches, one readable() of the twin
        for index in range(count):
            rig.send(rig.a, b"a%d" % index)
            rig.send(rig.b, b"b%d" % index)
        rig.tap.readable()
        got = [recv(rig.dest) for _ in range(2 * count)]
        by_source: dict[Any, list[bytes]] = {}
        for item in got:
            assert item is not None
            by_source.setdefault(item[1], []).append(item[0])
        assert by_source == {
            rig.out.getsockname(): [b"a%d" % index for index in range(count)],
            other_out.getsockname(): [b"b%d" % index for index in range(count)],
        }
        assert rig.tap.forwarded == 2 * count and rig.fallen == []
        if rig.tap_type is not dataplane.PyRouteTap:
            # C: one sendmmsg per outgoing socket for the whole drain, not one
            # per run of datagrams bound for the same socket (60 here).
            assert rig.tap.sends == 2
    finally:
        other_out.close()


@NEEDS_C
@AGAINST_THE_TWIN
@given(senders=st.lists(st.sampled_from("abc"), max_size=60))
def test_c_and_python_send_each_socket_the_same_sequence(senders: list[str]) -> None:
    # ``a`` is routed out of ``out``, ``b`` out of a second socket, ``c`` falls
    # back and its fallback sends a marker out of ``out`` by hand: C's grouped
    # sends must put on each socket exactly what the twin's one-by-one sends
    # do, the marker after every ``a`` datagram that came before it.
    outcomes = []
    for impl in (
        (dataplane.PyRouteTap, dataplane.PyRoute),
        (_turnfast.RouteTap, _turnfast.Route),
    ):
        rig = Rig(impl)
        c, other_out = udp(), udp()

        def by_hand(data: bytes, addr: Any, rig: Rig = rig) -> None:
            rig.out.sendto(b"marker " + data, rig.dest.getsockname())

        try:
            rig.tap = rig.tap_type(rig.relay, rig.routes, by_hand)
            rig.routes[rig.a.getsockname()] = rig.route()
            rig.routes[rig.b.getsockname()] = rig.route_type(
                other_out, rig.dest.getsockname()
            )
            senders_by_name = {"a": rig.a, "b": rig.b, "c": c}
            for index, name in enumerate(senders):
                rig.send(senders_by_name[name], b"%s%d" % (name.encode(), index))
            rig.tap.readable()
            names = {rig.out.getsockname(): "out", other_out.getsockname(): "other"}
            per_socket: dict[str, list[bytes]] = {"out": [], "other": []}
            while (got := recv(rig.dest, timeout=0.01)) is not None:
                per_socket[names[got[1]]].append(got[0])
            outcomes.append(per_socket)
        finally:
            rig.close()
            c.close()
            other_out.close()
    assert outcomes[0] == outcomes[1]
    assert sum(len(sent) for sent in outcomes[0].values()) == len(senders)
