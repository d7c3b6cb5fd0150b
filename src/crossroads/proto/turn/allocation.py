"""Allocations, permissions and channel bindings, and the forwarding tables.

Theory of operation. An :class:`Allocation` is keyed by the client's 5-tuple
(transport, client address, server address; RFC 8656 §2). It owns one relay port
per address family (two for a dual allocation, RFC 8656 §7.1), a set of
permissions keyed by peer IP (the port is ignored, §9) and channel bindings
(number <-> peer transport address, §12). Every object carries an ``expires``
timestamp; nothing has its own timer. The server core keeps one heap of deadlines
(:class:`Deadlines`) with at most one entry per object: a refresh only moves
``expires``, and when a stale heap entry pops the object is re-queued at its new
deadline. So a client hammering Refresh creates no timer garbage, and the whole
core needs one ``call_at`` (``get_timer``). An object deleted early (Refresh 0,
a closed TCP connection) *cancels* its entry: the entry lets go of the object at
once (so a deleted allocation and its relay sockets are freed now, not when
their old deadline would have come, up to an hour later) and the heap drops such
empty entries in bulk once they are as many as the live ones.

The *forwarding tables* are kept here and mirrored into the data plane's route
table (:mod:`crossroads.transport.turnplane`) through the :class:`RelayPort`;
only this module writes them:

- :attr:`Allocation.routes` — channel number -> ``(relay, peer address)`` for
  ChannelData from the client (only live bindings; a binding needs no permission
  check in this direction, RFC 8656 §12.5); each entry is also
  :meth:`RelayPort.route_channel`;
- peer address -> channel number for data from a peer, holding only bindings
  whose permission is live, so one lookup answers "ChannelData or not" and
  "allowed or not" at once: :meth:`RelayPort.route_peer` /
  :meth:`RelayPort.unroute_peer`;
- :attr:`Allocation.permissions` — peer IP -> :class:`Permission`, for Send
  indications and Data indications (peers without a channel).

Expired channel bindings stay reserved for 5 more minutes (RFC 8656 §12: a number
or address must not be rebound to something else that soon): they leave the
forwarding tables but still block a conflicting ChannelBind.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Protocol

from crossroads.proto.turn.constants import (
    CHANNEL_LIFETIME,
    CHANNEL_QUARANTINE,
    PERMISSION_LIFETIME,
    Family,
    Transport,
)
from crossroads.types import Address

#: (transport protocol, client address, server address) — RFC 8656 §2 5-tuple.
FiveTuple = tuple[Transport, Address, Address]
#: The server's side of a 5-tuple: (transport protocol, server address). The
#: TURN core's name for a socket (:class:`~crossroads.proto.core.MultiSocketCore`).
Listener = tuple[Transport, Address]

#: A heap entry ``[deadline, seq, kind, subject]``, returned by
#: :meth:`Deadlines.schedule` so that the owner can :meth:`Deadlines.cancel` it.
TimerHandle = list[Any]
#: ``schedule(deadline, kind, subject) -> handle``.
Schedule = Callable[[float, "Kind", object], TimerHandle]


class RelayPort(Protocol):
    """A relay socket owned by the transport (one per allocation and family).

    The core reads :attr:`address` and :attr:`family`, and tells it which
    traffic the data plane may forward (the ``route_*`` / ``unroute_*`` calls);
    the transport turns those into routes.
    """

    address: Address
    family: Family

    @property
    def bps(self) -> float:
        """Bandwidth limit in bytes/s for the data plane (0: none)."""
        ...

    def route_channel(self, number: int, peer: Address) -> None:
        """Forward the client's ChannelData on ``number`` to ``peer``."""
        ...

    def unroute_channel(self, number: int) -> None:
        """Stop forwarding the client's ChannelData on ``number``."""
        ...

    def route_peer(self, peer: Address, number: int) -> None:
        """Forward data from ``peer`` to the client as ChannelData on ``number``."""
        ...

    def unroute_peer(self, peer: Address) -> None:
        """Stop forwarding data from ``peer`` as ChannelData."""
        ...

    def unroute_permission(self, ip: str) -> None:
        """The permission for ``ip`` lapsed: forward nothing more from it."""
        ...

    def unroute_all(self) -> None:
        """Forward nothing more (the allocation is being deleted)."""
        ...

    def allow(self, size: int) -> bool:
        """Spend ``size`` bytes of the bandwidth budget (False: drop)."""
        ...

    def sendto(self, data: bytes, addr: Address) -> None:
        """Send one datagram to a peer from the relayed address (data plane)."""
        ...

    def close(self) -> None:
        """Release the socket (idempotent)."""
        ...


