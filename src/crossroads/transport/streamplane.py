"""Stream routes of the relay data plane: two TCP sockets joined by splice(2).

Theory of operation
-------------------
The datagram half of the data plane (:mod:`crossroads.transport.dataplane`)
forwards by looking a datagram's source up in a route table. A byte stream has
no per-packet source to look up: once a control plane has paired two connected
TCP sockets (OpenTTD's TURN relay, reference ``openttd-coordinator.md``
section 6), *every* byte read on one goes to the other, so the route *is* the
pair. :meth:`StreamPlane.join` installs one; from then on no Python code sees a
payload byte:

- each direction owns a pipe; a readable source is ``splice``\\ d into the pipe
  and the pipe ``splice``\\ d into the destination socket (splice(2): the
  kernel moves page references, the bytes are never copied to user space);
- readiness drives it: the plane's own level-triggered epoll set, watched by
  the event loop as one descriptor, reports each socket's readability and
  writability to the direction waiting for it, and a socket's error or hang-up
  (EPOLLERR, EPOLLHUP) to whichever handler is waiting, which then meets the
  error in its splice or send. (Not ``loop.add_reader`` per socket: uvloop
  stops watching a descriptor that reports EPOLLERR, without calling its
  reader, so a peer's reset would go unnoticed until the idle timeout.) A
  direction reads only while its pipe is empty: when the
  destination cannot take what the pipe holds, the direction stops reading
  its source and waits for the destination to be writable (backpressure: a
  peer that stops reading stalls its sender's TCP window, and the relay holds
  at most one pipe, :data:`fcntl.F_GETPIPE_SZ` bytes, per direction);
- end of stream is propagated as a half-close: a source's FIN becomes
  ``shutdown(SHUT_WR)`` of the destination once the pipe is flushed, and the
  other direction keeps flowing. The route ends when both directions have
  ended, or at once when either socket fails (reset, broken pipe);
- per-route byte counters (``octets`` per direction) are what the idle sweep
  reads: one coarse timer per plane (:data:`SWEEP_EVERY`), not a clock read per
  chunk, closes a route whose counters have not moved for ``idle_timeout``;
- bounded: at most ``max_routes`` routes (each holds two sockets and two pipes,
  six descriptors); :meth:`StreamPlane.join` refuses beyond.

Bytes the control plane must send before forwarding starts (a handshake reply,
and bytes it read past the handshake) go as each direction's *head*, written
before the first spliced byte.

End of stream is a half-close unless the owner asks for ``half_close=False``
(RFC 6062 §5.5: a TURN data connection that closes takes its pair with it):
then a source's FIN, once its pipe is flushed, stops the other direction
reading, and the route closes as soon as that direction's pipe is flushed too.

A side that is not a plain socket -- a TLS connection, whose plaintext exists
only in user space -- is an asyncio transport: :meth:`StreamPlane.
join_transport` pairs it with a socket as a :class:`TransportRoute`, the same
route with two copies through Python in place of splice(2) and the same
backpressure: the socket is read only while the transport's write buffer is
below its high-water mark (asyncio's ``pause_writing`` / ``resume_writing``),
and the transport is read only while the socket takes what it gives (one
chunk of at most :data:`CHUNK` bytes waits, unsent, at a time).

A socket whose other side does not exist yet (an RFC 6062 peer connection
before the client's ConnectionBind) is *held* (:meth:`StreamPlane.hold`): read
into a buffer up to a limit, then left unread (TCP flow control holds its
sender back); its failure or FIN ends it. :meth:`HeldStream.release` gives the
socket and what it read (the head of a route) back.

The plane takes ownership of the sockets it is given (usually duplicates of an
asyncio transport's socket, see
:meth:`crossroads.services.openttd.conn.PacketConnection.hand_over`) and
closes them when the route ends; ``on_closed(route)`` then tells the owner why
(:attr:`StreamRoute.reason`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import select
import socket
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field
from typing import Any

#: splice(2) flags: move pages instead of copying, and never block on the pipe.
SPLICE_FLAGS = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
#: Chunks one direction moves per readiness callback: with a 64 KiB pipe, up to
#: 1 MiB before the event loop serves the next socket (fairness).
SPLICES_PER_WAKEUP = 16
#: Seconds between idle sweeps. Idle timeouts are minutes (OpenTTD TURN: 300 s
#: by default), so a second of slack costs nothing and one timer serves every
#: route.
SWEEP_EVERY = 1.0
#: Bytes one read of a transport route's socket takes: asyncio's default
#: high-water mark, so one read never puts the transport's write buffer more
#: than one mark above it.
CHUNK = 64 * 1024
#: The most plaintext one read of a TLS transport delivers: asyncio's
#: SSLProtocol reads 256 KiB of the socket at a time (``max_size``), and TLS
#: records (16 KiB, RFC 8446 §5.1) do not add to it. What a transport route
#: holds for its socket is at most this: the transport is paused meanwhile.
MAX_TRANSPORT_READ = 256 * 1024
#: Readiness events one wakeup takes from the plane's epoll set.
EVENTS_PER_WAKEUP = 256
#: Events that wake a reader / a writer: its own, or the socket's failure.
READ_EVENTS = select.EPOLLIN | select.EPOLLERR | select.EPOLLHUP
WRITE_EVENTS = select.EPOLLOUT | select.EPOLLERR | select.EPOLLHUP
#: Why a route ended (:attr:`StreamRoute.reason`).
CLOSED = "closed"  # both sides finished their streams
RESET = "reset"  # a socket failed (RST, broken pipe)
IDLE = "idle"  # no byte either way for idle_timeout
SHUTDOWN = "shutdown"  # the plane (or its owner) closed it


@dataclass(eq=False, slots=True)
class _Direction:
    """One way of a route: ``src`` -> pipe -> ``dst``."""

    src: socket.socket
    dst: socket.socket
    head: bytes
    pipe_r: int = field(init=False)
    pipe_w: int = field(init=False)
    capacity: int = field(init=False)
    #: Bytes in the pipe, not yet written to ``dst``.
    pending: int = field(default=0, init=False)
    #: Bytes read from ``src`` (the head is not counted), and in how many reads.
    octets: int = field(default=0, init=False)
    chunks: int = field(default=0, init=False)
    reading: bool = field(default=False, init=False)
    writing: bool = field(default=False, init=False)
    eof: bool = field(default=False, init=False)
    done: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.pipe_r, self.pipe_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.capacity = fcntl.fcntl(self.pipe_w, fcntl.F_GETPIPE_SZ)

    def flush(self) -> bool:
        """Write the head, then the pipe, to ``dst``; True when all is out.
        Raises OSError when ``dst`` failed."""
        try:
            while self.head:
                sent = self.dst.send(self.head)
                self.head = self.head[sent:]
            while self.pending:
                self.pending -= os.splice(
                    self.pipe_r, self.dst.fileno(), self.pending, flags=SPLICE_FLAGS
                )
        except BlockingIOError:
            return False
        return True

    def close_pipe(self) -> None:
        for fd in (self.pipe_r, self.pipe_w):
            with contextlib.suppress(OSError):
                os.close(fd)


#: A descriptor's readiness handler and its argument.
_Handler = tuple[Callable[[Any], None], Any]


@dataclass(eq=False)
class StreamRoute:
    """Two connected TCP sockets, each one's bytes forwarded to the other."""

    plane: StreamPlane
    a: socket.socket
    b: socket.socket
    to_a: InitVar[bytes]
    to_b: InitVar[bytes]
    on_closed: Callable[[StreamRoute], None]
    #: False: a FIN ends the route once both pipes are flushed (module
    #: docstring).
    half_close: bool = True
    a_to_b: _Direction = field(init=False)
    b_to_a: _Direction = field(init=False)
    closed: bool = field(default=False, init=False)
    #: Why the route ended (one of :data:`CLOSED`, :data:`RESET`,
    #: :data:`IDLE`, :data:`SHUTDOWN`); empty while it lives.
    reason: str = field(default="", init=False)
    #: What the idle sweep saw last, and since when.
    seen: int = field(default=-1, init=False)
    quiet_since: float = field(default=0.0, init=False)

    def __post_init__(self, to_a: bytes, to_b: bytes) -> None:
        self.a_to_b = _Direction(self.a, self.b, to_b)
        self.b_to_a = _Direction(self.b, self.a, to_a)

    @property
    def octets(self) -> int:
        """Bytes forwarded both ways (heads not counted)."""
        return self.a_to_b.octets + self.b_to_a.octets

    def start(self) -> None:
        for way in (self.a_to_b, self.b_to_a):
            self._flushed(way)
            if self.closed:
                return

    def close(self, reason: str = SHUTDOWN) -> None:
        """End the route: stop watching, close both sockets and pipes, tell
        the owner (once)."""
        if self.closed:
            return
        self.closed = True
        self.reason = reason
        plane = self.plane
        for way in (self.a_to_b, self.b_to_a):
            if way.reading:
                plane.remove_reader(way.src.fileno())
                way.reading = False
            if way.writing:
                plane.remove_writer(way.dst.fileno())
                way.writing = False
            way.close_pipe()
        self.a.close()
        self.b.close()
        self.plane.forget(self)
        self.on_closed(self)

    # ------------------------------------------------------------ readiness

    def _readable(self, way: _Direction) -> None:
        if self.closed:
            return
        src = way.src.fileno()
        for _ in range(SPLICES_PER_WAKEUP):
            try:
                moved = os.splice(src, way.pipe_w, way.capacity, flags=SPLICE_FLAGS)
            except BlockingIOError:
                return
            except OSError:
                self.close(RESET)
                return
            if moved == 0:
                way.eof = True
                self._stop_reading(way)
                self._finish(way)
                return
            way.pending += moved
            way.octets += moved
            way.chunks += 1
            if not self._flush_or_fail(way):
                return  # failed, or waiting for the destination
        # More may be waiting; the loop calls again (level-triggered).

    def _writable(self, way: _Direction) -> None:
        if not self.closed and self._flush_or_fail(way):
            self._flushed(way)

    def _flush_or_fail(self, way: _Direction) -> bool:
        """Flush ``way``; on a full destination switch it to waiting for
        writability. False when the route failed or the flush is incomplete."""
        try:
            if way.flush():
                return True
        except OSError:
            self.close(RESET)
            return False
        self._stop_reading(way)
        if not way.writing:
            way.writing = True
            self.plane.add_writer(way.dst.fileno(), self._writable, way)
        return False

    def _flushed(self, way: _Direction) -> None:
        """``way``'s destination took everything: read again, or finish."""
        if way.head or way.pending:
            if not self._flush_or_fail(way):
                return
        if way.writing:
            self.plane.remove_writer(way.dst.fileno())
            way.writing = False
        if way.eof:
            self._finish(way)
        elif not way.reading:
            way.reading = True
            self.plane.add_reader(way.src.fileno(), self._readable, way)

    def _stop_reading(self, way: _Direction) -> None:
        if way.reading:
            self.plane.remove_reader(way.src.fileno())
            way.reading = False

    def _finish(self, way: _Direction) -> None:
        """``way``'s source ended and its pipe is empty: half-close the
        destination; the route ends when both ways have."""
        if way.done:
            return
        way.done = True
        if not self.half_close:
            other = self.b_to_a if way is self.a_to_b else self.a_to_b
            if not other.eof:
                # Read no more from the other side; what its pipe holds
                # still goes out before the route closes.
                other.eof = True
                self._stop_reading(other)
                self._flushed(other)
            if self.a_to_b.done and self.b_to_a.done and not self.closed:
                self.close(CLOSED)
            return
        try:
            way.dst.shutdown(socket.SHUT_WR)
        except OSError as exc:
            if exc.errno != errno.ENOTCONN:
                self.close(RESET)
                return
        if self.a_to_b.done and self.b_to_a.done:
            self.close(CLOSED)


