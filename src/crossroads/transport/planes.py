"""Which relay data plane runs, chosen once per process at start.

The planes, fastest first (docs/architecture.md "The kernel data plane"):

``kernel``
    The eBPF program of :mod:`crossroads.transport.kernelplane` forwards
    routed datagrams before they reach a socket; the C plane stays under it
    for everything the program passes (control traffic, first packets,
    routes it cannot take).
``c``
    :mod:`crossroads.transport._turnfast` (recvmmsg/sendmmsg, UDP GSO).
``python``
    The pure-Python twin in :mod:`crossroads.transport.dataplane`.

``--dataplane auto`` takes the first that works here and says which and why
in one log line; ``crossroads_dataplane_info{kind=...}`` is 1 for it. An
explicit choice that cannot run is an error at start, not a silent fallback.

``auto`` takes the kernel plane when the program loads (root or CAP_BPF and
CAP_NET_ADMIN, a kernel with BTF and the clang-built object): every relay
writes its routes there through the one route table (transport/routes.py) —
the Unity relay, the natneg relay's pairs, the RakNet UDP proxy's forwarders
and TURN's UDP channels (``TurnRoutes`` in transport/turnrelay.py decides
which: ChannelData both ways for a UDP client on a
listener bound to one address, without ``--turn-max-bps``, toward a peer
that is not one of this host's addresses; Send and Data indications,
TCP/TLS/DTLS clients and rate-limited relays stay on the plane under it) —
and several processes on one host share a device (each program passes what
it does not route on to the next: kernelplane.py).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from crossroads.transport import dataplane
from crossroads.transport.kernelplane import (
    KernelPlane,
    KernelPlaneUnavailable,
    device_name,
)

log = logging.getLogger("crossroads.dataplane")

Kind = Literal["kernel", "c", "python"]
KINDS: tuple[str, ...] = ("auto", "kernel", "c", "python")
#: Whether ``auto`` may pick the kernel plane: every relay writes its routes
#: there and several processes on one host share a device.
KERNEL_ROUTES_WIRED = True
#: What the C plane reads at import (dataplane.py); set for worker processes.
PURE_PYTHON_ENV = "CROSSROADS_TURN_PURE_PYTHON"


class DataplaneError(RuntimeError):
    """The requested plane cannot run here."""


@dataclass(eq=False)
class Dataplane:
    """The plane in use, why, and the loaded kernel program (kernel only)."""

    kind: Kind
    reason: str
    kernel: KernelPlane | None = None

    def close(self) -> None:
        if self.kernel is not None:
            self.kernel.close()
            self.kernel = None


def set_udp_gso(enabled: bool) -> bool:
    """Turn UDP GSO on the C plane's sends on or off; False when there is no C plane."""
    try:
        from crossroads.transport import _turnfast
    except ImportError:  # pragma: no cover - built by `make install`
        return False
    _turnfast.set_gso(enabled)
    return True


def use_python_plane() -> None:
    """Make every route, tap and budget made from now on the pure-Python twin.

    dataplane.py picks C at import unless PURE_PYTHON_ENV is set; this is the
    one place that switches it afterwards (and for the workers it starts)."""
    os.environ[PURE_PYTHON_ENV] = "1"
    dataplane.RouteType = dataplane.PyRoute
    dataplane.RouteTapType = dataplane.PyRouteTap
    dataplane.BudgetType = dataplane.PyBudget
    dataplane.PollerType = None
    for name in (
        "crossroads.transport.dataplane",
        "crossroads.transport.turnplane",
        "crossroads.transport.stunport",
        "crossroads.services.turn",
    ):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "ACCELERATED"):
            setattr(module, "ACCELERATED", False)  # noqa: B010


def select(requested: str, *, gso: bool = True, hook: str = "auto") -> Dataplane:
    """Choose the plane for ``requested`` (one of :data:`KINDS`); ``hook``
    is where the kernel plane's program runs (``--kernel-hook``)."""
    if requested not in KINDS:
        raise DataplaneError(f"--dataplane must be one of {', '.join(KINDS)}")
    c_built = dataplane.ACCELERATED
    if requested in ("kernel", "auto") and (
        requested == "kernel" or KERNEL_ROUTES_WIRED
    ):
        try:
            plane = KernelPlane.load()
        except KernelPlaneUnavailable as exc:
            if requested == "kernel":
                raise DataplaneError(f"--dataplane kernel: {exc}") from exc
            why = f"eBPF program not loaded ({exc})"
        else:
            plane.hook = hook
            set_udp_gso(gso)
            under = "C" if c_built else "Python"
            reason = (
                f"eBPF program loaded; Unity relay, natneg, RakNet proxy and "
                f"TURN channel routes forward in the kernel, the {under} plane "
                f"takes what it passes; --kernel-hook {hook}"
            )
            return Dataplane("kernel", reason, plane)
    elif requested == "auto":
        why = "the kernel plane is off in this build"
    else:
        why = f"--dataplane {requested}"
    if requested == "python":
        use_python_plane()
        return Dataplane("python", why)
    if c_built:
        set_udp_gso(gso)
        return Dataplane(
            "c", f"{why}; C plane built (UDP GSO {'on' if gso else 'off'})"
        )
    if requested == "c":
        raise DataplaneError(
            "--dataplane c: the C data plane is not built (no C compiler at install)"
        )
    return Dataplane("python", f"{why}; C plane not built")


def announce(choice: Dataplane, registry: CollectorRegistry) -> None:
    """The one log line and the info metric."""
    log.info("dataplane: %s (%s)", choice.kind, choice.reason)
    info = Gauge(
        "crossroads_dataplane_info",
        "1 for the relay data plane in use (kernel: eBPF; c: recvmmsg/sendmmsg; "
        "python: the pure-Python twin).",
        ["kind"],
        registry=registry,
    )
    for kind in ("kernel", "c", "python"):
        info.labels(kind=kind).set(1 if kind == choice.kind else 0)
    if choice.kernel is not None:
        registry.register(KernelPlaneCollector(choice))


class KernelPlaneCollector(Collector):
    """Which hook forwards on each device the kernel plane runs on, and how
    its datagrams went: what XDP forwarded or left to tc and why, and how tc
    moved ChannelData (read from the programs' per-CPU maps at scrape)."""

    def __init__(self, choice: Dataplane) -> None:
        self.choice = choice

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        devices = GaugeMetricFamily(
            "crossroads_dataplane_device_info",
            "1 per device the kernel plane runs on, with the hook that forwards "
            "there first (xdp in front of tc, or tc alone; the log says why).",
            labels=["device", "hook"],
        )
        xdp = CounterMetricFamily(
            "crossroads_dataplane_xdp_datagrams",
            "Routed datagrams the XDP program forwarded, or left to tc and why "
            "(left-egress, left-checksum, left-next-hop, left-other).",
            labels=["outcome"],
        )
        moves = CounterMetricFamily(
            "crossroads_dataplane_tc_channel_moves",
            "ChannelData datagrams the tc program moved by the header's 4 bytes: "
            "the headers (a finished checksum) or the data (a partial one).",
            labels=["moved"],
        )
        plane = self.choice.kernel
        if plane is not None:
            for ifindex, (hook, _why) in sorted(plane.hooks.copy().items()):
                devices.add_metric([device_name(ifindex), hook], 1)
            for outcome, count in plane.xdp_stats().items():
                xdp.add_metric([outcome], count)
            for moved, count in plane.tc_moves().items():
                moves.add_metric([moved], count)
        yield devices
        yield xdp
        yield moves
