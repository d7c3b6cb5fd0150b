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
without inheriting from anything here.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol, TypeVar

from crossroads.types import Address

EventT = TypeVar("EventT")
SocketT = TypeVar("SocketT", bound=Hashable)
ConnT = TypeVar("ConnT", bound=Hashable)
ReceivedT = TypeVar("ReceivedT", contravariant=True)
SentT = TypeVar("SentT")


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

    def datagrams_to_send(self, now: float) -> list[tuple[bytes, Address]]:
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

    def datagrams_to_send(self, now: float) -> list[tuple[bytes, Address, SocketT]]:
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