@dataclass(eq=False)
class _Flow:
    """One way of a :class:`TransportRoute`: what it moved, and its end."""

    octets: int = 0
    chunks: int = 0
    eof: bool = False
    done: bool = False


class _TransportSide(asyncio.Protocol):
    """The protocol a :class:`TransportRoute` sets on its transport."""

    def __init__(self, route: TransportRoute) -> None:
        self.route = route

    def data_received(self, data: bytes) -> None:
        self.route.from_transport(data)

    def eof_received(self) -> bool | None:
        return self.route.transport_eof()

    def pause_writing(self) -> None:
        self.route.transport_full(True)

    def resume_writing(self) -> None:
        self.route.transport_full(False)

    def connection_lost(self, exc: Exception | None) -> None:
        self.route.transport_lost(exc)


@dataclass(eq=False)
class TransportRoute:
    """A connected TCP socket ``a`` and an asyncio transport ``b`` (a TLS
    connection: splice(2) cannot carry it), each one's bytes forwarded to the
    other with the backpressure of a :class:`StreamRoute` (module docstring).
    """

    plane: StreamPlane
    a: socket.socket
    b: asyncio.Transport
    to_a: InitVar[bytes]
    to_b: InitVar[bytes]
    on_closed: Callable[[TransportRoute], None]
    half_close: bool = True
    a_to_b: _Flow = field(default_factory=_Flow, init=False)
    b_to_a: _Flow = field(default_factory=_Flow, init=False)
    #: Bytes from ``b`` that ``a`` has not taken yet (at most one chunk of
    #: ``b`` beyond what ``a``'s send buffer holds: ``b`` is paused meanwhile).
    unsent: bytearray = field(default_factory=bytearray, init=False)
    #: ``b``'s write buffer is above its high-water mark (the transport's:
    #: asyncio's TLS transports pause their writer at 512 KiB).
    b_full: bool = field(default=False, init=False)
    high_water: int = field(default=CHUNK, init=False)
    reading: bool = field(default=False, init=False)
    writing: bool = field(default=False, init=False)
    closed: bool = field(default=False, init=False)
    reason: str = field(default="", init=False)
    seen: int = field(default=-1, init=False)
    quiet_since: float = field(default=0.0, init=False)

    def __post_init__(self, to_a: bytes, to_b: bytes) -> None:
        self.unsent += to_a
        self._head_b = to_b

    @property
    def octets(self) -> int:
        """Bytes forwarded both ways (heads not counted)."""
        return self.a_to_b.octets + self.b_to_a.octets

    @property
    def buffered(self) -> int:
        """Bytes the route holds in user space: ``b``'s write buffer and what
        ``a`` has not taken."""
        if self.closed:
            return 0
        return self.b.get_write_buffer_size() + len(self.unsent)

    def start(self) -> None:
        b = self.b
        b.set_protocol(_TransportSide(self))
        if self._head_b:
            b.write(self._head_b)
            self._head_b = b""
        self.high_water = _high_water(b)
        self.b_full = b.get_write_buffer_size() > self.high_water
        b.resume_reading()
        self._flush_a()
        if not self.closed and not self.b_full:
            self._read_a(True)

    def close(self, reason: str = SHUTDOWN) -> None:
        """End the route: stop watching ``a`` and close it, close ``b`` (what
        its write buffer holds still goes, unless the route failed), tell the
        owner (once)."""
        if self.closed:
            return
        self.closed = True
        self.reason = reason
        plane = self.plane
        fd = self.a.fileno()
        if self.reading:
            plane.remove_reader(fd)
            self.reading = False
        if self.writing:
            plane.remove_writer(fd)
            self.writing = False
        self.a.close()
        self.unsent.clear()
        if reason in (RESET, SHUTDOWN):
            self.b.abort()
        else:
            self.b.close()
        plane.forget(self)
        self.on_closed(self)

    # -------------------------------------------------------------- a -> b

    def _read_a(self, on: bool) -> None:
        if on and not self.reading and not self.a_to_b.eof:
            self.reading = True
            self.plane.add_reader(self.a.fileno(), self._readable, None)
        elif not on and self.reading:
            self.reading = False
            self.plane.remove_reader(self.a.fileno())

    def _readable(self, _: object) -> None:
        flow = self.a_to_b
        for _ in range(SPLICES_PER_WAKEUP):
            if self.closed or self.b_full:
                return
            try:
                data = self.a.recv(CHUNK)
            except BlockingIOError:
                return
            except OSError:
                self.close(RESET)
                return
            if not data:
                flow.eof = True
                self._read_a(False)
                self._finish(flow)
                return
            flow.octets += len(data)
            flow.chunks += 1
            # May call transport_full(True) at once (above the high-water mark).
            self.b.write(data)

    def transport_full(self, full: bool) -> None:
        """``b``'s write buffer went above its high-water mark (stop reading
        ``a``: its sender's TCP window fills) or drained below the low one."""
        self.b_full = full
        if not self.closed:
            self._read_a(not full)

    # -------------------------------------------------------------- b -> a

    def from_transport(self, data: bytes) -> None:
        if self.closed:
            return
        flow = self.b_to_a
        flow.octets += len(data)
        flow.chunks += 1
        self.unsent += data
        self._flush_a()

    def _flush_a(self) -> None:
        """Send what ``a`` takes of :attr:`unsent`; while some remains, ``b``
        is not read and ``a``'s writability is awaited."""
        unsent = self.unsent
        try:
            while unsent:
                sent = self.a.send(unsent)
                del unsent[:sent]
        except BlockingIOError:
            pass
        except OSError:
            self.close(RESET)
            return
        fd = self.a.fileno()
        if unsent:
            if not self.writing:
                self.writing = True
                self.b.pause_reading()
                self.plane.add_writer(fd, self._writable, None)
            return
        if self.writing:
            self.writing = False
            self.plane.remove_writer(fd)
            if not self.b_to_a.eof:
                self.b.resume_reading()
        if self.b_to_a.eof:
            self._finish(self.b_to_a)

    def _writable(self, _: object) -> None:
        if not self.closed:
            self._flush_a()

    def transport_eof(self) -> bool | None:
        """``b``'s FIN (or TLS close_notify): once :attr:`unsent` is out,
        half-close ``a`` or end the route."""
        self.b_to_a.eof = True
        if not self.closed and not self.writing:
            self._finish(self.b_to_a)
        # Keep the transport open while the other way flows (ignored by a
        # TLS transport, which closes after a close_notify).
        return self.half_close and not self.closed

    def transport_lost(self, exc: Exception | None) -> None:
        """``b`` closed: on a failure the route ends at once; on a clean close
        (a TLS transport closes itself after close_notify) nothing more goes
        to ``b``, and the route ends once ``a`` took :attr:`unsent`."""
        if self.closed:
            return
        if exc is not None:
            self.close(RESET)
            return
        self.a_to_b.eof = self.a_to_b.done = True
        self._read_a(False)
        self.b_to_a.eof = True
        if not self.writing:
            self._finish(self.b_to_a)

    # -------------------------------------------------------------- ends

    def _finish(self, flow: _Flow) -> None:
        if flow.done or self.closed:
            return
        flow.done = True
        if flow is self.b_to_a and self.half_close:
            try:
                self.a.shutdown(socket.SHUT_WR)
            except OSError as exc:
                if exc.errno != errno.ENOTCONN:
                    self.close(RESET)
                    return
        elif flow is self.a_to_b and self.half_close and self.b.can_write_eof():
            self.b.write_eof()
        elif not (self.a_to_b.done and self.b_to_a.done):
            # No half-close: the other way reads no more; what it holds
            # still goes (b's write buffer on close, a's unsent first).
            other = self.b_to_a if flow is self.a_to_b else self.a_to_b
            other.eof = True
            if other is self.a_to_b:
                self._read_a(False)
                other.done = True
            else:
                self.b.pause_reading()
                if not self.writing:
                    other.done = True
        if self.a_to_b.done and self.b_to_a.done:
            self.close(CLOSED)