class Kind(IntEnum):
    """What a deadline entry refers to."""

    ALLOCATION = 0
    PERMISSION = 1
    CHANNEL = 2
    QUARANTINE = 3
    RESERVATION = 4
    CONNECTION = 5
    #: The memory of a deleted allocation's Allocate (replay protection).
    FREED = 6


@dataclass(slots=True, eq=False)
class Permission:
    """Permission for one peer IP (RFC 8656 §9)."""

    ip: str
    expires: float
    dead: bool = False
    #: Its entry in the core's deadline heap (cancelled on early deletion).
    timer: TimerHandle | None = None


@dataclass(slots=True, eq=False)
class Channel:
    """A channel binding (RFC 8656 §12); ``active`` False while quarantined."""

    number: int
    peer: Address
    relay: RelayPort
    expires: float
    active: bool = True
    dead: bool = False
    timer: TimerHandle | None = None


@dataclass(slots=True, eq=False)
class Allocation:
    """One client's allocation (RFC 8656 §5)."""

    five_tuple: FiveTuple
    username: str
    #: The quota bucket: the user part of a time-limited username, else the name.
    quota_user: str
    realm: str
    #: Long-term key the allocation was created with (RFC 8656 §7.2: later
    #: requests must use the same credentials, else 441).
    key: bytes = field(repr=False)
    relays: dict[Family, RelayPort]
    requested_transport: Transport
    expires: float
    #: Transaction ID of the Allocate that created it, and the response sent,
    #: so a retransmission gets the same answer (RFC 8656 §7.2 step 1).
    transaction_id: bytes = b""
    response: bytes = b""
    dead: bool = False
    permissions: dict[str, Permission] = field(default_factory=dict)
    channels: dict[int, Channel] = field(default_factory=dict)
    channel_of_peer: dict[Address, Channel] = field(default_factory=dict)
    #: Data plane: channel number -> (relay, peer), live bindings only.
    routes: dict[int, tuple[RelayPort, Address]] = field(default_factory=dict)
    #: RFC 6062 connection ids of this allocation's peer connections.
    connections: set[int] = field(default_factory=set)
    #: Free-form slot for the transport (e.g. how to reach the client).
    transport_data: object = None
    #: Its entry in the core's deadline heap (cancelled on early deletion).
    timer: TimerHandle | None = None
    #: Unix issue time of the nonce the Allocate was signed with (see
    #: :meth:`crossroads.proto.turn.server.TurnServer` on stale-nonce Refresh 0).
    nonce_issued: int = 0

    def relay_for(self, peer_ip_version: int) -> RelayPort | None:
        """The relay port of the family of a peer (None: 443 mismatch)."""
        return self.relays.get(Family.IPV4 if peer_ip_version == 4 else Family.IPV6)

    # ------------------------------------------------------------ permissions

    def install_permission(self, ip: str, now: float, schedule: Schedule) -> None:
        """Install or refresh the permission for ``ip`` (RFC 8656 §9)."""
        permission = self.permissions.get(ip)
        expires = now + PERMISSION_LIFETIME
        if permission is not None:
            permission.expires = expires
            return
        permission = Permission(ip, expires)
        self.permissions[ip] = permission
        permission.timer = schedule(expires, Kind.PERMISSION, (self, permission))
        # Channels to this IP whose permission had lapsed forward again.
        for channel in self.channels.values():
            if channel.active and channel.peer[0] == ip:
                channel.relay.route_peer(channel.peer, channel.number)

    def expire_permission(self, permission: Permission) -> None:
        """Remove a lapsed permission and stop peer data that depended on it."""
        permission.dead = True
        if self.permissions.get(permission.ip) is permission:
            del self.permissions[permission.ip]
        for channel in self.channels.values():
            if channel.peer[0] == permission.ip:
                channel.relay.unroute_peer(channel.peer)
        for relay in self.relays.values():
            relay.unroute_permission(permission.ip)

    # ------------------------------------------------------------ channels

    def channel_conflict(self, number: int, peer: Address) -> bool:
        """True when ``number`` or ``peer`` is bound (or quarantined) to another."""
        bound = self.channels.get(number)
        if bound is not None and bound.peer != peer:
            return True
        other = self.channel_of_peer.get(peer)
        return other is not None and other.number != number

    def bind_channel(
        self,
        number: int,
        peer: Address,
        relay: RelayPort,
        now: float,
        schedule: Schedule,
    ) -> Channel:
        """Create or refresh a binding; also installs/refreshes the permission.

        The caller has checked :meth:`channel_conflict`.
        """
        channel = self.channels.get(number)
        expires = now + CHANNEL_LIFETIME
        if channel is None:
            channel = Channel(number, peer, relay, expires)
            self.channels[number] = channel
            self.channel_of_peer[peer] = channel
            channel.timer = schedule(expires, Kind.CHANNEL, (self, channel))
        else:
            # Refresh, or revival of a quarantined binding of the same pair (its
            # heap entry re-queues itself at the new deadline).
            channel.expires = expires
            channel.active = True
        self.install_permission(peer[0], now, schedule)
        self.routes[number] = (relay, peer)
        relay.route_channel(number, peer)
        if peer[0] in self.permissions:
            relay.route_peer(peer, number)
        return channel

    def expire_channel(
        self,
        channel: Channel,
        now: float,
        schedule: Schedule,
    ) -> None:
        """A binding lapsed: stop forwarding, keep the pair reserved 5 minutes."""
        channel.active = False
        self.routes.pop(channel.number, None)
        channel.relay.unroute_channel(channel.number)
        channel.relay.unroute_peer(channel.peer)
        # Counted from the moment the binding lapsed, not from when the timer
        # ran (a late timer must not lengthen the quarantine).
        channel.expires = min(channel.expires, now) + CHANNEL_QUARANTINE
        channel.timer = schedule(channel.expires, Kind.QUARANTINE, (self, channel))

    def forget_channel(self, channel: Channel) -> None:
        """End of quarantine: the number and the peer are free again."""
        channel.dead = True
        if self.channels.get(channel.number) is channel:
            del self.channels[channel.number]
        if self.channel_of_peer.get(channel.peer) is channel:
            del self.channel_of_peer[channel.peer]

    @property
    def active_channels(self) -> int:
        return sum(1 for c in self.channels.values() if c.active)

    # ------------------------------------------------------------ teardown

    def clear(self, cancel: Callable[[TimerHandle | None], None]) -> None:
        """Drop every table and cancel every timer (the allocation is being
        deleted)."""
        self.dead = True
        cancel(self.timer)
        self.timer = None
        for permission in self.permissions.values():
            permission.dead = True
            cancel(permission.timer)
            permission.timer = None
        for channel in self.channels.values():
            channel.dead = True
            cancel(channel.timer)
            channel.timer = None
        for relay in self.relays.values():
            relay.unroute_all()
        self.permissions.clear()
        self.channels.clear()
        self.channel_of_peer.clear()
        self.routes.clear()


