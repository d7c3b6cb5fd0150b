"""TURN's routes on the relay data plane, C and pure Python, on real loopback sockets.

Both implementations run the same cases and must make the same decisions:
ChannelData from a client leaves for the peer without its header (0-3 bytes of
padding allowed, a length that disagrees dropped and counted), data from a peer
leaves for the client as ChannelData, both spend one bandwidth budget, and
everything else reaches the fallback in arrival order. A Hypothesis test feeds
both random route tables and datagrams and compares every output.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crossroads.proto.stun import Class, Message, Method, encode
from crossroads.proto.stun.attributes import (
    Data,
    DontFragment,
    Software,
    XorPeerAddress,
)
from crossroads.proto.turn.fastpath import data_indication
from crossroads.transport import dataplane, turnplane
from crossroads.transport.dataplane import Rewrite

TXID = bytes(range(8))

IMPLEMENTATIONS: list[Any] = [
    pytest.param(
        (dataplane.PyRouteTap, dataplane.PyRoute, dataplane.PyBudget), id="python"
    )
]
try:
    from crossroads.transport import _turnfast
except ImportError:  # pragma: no cover - built by `make install`
    _turnfast = None  # type: ignore[assignment]
else:
    IMPLEMENTATIONS.append(
        pytest.param((_turnfast.RouteTap, _turnfast.Route, _turnfast.Budget), id="c")
    )


def udp() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    return sock


def drain(sock: socket.socket, timeout: float = 2.0) -> list[bytes]:
    """Everything queued on ``sock``: waits up to ``timeout`` for the first."""
    got: list[bytes] = []
    sock.settimeout(timeout)
    try:
        while True:
            got.append(sock.recv(70000))
            sock.settimeout(0.01)
    except (TimeoutError, BlockingIOError):
        return got
    finally:
        sock.setblocking(False)


class Rig:
    """A listening socket, a relay socket, a client and two peers.

    ``listener`` (prefix-2 tap) routes ChannelData from ``client`` to peers
    from ``relay``; ``relay``'s tap routes peer data to ``client`` from
    ``listener``."""

    def __init__(self, impl: tuple[Any, Any, Any], bps: float = 0.0) -> None:
        self.tap_type, self.route_type, budget_type = impl
        self.listen, self.relay, self.client, self.peer, self.other = (
            udp() for _ in range(5)
        )
        self.budget = budget_type(bps)
        self.to_peer: dict[Any, Any] = {}
        self.to_client: dict[Any, Any] = {}
        self.fallen: list[tuple[str, bytes, Any]] = []
        #: The allocation's permissions (peer host -> anything) and the hosts
        #: a Send route leaves to the control plane.
        self.permissions: dict[str, Any] = {}
        self.refuse: set[str] = set()
        self.listener = self.tap_type(
            self.listen,
            self.to_peer,
            lambda data, addr: self.fallen.append(("listener", data, addr)),
            prefix=turnplane.CHANNEL_KEY_BYTES,
        )
        self.relay_tap = self.tap_type(
            self.relay,
            self.to_client,
            lambda data, addr: self.fallen.append(("relay", data, addr)),
        )

    def bind(self, number: int, peer: socket.socket) -> None:
        """What a ChannelBind with a live permission installs."""
        key = turnplane.channel_key(self.client.getsockname(), number)
        self.to_peer[key] = self.route_type(
            self.relay,
            peer.getsockname(),
            rewrite=Rewrite.UNWRAP_CHANNEL,
            budget=self.budget,
        )
        self.to_client[peer.getsockname()] = self.route_type(
            self.listen,
            self.client.getsockname(),
            rewrite=Rewrite.WRAP_CHANNEL,
            channel=number,
            budget=self.budget,
        )

    def allow_send(self) -> None:
        """What an allocation's relay installs for Send indications."""
        self.to_peer[(self.client.getsockname(), b"\x00\x16")] = self.route_type(
            self.relay,
            None,
            rewrite=Rewrite.UNWRAP_SEND,
            budget=self.budget,
            permissions=self.permissions,
            refuse=self.refuse,
            approved={},
        )

    def data_route(self, peer: Any, named: Any = None) -> Any:
        """What a permitted peer's first datagram teaches the relay (the Data
        indications name ``named``, by default ``peer``)."""
        route = self.route_type(
            self.listen,
            self.client.getsockname(),
            rewrite=Rewrite.DATA_INDICATION,
            budget=self.budget,
            peer=named or peer,
            txid=TXID,
        )
        self.to_client[peer] = route
        return route

    def from_client(self, *datagrams: bytes) -> None:
        for data in datagrams:
            self.client.sendto(data, self.listen.getsockname())
        self.listener.readable()

    def from_peer(self, peer: socket.socket, *datagrams: bytes) -> None:
        for data in datagrams:
            peer.sendto(data, self.relay.getsockname())
        self.relay_tap.readable()

    def close(self) -> None:
        for sock in (self.listen, self.relay, self.client, self.peer, self.other):
            sock.close()


