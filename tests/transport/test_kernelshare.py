"""Several processes' kernel planes on one device (issue 30: ``--workers N``,
two servers, a test suite running many runtimes on one host).

Each process loads its own program with its own routes and attaches it to
the same devices; what one does not route must reach the next one's, then
the sockets. The two attachments: tcx links (Linux >= 6.6) and classic
clsact filters (older kernels; forced here with ``tcx=False``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest

from crossroads.transport.kernelplane import (
    KernelPlane,
    KernelPlaneUnavailable,
    KernelRoute,
    RouteKind,
    tc_filters,
)
from tests.transport.netns_support import inside, relay_lab

LISTEN = ("192.0.2.1", 3478)
RELAYED = ("198.51.100.1", 50000)
PEER = ("198.51.100.2", 60000)
CLIENTS = [("192.0.2.2", 40000 + n) for n in range(2)]


def _route(n: int) -> KernelRoute:
    return KernelRoute(RouteKind.REWRITE, CLIENTS[n], LISTEN, RELAYED, PEER)


@pytest.fixture
def names() -> Iterator[dict[str, str]]:
    if os.geteuid() != 0:
        pytest.skip("needs root for namespaces and eBPF")
    with relay_lab("ks") as found:
        yield found


def _udp(ns: str, addr: tuple[str, int]) -> socket.socket:
    with inside(ns):
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(addr)
    sock.settimeout(2.0)
    return sock


def _load(ns: str) -> KernelPlane:
    with inside(ns):
        try:
            return KernelPlane.load()
        except KernelPlaneUnavailable as exc:
            pytest.skip(f"kernel plane unavailable: {exc}")


def _recv(sock: socket.socket, timeout: float = 2.0) -> tuple[bytes, object] | None:
    sock.settimeout(timeout)
    try:
        return sock.recvfrom(2048)
    except TimeoutError:
        return None


class Socks:
    def __init__(self, names: dict[str, str]) -> None:
        self.clients = [_udp(names["client"], a) for a in CLIENTS]
        self.listen = _udp(names["server"], LISTEN)
        self.peer = _udp(names["peer"], PEER)

    def close(self) -> None:
        for s in (*self.clients, self.listen, self.peer):
            s.close()


@pytest.mark.parametrize("tcx", [True, False], ids=["tcx", "classic"])
def test_two_planes_on_one_device_each_forward_their_own_route(
    names: dict[str, str], tcx: bool
) -> None:
    socks = Socks(names)
    planes = [_load(names["server"]) for _ in range(2)]
    try:
        with inside(names["server"]):
            for n, plane in enumerate(planes):
                plane.attach("toc", tcx=tcx)
                assert plane.install(_route(n))
        for n in range(2):
            socks.clients[n].sendto(b"flow %d" % n, LISTEN)
            assert _recv(socks.peer) == (b"flow %d" % n, RELAYED)
            assert planes[n].counters(_route(n)) == (1, 6)
            assert planes[1 - n].counters(_route(1 - n)) == (n, 6 * n)
        # What neither routes reaches the socket, unchanged.
        with inside(names["server"]):
            planes[0].remove(_route(0))
        socks.clients[0].sendto(b"no route", LISTEN)
        assert _recv(socks.listen) == (b"no route", CLIENTS[0])
        assert _recv(socks.peer, 0.3) is None
        # Closing one leaves the other forwarding (a classic filter's qdisc too).
        with inside(names["server"]):
            planes[0].close()
        socks.clients[1].sendto(b"still", LISTEN)
        assert _recv(socks.peer) == (b"still", RELAYED)
        with inside(names["server"]):
            planes[1].close()
            ifindex = socket.if_nametoindex("toc")
            # Teardown leaves nothing behind on the device.
            assert tc_filters(ifindex) == 0
        socks.clients[1].sendto(b"closed", LISTEN)
        assert _recv(socks.listen) == (b"closed", CLIENTS[1])
    finally:
        with inside(names["server"]):
            for plane in planes:
                plane.close()
        socks.close()


_HOLDER = textwrap.dedent(
    """
    import sys, time
    from crossroads.transport.kernelplane import KernelPlane, KernelRoute, RouteKind
    plane = KernelPlane.load()
    plane.attach("toc", tcx=sys.argv[1] == "tcx")
    assert plane.install(KernelRoute(RouteKind.REWRITE, ("192.0.2.2", 40000),
        ("192.0.2.1", 3478), ("198.51.100.1", 50000), ("198.51.100.2", 60000)))
    print("ready", flush=True)
    time.sleep(60)
    """
)


@pytest.mark.parametrize("mode", ["tcx", "classic"])
def test_a_killed_process_leaves_nothing_that_forwards(
    names: dict[str, str], mode: str
) -> None:
    """SIGKILL runs no close(): a tcx link dies with its descriptor; a classic
    filter stays on the device, holding the program and its routes, and must
    stop forwarding once its lease lapses (then pass everything)."""
    _load(names["server"]).close()  # skips where the program cannot load
    socks = Socks(names)
    holder = subprocess.Popen(
        ["ip", "netns", "exec", names["server"], sys.executable, "-c", _HOLDER, mode],
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "ready"
        socks.clients[0].sendto(b"alive", LISTEN)
        assert _recv(socks.peer) == (b"alive", RELAYED)
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        with inside(names["server"]):
            left = tc_filters(socket.if_nametoindex("toc"))
        assert left == (0 if mode == "tcx" else 2)  # the proto entry and the filter
        # Within the lease (2 s) the stale filter may still forward; then
        # never again: the datagram reaches the socket.
        deadline = time.monotonic() + 10
        got = None
        while time.monotonic() < deadline:
            socks.clients[0].sendto(b"after", LISTEN)
            got = _recv(socks.listen, 0.5)
            if got is not None:
                break
        assert got == (b"after", CLIENTS[0])
        while _recv(socks.peer, 0.1) is not None:
            pass  # what the stale filter forwarded within the lease
        for _ in range(5):
            socks.clients[0].sendto(b"after", LISTEN)
            assert _recv(socks.listen) == (b"after", CLIENTS[0])
        assert _recv(socks.peer, 0.3) is None
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(10)
        socks.close()
