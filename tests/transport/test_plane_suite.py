"""One route-behaviour suite for the rewrite relays (Unity relay, natneg
pairs, RakNet forwarders: transport/routes.py), run against every plane.

client (192.0.2.2) -- [toc] server [top] -- peer (198.51.100.2) for every
plane alike: the relay's socket (192.0.2.1) and the socket it forwards from
(198.51.100.1) in the server namespace under a route tap; on the kernel
plane the eBPF program runs on the server's devices above it. Install,
forward exact bytes, count, remove (the next datagram reaches the control
plane at once), reinstatement, and teardown that leaves nothing. TURN's channels
run the same cases in test_kernelturn.py.
"""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

import pytest

from crossroads.transport import dataplane
from crossroads.transport.kernelplane import KernelPlane, tc_filters
from crossroads.transport.routes import RouteTable
from tests.transport.netns_support import inside, relay_lab
from tests.transport.plane_support import PLANES, wire_like

pytestmark = pytest.mark.timeout(60)


def _types(plane: str) -> tuple[Any, Any]:
    if plane == "python" or not dataplane.ACCELERATED:
        return dataplane.PyRouteTap, dataplane.PyRoute
    from crossroads.transport import _turnfast

    return _turnfast.RouteTap, _turnfast.Route


class Rig:
    """A route tap on ``relay`` forwarding to ``dest`` from ``out``; ``a`` and
    ``b`` are clients; ``kernel`` the program on the server's devices."""

    def __init__(self, names: dict[str, str], plane: str) -> None:
        self.ns = names
        self.tap_type, self.route_type = _types(plane)
        self.relay = self.udp("server", "192.0.2.1")
        self.out = self.udp("server", "198.51.100.1")
        self.dest = self.udp("peer", "198.51.100.2")
        self.a = self.udp("client", "192.0.2.2")
        self.b = self.udp("client", "192.0.2.2")
        self.routes: dict[Any, Any] = {}
        self.fallen: list[tuple[bytes, Any]] = []
        self.tap = self.tap_type(self.relay, self.routes, self.fallen_back)
        self.kernel: KernelPlane | None = None
        if plane in ("kernel", "xdp"):
            with inside(names["server"]):
                self.kernel = KernelPlane.load()
            self.kernel.hook = "xdp" if plane == "xdp" else "tc"
        self.xdp = plane == "xdp"
        self.table = RouteTable(self.kernel)

    def udp(self, role: str, host: str) -> socket.socket:
        with inside(self.ns[role]):
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind((host, 0))
        sock.setblocking(False)
        return sock

    def fallen_back(self, data: bytes, addr: Any) -> None:
        self.fallen.append((data, addr))

    def install(self, sock: socket.socket, header: bytes | None = None) -> Any:
        with inside(self.ns["server"]):
            return self.table.install(
                self.routes,
                sock.getsockname(),
                self.route_type(self.out, self.dest.getsockname()),
                via=self.relay,
                header=header,
            )

    def cross(self, sock: socket.socket, data: bytes) -> str:
        """Send ``data`` to the relay; where it went: "dest" (exactly as
        sent, from ``out``) or "control" (the tap's fallback)."""
        fallen = len(self.fallen)
        sock.sendto(data, self.relay.getsockname())
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.relay, self.dest], [], [], 0.05)
            if self.relay in ready:
                self.tap.readable()
            if self.dest in ready:
                assert self.dest.recvfrom(70000) == (data, self.out.getsockname())
                return "dest"
            if len(self.fallen) > fallen:
                assert self.fallen[fallen:] == [(data, sock.getsockname())]
                return "control"
        raise AssertionError(f"{data[:20]!r} went nowhere")

    def close(self) -> None:
        self.table.clear(self.routes)
        if self.kernel is not None:
            with inside(self.ns["server"]):
                self.kernel.close()
        for sock in (self.relay, self.out, self.dest, self.a, self.b):
            sock.close()


@pytest.fixture(params=PLANES)
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    xdp = request.param == "xdp"
    with relay_lab("ks") as names, wire_like(names) if xdp else nullcontext():
        made = Rig(names, request.param)
        try:
            yield made
        finally:
            made.close()


def test_install_forwards_exact_bytes_and_counts(rig: Rig) -> None:
    route = rig.install(rig.a)
    assert (route.twin is not None) == (rig.kernel is not None)
    sizes = [0, 1, 2, 3, 100, 1199, 1400]
    for n in sizes:
        assert rig.cross(rig.a, bytes((i * 7 + n) % 256 for i in range(n))) == "dest"
    assert (route.packets, route.octets) == (len(sizes), sum(sizes))
    if rig.kernel is not None:  # the program forwarded every one
        assert route.kernel_packets == len(sizes)
    if rig.xdp:  # ...and in XDP, not tc
        assert rig.kernel is not None
        assert rig.kernel.xdp_stats()["forwarded"] == len(sizes)
    # Another source has no route: its datagram reaches the control plane.
    assert rig.cross(rig.b, b"who?") == "control"
    assert route.packets == len(sizes)


def test_remove_stops_at_once_and_reinstate_carries_the_counts_on(rig: Rig) -> None:
    route = rig.install(rig.a)
    assert rig.cross(rig.a, b"one") == "dest"
    route.remove()
    assert rig.routes == {}
    assert rig.cross(rig.a, b"two") == "control"  # the very next datagram
    assert (route.packets, route.octets) == (1, 3)  # kept
    with inside(rig.ns["server"]):  # the kernel twin's device is looked up there
        route.reinstate()
    assert rig.cross(rig.a, b"three") == "dest"
    assert (route.packets, route.octets) == (2, 8)


def test_a_header_keys_the_route_by_source_and_prefix(rig: Rig) -> None:
    """Unity RELAY routes: keyed also by the frame's first 36 bytes, taken
    only when the frame's DataLength (u16 after them) is the rest of it."""
    head = bytes(range(36))
    rig.tap = rig.tap_type(rig.relay, rig.routes, rig.fallen_back, prefix=36)
    route = rig.install(rig.a, header=head)
    frame = head + (5).to_bytes(2, "big") + b"hello"
    assert rig.cross(rig.a, frame) == "dest"
    assert rig.cross(rig.a, bytes(36) + (5).to_bytes(2, "big") + b"hello") == "control"
    assert route.packets == 1
    if rig.xdp:  # the RELAY frame went by XDP
        assert rig.kernel is not None
        assert rig.kernel.xdp_stats()["forwarded"] == 1


def test_teardown_leaves_nothing(rig: Rig) -> None:
    routes = [rig.install(sock) for sock in (rig.a, rig.b)]
    for sock in (rig.a, rig.b):
        assert rig.cross(sock, b"x") == "dest"
    rig.table.clear(rig.routes)
    assert rig.routes == {} and not any(r.live for r in routes)
    for sock in (rig.a, rig.b):
        assert rig.cross(sock, b"after") == "control"
    assert [r.packets for r in routes] == [1, 1]
    if rig.kernel is not None:
        assert len(rig.kernel) == 0
        with inside(rig.ns["server"]):
            rig.kernel.close()
            assert rig.kernel.devices == []
            assert tc_filters(socket.if_nametoindex("toc")) == 0
        assert rig.cross(rig.a, b"closed") == "control"