@pytest.fixture(params=IMPLEMENTATIONS)
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    made = Rig(request.param)
    yield made
    made.close()


def test_client_channel_data_leaves_for_the_peer_without_its_header(rig: Rig) -> None:
    rig.bind(0x4001, rig.peer)
    rig.from_client(b"\x40\x01\x00\x05hello", b"\x40\x01\x00\x02hi\x00\x00")
    assert drain(rig.peer) == [b"hello", b"hi"]  # padding (UDP: optional) dropped
    route = rig.to_peer[turnplane.channel_key(rig.client.getsockname(), 0x4001)]
    assert (route.packets, route.octets) == (2, 7)
    assert (rig.listener.forwarded, rig.listener.forwarded_bytes) == (2, 7)


def test_channel_data_whose_length_disagrees_is_dropped_and_counted(rig: Rig) -> None:
    rig.bind(0x4001, rig.peer)
    # RFC 8656 §12.5: shorter than its length field, or more than 3 bytes over.
    rig.from_client(
        b"\x40\x01\x00\x09short", b"\x40\x01\x00\x01x" + bytes(4), b"\x40\x01\x00"
    )
    assert rig.listener.malformed == 3
    assert drain(rig.peer, 0.1) == []
    assert rig.fallen == []


def test_what_is_not_routed_falls_back_in_order(rig: Rig) -> None:
    rig.bind(0x4001, rig.peer)
    client = rig.client.getsockname()
    stun = b"\x00\x01\x00\x00\x21\x12\xa4\x42" + bytes(12)
    rig.from_client(
        b"\x40\x02\x00\x01x",  # unbound channel
        stun,
        b"\x40\x01\x00\x01y",  # routed, between two that fall back
        b"\x40",  # too short for a key
    )
    assert rig.fallen == [
        ("listener", b"\x40\x02\x00\x01x", client),
        ("listener", stun, client),
        ("listener", b"\x40", client),
    ]
    assert drain(rig.peer) == [b"y"]
    rig.other.sendto(b"\x40\x01\x00\x01z", rig.listen.getsockname())  # a stranger
    rig.listener.readable()
    assert rig.fallen[-1] == ("listener", b"\x40\x01\x00\x01z", rig.other.getsockname())


def test_peer_data_reaches_the_client_as_channel_data(rig: Rig) -> None:
    rig.bind(0x4ABC, rig.peer)
    rig.from_peer(rig.peer, b"payload", b"")
    assert drain(rig.client) == [b"\x4a\xbc\x00\x07payload", b"\x4a\xbc\x00\x00"]
    assert (rig.relay_tap.forwarded, rig.relay_tap.forwarded_bytes) == (2, 7)
    # A peer without a route (no channel, or no live permission) falls back.
    rig.from_peer(rig.other, b"who")
    assert rig.fallen == [("relay", b"who", rig.other.getsockname())]


