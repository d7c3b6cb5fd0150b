"""The route table of the datagram relays: the one writer of their routes.

Theory of operation
-------------------
The Unity relay (:mod:`crossroads.transport.relay`), the natneg relay pairs
(:mod:`crossroads.transport.natneg_relay`) and RakNet's UDPProxy forwarders
(:mod:`crossroads.transport.raknet_forwarder`) forward a datagram as is, only
its addresses rewritten; TURN (:mod:`crossroads.transport.turnrelay`) also
takes a ChannelData header off or puts one on, or parses and writes Send and
Data indications (:mod:`crossroads.transport.turnplane`). Their control
planes decide *who may talk to whom*; :class:`RouteTable` is the only thing
that writes that decision down, in every plane that forwards:

- the socket plane: a route in the tap's route dict
  (:mod:`crossroads.transport.dataplane`; the C tap or its Python twin reads
  it per datagram), keyed by the source ``(host, port)`` — or, for the Unity
  relay, by ``((host, port), header)`` with the frame's first 36 bytes, and
  for TURN's listening side with the ChannelData channel number (2 bytes) or
  a Send indication's message type;
- the kernel plane, when the runtime runs it (``--dataplane kernel``): the
  same route in the eBPF program's map (:mod:`crossroads.transport.kernelplane`,
  ``REWRITE`` keyed by addresses, ``RELAY`` by addresses and those 36 bytes
  with the frame's DataLength checked, TURN's ``UNWRAP_CHANNEL`` by addresses
  and the channel number, ``WRAP_CHANNEL`` by addresses, putting the
  channel's header on). From then on the program forwards the
  flow before it reaches the socket and the tap's route sees nothing; the
  tap's route stays as the fallback (a route the kernel cannot take — no
  device toward the client, the map full, a DNAT in front, a bandwidth
  budget on the route: the program has no token bucket — is forwarded by the
  tap as before). A route of a kind the program does not forward (TURN's
  Send and Data indications) or one its owner keeps in user space
  (``kernel=False``: TURN's flows the program would not forward as the
  sockets do, :meth:`~crossroads.transport.turnrelay.TurnRoutes.kernel_takes`)
  is in the tap's dict only.

:meth:`RouteTable.install` writes both and returns an :class:`InstalledRoute`,
the relay's one handle on it: ``packets``/``octets`` are the sum of the tap's
and the kernel's counters (what idle sweeps, metrics, quotas and connection
insight read; they outlive removal), :meth:`InstalledRoute.remove` takes the
route out of both planes at once (the next datagram reaches the socket,
which has no route for it: a released pair, a revoked allocation), and
:meth:`InstalledRoute.reinstate` puts it back with its counts (a Unity route
suspended for its rate). A route the control plane forwards some other way
(the Unity relay's DTLS, stream or impaired ends) is installed with no socket
to read from (``via=None``): in the tap's dict only, which hands it to the
control plane.

Readers: the taps (C and Python), the kernel program, and the relays through
their handles. What is a relay's own stays with it: TURN's
:class:`~crossroads.transport.turnrelay.TurnRoutes` picks the tap (which
listening endpoint, which relay socket), keeps the handles by channel and
peer, and folds their counts into the allocation's usage when they go; it
writes no table itself. Byte streams (OpenTTD's TURN relay, RFC 6062 data
connections) are routes of the stream plane
(:mod:`crossroads.transport.streamplane`), its own one writer.

Addresses must be concrete in the kernel map: a relay socket bound to a
wildcard is keyed by the local address the kernel uses toward that client
(what the client sends to when it is reached directly).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from crossroads.transport.dataplane import Rewrite
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


class Bound(Protocol):
    """Something bound to a local address: a socket, or a listening endpoint
    as a route's out socket."""

    def getsockname(self) -> Any: ...


#: Where a route's source sends to: a socket, or its bound address.
Via = Bound | Address


def _bound(via: Via) -> Address:
    if isinstance(via, tuple):
        return via
    name = via.getsockname()
    return str(name[0]), int(name[1])


