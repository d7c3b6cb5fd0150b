"""The relay data plane: sockets forwarded by a route table the control plane writes.

Theory of operation
-------------------
Every relay in crossroads splits into a control plane (a sans-I/O core or a pool
that decides *who may talk to whom*) and a data plane that moves the datagrams.
The data plane is a set of :class:`RouteTap` objects, one per socket, each with a
*route table*, a plain dict the control plane owns and writes:

``key -> Route(out_sock, dest[, control], rewrite=, channel=, budget=)``
    ``key`` is the datagram's source ``(host, port)``; when the protocol names
    its route in a header, it is ``((host, port), data[:prefix])`` (the Unity
    relay's RELAY frame: signature, version, type, from and to allocation ids;
    TURN's ChannelData: the channel number). A datagram whose key is in the
    table — and, with ``length_at``, whose own u16 length field agrees with
    its size — is sent from ``out_sock`` to ``dest``, and the route counts it
    (``packets``, ``octets``: what idle timeouts and quotas read). Anything
    else goes to ``fallback(data, (host, port))``, in arrival order: that is
    where the control plane learns addresses, answers, counts and drops. The
    fallback may install or remove routes; the next datagram sees the change.

``rewrite`` (:class:`Rewrite`)
    What the route does to the datagram on the way: nothing (the Unity relay,
    natneg, RakNet), or TURN's ChannelData header — taken off client -> peer
    (after checking its length field, RFC 8656 §12.5; a mismatch is dropped
    and counted as malformed) and put on peer -> client (``channel``, and the
    length; no padding over UDP, §12.5).
``budget`` (:func:`make_budget`)
    A bytes/s token bucket the route spends from (TURN's ``--turn-max-bps``,
    shared by every route of one relay, both directions); a datagram it cannot
    pay for is dropped and counted (``throttled``, on the tap and the budget).

A tap may have no socket (``sock=None``): it then only routes what a reader of
its own hands in with ``datagram_received(data, addr)`` — TURN's ChannelData
over TCP, TLS and DTLS, and from asyncio endpoints — with the same decisions.

Nothing per datagram is parsed, allocated (beyond the address key) or stored.
Routes are installed only for traffic already proven legitimate (a learned
client, a confirmed side), so the table never grows with hostile traffic: its
size is bounded by the control plane's own caps.

Two implementations with identical decisions:

- the C accelerator in :mod:`crossroads.transport._turnfast` (``RouteTap`` and
  ``Route``), which drains the socket with ``recvmmsg`` (up to 8 batches of 32
  per readiness callback, the TURN taps' limits) and sends what it routes with
  ``sendmmsg``, the iovecs pointing into the receive buffers: no payload copy, no
  Python object per datagram but its (cached) address tuple. The receive
  buffers are an arena larger than one batch and the sends wait in one queue
  for every tap: one wakeup (``Poller.poll``, or ``readable``) reads every ready
  socket, then sends with one ``sendmmsg`` per outgoing socket, each socket's
  datagrams in arrival order (a flow leaves by one socket, so its order holds;
  the order *across* sockets is not kept, as it never is across sockets). The
  queue is flushed early before a fallback call (which sees everything before
  it sent) and when the arena is full. ``sends`` counts the send system calls
  (on the tap, and on the ``Poller`` for its wakeups);
- :class:`PyRouteTap` / :class:`PyRoute` below: ``recvfrom``, a dict lookup and a
  ``sendto`` per datagram, used when the accelerator is not built or
  ``CROSSROADS_TURN_PURE_PYTHON=1`` is set (TURN uses this plane too; see
  :mod:`crossroads.transport.turnplane` for its routes).

The owner registers ``tap.readable`` with ``loop.add_reader(tap.fd, ...)``, calls
``tap.close()`` before closing the socket, and reads the counters.

Byte streams have the plane's third kind of route, the *stream route*: two
connected TCP sockets joined whole, forwarded by splice(2) with backpressure,
half-close and an idle timeout (:mod:`crossroads.transport.streamplane`;
OpenTTD's TURN relay).
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from enum import IntEnum
from typing import Any, Protocol, TypedDict, Unpack

from crossroads.proto.turn.fastpath import data_indication, parse_send_indication
from crossroads.types import Address

#: Datagrams the Python twin reads per readiness callback: enough to amortise the
#: callback, small enough that one busy socket cannot starve the event loop.
PY_BATCH = 64
#: Largest UDP payload (a datagram is read whole, then judged by ``max_size``).
MAX_DATAGRAM = 65535
#: Largest control message a route sends with: in6_pktinfo is 20 bytes (ipv6(7)),
#: in_pktinfo 12 (ip(7)) -- a reply's source address on a wildcard bind.
ROUTE_CONTROL = 20
#: Room for the control messages a tap receives (:data:`pktinfo.ANCILLARY_BYTES`).
TAP_CONTROL = 128

#: A control message, as ``socket.recvmsg`` returns and ``sendmsg`` takes it.
Control = tuple[int, int, bytes]

#: ChannelData header: channel number and length, 2 bytes each (RFC 8656 §12.4).
CHANNEL_HEADER = 4
#: RFC 8656 §12.5: up to 3 bytes of padding may follow ChannelData's data.
CHANNEL_MAX_PADDING = 3


class Rewrite(IntEnum):
    """What a route does to a datagram (the C side's ``REWRITE_*``)."""

    #: Forward unchanged.
    NONE = 0
    #: TURN client -> peer: a ChannelData message whose length field agrees
    #: with its size (0-3 bytes of padding allowed) leaves as its data alone.
    UNWRAP_CHANNEL = 1
    #: TURN peer -> client: the data leaves as ChannelData on ``channel``.
    WRAP_CHANNEL = 2
    #: TURN peer -> client without a channel: the data leaves in a Data
    #: indication naming ``peer`` (RFC 8656 §11.6), transaction id ``txid``
    #: (8 random bytes) + a 4-byte counter of the route's.
    DATA_INDICATION = 3
    #: TURN client -> peer: a Send indication (RFC 8656 §11.4) that
    #: :func:`~crossroads.proto.turn.fastpath.parse_send_indication` accepts,
    #: to a peer whose IP is in ``permissions``, not in ``refuse``, of the out
    #: socket's family: its DATA leaves for its XOR-PEER-ADDRESS (an IP in
    #: ``refuse`` only on a ``(host, port)`` that ``approved`` maps to a
    #: ``time.monotonic()`` deadline still ahead). Any other goes to the
    #: fallback (the full codec, which counts what it drops).
    UNWRAP_SEND = 4


#: The largest data a Data indication route carries: its length field (u16)
#: must hold the attributes (up to 28 bytes with an IPv6 peer) and padding.
MAX_DATA_INDICATION = 0xFFFF - 28 - 3


class BudgetLike(Protocol):
    """A bytes/s token bucket (see :func:`make_budget`)."""

    bps: float

    @property
    def throttled(self) -> int: ...
    def allow(self, size: int) -> bool: ...


class PyBudget:
    """Pure-Python ``Budget``: at most ``bps`` bytes a second, bursts of one
    second's worth (a token bucket on ``time.monotonic``, C's CLOCK_MONOTONIC)."""

    __slots__ = ("bps", "throttled", "_tokens", "_stamp")

    def __init__(self, bps: float = 0.0) -> None:
        self.bps = float(bps)
        self.throttled = 0
        self._tokens = 0.0
        self._stamp = 0.0

    def allow(self, size: int) -> bool:
        """Spend ``size`` bytes of the budget; False: drop it (counted)."""
        if size < 0:
            raise ValueError("size must be >= 0")
        if self.bps <= 0:
            return True
        now = time.monotonic()
        tokens = min(self.bps, self._tokens + (now - self._stamp) * self.bps)
        self._stamp = now
        if tokens < size:
            self._tokens = tokens
            self.throttled += 1
            return False
        self._tokens = tokens - size
        return True


class RouteLike(Protocol):
    """What the control planes read from a route, whichever implementation."""

    @property
    def sock(self) -> socket.socket: ...
    @property
    def dest(self) -> Address: ...
    @property
    def control(self) -> Control | None: ...
    @property
    def rewrite(self) -> int: ...
    @property
    def channel(self) -> int: ...
    @property
    def budget(self) -> BudgetLike | None: ...

    #: Datagrams and bytes that took the route (writable: a control plane that
    #: forwards a datagram itself may count it here).
    packets: int
    octets: int


class RouteTapLike(Protocol):
    """What the control planes use of a tap, whichever implementation."""

    @property
    def fd(self) -> int: ...
    @property
    def routes(self) -> dict[Any, Any]: ...
    @property
    def forwarded(self) -> int: ...
    @property
    def forwarded_bytes(self) -> int: ...
    @property
    def send_errors(self) -> int: ...
    @property
    def malformed(self) -> int: ...
    @property
    def throttled(self) -> int: ...
    @property
    def sends(self) -> int: ...
    def readable(self) -> None: ...
    def datagram_received(self, data: bytes, addr: Any) -> None: ...
    def close(self) -> None: ...


class PyRoute:
    """Pure-Python ``Route``: forward from ``sock`` to ``dest``, rewritten as
    ``rewrite`` says, paid from ``budget``."""

    __slots__ = (
        "sock",
        "dest",
        "control",
        "rewrite",
        "channel",
        "budget",
        "peer",
        "permissions",
        "refuse",
        "approved",
        "packets",
        "octets",
        "_txid",
        "_counter",
    )

    def __init__(
        self,
        sock: socket.socket,
        dest: Address | None,
        control: Control | None = None,
        *,
        rewrite: int = Rewrite.NONE,
        channel: int = 0,
        budget: PyBudget | None = None,
        peer: Address | None = None,
        txid: bytes = b"",
        permissions: dict[str, Any] | None = None,
        refuse: set[str] | None = None,
        approved: dict[Address, float] | None = None,
    ) -> None:
        if not Rewrite.NONE <= rewrite <= Rewrite.UNWRAP_SEND:
            raise ValueError("rewrite or channel out of range")
        if not 0 <= channel <= 0xFFFF:
            raise ValueError("rewrite or channel out of range")
        if budget is not None and not isinstance(budget, PyBudget):
            raise TypeError("budget must be a Budget or None")
        self.peer: Address | None = None
        if rewrite == Rewrite.DATA_INDICATION:
            if peer is None or len(txid) != 8 or not _is_address(peer):
                raise ValueError(
                    "a Data indication route needs peer=(ip, port), txid=8 bytes"
                )
            self.peer = (peer[0], peer[1])
        self.permissions: dict[str, Any] = {}
        self.refuse: set[str] | frozenset[str] = frozenset()
        self.approved: dict[Address, float] | None = None
        if rewrite == Rewrite.UNWRAP_SEND:
            if (
                not isinstance(permissions, dict)
                or not isinstance(refuse, set | frozenset | None)
                or not isinstance(approved, dict | None)
            ):
                raise TypeError(
                    "a Send route needs permissions=dict, refuse=set or None, "
                    "approved=dict or None"
                )
            self.permissions = permissions
            self.refuse = refuse if refuse is not None else frozenset()
            self.approved = approved
        self._txid = bytes(txid)
        self._counter = 0
        if sock.fileno() < 0:
            raise ValueError("the out socket is closed")
        if dest is None and rewrite == Rewrite.UNWRAP_SEND:
            dest = ("0.0.0.0", 0)  # each Send indication names its own
        if dest is None or not _is_address(dest):
            raise ValueError("dest must be (ip, port)")
        if control is not None and not 0 < len(control[2]) <= ROUTE_CONTROL:
            raise ValueError("control data must be 1-20 bytes")
        self.sock = sock
        self.dest: Address = (dest[0], dest[1])
        self.control = control
        self.rewrite = int(rewrite)
        self.channel = channel
        self.budget = budget
        self.packets = 0
        self.octets = 0

    def send(self, data: bytes, dest: Address | None = None) -> None:
        """Send ``data`` along the route, or to ``dest`` (raises ``OSError``
        as ``sendto``)."""
        if self.control is None:
            self.sock.sendto(data, dest or self.dest)
        else:
            self.sock.sendmsg([data], [self.control], 0, dest or self.dest)

    def data_indication(self, payload: bytes) -> bytes:
        """The next Data indication of this route carrying ``payload``."""
        assert self.peer is not None
        self._counter = (self._counter + 1) & 0xFFFFFFFF
        txid = self._txid + self._counter.to_bytes(4, "big")
        return data_indication(self.peer, payload, txid)


def _is_address(addr: object) -> bool:
    return (
        isinstance(addr, tuple)
        and len(addr) >= 2
        and _is_ip(addr[0])
        and isinstance(addr[1], int)
        and 0 <= addr[1] <= 65535
    )


def _is_ip(host: object) -> bool:
    """The C twin's rule for a destination: a literal IPv4 or IPv6 address."""
    if not isinstance(host, str):
        return False
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
        except (OSError, ValueError):
            continue
        return True
    return False


class PyCounters:
    """The counters every data-plane tap exports (C: ``COUNTER_MEMBERS``)."""

    def __init__(self) -> None:
        self.forwarded = 0
        self.forwarded_bytes = 0
        self.send_errors = 0
        self.malformed = 0
        self.batches = 0
        self.drained = 0
        self.throttled = 0
        #: Send system calls that carried this tap's datagrams (C: sendmmsg
        #: calls, one per outgoing socket per wakeup; here one per datagram).
        self.sends = 0


@dataclass(eq=False)
class PyRouteTap(PyCounters):
    """Pure-Python ``RouteTap`` (see the module docstring)."""

    sock: socket.socket | None
    routes: dict[Any, Any]
    fallback: Callable[..., None]
    _: KW_ONLY
    prefix: int = 0
    length_at: int = -1
    max_size: int = MAX_DATAGRAM
    ancillary: bool = False
    fd: int = field(init=False)

    def __post_init__(self) -> None:
        if not 0 <= self.prefix <= 64 or not -1 <= self.length_at <= 65533:
            raise ValueError("prefix, length_at or max_size out of range")
        if not 0 <= self.max_size <= MAX_DATAGRAM:
            raise ValueError("prefix, length_at or max_size out of range")
        self.fd = self.sock.fileno() if self.sock is not None else -1
        super().__init__()

    def close(self) -> None:
        """Stop reading (the owner closes the socket)."""
        self.fd = -1

    def readable(self) -> None:
        """Drain up to :data:`PY_BATCH` datagrams (for ``loop.add_reader``)."""
        sock = self.sock
        if sock is None:
            return
        ancillary = self.ancillary
        ancdata: list[Control] = []
        for _ in range(PY_BATCH):
            if self.fd < 0:
                return
            try:
                if ancillary:
                    data, ancdata, _flags, raw = sock.recvmsg(MAX_DATAGRAM, TAP_CONTROL)
                else:
                    data, raw = sock.recvfrom(MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                # ICMP errors from earlier sends surface here on Linux; keep reading.
                continue
            self.drained += 1
            addr: Address = raw if len(raw) == 2 else (raw[0], raw[1])
            self._one(data, addr, addr, ancdata)

    def datagram_received(self, data: bytes, addr: Any) -> None:
        """Route one datagram read elsewhere (``addr`` as its reader has it;
        the key is its ``(host, port)``)."""
        if not isinstance(data, bytes):
            raise TypeError("data must be bytes")
        if not isinstance(addr, tuple) or len(addr) < 2:
            raise ValueError("addr must be (host, port, ...)")
        key: Address = addr if len(addr) == 2 else (addr[0], addr[1])
        self._one(data, key, addr, [])

    def _one(
        self, data: bytes, key: Address, addr: Any, ancdata: list[Control]
    ) -> None:
        size = len(data)
        if size > self.max_size:
            self.malformed += 1
            return
        prefix = self.prefix
        if prefix == 0:
            route = self.routes.get(key)
        elif size >= prefix:
            route = self.routes.get((key, data[:prefix]))
        else:
            route = None
        length_at = self.length_at
        if (
            route is not None
            and (
                length_at < 0
                or (
                    size >= length_at + 2
                    and size - length_at - 2
                    == (data[length_at] << 8 | data[length_at + 1])
                )
            )
            and self._forward(route, data)
        ):
            return
        if self.ancillary:
            self.fallback(data, addr, ancdata)
        else:
            self.fallback(data, addr)

    def _forward(self, route: PyRoute, data: bytes) -> bool:
        """Forward (or drop and count) a routed datagram; False: it is the
        fallback's after all (a Send indication this plane does not take)."""
        rewrite = route.rewrite
        payload = data
        dest: Address | None = None
        if rewrite == Rewrite.UNWRAP_CHANNEL:
            size = len(data)
            length = (data[2] << 8 | data[3]) if size >= CHANNEL_HEADER else size
            extra = size - CHANNEL_HEADER - length
            if extra < 0 or extra > CHANNEL_MAX_PADDING:
                self.malformed += 1
                return True
            payload = data[CHANNEL_HEADER : CHANNEL_HEADER + length]
        elif rewrite == Rewrite.UNWRAP_SEND:
            parsed = parse_send_indication(data)
            if parsed is None:
                return False
            dest, payload, _dont_fragment = parsed
            family = socket.AF_INET6 if ":" in dest[0] else socket.AF_INET
            if family != route.sock.family or dest[0] not in route.permissions:
                return False
            if dest[0] in route.refuse:
                # One of the service's own hosts: only a port the fallback
                # approved, until the deadline it set.
                approved = route.approved
                until = approved.get(dest) if approved is not None else None
                if not isinstance(until, float) or time.monotonic() >= until:
                    return False
        elif rewrite == Rewrite.DATA_INDICATION and len(data) > MAX_DATA_INDICATION:
            self.malformed += 1
            return True
        length = len(payload)
        budget = route.budget
        if budget is not None and not budget.allow(length):
            self.throttled += 1
            return True
        route.packets += 1
        route.octets += length
        if rewrite == Rewrite.WRAP_CHANNEL:
            channel = route.channel
            data = bytes((channel >> 8, channel & 0xFF, length >> 8, length & 0xFF))
            data += payload
        elif rewrite == Rewrite.DATA_INDICATION:
            data = route.data_indication(payload)
        else:
            data = payload
        self.sends += 1
        try:
            route.send(data, dest)
        except OSError:
            self.send_errors += 1
        else:
            self.forwarded += 1
            self.forwarded_bytes += length
        return True


RouteType: Callable[..., Any] = PyRoute
RouteTapType: Callable[..., Any] = PyRouteTap
BudgetType: Callable[[float], Any] = PyBudget
PollerType: Callable[[], Any] | None = None
#: Whether the C implementation is in use.
ACCELERATED = False
if os.environ.get("CROSSROADS_TURN_PURE_PYTHON", "") not in ("1", "true", "yes"):
    try:
        from crossroads.transport._turnfast import Budget as _CBudget
        from crossroads.transport._turnfast import Poller as _CPoller
        from crossroads.transport._turnfast import Route as _CRoute
        from crossroads.transport._turnfast import RouteTap as _CRouteTap
    except ImportError:  # not built (no C compiler at install time)
        pass
    else:
        RouteType = _CRoute
        RouteTapType = _CRouteTap
        BudgetType = _CBudget
        PollerType = _CPoller
        ACCELERATED = True


class TapReaders:
    """Reads a changing set of taps on the running event loop.

    With the C accelerator every tap goes into one epoll set (``Poller``) and the
    event loop watches its one fd: one wakeup drains every ready socket in C,
    instead of one Python callback per socket. Without it, each tap gets its own
    ``loop.add_reader``. Remove a tap before closing its socket.
    """

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._poller = PollerType() if PollerType is not None else None
        if self._poller is not None:
            self._loop.add_reader(self._poller.fileno(), self._poller.poll)

    def add(self, tap: RouteTapLike) -> None:
        if self._poller is not None:
            self._poller.register(tap.fd, tap)
        else:
            self._loop.add_reader(tap.fd, tap.readable)

    def remove(self, tap: RouteTapLike) -> None:
        if tap.fd < 0:
            return
        if self._poller is not None:
            self._poller.unregister(tap.fd)
        else:
            self._loop.remove_reader(tap.fd)

    def close(self) -> None:
        if self._poller is not None:
            self._loop.remove_reader(self._poller.fileno())
            self._poller.close()
            self._poller = None


class RouteOptions(TypedDict, total=False):
    """A route's keyword options (defaults: those of :class:`PyRoute`)."""

    rewrite: int
    channel: int
    budget: BudgetLike | None
    peer: Address
    txid: bytes
    permissions: dict[str, Any]
    refuse: set[str] | None
    approved: dict[Address, float] | None


def make_route(
    sock: socket.socket,
    dest: Address | None,
    control: Control | None = None,
    **options: Unpack[RouteOptions],
) -> RouteLike:
    """A route from ``sock`` to ``dest`` (C when built, else Python); each
    datagram goes with ``control`` (a source address on a wildcard bind),
    rewritten as ``rewrite`` says (``channel``: the number WRAP_CHANNEL puts
    on), paid from ``budget`` (from :func:`make_budget`); the ``peer``/``txid``
    of a Data indication route, the ``permissions``/``refuse``/``approved`` of a
    Send route (see :class:`Rewrite`)."""
    route: RouteLike = RouteType(sock, dest, control, **options)
    return route


def make_budget(bps: float) -> BudgetLike:
    """A token bucket of ``bps`` bytes a second (0: no limit) for routes."""
    budget: BudgetLike = BudgetType(float(bps))
    return budget


class TapOptions(TypedDict, total=False):
    """A tap's keyword options (defaults: those of :class:`PyRouteTap`)."""

    prefix: int
    length_at: int
    max_size: int
    ancillary: bool


def make_tap(
    sock: socket.socket | None,
    routes: dict[Any, Any],
    fallback: Callable[..., None],
    **options: Unpack[TapOptions],
) -> RouteTapLike:
    """A tap reading ``sock`` through ``routes`` (C when built, else Python;
    ``sock=None``: datagrams are handed in with ``datagram_received``).
    ``fallback(data, addr)``, or ``fallback(data, addr, ancdata)`` with
    ``ancillary`` (the socket's control messages, as ``recvmsg`` gives them);
    ``prefix``, ``length_at``, ``max_size``: see the module docstring."""
    tap: RouteTapLike = RouteTapType(sock, routes, fallback, **options)
    return tap