def test_removed_routes_stop_forwarding(rig: Rig) -> None:
    rig.bind(0x4001, rig.peer)
    rig.to_client.pop(rig.peer.getsockname())  # the permission lapsed
    rig.from_peer(rig.peer, b"late")
    assert rig.fallen == [("relay", b"late", rig.peer.getsockname())]
    rig.to_peer.clear()  # the binding lapsed
    rig.from_client(b"\x40\x01\x00\x01x")
    assert rig.fallen[-1][:2] == ("listener", b"\x40\x01\x00\x01x")


def send_indication(
    peer: Any, payload: bytes, *extra: Any, fingerprint: bool = False
) -> bytes:
    message = Message(
        Class.INDICATION,
        Method.SEND,
        bytes(range(12)),
        (XorPeerAddress(*peer), Data(payload), *extra),
    )
    return encode(message, fingerprint=fingerprint)


def test_send_indications_to_permitted_peers_leave_as_their_data(rig: Rig) -> None:
    rig.allow_send()
    peer = rig.peer.getsockname()
    rig.permissions[peer[0]] = object()
    good = [
        send_indication(peer, b"one"),
        send_indication(peer, b"two", DontFragment()),
        send_indication(peer, b"three", fingerprint=True),
    ]
    rig.from_client(*good)
    assert drain(rig.peer) == [b"one", b"two", b"three"]
    route = rig.to_peer[(rig.client.getsockname(), b"\x00\x16")]
    assert (route.packets, route.octets) == (3, 11)
    assert rig.fallen == []


def test_unusual_or_unpermitted_send_indications_fall_back(rig: Rig) -> None:
    rig.allow_send()
    peer = rig.peer.getsockname()
    rig.permissions[peer[0]] = object()
    bad_fingerprint = bytearray(send_indication(peer, b"x", fingerprint=True))
    bad_fingerprint[-1] ^= 1
    unusual = [
        send_indication(peer, b"x", Software("me")),  # another attribute
        bytes(bad_fingerprint),
        send_indication(("2001:db8::5", 9), b"x"),  # not the relay's family
        send_indication(peer, b"x")[:-4],  # lengths disagree
    ]
    rig.from_client(*unusual)
    rig.refuse.add(peer[0])  # one of the service's own hosts
    rig.from_client(send_indication(peer, b"mine"))
    del rig.permissions[peer[0]]
    rig.refuse.clear()
    rig.from_client(send_indication(peer, b"no permission"))
    client = rig.client.getsockname()
    assert rig.fallen == [
        ("listener", data, client)
        for data in (
            *unusual,
            send_indication(peer, b"mine"),
            send_indication(peer, b"no permission"),
        )
    ]
    assert drain(rig.peer, 0.1) == []


def test_sends_to_the_services_own_hosts_need_a_fresh_approval(rig: Rig) -> None:
    rig.allow_send()
    peer = rig.peer.getsockname()
    rig.permissions[peer[0]] = object()
    rig.refuse.add(peer[0])
    route = rig.to_peer[(rig.client.getsockname(), b"\x00\x16")]
    rig.from_client(send_indication(peer, b"judged"))  # no approval yet
    turnplane.approve(route, peer, time.monotonic())
    rig.from_client(send_indication(peer, b"approved"))
    other_port = (peer[0], peer[1] ^ 1)
    rig.from_client(send_indication(other_port, b"another port"))
    turnplane.approve(route, peer, time.monotonic() - turnplane.SELF_PEER_APPROVAL)
    rig.from_client(send_indication(peer, b"stale"))
    assert drain(rig.peer) == [b"approved"]
    assert [data for _, data, _ in rig.fallen] == [
        send_indication(peer, b"judged"),
        send_indication(other_port, b"another port"),
        send_indication(peer, b"stale"),
    ]


