"""UDP GSO on the C data plane's sends (UDP_SEGMENT, udp(7), Linux >= 4.18).

A burst of routed datagrams to one destination leaves as one GSO message; the
receiver must see exactly the datagrams it would see without GSO, in order.
A kernel or device that refuses to segment makes the socket fall back to
plain sends without losing the burst.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

try:
    from crossroads.transport import _turnfast
except ImportError:  # pragma: no cover - built by `make install`
    _turnfast = None  # type: ignore[assignment]

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(_turnfast is None, reason="C data plane not built")


def udp() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    return sock


def drain(sock: socket.socket, count: int) -> list[bytes]:
    got: list[bytes] = []
    sock.settimeout(2.0)
    try:
        while len(got) < count:
            got.append(sock.recv(70000))
    except TimeoutError:
        pass
    sock.setblocking(False)
    return got


@pytest.fixture
def gso() -> Iterator[Any]:
    _turnfast.set_gso(True)
    yield _turnfast
    _turnfast.set_gso(True)


def relay_burst(payloads: list[bytes], dests: int = 1) -> tuple[list[list[bytes]], Any]:
    """Send ``payloads`` from one client through a tap routing to ``dests``
    destinations in turn (datagram i goes to destination i % dests)."""
    relay, out = udp(), udp()
    targets = [udp() for _ in range(dests)]
    clients = [udp() for _ in range(dests)]
    routes = {
        c.getsockname(): _turnfast.Route(out, t.getsockname())
        for c, t in zip(clients, targets, strict=True)
    }
    tap = _turnfast.RouteTap(relay, routes, lambda data, addr: None)
    for i, data in enumerate(payloads):
        clients[i % dests].sendto(data, relay.getsockname())
    tap.readable()
    got = [drain(t, len(payloads[i::dests])) for i, t in enumerate(targets)]
    tap.close()
    for s in (relay, out, *targets, *clients):
        s.close()
    return got, tap


def test_a_burst_to_one_destination_leaves_as_gso(gso: Any) -> None:
    payloads = [bytes([i]) * 200 for i in range(40)]
    before = gso.gso_stats()
    got, tap = relay_burst(payloads)
    after = gso.gso_stats()
    assert got == [payloads]
    assert tap.forwarded == 40 and tap.forwarded_bytes == 40 * 200
    assert after["sends"] > before["sends"]
    assert after["segments"] - before["segments"] == 40
    assert after["refused"] == before["refused"]


def test_gso_off_sends_the_same_datagrams(gso: Any) -> None:
    payloads = [bytes([i]) * 200 for i in range(40)]
    gso.set_gso(False)
    before = gso.gso_stats()
    got, tap = relay_burst(payloads)
    assert got == [payloads]
    assert tap.forwarded == 40
    assert gso.gso_stats()["sends"] == before["sends"]
    assert gso.gso_stats()["enabled"] is False


def test_mixed_sizes_and_destinations_arrive_exactly(gso: Any) -> None:
    # Runs end at a size change (a shorter datagram may end one) and at a
    # change of destination; each destination gets its own in order.
    sizes = [100, 100, 100, 60, 100, 100, 1452, 1452, 1453, 1, 1, 0, 5, 5]
    payloads = [bytes([i % 251]) * n for i, n in enumerate(sizes * 3)]
    got, _ = relay_burst(payloads)
    assert got == [payloads]
    got, _ = relay_burst(payloads, dests=3)
    assert got == [payloads[0::3], payloads[1::3], payloads[2::3]]


def test_a_refused_segment_size_falls_back_to_plain_sends(tmp_path: Any) -> None:
    """A segment over the path MTU is refused by the kernel (EINVAL): the burst
    goes again datagram by datagram (fragmented, as without GSO) and the socket
    keeps sending without GSO."""
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        pytest.skip("needs ip netns (root)")
    ns = f"kpgso{id(tmp_path) % 100000}"
    code = textwrap.dedent(
        """
        import json
        from tests.transport.test_gso import relay_burst
        from crossroads.transport import _turnfast
        payloads = [bytes([i]) * 1400 for i in range(10)]
        first, _ = relay_burst(payloads)
        middle = _turnfast.gso_stats()
        second, _ = relay_burst([b"x" * 100] * 10)
        print(json.dumps([first == [payloads], middle, second == [[b"x" * 100] * 10],
                          _turnfast.gso_stats()]))
        """
    )
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        # Loopback with an IPv6-minimum MTU: 1400-byte segments do not fit.
        subprocess.run(
            ["ip", "-n", ns, "link", "set", "lo", "mtu", "1280", "up"], check=True
        )
        out = subprocess.run(
            ["ip", "netns", "exec", ns, sys.executable, "-c", code],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)
    first_ok, middle, second_ok, last = json.loads(out)
    assert first_ok, "the refused burst must still arrive whole"
    assert middle["refused"] == 1 and middle["sends"] == 0
    # A new socket on another fd may use GSO again: 100-byte segments fit.
    assert second_ok and last["sends"] >= 1