def _high_water(transport: asyncio.Transport) -> int:
    """The transport's high-water mark (asyncio's default when it does not
    say)."""
    try:
        return int(transport.get_write_buffer_limits()[1])
    except (AttributeError, NotImplementedError):
        return CHUNK


@dataclass(eq=False)
class HeldStream:
    """A socket waiting for the other side of its route (module docstring)."""

    plane: StreamPlane
    sock: socket.socket
    limit: int
    on_closed: Callable[[HeldStream], None]
    buffered: bytearray = field(default_factory=bytearray, init=False)
    reading: bool = field(default=False, init=False)
    closed: bool = field(default=False, init=False)

    def start(self) -> None:
        self.reading = True
        self.plane.add_reader(self.sock.fileno(), self._readable, None)

    def _readable(self, _: object) -> None:
        if self.closed:
            return
        try:
            data = self.sock.recv(self.limit - len(self.buffered))
        except BlockingIOError:
            return
        except OSError:
            self.close()
            return
        if not data:
            # A FIN before the route exists ends it (RFC 6062 §5.5).
            self.close()
            return
        self.buffered += data
        if len(self.buffered) >= self.limit:
            self._stop()

    def _stop(self) -> None:
        if self.reading:
            self.reading = False
            self.plane.remove_reader(self.sock.fileno())

    def release(self) -> tuple[socket.socket, bytes]:
        """Stop holding: the socket (the caller owns it now) and the bytes
        read from it."""
        self._stop()
        self.closed = True
        self.plane.held.discard(self)
        data = bytes(self.buffered)
        self.buffered.clear()
        return self.sock, data

    def close(self) -> None:
        """Close the socket and tell the owner (once)."""
        if self.closed:
            return
        self._stop()
        self.closed = True
        self.plane.held.discard(self)
        self.sock.close()
        self.on_closed(self)