@pytest.mark.parametrize("peer", [("192.0.2.7", 4000), ("2001:db8::7", 4000)])
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_data_indications_are_byte_exact(impl: Any, peer: Any) -> None:
    rig = Rig(impl)
    try:
        # The route names its peer; the datagram may come from anywhere the
        # control plane keyed it under.
        route = rig.data_route(peer)
        rig.to_client[rig.peer.getsockname()] = route
        rig.from_peer(rig.peer, b"hello", b"", b"four")
        txids = [TXID + n.to_bytes(4, "big") for n in (1, 2, 3)]
        assert drain(rig.client) == [
            data_indication(peer, payload, txid)
            for payload, txid in zip((b"hello", b"", b"four"), txids, strict=True)
        ]
        assert (route.packets, route.octets) == (3, 9)
        assert rig.relay_tap.forwarded_bytes == 9
    finally:
        rig.close()


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_bad_turn_route_options_are_refused(impl: Any) -> None:
    _, route_type, _ = impl
    sock = udp()
    try:
        with pytest.raises(ValueError):
            route_type(sock, ("127.0.0.1", 1), rewrite=Rewrite.DATA_INDICATION)
        with pytest.raises(ValueError):
            route_type(
                sock,
                ("127.0.0.1", 1),
                rewrite=Rewrite.DATA_INDICATION,
                peer=("192.0.2.1", 1),
                txid=b"short",
            )
        with pytest.raises(TypeError):
            route_type(sock, None, rewrite=Rewrite.UNWRAP_SEND, permissions=[])
        with pytest.raises(ValueError):
            route_type(sock, None)  # only a Send route has no destination
    finally:
        sock.close()


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_one_budget_for_both_directions(impl: Any) -> None:
    rig = Rig(impl, bps=1000.0)
    try:
        rig.bind(0x4001, rig.peer)
        rig.from_client(b"\x40\x01\x02\x58" + bytes(600))  # 600 of 1000 bytes
        rig.from_peer(rig.peer, bytes(300), bytes(300))  # the second is over
        assert [len(d) for d in drain(rig.peer)] == [600]
        assert [len(d) for d in drain(rig.client)] == [304]
        assert rig.budget.throttled == 1 and rig.relay_tap.throttled == 1
    finally:
        rig.close()


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_budget_token_bucket(impl: Any) -> None:
    budget = impl[2](0.0)
    assert budget.allow(10**9)  # no limit
    budget.bps = 1000.0
    assert budget.allow(600)
    assert budget.allow(400)
    assert not budget.allow(100)  # the second's budget is spent
    assert budget.throttled == 1
    with pytest.raises(ValueError):
        budget.allow(-1)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_a_tap_without_a_socket_routes_what_is_handed_in(impl: Any) -> None:
    """ChannelData over TCP/TLS/DTLS and from asyncio endpoints: another reader
    hands each message in; the decisions are the same (TCP pads to 4 bytes)."""
    tap_type, route_type, budget_type = impl
    relay, peer = udp(), udp()
    try:
        fallen: list[tuple[bytes, Any]] = []
        routes: dict[Any, Any] = {}
        tap = tap_type(
            None,
            routes,
            lambda data, addr: fallen.append((data, addr)),
            prefix=2,
        )
        assert tap.fd == -1
        tap.readable()  # nothing to read: a no-op
        client = ("2001:db8::1", 5000, 0, 0)  # IPv6 as a reader reports it
        routes[turnplane.channel_key(client[:2], 0x4000)] = route_type(
            relay,
            peer.getsockname(),
            rewrite=Rewrite.UNWRAP_CHANNEL,
            budget=budget_type(0.0),
        )
        tap.datagram_received(b"\x40\x00\x00\x03abc\x00", client)
        assert drain(peer) == [b"abc"]
        tap.datagram_received(b"\x40\x09\x00\x03abc", client)
        assert fallen == [(b"\x40\x09\x00\x03abc", client)]  # the reader's form
        with pytest.raises(TypeError):
            tap.datagram_received("text", client)
        with pytest.raises(ValueError):
            tap.datagram_received(b"x", "nowhere")
    finally:
        relay.close()
        peer.close()


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_bad_route_options_are_refused(impl: Any) -> None:
    _, route_type, _ = impl
    sock = udp()
    try:
        dest = ("127.0.0.1", 1)
        with pytest.raises(ValueError):
            route_type(sock, dest, rewrite=3)
        with pytest.raises(ValueError):
            route_type(sock, dest, rewrite=Rewrite.WRAP_CHANNEL, channel=0x10000)
        with pytest.raises(TypeError):
            route_type(sock, dest, budget=object())
        route = route_type(sock, dest, rewrite=Rewrite.WRAP_CHANNEL, channel=0x4000)
        assert (route.rewrite, route.channel, route.budget) == (2, 0x4000, None)
    finally:
        sock.close()