def _concrete(sock_address: Address, toward: str) -> Address:
    host, port = sock_address[0], sock_address[1]
    if ipaddress.ip_address(host).is_unspecified:
        host = local_address_for(toward)
    return host, port


def kernel_kind(entry: object, header: bytes | None) -> tuple[RouteKind, int] | None:
    """The kernel's kind of route doing what the tap's ``entry`` does, and its
    channel; None: a rewrite the program does not do (TURN's Send and Data
    indications: parsed and written in user space)."""
    rewrite = getattr(entry, "rewrite", Rewrite.NONE)
    if rewrite == Rewrite.NONE:
        return (RouteKind.REWRITE if header is None else RouteKind.RELAY), 0
    if rewrite == Rewrite.UNWRAP_CHANNEL and header is not None:
        # The listening side's key: the client and the channel number.
        return RouteKind.UNWRAP_CHANNEL, int.from_bytes(header, "big")
    if rewrite == Rewrite.WRAP_CHANNEL:
        return RouteKind.WRAP_CHANNEL, int(getattr(entry, "channel", 0))
    return None


class Entry(Protocol):
    """What a tap's route dict holds, as the table counts it: a data-plane
    route (:func:`~crossroads.transport.dataplane.make_route`) or a relay's
    own forwarding entry."""

    @property
    def dest(self) -> Address: ...

    packets: int
    octets: int


@dataclass(eq=False, slots=True)
class RewriteRoute:
    """One route in the kernel map; its counts outlive its removal."""

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


@dataclass(eq=False, slots=True)
class InstalledRoute:
    """One route as a relay holds it: the tap's entry and its kernel twin."""

    table: RouteTable
    routes: MutableMapping[Any, Any]
    #: Whose datagrams it forwards, and (Unity RELAY) the first bytes they
    #: start with: the tap's key is ``source`` or ``(source, header)``.
    source: Address
    header: bytes | None
    entry: Entry
    #: The socket the source sends to, or its address (None: not forwarded
    #: by a socket of ours, so never by the kernel either).
    via: Via | None
    #: False: the tap's dict only, whatever the planes (the owner's call).
    kernel: bool = True
    #: The kernel's route while it forwards this one.
    twin: RewriteRoute | None = None
    #: Counts of kernel twins already removed (a suspended route reinstated).
    _earlier: tuple[int, int] = (0, 0)
    live: bool = field(default=True, init=False)

    @property
    def key(self) -> object:
        """The route's key in the tap's dict."""
        return self.source if self.header is None else (self.source, self.header)

    @property
    def dest(self) -> Address:
        return self.entry.dest

    @property
    def packets(self) -> int:
        """Datagrams that took the route, on every plane."""
        twin = self.twin.packets if self.twin is not None else 0
        return self.entry.packets + twin + self._earlier[0]

    @property
    def octets(self) -> int:
        """Their bytes."""
        twin = self.twin.octets if self.twin is not None else 0
        return self.entry.octets + twin + self._earlier[1]

    @property
    def kernel_packets(self) -> int:
        """The part of :attr:`packets` the kernel forwarded."""
        twin = self.twin.packets if self.twin is not None else 0
        return twin + self._earlier[0]

    @property
    def kernel_octets(self) -> int:
        """The part of :attr:`octets` the kernel forwarded."""
        twin = self.twin.octets if self.twin is not None else 0
        return twin + self._earlier[1]

    def remove(self) -> None:
        """Take the route out of every plane at once, keeping its counts."""
        if not self.live:
            return
        self.live = False
        self.table.forget(self)
        if self.routes.get(self.key) is self.entry:
            del self.routes[self.key]
        twin = self.twin
        if twin is not None:
            twin.remove()
            self._earlier = (
                self._earlier[0] + twin.packets,
                self._earlier[1] + twin.octets,
            )
            self.twin = None

    def reinstate(self) -> None:
        """Put a removed route back in every plane, its counts carried on."""
        if self.live:
            return
        self.live = True
        self.routes[self.key] = self.entry
        self.table.remember(self)
        self.twin = self.table.twin(self)


