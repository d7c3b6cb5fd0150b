"""The one API of a sans-I/O protocol core (DESIGN.md, "A protocol is a pure core").

Every protocol state machine in :mod:`crossroads.proto` is driven the same
way, as aioquic's ``QuicConnection`` is (reference code-style-anchors.md §2):

- input: ``receive_datagram(data, addr, now)``, and ``handle_timer(now)``
  when the deadline of ``get_timer()`` has passed;
- output, pulled by the caller: ``datagrams_to_send(now)``,
  ``pop_events()`` for what the service
  around the core must act on (metrics, logging, store writes, sockets), and
  ``get_timer()``, the one absolute deadline (in the ``now`` clock) at which
  the core wants ``handle_timer``, or None.

A core never reads a clock, opens a socket or awaits: time comes in as
``now``. The one driver that runs a datagram core on an asyncio socket is
:class:`crossroads.transport.driver.DatagramDriver`; services that run a core
on several sockets, or on no socket at all, keep its single timer with
:class:`crossroads.transport.driver.CoreTimer`.

A core on several sockets (:class:`MultiSocketCore`) tags each datagram with
its socket and runs on :class:`crossroads.transport.driver.SocketSetDriver`.

A core that serves many connections (TCP, WebSocket: :class:`StreamCore`) has
the same shape with the connection in place of the address, as h11 and
websockets name it: ``receive_data(conn, data, now)`` in,
``data_to_send()`` out, each item tagged with its connection.

These are :class:`typing.Protocol` classes: a core satisfies them by shape,
without inheriting from anything here. The queues behind the pull methods are
written once, below (:class:`Outbox`, :class:`EventQueue`): a core inherits
them and appends to ``self._outbox`` / ``self._events`` where it produces
output (a plain ``list.append``: no call on the hot paths).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, Protocol, TypeVar

from crossroads.types import Address

EventT = TypeVar("EventT")
SocketT = TypeVar("SocketT", bound=Hashable)
ConnT = TypeVar("ConnT", bound=Hashable)
ReceivedT = TypeVar("ReceivedT", contravariant=True)
SentT = TypeVar("SentT")
ItemT = TypeVar("ItemT")

#: One datagram to send from a core on one socket: ``(data, destination)``.
Datagram = tuple[bytes, Address]
#: One datagram to send from a core on several sockets: ``(data, destination,
#: socket)``, the socket in the core's own name for it.
SocketDatagram = tuple[bytes, Address, SocketT]


class TimedCore(Protocol):
    """A core with (at most) one pending deadline."""

    def get_timer(self) -> float | None:
        """When ``handle_timer`` is next due (the ``now`` clock), or None."""
        ...

    def handle_timer(self, now: float) -> None:
        """The deadline of :meth:`get_timer` has passed."""
        ...


class DatagramCore(TimedCore, Protocol):
    """A datagram protocol core on one socket."""

    def receive_datagram(self, data: bytes, addr: Address, now: float) -> None:
        """One datagram from ``addr`` (``(host, port)``)."""
        ...

    def datagrams_to_send(self, now: float) -> list[Datagram]:
        """What to send now, as ``(data, destination)``; the queue is emptied."""
        ...


class MultiSocketCore(TimedCore, Protocol[SocketT]):
    """A datagram core on several sockets that tells them apart (natneg's
    primary, secondary and probe sockets): the same API, each datagram tagged
    with the core's own name for the socket it came in on or leaves from."""

    def receive_datagram(
        self, data: bytes, addr: Address, now: float, socket: SocketT
    ) -> None:
        """One datagram from ``addr`` on ``socket``."""
        ...

    def datagrams_to_send(self, now: float) -> list[SocketDatagram[SocketT]]:
        """What to send now, as ``(data, destination, socket)``."""
        ...


class StreamCore(TimedCore, Protocol[ConnT, ReceivedT, SentT]):
    """A core serving many connections (the p2p signalling server's
    WebSockets): the datagram API with the owner's name for a connection in
    place of an address. ``ReceivedT`` / ``SentT`` are what one read gives and
    one write takes (bytes of a TCP stream, or whole WebSocket messages)."""

    def receive_data(self, conn: ConnT, data: ReceivedT, now: float) -> None:
        """What connection ``conn`` received."""
        ...

    def data_to_send(self) -> list[tuple[ConnT, SentT]]:
        """What to write now, as ``(connection, data)`` in order; the queue is
        emptied."""
        ...


class EventSource(Protocol[EventT]):
    """A core that reports what happened as typed events."""

    def pop_events(self) -> list[EventT]:
        """The events since the last call, oldest first; the queue is emptied."""
        ...


class Outbox(Generic[ItemT]):
    """The datagram queue behind ``datagrams_to_send``, written once for every
    core. ``ItemT`` is :data:`Datagram` for a :class:`DatagramCore`,
    :data:`SocketDatagram` for a :class:`MultiSocketCore`. A core that filters
    or adds to what leaves (a reflection budget, retransmissions) overrides
    :meth:`datagrams_to_send` and calls this one first.

    Cooperative: ``__init__`` calls ``super().__init__()``, so a core can
    inherit both this and :class:`EventQueue`."""

    def __init__(self) -> None:
        super().__init__()
        self._outbox: list[ItemT] = []

    def datagrams_to_send(self, now: float) -> list[ItemT]:
        """What to send now, oldest first; the queue is emptied."""
        out, self._outbox = self._outbox, []
        return out


class EventQueue(Generic[EventT]):
    """The event queue behind ``pop_events`` (:class:`EventSource`), written
    once for every core. Cooperative like :class:`Outbox`."""

    def __init__(self) -> None:
        super().__init__()
        self._events: list[EventT] = []

    def pop_events(self) -> list[EventT]:
        """The events since the last call, oldest first; the queue is emptied."""
        events, self._events = self._events, []
        return events
