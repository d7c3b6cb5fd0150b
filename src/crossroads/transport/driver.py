"""The one driver of sans-I/O cores (the API is :mod:`crossroads.proto.core`).

Theory of operation
-------------------
A core is a pure state machine: it is told the time, never reads it. The
driver is the only place that turns asyncio happenings into core calls, the
way aioquic's ``QuicConnectionProtocol`` does (reference
code-style-anchors.md §2):

1. a datagram arrives: ``core.receive_datagram(data, addr, loop.time())``;
2. after every input: hand ``core.pop_events()`` (if the core has it) to the
   owner's callback, send what ``core.datagrams_to_send(now)`` returns, and
   re-arm the timer;
3. the timer: exactly one ``loop.call_at`` handle per core, at
   ``core.get_timer()``. Re-arming with an unchanged deadline is free (no
   cancel, no new handle), so calling :meth:`CoreTimer.rearm` after every
   input costs one comparison on the hot path. When it fires,
   ``core.handle_timer(now)`` runs, then step 2.

:class:`DatagramDriver` does all of this for a core on one UDP socket,
:class:`SocketSetDriver` for a core on several (natneg's), and
:class:`TapDriver` for a core on one socket that the relay data plane reads
(the Unity relay node, DTLS): step 1 per datagram the tap does not forward
itself, step 2 once per batch.
:class:`CoreTimer` is step 3 alone, for owners whose core spans several
sockets (natneg, p2p rendezvous), a WebSocket (p2p signalling, the Unity relay
client) or the STUN/TURN port (the TURN control core), and that do steps 1-2
in their own words.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any, Generic, TypeVar, cast

from crossroads.proto.core import (
    DatagramCore,
    EventSource,
    MultiSocketCore,
    SocketT,
)
from crossroads.transport.dataplane import make_tap
from crossroads.transport.pktinfo import (
    ReplySource,
    is_wildcard,
    open_datagram_endpoint,
)
from crossroads.types import Address, normalize_address

TapCoreT = TypeVar("TapCoreT", bound=DatagramCore)


class CoreTimer:
    """The single ``call_at`` timer of one core.

    ``deadline()`` says when the core next wants its timer (usually
    ``core.get_timer``); ``fire(now)`` is called when that time has come (it
    calls ``core.handle_timer(now)`` and whatever the owner does after an
    input). The timer re-arms itself after ``fire``; call :meth:`rearm` after
    every other input. :meth:`close` stops it for good.
    """

    __slots__ = ("_loop", "_deadline", "_fire", "_handle", "_armed_at", "_closed")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        deadline: Callable[[], float | None],
        fire: Callable[[float], None],
    ) -> None:
        self._loop = loop
        self._deadline = deadline
        self._fire = fire
        self._handle: asyncio.TimerHandle | None = None
        self._armed_at: float | None = None
        self._closed = False

    @property
    def armed_at(self) -> float | None:
        """The deadline the timer is armed at (None: not armed)."""
        return self._armed_at

    def rearm(self) -> None:
        """Arm the timer at the core's current deadline (no-op if unchanged)."""
        if self._closed:
            return
        deadline = self._deadline()
        if deadline == self._armed_at:
            return
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._armed_at = deadline
        if deadline is not None:
            self._handle = self._loop.call_at(deadline, self._expired)

    def close(self) -> None:
        """Cancel the timer; later :meth:`rearm` calls do nothing."""
        self._closed = True
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._armed_at = None

    def _expired(self) -> None:
        self._handle = None
        self._armed_at = None
        self._fire(self._loop.time())
        self.rearm()