#: A route of the plane, either kind.
Route = StreamRoute | TransportRoute


class StreamPlane:
    """The stream routes of one owner (see the module docstring)."""

    def __init__(self, *, idle_timeout: float | None, max_routes: int) -> None:
        """``idle_timeout`` None: no idle sweep (the owner ends its routes)."""
        if (idle_timeout is not None and idle_timeout <= 0) or max_routes < 1:
            raise ValueError("idle_timeout and max_routes must be positive")
        self.loop = asyncio.get_running_loop()
        self.idle_timeout = idle_timeout
        self.max_routes = max_routes
        self.routes: set[Route] = set()
        self.held: set[HeldStream] = set()
        #: Routes ended, by reason; bytes forwarded by ended routes.
        self.ended: dict[str, int] = {}
        self.forwarded_bytes = 0
        self._sweeper: asyncio.TimerHandle | None = None
        #: fd -> [its reader, its writer], each (callback, direction) or None.
        self._watched: dict[int, list[_Handler | None]] = {}
        self._epoll = select.epoll()
        self.loop.add_reader(self._epoll.fileno(), self._ready)

    # ------------------------------------------------------------ readiness

    def add_reader(self, fd: int, callback: Callable[[Any], None], arg: Any) -> None:
        """Call ``callback(arg)`` while ``fd`` is readable (or failed)."""
        self._watch(fd, 0, (callback, arg))

    def remove_reader(self, fd: int) -> None:
        self._watch(fd, 0, None)

    def add_writer(self, fd: int, callback: Callable[[Any], None], arg: Any) -> None:
        """Call ``callback(arg)`` while ``fd`` is writable (or failed)."""
        self._watch(fd, 1, (callback, arg))

    def remove_writer(self, fd: int) -> None:
        self._watch(fd, 1, None)

    def _watch(self, fd: int, slot: int, handler: _Handler | None) -> None:
        if self._epoll.closed:
            # The plane closed: an owner's socket closing after it (a TCP
            # relay's listener) has nothing left to unwatch.
            self._watched.pop(fd, None)
            return
        handlers = self._watched.get(fd)
        if handlers is None:
            if handler is None:
                return
            handlers = self._watched[fd] = [None, None]
            handlers[slot] = handler
            self._epoll.register(fd, self._mask(handlers))
            return
        handlers[slot] = handler
        if handlers == [None, None]:
            del self._watched[fd]
            with contextlib.suppress(OSError):
                self._epoll.unregister(fd)
        else:
            self._epoll.modify(fd, self._mask(handlers))

    @staticmethod
    def _mask(handlers: list[_Handler | None]) -> int:
        reader, writer = handlers
        return (select.EPOLLIN if reader else 0) | (select.EPOLLOUT if writer else 0)

    def _ready(self) -> None:
        for fd, events in self._epoll.poll(0, EVENTS_PER_WAKEUP):
            # Looked up afresh for each handler: the first may have ended the
            # route (and so unwatched the descriptor).
            handlers = self._watched.get(fd)
            if handlers is not None and handlers[0] and events & READ_EVENTS:
                callback, way = handlers[0]
                callback(way)
            handlers = self._watched.get(fd)
            if handlers is not None and handlers[1] and events & WRITE_EVENTS:
                callback, way = handlers[1]
                callback(way)

    def join(
        self,
        a: socket.socket,
        b: socket.socket,
        *,
        to_a: bytes = b"",
        to_b: bytes = b"",
        on_closed: Callable[[StreamRoute], None],
        half_close: bool = True,
    ) -> StreamRoute | None:
        """Forward ``a`` <-> ``b`` (connected, non-blocking TCP sockets the
        plane now owns), after sending ``to_a`` / ``to_b``. None, and both
        sockets closed, when the plane is full."""
        if len(self.routes) >= self.max_routes:
            a.close()
            b.close()
            return None
        a.setblocking(False)
        b.setblocking(False)
        route = StreamRoute(self, a, b, to_a, to_b, on_closed, half_close)
        self._add(route)
        route.start()
        return route

    def join_transport(
        self,
        a: socket.socket,
        b: asyncio.Transport,
        *,
        to_a: bytes = b"",
        to_b: bytes = b"",
        on_closed: Callable[[TransportRoute], None],
        half_close: bool = True,
    ) -> TransportRoute | None:
        """Forward ``a`` (a connected TCP socket the plane now owns) <-> ``b``
        (an asyncio transport, given a protocol of the plane's: a TLS
        connection), after sending ``to_a`` / ``to_b``. None, ``a`` closed and
        ``b`` aborted, when the plane is full."""
        if len(self.routes) >= self.max_routes:
            a.close()
            b.abort()
            return None
        a.setblocking(False)
        route = TransportRoute(self, a, b, to_a, to_b, on_closed, half_close)
        self._add(route)
        route.start()
        return route

    def hold(
        self,
        sock: socket.socket,
        *,
        limit: int,
        on_closed: Callable[[HeldStream], None],
    ) -> HeldStream:
        """Read ``sock`` (a connected TCP socket the plane now owns) into a
        buffer of at most ``limit`` bytes until :meth:`HeldStream.release`."""
        sock.setblocking(False)
        held = HeldStream(self, sock, limit, on_closed)
        self.held.add(held)
        held.start()
        return held

    def _add(self, route: Route) -> None:
        route.quiet_since = self.loop.time()
        self.routes.add(route)
        if self._sweeper is None and self.idle_timeout is not None:
            self._sweeper = self.loop.call_later(SWEEP_EVERY, self._sweep)

    def forget(self, route: Route) -> None:
        """Called by a route as it ends."""
        self.routes.discard(route)
        self.ended[route.reason] = self.ended.get(route.reason, 0) + 1
        self.forwarded_bytes += route.octets

    def sweep(self, now: float) -> None:
        """Close the routes whose counters have not moved for ``idle_timeout``."""
        if self.idle_timeout is None:
            return
        for route in list(self.routes):
            octets = route.octets
            if octets != route.seen:
                route.seen = octets
                route.quiet_since = now
            elif now - route.quiet_since > self.idle_timeout:
                route.close(IDLE)

    def close(self) -> None:
        """End every route (:data:`SHUTDOWN`) and stop the sweeper."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for route in list(self.routes):
            route.close(SHUTDOWN)
        for held in list(self.held):
            held.close()
        if not self._epoll.closed:
            self.loop.remove_reader(self._epoll.fileno())
            self._epoll.close()

    def _sweep(self) -> None:
        self._sweeper = None
        self.sweep(self.loop.time())
        if self.routes:
            self._sweeper = self.loop.call_later(SWEEP_EVERY, self._sweep)