@pytest.mark.skipif(_turnfast is None, reason="C data plane not built")
@settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    channels=st.lists(st.integers(0x4000, 0x4005), max_size=3, unique=True),
    routed_peer=st.booleans(),
    data_peer=st.booleans(),
    permitted=st.booleans(),
    frames=st.lists(
        st.tuples(
            st.sampled_from(["client", "peer", "other"]),
            st.one_of(
                # ChannelData-shaped, with any length field and 0-6 extra bytes.
                st.tuples(
                    st.integers(0x4000, 0x4005),
                    st.integers(0, 12),
                    st.binary(max_size=14),
                ).map(
                    lambda t: t[0].to_bytes(2, "big") + t[1].to_bytes(2, "big") + t[2]
                ),
                st.binary(max_size=24),
                # Send indications, well-formed or not.
                st.tuples(
                    st.binary(max_size=20),
                    st.sampled_from(["plain", "fingerprint", "software", "cut"]),
                ).map(lambda t: t),
            ),
        ),
        max_size=12,
    ),
)
def test_c_and_python_make_the_same_decisions(
    channels: list[int],
    routed_peer: bool,
    data_peer: bool,
    permitted: bool,
    frames: list[tuple[str, Any]],
) -> None:
    outcomes = []
    for impl in (
        (dataplane.PyRouteTap, dataplane.PyRoute, dataplane.PyBudget),
        (_turnfast.RouteTap, _turnfast.Route, _turnfast.Budget),
    ):
        rig = Rig(impl)
        try:
            for number in channels:
                rig.bind(number, rig.peer)
            if not routed_peer:
                rig.to_client.clear()
            rig.allow_send()
            if permitted:
                rig.permissions[rig.peer.getsockname()[0]] = True
            if data_peer:
                rig.data_route(rig.other.getsockname(), ("192.0.2.9", 7))
            sent: list[bytes] = []
            for source, data in frames:
                if isinstance(data, tuple):
                    payload, shape = data
                    # To the rig's peer from the client (a port of its own:
                    # only the forwarded data may be compared), else fixed.
                    peer = (
                        rig.peer.getsockname()
                        if source == "client"
                        else ("192.0.2.9", 7)
                    )
                    if shape == "software":
                        data = send_indication(peer, payload, Software("x"))
                    else:
                        data = send_indication(
                            peer, payload, fingerprint=shape == "fingerprint"
                        )
                        if shape == "cut":
                            data = data[:-1]
                sent.append(data)
                if source == "client":
                    rig.client.sendto(data, rig.listen.getsockname())
                else:
                    sender = rig.peer if source == "peer" else rig.other
                    sender.sendto(data, rig.relay.getsockname())
            rig.listener.readable()
            rig.relay_tap.readable()
            names = {
                rig.client.getsockname(): "client",
                rig.peer.getsockname(): "peer",
                rig.other.getsockname(): "other",
            }
            outcomes.append(
                (
                    drain(rig.peer, 0.05),
                    drain(rig.client, 0.05),
                    # Which frame fell back (a Send indication's bytes hold
                    # this rig's own peer port).
                    [
                        (tap, sent.index(data), names[addr])
                        for tap, data, addr in rig.fallen
                    ],
                    [
                        (t.forwarded, t.forwarded_bytes, t.malformed)
                        for t in (rig.listener, rig.relay_tap)
                    ],
                )
            )
        finally:
            rig.close()
    assert outcomes[0] == outcomes[1]