class DatagramDriver(asyncio.DatagramProtocol):
    """Runs one :class:`~crossroads.proto.core.DatagramCore` on one UDP socket.

    ``on_events``, when given, receives the core's ``pop_events()`` after each
    input (the core must then have ``pop_events``). Subclasses that send on
    more sockets than this one extend :meth:`transmit`.
    """

    def __init__(
        self,
        core: DatagramCore,
        on_events: Callable[[list[Any]], None] | None = None,
    ) -> None:
        self.core = core
        self.transport: asyncio.DatagramTransport | None = None
        self._loop = asyncio.get_running_loop()
        self._on_events = on_events
        self._pop_events: Callable[[], list[Any]] | None = (
            cast(EventSource[Any], core).pop_events if on_events is not None else None
        )
        self._dual_stack = False
        self.timer = CoreTimer(self._loop, core.get_timer, self._on_timer)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's UDPTransport is not a subclass of asyncio.DatagramTransport,
        # so no isinstance check here (it failed under `crossroads serve`).
        self.transport = cast(asyncio.DatagramTransport, transport)
        sock = transport.get_extra_info("socket")
        self._dual_stack = sock is not None and sock.family == socket.AF_INET6
        self.timer.rearm()

    def datagram_received(self, data: bytes, addr: tuple[str | object, ...]) -> None:
        now = self._loop.time()
        self.core.receive_datagram(data, normalize_address(addr), now)
        self.transmit(now)

    def error_received(self, exc: Exception) -> None:
        # ICMP errors for earlier sends (port unreachable, ...): nothing to do for
        # a connectionless server.
        pass

    def connection_lost(self, exc: Exception | None) -> None:
        self.timer.close()

    def transmit(self, now: float | None = None) -> None:
        """Send what the core has to send, dispatch its events, re-arm."""
        if self.transport is None:
            return
        now = self._loop.time() if now is None else now
        # Events first: what the owner does with them may queue datagrams.
        if self._pop_events is not None and self._on_events is not None:
            events = self._pop_events()
            if events:
                self._on_events(events)
        sendto = self.transport.sendto
        for data, addr in self.core.datagrams_to_send(now):
            if self._dual_stack and "." in addr[0]:
                # An IPv4 destination on an IPv6 (dual-stack) socket needs the
                # mapped form (RFC 4291 §2.5.5.2).
                addr = (f"::ffff:{addr[0]}", addr[1])
            sendto(data, addr)
        self.timer.rearm()

    def _on_timer(self, now: float) -> None:
        self.core.handle_timer(now)
        self.transmit(now)


class SocketSetDriver(Generic[SocketT]):
    """Runs one :class:`~crossroads.proto.core.MultiSocketCore` on several UDP
    sockets, each known by the core's own name for it (steps 1-3 above, per
    socket). ``on_events(events, now)``, when given, receives the core's
    ``pop_events()`` after each input, before its datagrams are sent (what the
    owner does with them may queue more).
    """

    def __init__(
        self,
        core: MultiSocketCore[SocketT],
        on_events: Callable[[list[Any], float], None] | None = None,
    ) -> None:
        self.core = core
        self._loop = asyncio.get_running_loop()
        self._on_events = on_events
        self._pop_events: Callable[[], list[Any]] | None = (
            cast(EventSource[Any], core).pop_events if on_events is not None else None
        )
        self._transports: dict[SocketT, asyncio.DatagramTransport] = {}
        self._send_via: dict[SocketT, asyncio.DatagramTransport] = {}
        self.timer = CoreTimer(self._loop, core.get_timer, self._on_timer)

    @property
    def sockets(self) -> list[SocketT]:
        """The names of the open sockets."""
        return list(self._transports)

    async def open(self, name: SocketT, sock: socket.socket) -> None:
        """Run the core on ``sock`` (bound, non-blocking) as ``name``. On a
        wildcard bind, replies leave from the address each client sent to
        (:func:`~crossroads.transport.pktinfo.open_datagram_endpoint`)."""
        transport = await open_datagram_endpoint(_NamedSocket(self, name), sock)
        self._transports[name] = transport
        self._send_via[name] = transport

    def share(self, name: SocketT, owner: SocketT) -> None:
        """What the core sends from ``name``, which has no socket of its own,
        leaves from ``owner``'s (one socket playing two roles)."""
        if name not in self._transports:
            self._send_via[name] = self._transports[owner]

    def receive(self, data: bytes, addr: Address, name: SocketT) -> None:
        """One datagram from ``addr`` on socket ``name``."""
        now = self._loop.time()
        self.core.receive_datagram(data, addr, now, name)
        self.transmit(now)

    def transmit(self, now: float | None = None) -> None:
        """Dispatch the core's events, send its datagrams, re-arm its timer."""
        now = self._loop.time() if now is None else now
        if self._pop_events is not None and self._on_events is not None:
            events = self._pop_events()
            if events:
                self._on_events(events, now)
        send_via = self._send_via
        for data, addr, name in self.core.datagrams_to_send(now):
            transport = send_via.get(name)
            if transport is not None:
                transport.sendto(data, addr)
        self.timer.rearm()

    def close(self) -> None:
        """Stop the timer and close every socket."""
        self.timer.close()
        for transport in self._transports.values():
            transport.close()
        self._transports.clear()
        self._send_via.clear()

    def _on_timer(self, now: float) -> None:
        self.core.handle_timer(now)
        self.transmit(now)


