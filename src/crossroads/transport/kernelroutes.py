"""The address-rewrite relays' adapter to the kernel data plane.

natneg relay pairs (:mod:`crossroads.transport.natneg_relay`) and RakNet
UDPProxy forwarders (:mod:`crossroads.transport.raknet_forwarder`) forward a
datagram as is, only its addresses rewritten: exactly the kernel plane's
``REWRITE`` route (relay.bpf.c). When the runtime's plane is ``kernel``
(``--dataplane kernel``), each of them, where it puts a route in its socket
tap's table, also asks :meth:`KernelRoutes.rewrite` for the same route in the
kernel; from then on the eBPF program forwards that flow before it reaches the
socket, and the tap's own route sees nothing (it stays as the fallback: a
route the kernel cannot take — no device toward the client, the map full —
is forwarded by the tap as before).

:class:`RewriteRoute` is the relay's handle: ``packets``/``octets`` read the
kernel's per-route counters (so idle sweeps, metrics and connection insight
see kernel-forwarded traffic as they see the tap's), and :meth:`RewriteRoute.remove`
takes the route out of the map at once — the pair's or forwarder's end, or a
rewrite when a side moves — keeping the counts it had.

Addresses must be concrete in the map: a relay socket bound to a wildcard is
keyed by the local address the kernel uses toward that client (what the
client sends to when it is reached directly; behind a DNAT the route is not
taken and the tap forwards).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from dataclasses import dataclass

from crossroads.transport.kernelplane import (
    KernelPlane,
    KernelRoute,
    RouteKind,
    egress_ifindex,
)
from crossroads.types import Address

log = logging.getLogger("crossroads.dataplane")


def local_address_for(host: str) -> str:
    """The source address the kernel picks toward ``host`` (a connected UDP
    socket sends nothing)."""
    family = (
        socket.AF_INET if ipaddress.ip_address(host).version == 4 else socket.AF_INET6
    )
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return str(probe.getsockname()[0])


def _concrete(sock_address: Address, toward: str) -> Address:
    host, port = sock_address[0], sock_address[1]
    if ipaddress.ip_address(host).is_unspecified:
        host = local_address_for(toward)
    return host, port


@dataclass(eq=False)
class RewriteRoute:
    """One rewrite route in the kernel map; its counts outlive its removal."""

    plane: KernelPlane | None
    route: KernelRoute
    _final: tuple[int, int] = (0, 0)

    def _read(self) -> tuple[int, int]:
        if self.plane is None:
            return self._final
        return self.plane.counters(self.route) or self._final

    @property
    def packets(self) -> int:
        """Datagrams the kernel forwarded on this route."""
        return self._read()[0]

    @property
    def octets(self) -> int:
        """Their bytes (UDP payload)."""
        return self._read()[1]

    def remove(self) -> None:
        """Stop forwarding at once (the next datagram reaches the socket)."""
        if self.plane is None:
            return
        self._final = self._read()
        self.plane.remove(self.route)
        self.plane = None


@dataclass(eq=False)
class KernelRoutes:
    """The kernel plane as the rewrite relays see it (one per runtime)."""

    plane: KernelPlane

    def rewrite(
        self,
        source: Address,
        via: socket.socket,
        out: socket.socket,
        dest: Address,
    ) -> RewriteRoute | None:
        """Forward what ``source`` sends to ``via`` out of ``out`` to ``dest``
        in the kernel; None when the kernel cannot take it (the tap does)."""
        try:
            target = _concrete(via.getsockname(), source[0])
            out_source = _concrete(out.getsockname(), dest[0])
            # The program runs on the ingress of the device the client's
            # datagrams arrive on: the one the kernel routes the client by.
            self.plane.attach(egress_ifindex(source[0]))
        except (OSError, ValueError) as exc:
            log.debug("kernel route %s -> %s not taken: %s", source, dest, exc)
            return None
        route = KernelRoute(
            RouteKind.REWRITE,
            (source[0], source[1]),
            target,
            out_source,
            (dest[0], dest[1]),
        )
        if not self.plane.install(route):
            return None
        return RewriteRoute(self.plane, route)