@dataclass(eq=False)
class RouteTable:
    """The one writer of rewrite routes (one per runtime); ``plane`` is the
    kernel plane when the runtime runs it."""

    plane: KernelPlane | None = None
    #: Every live route (:meth:`clear`); a set of the handles themselves,
    #: the cheapest index (~40 bytes a route; a set per table would cost
    #: ~250 bytes a TURN relay, whose table holds a route or two).
    _live: set[InstalledRoute] = field(default_factory=set, repr=False)

    def remember(self, route: InstalledRoute) -> None:
        self._live.add(route)

    def forget(self, route: InstalledRoute) -> None:
        self._live.discard(route)

    def live(self, routes: MutableMapping[Any, Any]) -> list[InstalledRoute]:
        """The live routes of one tap's table (a walk over every route: for
        an owner's close and the replace safety net, not per datagram)."""
        return [r for r in self._live if r.routes is routes]

    def clear(self, routes: MutableMapping[Any, Any]) -> None:
        """Remove every live route of one tap's table (its owner closes)."""
        for route in self.live(routes):
            route.remove()

    def install(
        self,
        routes: MutableMapping[Any, Any],
        source: Address,
        entry: Entry,
        *,
        via: Via | None,
        header: bytes | None = None,
        kernel: bool = True,
    ) -> InstalledRoute:
        """Route what ``source`` sends (to ``via``; with ``header``, frames
        starting with it) along ``entry``: into the tap's ``routes`` and, on
        the kernel plane, into the map (:func:`kernel_kind`). The entry's
        ``sock`` and ``dest`` are where it leaves; ``via=None`` or
        ``kernel=False``: the tap's dict only."""
        installed = InstalledRoute(self, routes, source, header, entry, via, kernel)
        if installed.key in routes:
            # One route per key in every plane: the one there goes first
            # (its owner removes it before; this is the safety net).
            for old in self.live(routes):
                if old.key == installed.key:
                    old.remove()
        routes[installed.key] = entry
        self.remember(installed)
        installed.twin = self.twin(installed)
        return installed

    def refresh(self, route: InstalledRoute) -> None:
        """The owner confirms a live route (a TURN binding refreshed): the
        route and its counts stay; one the kernel did not take (the map was
        full) is offered to it again."""
        if route.live and route.twin is None:
            route.twin = self.twin(route)

    def twin(self, route: InstalledRoute) -> RewriteRoute | None:
        """``route`` in the kernel map, or None (no kernel plane, no socket,
        or a route the kernel cannot take: then the tap forwards it)."""
        plane, via = self.plane, route.via
        out: Bound | None = getattr(route.entry, "sock", None)
        if plane is None or via is None or out is None or not route.kernel:
            return None
        budget = getattr(route.entry, "budget", None)
        if budget is not None and budget.bps > 0:
            return None  # the program has no token bucket: the tap spends it
        taken = kernel_kind(route.entry, route.header)
        if taken is None:
            return None
        kind, channel = taken
        source, dest = route.source, route.dest
        header = route.header
        try:
            target = _concrete(_bound(via), source[0])
            out_source = _concrete(_bound(out), dest[0])
            # The program runs on the ingress of the device the client's
            # datagrams arrive on: the one the kernel routes the client by.
            plane.attach(egress_ifindex(source[0]))
        except (OSError, ValueError) as exc:
            log.debug("kernel route %s -> %s not taken: %s", source, dest, exc)
            return None
        kernel = KernelRoute(
            kind,
            (source[0], source[1]),
            target,
            out_source,
            (dest[0], dest[1]),
            channel,
            header=(header or b"") if kind is RouteKind.RELAY else b"",
        )
        if not plane.install(kernel):
            return None
        return RewriteRoute(plane, kernel)