class _NamedSocket(asyncio.DatagramProtocol, Generic[SocketT]):
    """One socket of a :class:`SocketSetDriver`."""

    def __init__(self, driver: SocketSetDriver[SocketT], name: SocketT) -> None:
        self.driver = driver
        self.name = name

    def datagram_received(self, data: bytes, addr: tuple[str | object, ...]) -> None:
        self.driver.receive(data, normalize_address(addr), self.name)

    def error_received(self, exc: Exception) -> None:
        # ICMP errors for earlier sends (port unreachable): nothing to do.
        pass


class TapDriver(Generic[TapCoreT]):
    """Runs one :class:`~crossroads.proto.core.DatagramCore` on one bound,
    non-blocking UDP socket read by a relay data-plane tap
    (:func:`~crossroads.transport.dataplane.make_tap`: recvmmsg batches in C
    when built, its pure-Python twin otherwise).

    The tap forwards what ``routes`` says itself; every other datagram reaches
    the core in arrival order, all of one batch with the time its first one was
    handed over. After the batch the subclass's :meth:`_flush` sends what the
    core emits and dispatches its events, then re-arms the one timer. On a
    wildcard bind, replies leave from the address each client sent to
    (:mod:`crossroads.transport.pktinfo`).
    """

    def __init__(
        self,
        core: TapCoreT,
        sock: socket.socket,
        routes: dict[Any, Any],
        *,
        prefix: int = 0,
        length_at: int = -1,
    ) -> None:
        self.core = core
        self.sock = sock
        self._loop = asyncio.get_running_loop()
        self._replies = (
            ReplySource(sock) if is_wildcard(sock.getsockname()[0]) else None
        )
        self.tap = make_tap(
            sock,
            routes,
            self._received,
            prefix=prefix,
            length_at=length_at,
            ancillary=self._replies is not None,
        )
        #: The time of the batch being read (set by its first datagram that
        #: reaches the core; None between batches).
        self._batch_now: float | None = None
        self._timer = CoreTimer(self._loop, core.get_timer, self._on_timer)
        self._closed = False

    def start(self) -> None:
        self._loop.add_reader(self.sock.fileno(), self._readable)

    def close(self) -> None:
        """Stop reading, stop the timer, close the socket. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self.sock.fileno())
        self.tap.close()
        self._timer.close()
        self.sock.close()

    def _flush(self, now: float) -> None:
        """Send what the core emits and dispatch its events; re-arm the timer."""
        raise NotImplementedError

    def _sendto(self, data: bytes, addr: Address) -> None:
        """Send one datagram from this socket (raises OSError as ``sendto``)."""
        if self._replies is None:
            self.sock.sendto(data, addr)
        else:
            self._replies.sendto(data, addr)

    def _readable(self) -> None:
        self.tap.readable()
        now = self._batch_now
        if now is not None:
            self._batch_now = None
            self._flush(now)

    def _received(self, data: bytes, addr: Address, ancdata: Any = None) -> None:
        """The tap's fallback: one datagram it did not forward, in arrival order."""
        if self._replies is not None and ancdata:
            self._replies.learn(addr, ancdata)
        now = self._batch_now
        if now is None:
            now = self._batch_now = self._loop.time()
        self.core.receive_datagram(data, addr, now)

    def _on_timer(self, now: float) -> None:
        self.core.handle_timer(now)
        self._flush(now)