class Deadlines:
    """One heap of ``[deadline, seq, kind, subject]`` — the core's only timer.

    Entries are not moved when an object is refreshed: an object whose deadline
    moved is recognised when its entry pops (see module docstring). An object
    deleted early cancels its entry instead: the entry forgets its subject at
    once, and the heap is rebuilt without such empty entries when they make up
    half of it (amortised O(1) per cancel; at most as many empty entries as
    live ones, plus :attr:`COMPACT_MIN`).
    """

    __slots__ = ("_heap", "_seq", "_cancelled")

    #: Below this many cancelled entries the heap is not worth rebuilding.
    COMPACT_MIN = 64

    def __init__(self) -> None:
        self._heap: list[TimerHandle] = []
        self._seq = 0
        self._cancelled = 0

    def __len__(self) -> int:
        return len(self._heap)

    def schedule(self, deadline: float, kind: Kind, subject: object) -> TimerHandle:
        self._seq += 1
        entry: TimerHandle = [deadline, self._seq, kind, subject]
        heapq.heappush(self._heap, entry)
        return entry

    def cancel(self, entry: TimerHandle | None) -> None:
        """Forget ``entry``'s subject now (idempotent; None is ignored)."""
        if entry is None or entry[3] is None:
            return
        entry[3] = None
        self._cancelled += 1
        heap = self._heap
        if self._cancelled > self.COMPACT_MIN and self._cancelled * 2 > len(heap):
            heap[:] = [e for e in heap if e[3] is not None]
            heapq.heapify(heap)
            self._cancelled = 0

    def next_deadline(self) -> float | None:
        heap = self._heap
        while heap and heap[0][3] is None:
            heapq.heappop(heap)
            self._cancelled -= 1
        return heap[0][0] if heap else None

    def pop_due(self, now: float) -> list[tuple[float, Kind, object]]:
        """Live entries whose deadline is ``<= now``, earliest first."""
        heap = self._heap
        due: list[tuple[float, Kind, object]] = []
        while heap and heap[0][0] <= now:
            entry = heapq.heappop(heap)
            deadline, _seq, kind, subject = entry
            if subject is None:
                self._cancelled -= 1
                continue
            entry[3] = None  # popped: a later cancel() of it is a no-op
            due.append((deadline, kind, subject))
        return due
