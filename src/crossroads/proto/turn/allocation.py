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
core needs one ``call_at`` (``get_timer``).

The *forwarding tables* are plain dicts the data plane reads with one lookup per
packet; only this module writes them:

- :attr:`Allocation.routes` — channel number -> ``(relay, peer address)`` for
  ChannelData from the client (only live bindings; a binding needs no permission
  check in this direction, RFC 8656 §12.5);
- :attr:`RelayPort.peer_channels` — peer address -> channel number for data from a
  peer, holding only bindings whose permission is live, so one lookup answers
  "ChannelData or not" and "allowed or not" at once;
- :attr:`Allocation.permitted` — peer IP -> :class:`Permission`, for Send
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
from typing import Protocol

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


class RelayPort(Protocol):
    """A relay socket owned by the transport (one per allocation and family).

    The core reads :attr:`address` and :attr:`family`, and maintains
    :attr:`peer_channels` (the data plane's peer -> channel table).
    """

    address: Address
    family: Family
    peer_channels: dict[Address, int]
    #: Bandwidth limit in bytes/s for the data plane (0: none).
    bps: float

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


@dataclass(slots=True, eq=False)
class Permission:
    """Permission for one peer IP (RFC 8656 §9)."""

    ip: str
    expires: float
    dead: bool = False


@dataclass(slots=True, eq=False)
class Channel:
    """A channel binding (RFC 8656 §12); ``active`` False while quarantined."""

    number: int
    peer: Address
    relay: RelayPort
    expires: float
    active: bool = True
    dead: bool = False


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
    key: bytes
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

    def relay_for(self, peer_ip_version: int) -> RelayPort | None:
        """The relay port of the family of a peer (None: 443 mismatch)."""
        return self.relays.get(Family.IPV4 if peer_ip_version == 4 else Family.IPV6)

    # ------------------------------------------------------------ permissions

    def permission_live(self, ip: str) -> bool:
        return ip in self.permissions

    def install_permission(
        self, ip: str, now: float, schedule: Callable[[float, Kind, object], None]
    ) -> None:
        """Install or refresh the permission for ``ip`` (RFC 8656 §9)."""
        permission = self.permissions.get(ip)
        expires = now + PERMISSION_LIFETIME
        if permission is not None:
            permission.expires = expires
            return
        permission = Permission(ip, expires)
        self.permissions[ip] = permission
        schedule(expires, Kind.PERMISSION, (self, permission))
        # Channels to this IP whose permission had lapsed forward again.
        for channel in self.channels.values():
            if channel.active and channel.peer[0] == ip:
                channel.relay.peer_channels[channel.peer] = channel.number

    def expire_permission(self, permission: Permission) -> None:
        """Remove a lapsed permission and stop peer data that depended on it."""
        permission.dead = True
        if self.permissions.get(permission.ip) is permission:
            del self.permissions[permission.ip]
        for channel in self.channels.values():
            if channel.peer[0] == permission.ip:
                channel.relay.peer_channels.pop(channel.peer, None)

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
        schedule: Callable[[float, Kind, object], None],
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
            schedule(expires, Kind.CHANNEL, (self, channel))
        else:
            # Refresh, or revival of a quarantined binding of the same pair (its
            # heap entry re-queues itself at the new deadline).
            channel.expires = expires
            channel.active = True
        self.install_permission(peer[0], now, schedule)
        self.routes[number] = (relay, peer)
        if peer[0] in self.permissions:
            relay.peer_channels[peer] = number
        return channel

    def expire_channel(
        self,
        channel: Channel,
        now: float,
        schedule: Callable[[float, Kind, object], None],
    ) -> None:
        """A binding lapsed: stop forwarding, keep the pair reserved 5 minutes."""
        channel.active = False
        self.routes.pop(channel.number, None)
        channel.relay.peer_channels.pop(channel.peer, None)
        # Counted from the moment the binding lapsed, not from when the timer
        # ran (a late timer must not lengthen the quarantine).
        channel.expires = min(channel.expires, now) + CHANNEL_QUARANTINE
        schedule(channel.expires, Kind.QUARANTINE, (self, channel))

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

    def clear(self) -> None:
        """Drop every table (the allocation is being deleted)."""
        self.dead = True
        for permission in self.permissions.values():
            permission.dead = True
        for channel in self.channels.values():
            channel.dead = True
        for relay in self.relays.values():
            relay.peer_channels.clear()
        self.permissions.clear()
        self.channels.clear()
        self.channel_of_peer.clear()
        self.routes.clear()


class Deadlines:
    """One heap of ``(deadline, seq, kind, subject)`` — the core's only timer.

    Entries are never removed early; an object that was refreshed or deleted is
    recognised when its entry pops (see module docstring).
    """

    __slots__ = ("_heap", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Kind, object]] = []
        self._seq = 0

    def __len__(self) -> int:
        return len(self._heap)

    def schedule(self, deadline: float, kind: Kind, subject: object) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (deadline, self._seq, kind, subject))

    def next_deadline(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: float) -> list[tuple[float, Kind, object]]:
        """Entries whose deadline is ``<= now``, earliest first."""
        heap = self._heap
        due: list[tuple[float, Kind, object]] = []
        while heap and heap[0][0] <= now:
            deadline, _seq, kind, subject = heapq.heappop(heap)
            due.append((deadline, kind, subject))
        return due
