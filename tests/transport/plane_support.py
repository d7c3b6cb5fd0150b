"""The three relay data planes as test parameters (issue 30: "routes,
counters and teardown behave the same on every plane; one test suite runs
against each")."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest

from crossroads.transport import dataplane, planes, turnplane
from crossroads.transport.kernelplane import KernelPlane, KernelPlaneUnavailable
from tests.transport.netns_support import inside, tx_checksum


def _kernel_loads() -> bool:
    if os.geteuid() != 0:
        return False
    try:
        KernelPlane.load().close()
    except KernelPlaneUnavailable:
        return False
    return True


def skip_unless_kernel_loads() -> None:
    """Skip the test, saying why, where the kernel plane's program does not
    load here."""
    try:
        KernelPlane.load().close()
    except KernelPlaneUnavailable as exc:
        pytest.skip(f"kernel plane unavailable: {exc}")


PLANES = [
    pytest.param("python", id="python"),
    pytest.param(
        "c",
        id="c",
        marks=pytest.mark.skipif(
            not dataplane.ACCELERATED, reason="C data plane not built"
        ),
    ),
    pytest.param(
        "kernel",
        id="kernel",
        marks=pytest.mark.skipif(
            not _kernel_loads(), reason="needs root and a kernel that loads the program"
        ),
    ),
    # The kernel plane with --kernel-hook xdp on a wire_like lab: XDP in
    # driver mode forwards in front of tc.
    pytest.param(
        "xdp",
        id="xdp",
        marks=pytest.mark.skipif(
            not _kernel_loads(), reason="needs root and a kernel that loads the program"
        ),
    ),
]


def keep_plane_globals(monkeypatch: pytest.MonkeyPatch) -> None:
    """Undo, after the test, what choosing the Python plane switches for the
    whole process (planes.use_python_plane)."""
    for name in (
        "RouteType",
        "RouteTapType",
        "BudgetType",
        "PollerType",
        "ACCELERATED",
    ):
        monkeypatch.setattr(dataplane, name, getattr(dataplane, name))
    monkeypatch.setattr(turnplane, "ACCELERATED", turnplane.ACCELERATED)
    import crossroads.services.turn as turn_service
    import crossroads.transport.stunport as stunport

    monkeypatch.setattr(turn_service, "ACCELERATED", turn_service.ACCELERATED)
    monkeypatch.setattr(stunport, "ACCELERATED", stunport.ACCELERATED)
    if planes.PURE_PYTHON_ENV in os.environ:
        monkeypatch.setenv(planes.PURE_PYTHON_ENV, os.environ[planes.PURE_PYTHON_ENV])
    else:
        monkeypatch.delenv(planes.PURE_PYTHON_ENV, raising=False)


@contextlib.contextmanager
def wire_like(
    names: dict[str, str], *, forwarding: bool = True
) -> Iterator[dict[str, KernelPlane]]:
    """Make relay_lab's namespaces look to the server's XDP program like
    NICs on a wire (docs/architecture.md "Which hook, per device"): the
    client's and peer's datagrams leave with full checksums (transmit
    checksum offload off: not CHECKSUM_PARTIAL), their veth ends have NAPI
    (an XDP program: a routeless kernel plane that passes everything) so
    the server's XDP frames sent into the veths are delivered, and the
    server's devices forward (else bpf_fib_lookup answers only FWD_DISABLED
    and the XDP program takes the next hops user space resolved:
    ``forwarding=False``, a relay host's usual setting). Yields the far ends'
    XDP holders by role ("client", "peer"): closing one takes NAPI away."""
    held: list[KernelPlane] = []
    try:
        for role in ("client", "peer"):
            tx_checksum(names[role], "eth0", False)
            with inside(names[role]):
                napi = KernelPlane.load()
                held.append(napi)
                napi.hook = "xdp"
                napi.attach("eth0")
        for family in ("ipv4", "ipv6"):
            for dev in ("toc", "top"):
                subprocess.run(
                    ["ip", "netns", "exec", names["server"], "sysctl", "-qw",
                     f"net.{family}.conf.{dev}.forwarding={int(forwarding)}"],
                    check=True, capture_output=True,
                )  # fmt: skip
        # The server knows its neighbours (else the first datagrams find no
        # next hop in XDP and go by tc, which resolves them).
        prime_neighbours(
            names["server"],
            ("192.0.2.2", "198.51.100.2", "2001:db8:2::2", "2001:db8:3::2"),
        )
        yield dict(zip(("client", "peer"), held, strict=True))
    finally:
        for role, napi in zip(("client", "peer"), held, strict=False):
            with inside(names[role]):
                napi.close()


def prime_neighbours(ns: str, hosts: tuple[str, ...]) -> None:
    """Make ``ns`` resolve the link-layer addresses of ``hosts`` (a datagram
    to the discard port each), waiting (bounded) until it knows them."""
    for host in hosts:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with inside(ns), socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.sendto(b"", (host, 9))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        shown = subprocess.run(
            ["ip", "-n", ns, "neigh", "show"], capture_output=True, text=True
        ).stdout
        known = [
            line.split()[0]
            for line in shown.splitlines()
            if "lladdr" in line and "REACHABLE" in line
        ]
        if all(host in known for host in hosts):
            return
        time.sleep(0.05)
    raise AssertionError(f"{ns} never resolved {hosts}: {shown}")
