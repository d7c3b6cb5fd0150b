"""The TURN half of the STUN/TURN port: its control core, relays and route table.

Theory of operation
-------------------
:class:`TurnPlane` runs TURN's control core
(:class:`~crossroads.proto.turn.server.TurnServer`) for the port engine
(:mod:`crossroads.transport.stunport`), which sorts each datagram once and
hands it the non-Binding STUN messages and the ChannelData no route took. Each
input is one driver step (:mod:`crossroads.transport.driver`): the core's
input, then what it queued for clients leaves by the endpoint of the 5-tuple
(the port's endpoint table, never a parked endpoint), its events are acted on
(relay sockets, RFC 6062 connections) and handed to the owner (metrics, logs,
insight), and its one timer is re-armed.

The core decides everything (permissions, channels, lifetimes, quotas, the
Send indications and peer datagrams the routes do not take, and their
framing); it tells each relay what to forward through the ``RelayPort`` calls
(``route_channel`` ...), and :class:`TurnRoutes` turns those into routes of
the runtime's :class:`~crossroads.transport.routes.RouteTable`, the one writer
of every relay's routes: it picks the table (the listening side's, one per
listening endpoint: the taps the port made at bind time, or a hand-fed one for
a TCP connection or a DTLS session; or the relay socket's), keeps the handles
and folds their counts into the allocations' usage. The taps, the C plane and
its counters read the tables (:mod:`crossroads.transport.turnplane` says which
route does what). On the kernel plane (``--dataplane kernel``) the route table
puts each UDP channel's two routes into the eBPF program's map too, beside the
taps' (see :meth:`TurnRoutes.kernel_takes` for which flows, docs/architecture.md
"The kernel data plane"), and removes them with the taps' routes.

Relays are built from those tables (:class:`UdpRelay`, :class:`TcpRelay`), not
from a reference to a service. RFC 6062 data connections are routes of the
stream plane (:mod:`crossroads.transport.streamplane`), like every relayed TCP
flow: a peer connection is held until ConnectionBind, then joined to the
client's by splice(2), or, when the client's connection is TLS, through a
transport route.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from crossroads.proto.turn.allocation import Allocation, FiveTuple, Listener
from crossroads.proto.turn.constants import MAX_PENDING_PEER_BYTES, Family, Transport
from crossroads.proto.turn.server import (
    AllocationDeleted,
    BindConnection,
    CloseConnection,
    ConnectPeer,
    RelayBinder,
    TurnEvent,
    TurnServer,
)
from crossroads.transport import streamplane
from crossroads.transport.admission import Admission
from crossroads.transport.dataplane import (
    BudgetLike,
    Rewrite,
    RouteTapLike,
    TapReaders,
    make_budget,
    make_tap,
)
from crossroads.transport.driver import CoreTimer
from crossroads.transport.routes import InstalledRoute, RewriteRoute, RouteTable
from crossroads.transport.sockets import set_buffers
from crossroads.transport.streamplane import HeldStream, Route, StreamPlane
from crossroads.transport.tasks import cancel_until_done
from crossroads.transport.turnplane import (
    MAX_DATA_ROUTES,
    SEND_INDICATION_KEY,
    SendsTo,
    approve,
    channel_key,
    data_route,
    listener_tap,
    send_route,
    to_client_route,
    to_peer_route,
)
from crossroads.types import Address

log = logging.getLogger("crossroads.turn")

#: Drop reason of relayed data for a TCP/TLS client whose connection has
#: :data:`~crossroads.transport.stunport.TCP_MAX_UNSENT` bytes unsent (the
#: client stalls; its connection and allocation stay).
DROP_CLIENT_BUFFER_FULL = "tcp-client-buffer-full"
#: Linux IP_MTU_DISCOVER / IP_PMTUDISC_DO: set the DF bit (RFC 8656 §7.2
#: DONT-FRAGMENT; §11.2 "the server sets the DF bit").
_IP_MTU_DISCOVER = getattr(socket, "IP_MTU_DISCOVER", 10)
_IP_PMTUDISC_DO = getattr(socket, "IP_PMTUDISC_DO", 2)
_IPV6_DONTFRAG = getattr(socket, "IPV6_DONTFRAG", 62)
#: Kernel buffers of relay sockets (same reasoning as the STUN sockets:
#: bursts are dropped by a small default buffer long before Python is busy).
RELAY_BUFFER_BYTES = 1024 * 1024


class Endpoint(Protocol):
    """A place STUN/TURN traffic arrived on: one UDP socket, one TCP (TLS)
    connection or one DTLS listener.

    ``transport`` is ``"udp"`` or ``"tcp"``; ``local`` the bound address;
    ``send(data, addr)`` sends from that same socket (for TCP, ``addr`` is
    ignored: data goes down the connection, which must already be framed --
    STUN messages as they are, ChannelData padded to 4 bytes).
    """

    @property
    def transport(self) -> Literal["udp", "tcp"]: ...

    @property
    def local(self) -> Address: ...

    def send(self, data: bytes, addr: Address) -> None: ...


class RelayedStream(Protocol):
    """A TCP/TLS client connection as relayed data sees it."""

    def send_relayed(self, data: bytes) -> bool:
        """Write relayed data; False (nothing written) while it cannot take it."""
        ...

    def round_trip(self) -> float | None:
        """The kernel's smoothed RTT of the connection (seconds; TCP_INFO),
        None if unknown: the one round trip TURN shows (connection insight)."""
        ...


class PortSide(Protocol):
    """What the TURN plane asks of the port it runs on."""

    def endpoint(self, five: FiveTuple) -> Endpoint | None:
        """The endpoint a client of ``five`` is reached by (None: gone)."""
        ...

    def route_out(self, endpoint: Endpoint) -> SendsTo | None:
        """The socket peer -> client routes of ``endpoint``'s clients leave
        from, when the data plane can send for it (None: Python path)."""
        ...

    def stream(self, endpoint: Endpoint) -> RelayedStream | None:
        """``endpoint`` as a TCP/TLS connection (None: a datagram endpoint)."""
        ...

    def detach_stream(
        self, endpoint: Endpoint
    ) -> tuple[asyncio.Transport | None, bytes]:
        """Hand a TCP connection over (RFC 6062 §5.4): its transport and the
        bytes it had buffered past its last frame."""
        ...

    def end_session(self, endpoint: Endpoint, client: Address) -> None:
        """The allocation of ``client`` on ``endpoint`` ended (a DTLS session
        ends with it, as coturn's does)."""
        ...


# ------------------------------------------------------------------ counters


class RelayStats:
    """Data-plane counters: plain ints on the hot path, exported at scrape time."""

    __slots__ = (
        "to_peer_packets",
        "to_peer_bytes",
        "to_client_packets",
        "to_client_bytes",
        "retired_errors",
        "retired_throttled",
        "drops",
    )

    def __init__(self) -> None:
        self.to_peer_packets = 0
        self.to_peer_bytes = 0
        self.to_client_packets = 0
        self.to_client_bytes = 0
        #: Send errors and malformed drops counted by taps that are gone.
        self.retired_errors = 0
        #: Datagrams dropped by the bandwidth limit of relays that are gone.
        self.retired_throttled = 0
        self.drops: dict[str, int] = {}

    def drop(self, reason: str) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + 1


# ------------------------------------------------------------------ route table


class TurnRoutes:
    """TURN's side of the route table: which tap each route goes in, the
    handles by channel and peer, and their counts folded into the totals
    and the allocations' usage. The runtime's
    :class:`~crossroads.transport.routes.RouteTable` writes every route (the
    taps' dicts and, on the kernel plane, the eBPF map); nothing here does.

    Listening side: one table per listening endpoint, keyed by
    ``(client, first 2 bytes)`` (:func:`~crossroads.transport.turnplane.
    channel_key`, ``SEND_INDICATION_KEY``): the tap the port put on a socket at
    bind time (:meth:`listen`), or one made on the first route of an endpoint
    whose datagrams come in through the port (TCP, TLS, DTLS: :meth:`table`).
    Relay side: one table per relay socket, keyed by the peer. All taps are
    read by one :class:`~crossroads.transport.dataplane.TapReaders`.

    On the kernel plane (``--dataplane kernel``) a UDP channel's two routes
    also forward in the eBPF program (client -> peer: ``UNWRAP_CHANNEL``
    keyed by the client, our listening address and the channel; peer ->
    client: ``WRAP_CHANNEL`` keyed by the peer and the relayed address), for
    the flows it forwards exactly as the taps would (:meth:`kernel_takes`;
    docs/architecture.md "The kernel data plane"). The taps' routes stay as
    the fallback (a padded ChannelData, a route the map could not hold).
    """

    def __init__(
        self, stats: RelayStats, route_table: RouteTable | None = None
    ) -> None:
        self.stats = stats
        #: The runtime's route table: the only writer of the routes below.
        self.route_table = RouteTable() if route_table is None else route_table
        self.readers = TapReaders()
        #: Taps the port put in front of its UDP sockets at bind time.
        self.taps: dict[Endpoint, RouteTapLike] = {}
        #: Taps without a socket, for endpoints whose ChannelData comes
        #: through the port (TCP, TLS, DTLS, a socket read by the port).
        self.hand_taps: dict[Endpoint, RouteTapLike] = {}
        #: Relay taps (peer -> client), by relay.
        self.relay_taps: dict[UdpRelay, RouteTapLike] = {}
        #: What a hand-fed tap's unrouted ChannelData becomes (the TURN
        #: plane's count of why, once it runs).
        self.unrouted: Callable[[bytes, Address, Endpoint], None] = _ignore
        #: Relayed address -> relays that learned a Data indication route
        #: from it, and Send routes that approved it (see :meth:`forget_relayed`).
        self.self_peer_relays: dict[Address, set[UdpRelay]] = {}
        self.self_peer_approvals: dict[Address, set[Any]] = {}
        #: What removed kernel routes forwarded (to-peer packets and bytes,
        #: to-client packets and bytes; also in ``stats``, with the rest).
        self.kernel_retired = [0, 0, 0, 0]

    # -- listening side --------------------------------------------------------

    def listen(
        self,
        endpoint: Endpoint,
        sock: socket.socket | None,
        dispatch: Callable[[bytes, Any], None],
    ) -> RouteTapLike:
        """The tap in front of one UDP socket of the port (made at bind time):
        it reads ``sock`` (None: the endpoint hands each datagram in), forwards
        routed ChannelData and Send indications, and gives every other
        datagram to ``dispatch``."""
        tap = listener_tap(sock, {}, dispatch)
        if sock is not None:
            self.readers.add(tap)
        self.taps[endpoint] = tap
        return tap

    def tapped(self, endpoint: Endpoint) -> bool:
        """Whether a tap sees this endpoint's datagrams before the port does."""
        return endpoint in self.taps

    def table_if_any(self, endpoint: Endpoint) -> dict[Any, Any] | None:
        """The endpoint's client -> peer route table, if it has one."""
        tap = self.taps.get(endpoint) or self.hand_taps.get(endpoint)
        return tap.routes if tap is not None else None

    def table(self, endpoint: Endpoint) -> dict[Any, Any]:
        """The client -> peer route table of a listening endpoint."""
        tap = self.taps.get(endpoint) or self.hand_taps.get(endpoint)
        if tap is None:

            def unrouted(data: bytes, client: Any) -> None:
                self.unrouted(data, client, endpoint)

            tap = self.hand_taps[endpoint] = listener_tap(None, {}, unrouted)
        return tap.routes

    def _settle(self, endpoint: Endpoint) -> None:
        """A hand-fed tap left without routes goes (TCP connections and DTLS
        sessions come and go)."""
        tap = self.hand_taps.get(endpoint)
        if tap is not None and not tap.routes:
            del self.hand_taps[endpoint]
            self._retire_listener(tap)

    def hand_in(self, data: bytes, client: Address, endpoint: Endpoint) -> bool:
        """ChannelData the port read itself: through the endpoint's hand-fed
        tap if it has one (True), else False."""
        tap = self.hand_taps.get(endpoint)
        if tap is None:
            return False
        tap.datagram_received(data, client)
        return True

    def _retire_listener(self, tap: RouteTapLike) -> None:
        stats = self.stats
        stats.to_peer_packets += tap.forwarded
        stats.to_peer_bytes += tap.forwarded_bytes
        stats.retired_errors += tap.send_errors + tap.malformed

    # -- a relay's routes, as the core decides them ----------------------------

    def kernel_takes(self, relay: UdpRelay, peer: Address) -> bool:
        """Whether the kernel may forward ``relay``'s channel to ``peer``
        exactly as the sockets do (the route table adds its own conditions:
        a kernel plane, a device toward the sender, room in the map, no
        bandwidth budget on the route): a UDP client on a UDP listener bound
        to one address (``link.out``: the one a peer -> client route leaves
        from; a wildcard listener replies from each client's destination
        address, TCP/TLS frame, DTLS encrypts), and a peer that is not one of
        this host's addresses (a relayed address or service port is judged
        per port by the control plane)."""
        return relay.link.out is not None and peer[0] not in relay.core.self_peers

    def route_send(self, relay: UdpRelay) -> None:
        """The client's Send indications leave from ``relay`` on the data
        plane (the first relay of a dual allocation takes them; the other
        family's go to the Python path, which handles both). Parsed and
        checked in user space: the socket taps' only."""
        table = self.table(relay.endpoint)
        if (relay.client, SEND_INDICATION_KEY) in table:
            return
        relay.sending = self.route_table.install(
            table,
            relay.client,
            send_route(
                relay.sock,
                relay.allocation.permissions,
                relay.core.self_peers,
                relay.budget,
            ),
            via=None,
            header=SEND_INDICATION_KEY,
        )

    def route_channel(self, relay: UdpRelay, number: int, peer: Address) -> None:
        """ChannelData from the client on ``number`` goes to ``peer``; a
        refresh keeps the route and its counts."""
        old = relay.installed.get(number)
        if old is not None:
            if (old.dest[0], old.dest[1]) == (peer[0], peer[1]):
                self.route_table.refresh(old)
                return
            self.unroute_channel(relay, number)
        relay.installed[number] = self.route_table.install(
            self.table(relay.endpoint),
            relay.client,
            to_peer_route(relay.sock, peer, relay.budget),
            via=relay.endpoint.local,
            header=channel_key(relay.client, number)[1],
            kernel=self.kernel_takes(relay, peer),
        )

    def unroute_channel(self, relay: UdpRelay, number: int) -> None:
        """Stop the client's ChannelData on ``number`` on every plane at once;
        what it forwarded joins the allocation's usage (the kernel's the
        totals too: the tap's are there already)."""
        installed = relay.installed.pop(number, None)
        if installed is None:
            return
        installed.remove()
        usage = relay.link.usage
        usage[0] += installed.packets
        usage[1] += installed.octets
        self._fold_kernel(installed, to_peer=True)
        self._settle(relay.endpoint)

    def route_peer(self, relay: UdpRelay, peer: Address, number: int) -> None:
        """Data from ``peer`` goes to the client as ChannelData on ``number``
        (a Data indication route of the peer's is replaced)."""
        relay.forget_learned(peer)
        if relay.link.out is None:
            return  # the relay's fallback sends it (TCP framing, DTLS...)
        old = relay.installed.get(peer)
        if old is not None:
            entry = old.entry
            if (
                getattr(entry, "rewrite", None) == Rewrite.WRAP_CHANNEL
                and getattr(entry, "channel", None) == number
            ):
                self.route_table.refresh(old)
                return
            self._unroute_to_client(relay, peer)
        relay.installed[peer] = self.route_table.install(
            relay.peer_routes,
            peer,
            to_client_route(relay.link.out, relay.client, number, relay.budget),
            via=relay.sock,
            kernel=self.kernel_takes(relay, peer),
        )

    def learn_peer(self, relay: UdpRelay, peer: Address, out: SendsTo) -> None:
        """The next datagrams from ``peer`` (permitted, no channel) leave as
        Data indications on the data plane (parsed and written in user space:
        the relay tap's only), until its permission lapses or a channel is
        bound to it."""
        relay.installed[peer] = self.route_table.install(
            relay.peer_routes,
            peer,
            data_route(out, relay.client, peer, os.urandom(8), relay.budget),
            via=relay.sock,
        )
        relay.data_peers.setdefault(peer[0], set()).add(peer)
        if peer[0] in relay.core.self_peers:
            self.self_peer_relays.setdefault(peer, set()).add(relay)

    def unroute_peer(self, relay: UdpRelay, peer: Address) -> None:
        """Stop data from ``peer`` on every plane at once."""
        self._unroute_to_client(relay, peer)
        relay.forget_learned(peer)

    def unroute_permission(self, relay: UdpRelay, ip: str) -> None:
        """The permission of ``ip`` lapsed: its learned Data indication routes go."""
        for peer in relay.data_peers.pop(ip, ()):
            self._unroute_to_client(relay, peer)

    def unroute_all(self, relay: UdpRelay) -> None:
        """Every route of ``relay`` goes (its allocation ends)."""
        for key in list(relay.installed):
            if isinstance(key, int):
                self.unroute_channel(relay, key)
            else:
                self._unroute_to_client(relay, key)
        relay.data_peers.clear()
        sending, relay.sending = relay.sending, None
        if sending is not None:
            sending.remove()
            usage = relay.link.usage
            usage[0] += sending.packets
            usage[1] += sending.octets
            self._settle(relay.endpoint)

    def _unroute_to_client(self, relay: UdpRelay, peer: Address) -> None:
        installed = relay.installed.pop(peer, None)
        if installed is not None:
            installed.remove()
            # The tap's part is in the relay tap's counts (folded at retire).
            self._fold_kernel(installed, to_peer=False)
            usage = relay.link.usage
            usage[2] += installed.kernel_packets
            usage[3] += installed.kernel_octets

    def _fold_kernel(self, installed: InstalledRoute, *, to_peer: bool) -> None:
        """A removed route's kernel counts (final: they outlive the route)
        join the totals, as a tap's do."""
        packets, octets = installed.kernel_packets, installed.kernel_octets
        if not packets:
            return
        stats, retired = self.stats, self.kernel_retired
        at = 0 if to_peer else 2
        retired[at] += packets
        retired[at + 1] += octets
        if to_peer:
            stats.to_peer_packets += packets
            stats.to_peer_bytes += octets
        else:
            stats.to_client_packets += packets
            stats.to_client_bytes += octets

    # -- relay side ------------------------------------------------------------

    def relay_tap(self, relay: UdpRelay) -> RouteTapLike:
        """The tap reading a relay socket (its table keyed by the peer)."""
        tap = make_tap(relay.sock, relay.peer_routes, relay.from_peer)
        self.readers.add(tap)
        self.relay_taps[relay] = tap
        return tap

    def retire(self, relay: UdpRelay) -> None:
        """Stop reading a closing relay; fold its counters into the totals."""
        self.forget_relayed(relay.address)
        self.unroute_all(relay)
        tap = self.relay_taps.pop(relay, None)
        if tap is None:
            return
        self.readers.remove(tap)
        tap.close()
        stats = self.stats
        stats.to_client_packets += tap.forwarded
        stats.to_client_bytes += tap.forwarded_bytes
        stats.retired_errors += tap.send_errors + tap.malformed
        stats.retired_throttled += relay.budget.throttled
        usage = relay.link.usage
        usage[2] += tap.forwarded
        usage[3] += tap.forwarded_bytes

    def approved(self, peer: Address, route: Any) -> None:
        """A Send route was approved for ``peer``, a relayed address."""
        self.self_peer_approvals.setdefault(peer, set()).add(route)

    def forget_relayed(self, address: Address) -> None:
        """The relayed ``address`` is gone: no route another allocation
        learned from it and no Send approval to it forwards any more (the
        core ended the channels to it; a new socket may take the port)."""
        for relay in self.self_peer_relays.pop(address, ()):
            self.unroute_peer(relay, address)
        for route in self.self_peer_approvals.pop(address, ()):
            approved = route.approved
            if approved is not None:
                approved.pop(address, None)

    # -- counters and life -----------------------------------------------------

    @property
    def kernel_routes(self) -> dict[UdpRelay, KernelChannels]:
        """Each relay's routes the kernel forwards now."""
        found: dict[UdpRelay, KernelChannels] = {}
        for relay in self.relay_taps:
            kernel = KernelChannels()
            for key, route in relay.installed.items():
                if route.twin is None:
                    continue
                if isinstance(key, int):
                    kernel.to_peer[key] = route.twin
                else:
                    kernel.to_client[key] = route.twin
            if kernel.to_peer or kernel.to_client:
                found[relay] = kernel
        return found

    def kernel_counters(self) -> tuple[int, int, int, int]:
        """What the kernel forwarded, removed routes and live ones: (to_peer
        packets, to_peer bytes, to_client packets, to_client bytes)."""
        live = self._kernel_live()
        retired = self.kernel_retired
        return (
            retired[0] + live[0],
            retired[1] + live[1],
            retired[2] + live[2],
            retired[3] + live[3],
        )

    def _kernel_live(self) -> list[int]:
        """What the live routes' kernel twins forwarded (read from the map)."""
        counts = [0, 0, 0, 0]
        for relay in self.relay_taps:
            for key, route in relay.installed.items():
                if route.twin is not None:
                    at = 0 if isinstance(key, int) else 2
                    counts[at] += route.kernel_packets
                    counts[at + 1] += route.kernel_octets
        return counts

    def counters(self) -> tuple[int, int, int, int, int]:
        """(to_peer packets, to_peer bytes, to_client packets, to_client bytes,
        data-plane drops), Python and C paths together."""
        stats = self.stats
        taps = [*self.taps.values(), *self.hand_taps.values()]
        relays = list(self.relay_taps.values())
        to_peer = stats.to_peer_packets + sum(t.forwarded for t in taps)
        to_peer_bytes = stats.to_peer_bytes + sum(t.forwarded_bytes for t in taps)
        to_client = stats.to_client_packets + sum(t.forwarded for t in relays)
        to_client_bytes = stats.to_client_bytes + sum(t.forwarded_bytes for t in relays)
        errors = stats.retired_errors + sum(
            t.send_errors + t.malformed for t in (*taps, *relays)
        )
        # Live kernel routes (removed ones are in ``stats`` already).
        kernel = self._kernel_live()
        to_peer += kernel[0]
        to_peer_bytes += kernel[1]
        to_client += kernel[2]
        to_client_bytes += kernel[3]
        return to_peer, to_peer_bytes, to_client, to_client_bytes, errors

    def throttled(self) -> int:
        """Datagrams the relays' bandwidth limits dropped."""
        return self.stats.retired_throttled + sum(
            relay.budget.throttled for relay in self.relay_taps
        )

    def close_listeners(self) -> None:
        """The port closes: stop reading its sockets (before they close)."""
        for tap in self.taps.values():
            self.readers.remove(tap)
            tap.close()
        self.taps.clear()

    def close(self) -> None:
        self.close_listeners()
        self.readers.close()


def _ignore(data: bytes, client: Address, endpoint: Endpoint) -> None:
    """Unrouted ChannelData while no TURN plane runs: nothing to count it."""


@dataclass(eq=False)
class KernelChannels:
    """One relay's channel routes in the kernel map."""

    #: Client -> peer, by channel number.
    to_peer: dict[int, RewriteRoute] = field(default_factory=dict)
    #: Peer -> client, by peer address.
    to_client: dict[Address, RewriteRoute] = field(default_factory=dict)


# ------------------------------------------------------------------ clients


class ClientLink:
    """How to reach the client of an allocation: its endpoint and address,
    and what peer -> client routes leave from (``out``: the listening UDP
    socket, unless replies must leave from each client's destination address
    or go through the endpoint: TCP framing, DTLS)."""

    __slots__ = ("endpoint", "client", "out", "stream", "usage", "created")

    def __init__(
        self,
        endpoint: Endpoint,
        client: Address,
        out: SendsTo | None,
        stream: RelayedStream | None,
    ) -> None:
        self.endpoint = endpoint
        self.client = client
        self.out = out
        #: A TCP/TLS client's connection: relayed data for it is dropped
        #: (counted) while its write buffer is full, never the connection.
        self.stream = stream
        #: What the allocation relayed (connection insight): to-peer packets
        #: and bytes, to-client packets and bytes, added up from the route
        #: and tap counters when they go (the data plane counts; nothing is
        #: written per datagram for it) and on the Python path.
        self.usage = [0, 0, 0, 0]
        self.created = time.time()


# ------------------------------------------------------------------ UDP relays


@dataclass(eq=False)
class UdpRelay:
    """One relay socket of a UDP allocation (a ``RelayPort`` for the core).

    A tap reads it (see :mod:`crossroads.transport.turnplane`): data from a
    peer with a channel and a live permission leaves as ChannelData by its
    route; everything else comes to :meth:`from_peer`, which asks the core
    what to do with it. The core's ``route_*`` calls become routes of both
    directions, written by the route table (:class:`TurnRoutes` says where).
    """

    allocation: Allocation = field(repr=False)
    family: Family
    sock: socket.socket
    address: Address
    link: ClientLink = field(repr=False)
    routes: TurnRoutes = field(repr=False)
    core: TurnServer = field(repr=False)
    #: ``--turn-max-bps``, both directions, every route of this relay.
    budget: BudgetLike = field(repr=False)
    #: Called once the relay's socket closes (kernel drop counting).
    on_close: Callable[[socket.socket], None] = field(repr=False)
    closed: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.client = self.link.client
        self.endpoint = self.link.endpoint
        #: The relay socket's route table: peer -> route to the client
        #: (written by the route table only).
        self.peer_routes: dict[Address, Any] = {}
        #: The routes as this relay holds them, in one dict (a few hundred
        #: bytes an allocation less than two): client -> peer by channel
        #: number (an int; in the listening endpoint's table), peer -> client
        #: by peer address (ChannelData or a learned Data indication); and
        #: the client's Send route when this relay has it.
        self.installed: dict[int | Address, InstalledRoute] = {}
        self.sending: InstalledRoute | None = None
        #: Peers (by IP) with a learned Data indication route in peer_routes.
        self.data_peers: dict[str, set[Address]] = {}
        self.tap = self.routes.relay_tap(self)
        if self.routes.tapped(self.endpoint) and self.link.stream is None:
            # Send indications of this client's, once parsed, checked for a
            # permission and a peer the control plane need not judge per port,
            # leave from this relay socket on the data plane.
            self.routes.route_send(self)

    @property
    def bps(self) -> float:
        return self.budget.bps

    def allow(self, size: int) -> bool:
        """Spend ``size`` bytes of the relay's bandwidth budget (False: drop)."""
        return self.budget.allow(size)

    def sendto(self, data: bytes, addr: Address) -> None:
        """Send to a peer from the relayed address (Send indications)."""
        try:
            self.sock.sendto(data, addr)
        except OSError:
            self.routes.stats.drop("relay-send-error")

    # -- the core's forwarding decisions, as routes ----------------------------

    def route_channel(self, number: int, peer: Address) -> None:
        self.routes.route_channel(self, number, peer)

    def unroute_channel(self, number: int) -> None:
        self.routes.unroute_channel(self, number)

    def route_peer(self, peer: Address, number: int) -> None:
        self.routes.route_peer(self, peer, number)

    def unroute_peer(self, peer: Address) -> None:
        self.routes.unroute_peer(self, peer)

    def forget_learned(self, peer: Address) -> None:
        """``peer``'s route is no longer a learned Data indication one."""
        learned = self.data_peers.get(peer[0])
        if learned is not None:
            learned.discard(peer)

    def unroute_permission(self, ip: str) -> None:
        self.routes.unroute_permission(self, ip)

    def unroute_all(self) -> None:
        self.routes.unroute_all(self)

    # -- what the routes do not forward ----------------------------------------

    def from_peer(self, data: bytes, addr: Address) -> None:
        """A datagram from a peer without a route: the core decides (RFC 8656
        §11.3, §12) and frames it; it leaves here."""
        decided = self.core.peer_data(self.allocation, self, data, addr)
        if decided is None:
            return
        message, is_channel = decided
        link = self.link
        stats = self.routes.stats
        if link.stream is not None:
            if not link.stream.send_relayed(message):
                stats.drop(DROP_CLIENT_BUFFER_FULL)
                return
        else:
            self.endpoint.send(message, self.client)
        size = len(data)
        stats.to_client_packets += 1
        stats.to_client_bytes += size
        usage = link.usage
        usage[2] += 1
        usage[3] += size
        if not is_channel and link.out is not None and self.learned < MAX_DATA_ROUTES:
            # The next ones from this peer take the data plane, until its
            # permission lapses (unroute_permission) or a channel is bound.
            self.routes.learn_peer(self, addr, link.out)

    @property
    def learned(self) -> int:
        """Data indication routes learned (at most MAX_DATA_ROUTES)."""
        return sum(len(peers) for peers in self.data_peers.values())

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.unroute_all()
        self.routes.retire(self)
        # Counting what the kernel dropped on it: a relay of a short call may
        # never have been seen by a scrape.
        self.on_close(self.sock)


# ------------------------------------------------------------------ TCP relays


@dataclass(eq=False)
class TcpRelay:
    """The listening socket of an RFC 6062 TCP allocation (a ``RelayPort``)."""

    allocation: Allocation
    family: Family
    sock: socket.socket
    address: Address
    plane: TurnPlane = field(repr=False)
    closed: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        bound = self.sock.getsockname()
        self.bind_address: Address = (bound[0], bound[1])
        self.bps = 0.0  # RFC 6062 data is spliced; TCP flow control applies
        # Peers' connections are accepted on the stream plane's epoll set.
        self.plane.streams.add_reader(self.sock.fileno(), self.plane.accept, self)

    def allow(self, size: int) -> bool:
        return True

    # No channels on a TCP allocation (RFC 6062 §4: ChannelBind is refused):
    # nothing to route.
    def route_channel(self, number: int, peer: Address) -> None:
        pass

    def unroute_channel(self, number: int) -> None:
        pass

    def route_peer(self, peer: Address, number: int) -> None:
        pass

    def unroute_peer(self, peer: Address) -> None:
        pass

    def unroute_permission(self, ip: str) -> None:
        pass

    def unroute_all(self) -> None:
        pass

    def sendto(self, data: bytes, addr: Address) -> None:
        self.plane.stats.drop("send-on-tcp-allocation")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.plane.streams.remove_reader(self.sock.fileno())
        self.sock.close()


# ------------------------------------------------------------------ the plane


class TurnPlane(RelayBinder):
    """TURN on the STUN/TURN port: the control core on the driver step, its
    relays and their routes (module docstring).

    ``make_core(binder)`` builds the core with this plane as its
    ``RelayBinder``; ``relay_hosts``: family -> (bind address, advertised
    address, or "" to find it per client); ``max_bps``: each relay's
    bandwidth budget; ``peer_connections``: the budget's table of RFC 6062
    peer data connections; ``on_event``: every core event, after the plane
    acted on it (metrics, logs, insight); ``on_socket_closed``: a relay
    socket closed (kernel drop counting).
    """

    def __init__(
        self,
        port: PortSide,
        routes: TurnRoutes,
        make_core: Callable[[RelayBinder], TurnServer],
        *,
        relay_hosts: dict[Family, tuple[str, str]],
        max_bps: float,
        peer_connections: Admission,
        on_event: Callable[[TurnEvent], None],
        on_socket_closed: Callable[[socket.socket], None],
    ) -> None:
        self.port = port
        self.routes = routes
        self.stats = routes.stats
        self.relay_hosts = relay_hosts
        self.max_bps = max_bps
        self.peer_connections = peer_connections
        self.on_event = on_event
        self.on_socket_closed = on_socket_closed
        self.loop = asyncio.get_running_loop()
        self.core = make_core(self)
        self.core.wall_offset = time.time() - self.loop.time()
        # One count of drops by reason: the core's and the relays' together.
        self.stats.drops = self.core.counters.drops
        #: RFC 6062 data connections on the stream plane: no idle timeout (a
        #: connection lives as long as its allocation, RFC 6062 §5.5), as many
        #: as the budget's peer connection table admits.
        self.streams = StreamPlane(
            idle_timeout=None, max_routes=max(1, peer_connections.max_items)
        )
        #: Peer data connections waiting for ConnectionBind, and joined data
        #: connections, by RFC 6062 connection id.
        self.held: dict[int, HeldStream] = {}
        self.joined: dict[int, Route] = {}
        #: The client host each peer data connection was admitted for in the
        #: budget's table (released once, when the connection ends).
        self._admitted: dict[int, str] = {}
        #: (to-peer chunks, bytes, to-client chunks, bytes) of the joined
        #: connections that ended.
        self._stream_totals = [0, 0, 0, 0]
        self._timer = CoreTimer(self.loop, self.core.get_timer, self._on_timer)
        self._tasks: set[asyncio.Task[Any]] = set()
        self.closed = False
        routes.unrouted = self.channel_data_unrouted

    @property
    def relays(self) -> set[UdpRelay]:
        """The live UDP relays (those the route table reads)."""
        return set(self.routes.relay_taps)

    # ------------------------------------------------------------ inputs

    def stun(self, data: bytes, client: Address, endpoint: Endpoint) -> None:
        """A non-Binding STUN message from a client, as the port sorted it."""
        listener = _listener(endpoint)
        if data[1] == 0x16 and data[0] == 0:  # a Send indication (RFC 8656 §11.2)
            self._send(data, client, endpoint, listener)
            return
        self.core.receive_datagram(data, client, self.loop.time(), listener)
        self.step()

    def channel_data(self, data: bytes, client: Address, endpoint: Endpoint) -> None:
        """ChannelData the port read itself (no tap in front of the socket):
        routed by the endpoint's hand-fed tap, or counted by the core."""
        if not self.routes.hand_in(data, client, endpoint):
            self.channel_data_unrouted(data, client, endpoint)

    def channel_data_unrouted(
        self, data: bytes, client: Address, endpoint: Endpoint
    ) -> None:
        """ChannelData no route forwarded: the core counts why."""
        self.core.channel_data_unrouted(data, client, _listener(endpoint))

    def connection_lost(self, client: Address, endpoint: Endpoint) -> None:
        """A TCP control connection closed: its allocation goes (RFC 8656 §3.1)."""
        if self.closed:
            return
        self.core.client_disconnected((Transport.TCP, client, endpoint.local))
        self.step()

    def _send(
        self, data: bytes, client: Address, endpoint: Endpoint, listener: Listener
    ) -> None:
        """A Send indication the routes did not take: the core judges it, it
        leaves from the relay here."""
        route = self.core.send_indication(data, client, listener)
        if route is None:
            return
        relay, peer, payload = route
        if peer[0] in self.core.self_peers and isinstance(relay, UdpRelay):
            # Approved for this port: the Send route may take the next ones
            # for a second (turnplane.SELF_PEER_APPROVAL).
            table = self.routes.table_if_any(endpoint)
            send = table.get((client, SEND_INDICATION_KEY)) if table else None
            if send is not None and send.sock is relay.sock:
                approve(send, peer, time.monotonic())
                if peer in self.core.relayed:
                    self.routes.approved(peer, send)
        relay.sendto(payload, peer)
        stats = self.stats
        stats.to_peer_packets += 1
        stats.to_peer_bytes += len(payload)
        if isinstance(relay, UdpRelay):
            relay.link.usage[0] += 1
            relay.link.usage[1] += len(payload)

    # ------------------------------------------------------------ driver step

    def step(self) -> None:
        """What follows every input of the core: what it queued for clients
        leaves, its events are acted on, its timer is re-armed (the driver's
        steps 2-3, :mod:`crossroads.transport.driver`)."""
        self._transmit()
        self._timer.rearm()

    def _transmit(self) -> None:
        # Datagrams first: an event may act on a connection an answer still has
        # to go down (BindConnection pipes it after the ConnectionBind answer).
        now = self.loop.time()
        port = self.port
        for data, client, (transport, local) in self.core.datagrams_to_send(now):
            endpoint = port.endpoint((transport, client, local))
            if endpoint is not None:
                endpoint.send(data, client)
        self.process_events()

    def process_events(self) -> None:
        """Act on the core's events, then hand each to the owner."""
        for event in self.core.pop_events():
            self._act(event)
            self.on_event(event)

    def _act(self, event: TurnEvent) -> None:
        match event:
            case AllocationDeleted(allocation=allocation):
                link = allocation.transport_data
                if isinstance(link, ClientLink):
                    self.port.end_session(link.endpoint, link.client)
            case ConnectPeer(connection_id=cid, relay=relay, peer=peer):
                assert isinstance(relay, TcpRelay)
                self._spawn(self._connect_peer(cid, relay, peer))
            case BindConnection(connection_id=cid, five_tuple=five):
                self._bind_connection(cid, five)
            case CloseConnection(connection_id=cid):
                held = self.held.pop(cid, None)
                if held is not None:
                    held.close()
                route = self.joined.pop(cid, None)
                if route is not None:
                    route.close(streamplane.CLOSED)
                self._release(cid)

    def _on_timer(self, now: float) -> None:
        self.core.wall_offset = time.time() - now
        self.core.handle_timer(now)
        self._transmit()

    # ------------------------------------------------------------ RelayBinder

    def has_relay_address(self, family: Family) -> bool:
        return family in self.relay_hosts

    def open_relay(
        self,
        allocation: Allocation,
        family: Family,
        port: int,
        transport: Transport,
        dont_fragment: bool,
    ) -> UdpRelay | TcpRelay | None:
        bind_host, advertised = self.relay_hosts[family]
        five = allocation.five_tuple
        if not advertised:
            advertised = _route_source(family, five[1][0])
            if not advertised:
                return None
        endpoint = self.port.endpoint(five)
        if endpoint is None:
            return None
        link = allocation.transport_data
        if not isinstance(link, ClientLink):
            link = allocation.transport_data = ClientLink(
                endpoint,
                five[1],
                self.port.route_out(endpoint),
                self.port.stream(endpoint),
            )
        af = socket.AF_INET6 if family == Family.IPV6 else socket.AF_INET
        if transport == Transport.UDP:
            sock = _udp_socket(af, bind_host, port, dont_fragment)
            if sock is None:
                return None
            relay = UdpRelay(
                allocation,
                family,
                sock,
                (advertised, port),
                link,
                self.routes,
                self.core,
                make_budget(self.max_bps),
                self.on_socket_closed,
            )
            return relay
        return self._open_tcp(allocation, family, af, bind_host, port, advertised)

    def _open_tcp(
        self,
        allocation: Allocation,
        family: Family,
        af: socket.AddressFamily,
        bind_host: str,
        port: int,
        advertised: str,
    ) -> TcpRelay | None:
        # Probe without SO_REUSEPORT first: the port must be ours alone. The
        # listener then uses SO_REUSEPORT so that Connect can open outgoing
        # connections from the same relayed address (RFC 6062 §5.2).
        try:
            with socket.socket(af, socket.SOCK_STREAM) as probe:
                if af == socket.AF_INET6:
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                probe.bind((bind_host, port))
        except OSError:
            return None
        sock = socket.socket(af, socket.SOCK_STREAM)
        try:
            if af == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((bind_host, port))
            sock.listen(64)
            sock.setblocking(False)
        except OSError:
            sock.close()
            return None
        return TcpRelay(allocation, family, sock, (advertised, port), self)

    # ------------------------------------------------------------ RFC 6062

    async def _connect_peer(self, cid: int, relay: TcpRelay, peer: Address) -> None:
        client = relay.allocation.five_tuple[1][0]
        refused = self.peer_connections.admit(client)
        if refused is not None:
            self.stats.drop(f"peer-connection-{refused}")
            self.core.peer_connect_failed(cid)
            self.step()
            return
        af = socket.AF_INET6 if relay.family == Family.IPV6 else socket.AF_INET
        sock = socket.socket(af, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            with contextlib.suppress(OSError):
                # RFC 6062 §5.2: from the relayed transport address.
                sock.bind(relay.bind_address)
            await self.loop.sock_connect(sock, peer)
        except (OSError, asyncio.CancelledError) as exc:
            sock.close()
            self.peer_connections.release(client)
            if not isinstance(exc, asyncio.CancelledError):
                self.core.peer_connect_failed(cid)
                self.step()
            return
        if cid not in self.core.connections or self.closed:
            sock.close()
            self.peer_connections.release(client)
            return
        self._hold(cid, sock, client)
        self.core.peer_connected(cid, self.loop.time())
        self.step()

    def accept(self, relay: TcpRelay) -> None:
        """Peers connecting to a TCP relay (RFC 6062 §5.3): each admitted by
        the budget and the core is held until the client binds it."""
        client = relay.allocation.five_tuple[1][0]
        for _ in range(streamplane.SPLICES_PER_WAKEUP):
            if relay.closed:
                return
            try:
                sock, peer = relay.sock.accept()
            except BlockingIOError:
                return
            except OSError:
                return  # ECONNABORTED, EMFILE...: the next readiness retries
            refused = self.peer_connections.admit(client)
            if refused is not None:
                self.stats.drop(f"peer-connection-{refused}")
                sock.close()
                continue
            cid = self.core.peer_accepted(
                relay.allocation, (peer[0], peer[1]), self.loop.time()
            )
            if cid is None:
                self.peer_connections.release(client)
                sock.close()
            else:
                self._hold(cid, sock, client)
            self.step()

    def _hold(self, cid: int, sock: socket.socket, client: str) -> None:
        """Read a peer data connection (at most MAX_PENDING_PEER_BYTES, RFC
        6062 §5.3) until the client binds it."""
        self._admitted[cid] = client

        def closed(held: HeldStream) -> None:
            if self.held.pop(cid, None) is not None:
                self.tcp_connection_lost(cid)

        self.held[cid] = self.streams.hold(
            sock, limit=MAX_PENDING_PEER_BYTES, on_closed=closed
        )

    def _bind_connection(self, cid: int, five: FiveTuple) -> None:
        """Take the client data connection over from the port and join it to
        the peer's on the stream plane."""
        endpoint = self.port.endpoint(five)
        if endpoint is None or cid not in self.held:
            self.core.connection_closed(cid)
            return
        stream, leftover = self.port.detach_stream(endpoint)
        if stream is None:
            self.core.connection_closed(cid)
            return
        # After the ConnectionBind response (already written) the connection
        # carries raw application data (RFC 6062 §5.4): nothing more is read
        # from it until the route reads it.
        stream.pause_reading()
        self.loop.call_soon(self._join, cid, stream, leftover)

    def _join(self, cid: int, stream: asyncio.Transport, leftover: bytes) -> None:
        held = self.held.pop(cid, None)
        if held is None or self.closed:
            stream.abort()
            return
        peer, head = held.release()

        def closed(route: Route) -> None:
            self._fold(route)
            self.joined.pop(cid, None)
            self.tcp_connection_lost(cid)

        client = _plain_socket(stream)
        route: Route | None
        if client is not None:
            # TCP: the two sockets are spliced (the transport's own descriptor
            # goes; the duplicate carries the connection).
            stream.abort()
            route = self.streams.join(
                peer, client, to_a=leftover, to_b=head, on_closed=closed,
                half_close=False,
            )  # fmt: skip
        else:
            # TLS: the plaintext exists in user space only.
            route = self.streams.join_transport(
                peer, stream, to_a=leftover, to_b=head, on_closed=closed,
                half_close=False,
            )  # fmt: skip
        if route is None:
            self.stats.drop("peer-connection-over-limit")
            self.tcp_connection_lost(cid)
        elif not route.closed:
            self.joined[cid] = route

    def _fold(self, route: Route) -> None:
        """An ended route's counters join the totals."""
        totals = self._stream_totals
        totals[0] += route.b_to_a.chunks
        totals[1] += route.b_to_a.octets
        totals[2] += route.a_to_b.chunks
        totals[3] += route.a_to_b.octets

    def counters(self) -> tuple[int, int, int, int, int]:
        """The route table's counters (:meth:`TurnRoutes.counters`) with the
        RFC 6062 data connections' added: their packets are the chunks the
        stream plane read, counted by the routes (nothing per chunk here)."""
        to_peer, to_peer_bytes, to_client, to_client_bytes, errors = (
            self.routes.counters()
        )
        totals = list(self._stream_totals)
        for route in self.joined.values():
            totals[0] += route.b_to_a.chunks
            totals[1] += route.b_to_a.octets
            totals[2] += route.a_to_b.chunks
            totals[3] += route.a_to_b.octets
        return (
            to_peer + totals[0],
            to_peer_bytes + totals[1],
            to_client + totals[2],
            to_client_bytes + totals[3],
            errors,
        )

    def _release(self, cid: int) -> None:
        """Give the data connection's place in the budget back (once)."""
        client = self._admitted.pop(cid, None)
        if client is not None:
            self.peer_connections.release(client)

    def tcp_connection_lost(self, cid: int) -> None:
        self._release(cid)
        if self.closed:
            return
        self.core.connection_closed(cid)
        self.step()

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ------------------------------------------------------------ life

    def revoke(self, allocations: list[Allocation]) -> None:
        """Delete ``allocations`` now, as if they expired (relays closed)."""
        for allocation in allocations:
            self.core.delete_allocation(allocation, "revoked")
        self.step()

    async def close(self) -> None:
        """Every allocation ends (relays closed, their routes gone)."""
        if self.closed:
            return
        self.closed = True
        self.core.close()
        self._transmit()
        self.held.clear()
        self.joined.clear()
        self.streams.close()  # closed routes give their budget places back
        for cid in list(self._admitted):
            self._release(cid)
        self._timer.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            await cancel_until_done(task)
            if not task.cancelled():
                task.exception()  # retrieved: not reported again at shutdown


def _plain_socket(stream: asyncio.Transport) -> socket.socket | None:
    """A duplicate of a plain TCP transport's socket, to splice (None: TLS,
    bytes still unsent, or no socket)."""
    if stream.get_extra_info("sslcontext") is not None:
        return None
    if stream.get_write_buffer_size() or stream.is_closing():
        return None
    raw = stream.get_extra_info("socket")
    if raw is None:
        return None
    try:
        return socket.socket(fileno=os.dup(raw.fileno()))
    except OSError:
        return None


def _listener(endpoint: Endpoint) -> Listener:
    """The core's name of the socket a message came in on."""
    transport = Transport.TCP if endpoint.transport == "tcp" else Transport.UDP
    return transport, endpoint.local


def _udp_socket(
    af: socket.AddressFamily, bind_host: str, port: int, dont_fragment: bool
) -> socket.socket | None:
    """A relay socket bound to ``(bind_host, port)``; None when it is taken."""
    sock = socket.socket(af, socket.SOCK_DGRAM)
    try:
        if af == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        set_buffers(sock, RELAY_BUFFER_BYTES)
        if dont_fragment:
            if af == socket.AF_INET:
                sock.setsockopt(socket.IPPROTO_IP, _IP_MTU_DISCOVER, _IP_PMTUDISC_DO)
            else:
                sock.setsockopt(socket.IPPROTO_IPV6, _IPV6_DONTFRAG, 1)
        sock.bind((bind_host, port))
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
            log.warning("relay bind %s:%s failed: %s", bind_host, port, exc)
        return None
    return sock


def _route_source(family: Family, client_host: str) -> str:
    """The local address the kernel would use to reach ``client_host`` (a UDP
    ``connect`` does a route lookup and sends nothing)."""
    af = socket.AF_INET6 if family == Family.IPV6 else socket.AF_INET
    if (":" in client_host) != (family == Family.IPV6):
        return ""
    with socket.socket(af, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((client_host, 9))
        except OSError:
            return ""
        return str(probe.getsockname()[0])