@pytest.mark.skipif(_turnfast is None, reason="C data plane not built")
@pytest.mark.parametrize("per_relay", [3, 40])
def test_one_poll_over_many_relay_sockets_sends_once_per_outgoing_socket(
    per_relay: int,
) -> None:
    # TURN's peer -> client shape: many allocations' relay sockets, each with a
    # few datagrams, all leaving as ChannelData by the one listening socket.
    # One wakeup drains them all, then sends them in one sendmmsg; with 40 a
    # relay (320 in all, more than the receive arena holds) the queue is
    # flushed early, and still nothing is lost or reordered within a flow.
    poller = _turnfast.Poller()
    listen = udp()
    relays = [udp() for _ in range(8)]
    peers = [udp() for _ in range(8)]
    clients = [udp() for _ in range(8)]
    budget = _turnfast.Budget(0.0)
    taps = []
    try:
        for number, (relay, peer, client) in enumerate(
            zip(relays, peers, clients, strict=True)
        ):
            routes = {
                peer.getsockname(): turnplane.to_client_route(
                    listen, client.getsockname(), 0x4000 + number, budget
                )
            }
            tap = _turnfast.RouteTap(relay, routes, print)
            poller.register(relay.fileno(), tap)
            taps.append(tap)
        for index in range(per_relay):
            for relay, peer in zip(relays, peers, strict=True):
                peer.sendto(b"%d" % index, relay.getsockname())
        poller.poll()
        for number, client in enumerate(clients):
            expected = [
                turnplane.channel_header(0x4000 + number, len(b"%d" % index))
                + b"%d" % index
                for index in range(per_relay)
            ]
            assert drain(client) == expected
        assert [tap.forwarded for tap in taps] == [per_relay] * len(taps)
        if per_relay == 3:
            # One sendmmsg for the 24 datagrams, not one per relay socket.
            assert poller.sends == 1
            assert [tap.sends for tap in taps] == [1] * len(taps)
        else:
            assert 2 <= poller.sends < len(taps)
    finally:
        poller.close()
        for sock in (listen, *relays, *peers, *clients):
            sock.close()


@pytest.mark.skipif(_turnfast is None, reason="C data plane not built")
def test_a_fallback_that_tears_down_every_tap_mid_poll_loses_nothing_queued() -> None:
    # Released allocations: the first fallback of a poll unregisters and
    # closes every tap, closes their sockets and drops the last references
    # but the poller's. What was queued before it was sent first; the taps not
    # yet drained read nothing; nothing is freed while a queued send needs it.
    poller = _turnfast.Poller()
    out, dest, peer, stranger = udp(), udp(), udp(), udp()
    relays = [udp() for _ in range(6)]
    taps: list[Any] = []
    torn_down: list[bytes] = []

    def release(data: bytes, addr: Any) -> None:
        torn_down.append(data)
        for tap, relay in zip(taps, relays, strict=True):
            poller.unregister(relay.fileno())
            tap.close()
            relay.close()
        taps.clear()

    try:
        for relay in relays:
            routes = {peer.getsockname(): _turnfast.Route(out, dest.getsockname())}
            tap = _turnfast.RouteTap(relay, routes, release)
            poller.register(relay.fileno(), tap)
            taps.append(tap)
        for number, relay in enumerate(relays):
            for index in range(3):
                peer.sendto(b"%d.%d" % (number, index), relay.getsockname())
            stranger.sendto(b"release %d" % number, relay.getsockname())
        poller.poll()
        assert len(torn_down) == 1
        released = int(torn_down[0].split()[1])
        # The released relay's own datagrams came before its fallback; any
        # other relay drained before it forwarded all three.
        got = drain(dest)
        assert got[-3:] == [b"%d.%d" % (released, index) for index in range(3)]
        assert len(got) % 3 == 0 and len(set(got)) == len(got)
        poller.poll()  # nothing registered, nothing to free twice
        assert poller.events == len(relays)
    finally:
        poller.close()
        for sock in (out, dest, peer, stranger, *relays):
            sock.close()
