"""The STUN/TURN port: one engine owns its sockets from bind time.

Theory of operation
-------------------
:class:`StunTurnPort` binds the STUN/TURN sockets (``--stun-port`` 3478 and the
RFC 5780 alternates, UDP and TCP, IPv4 and IPv6), TURN over TLS (5349, or
connections the runtime's HTTPS listener sorted to it on a shared 443) and
TURN over DTLS, and sorts each datagram or stream frame once, by its first
bytes (:func:`~crossroads.proto.stun.message.sort_traffic`):

- Binding: the sans-I/O :class:`~crossroads.proto.stun.server.BindingCore`
  (on UDP its queue-free ``answer()``, the replies of a recvmmsg batch leaving
  with one sendmmsg);
- any other STUN message: the TURN plane's control core
  (:class:`~crossroads.transport.turnrelay.TurnPlane`), or, while the port
  serves no TURN, the Binding core, which counts and discards it (RFC 8489
  §6.3);
- ChannelData: the TURN route table (its taps forward what is routed), or
  counted;
- anything else: counted (``not-stun``).

Whether the port serves TURN is known when it binds (``PortConfig.turn``): then
a listener tap of the TURN route table sits in front of every UDP socket from
the start. With the C data plane a recvmmsg socket is read by its tap, which
forwards routed ChannelData and Send indications and hands every other
datagram to the endpoint's :meth:`~_UdpDispatch.dispatch`; an asyncio socket
hands each datagram to its tap; a wildcard-bound recvmmsg socket (replies leave
from each request's destination address, IP_PKTINFO) and the pure-Python plane
keep the endpoint's own loop, its ChannelData going through the table's
hand-fed tap. Nothing is rewired later: the TURN plane, when the TURN service
starts it (:meth:`StunTurnPort.serve_turn`), writes routes into tables that
already exist.

Over TCP and TLS the stream is cut into STUN / ChannelData frames (RFC 8489
§6.2.2, RFC 8656 §12.5: ChannelData is padded to 4 bytes over TCP) and each
frame takes the same path. Connections are bounded in number (in total and per
source, by the runtime's shared :mod:`~crossroads.transport.admission`), idle
time, time to send the first message and to finish any started one, and
unsent bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from crossroads.errors import DecodeError
from crossroads.proto.admission import REFUSED_OVER_IP_LIMIT, REFUSED_OVER_LIMIT
from crossroads.proto.reflection import ReflectionBudget
from crossroads.proto.stun.constants import HEADER_LENGTH
from crossroads.proto.stun.message import (
    PortTraffic,
    peek_header,
    sort_traffic,
    stream_frame_length,
)
from crossroads.proto.stun.server import DROP_NOT_STUN, BindingCore
from crossroads.proto.turn.allocation import FiveTuple
from crossroads.proto.turn.constants import Transport
from crossroads.transport import mmsg
from crossroads.transport.admission import ResourceBudget
from crossroads.transport.dataplane import ACCELERATED
from crossroads.transport.dtls import (
    DtlsListener,
    DtlsTables,
    dtls_tables,
    open_dtls_listener,
)
from crossroads.transport.mmsg import MmsgSocket
from crossroads.transport.pktinfo import (
    DatagramEndpoint,
    ReplySource,
    is_wildcard,
    open_datagram_endpoint,
)
from crossroads.transport.routes import RouteTable
from crossroads.transport.sockets import bind_socket, family_of, tcp_round_trip
from crossroads.transport.tasks import cancel_and_wait
from crossroads.transport.tls import Certificates, TlsAcceptor, TlsTables, tls_tables
from crossroads.transport.turnplane import SendsTo
from crossroads.transport.turnrelay import (
    Endpoint,
    RelayedStream,
    RelayStats,
    TurnPlane,
    TurnRoutes,
)
from crossroads.types import Address, frozen, show_address

__all__ = [
    "BatchUdpEndpoint",
    "Endpoint",
    "PortConfig",
    "StunTurnPort",
    "TcpConnection",
    "UdpEndpoint",
]

log = logging.getLogger("crossroads.stun")
#: The service name the port's listeners are registered under.
SERVICE = "stun"
#: Listener kinds in the resource registry, by socket index of a group (the
#: RFC 5780 primary, alternate port, alternate host, both alternates).
KINDS = ("stun", "stun-alt-port", "stun-alt-host", "stun-alt-host-alt-port")
#: The table of TURN allocations (registered by the TURN service): the state a
#: client makes a STUN/TURN UDP socket hold.
TURN_TABLE = "turn-allocations"

#: How often TCP deadlines are checked (seconds). Deadlines are coarse on
#: purpose: one timer for every connection of the port, not one each.
TCP_SWEEP_INTERVAL = 1.0
#: Relayed data (ChannelData, Data indications) for a TCP/TLS client is dropped,
#: and counted, while this many bytes wait unsent in our write buffer: relayed
#: data is unreliable by contract (RFC 8656 §2.7 carries UDP semantics over the
#: stream), and a browser or pion client whose reader stalls a moment must lose
#: datagrams, not its allocation. 64 KiB is asyncio's default high-water mark.
TCP_MAX_UNSENT = 64 * 1024
#: What answers to the client's own requests (and the control plane's
#: indications) may add on top of :data:`TCP_MAX_UNSENT`: a client that keeps
#: sending requests and never reads the answers is cut off beyond it
#: (``tcp-slow-reader``). 16 KiB is a hundred TURN answers: more than a client
#: has requests in flight (RFC 8489 §6.2.1 paces retransmissions, not
#: pipelining, and a browser has a handful of transactions per allocation).
#: With at most one partial frame (< 64 KiB, the STUN length field's limit) in
#: the read buffer, a connection holds < 144 KiB of buffers.
TCP_CONTROL_ALLOWANCE = 16 * 1024
#: A connection whose unsent bytes have not drained at all for this long is
#: closed (``tcp-write-stall-timeout``): its client stopped reading for good.
#: Twice the 30 s after which an ICE agent gives up a candidate pair that
#: stopped answering (RFC 7675 §5.1, consent freshness), so no live call is
#: cut by it.
TCP_WRITE_STALL_TIMEOUT = 60.0
#: Batches of 64 datagrams read per readiness callback before yielding to the
#: event loop (fairness with TCP, HTTP and timers).
DRAIN_BATCHES = 8
#: Drop reason of a TCP connection refused by the admission, by its reason.
_TCP_REFUSALS = {
    REFUSED_OVER_LIMIT: "tcp-connection-limit",
    REFUSED_OVER_IP_LIMIT: "tcp-ip-connection-limit",
}
#: Retries when binding "any free port" (port 0) must find the same free port on
#: several addresses / both protocols.
BIND_ATTEMPTS = 30


@frozen
class PortConfig:
    """What the port needs to know when it binds (the STUN service's
    settings, and whether TURN is served on it)."""

    software: str
    rate_limit: int
    rate_limit_sources: int
    tcp: bool
    batch_io: bool
    tcp_max_connections: int
    tcp_max_connections_per_ip: int
    tcp_message_timeout: float
    tcp_idle_timeout: float
    #: TURN runs on this port: listener taps from bind time.
    turn: bool


class PortStats:
    """Plain counters; the hot path increments ints, the collector exports."""

    def __init__(self) -> None:
        self.drops: dict[str, int] = {}
        self.tcp_requests = 0
        self.tcp_success = 0
        self.tcp_error = 0
        self.tcp_connections = 0

    def drop(self, reason: str, count: int = 1) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + count


def is_stun_message(data: bytes) -> bool:
    """A well-formed STUN message (RFC 8489 §5: header with the magic cookie,
    length matching the datagram): what ends a DTLS session's pre-auth state."""
    header = peek_header(data)
    return (
        header is not None
        and header.magic
        and header.length + HEADER_LENGTH == len(data)
    )


class EndpointSocket:
    """A listening UDP endpoint as a route's out socket: its fd for the C data
    plane, its ``send`` for the pure-Python twin."""

    __slots__ = ("endpoint",)

    def __init__(self, endpoint: UdpEndpoint | BatchUdpEndpoint) -> None:
        self.endpoint = endpoint

    def fileno(self) -> int:
        return self.endpoint.fileno()

    def sendto(self, data: bytes, addr: Address) -> None:
        self.endpoint.send(data, addr)

    def getsockname(self) -> Address:
        """Where it sends from (the kernel twin of a route leaving by it)."""
        return self.endpoint.local


# ------------------------------------------------------------------ UDP


class _PortEndpoint:
    """What a UDP socket and a TCP connection of the STUN/TURN port do alike
    with a message that is not a Binding request (an :class:`Endpoint`)."""

    port: StunTurnPort
    core: BindingCore
    index: int
    local: Address
    transport: Literal["udp", "tcp"]
    _loop: asyncio.AbstractEventLoop

    def send(self, data: bytes, addr: Address) -> None:
        raise NotImplementedError

    def _before_turn(self, addr: Address, slot: int) -> None:
        """Called before a message goes to TURN (see BatchUdpEndpoint)."""

    def _pass_on(self, kind: PortTraffic, data: bytes, addr: Any, slot: int) -> None:
        """STUN and ChannelData to the port's TURN plane, from ``(host,
        port)``; with no TURN served, a STUN message goes to the Binding core,
        which counts it and discards it silently (RFC 8489 §6.3), and
        ChannelData is dropped and counted. ``addr``: as the socket reports it;
        ``slot``: the recvmmsg batch slot, or -1."""
        turn = self.port.turn
        if kind is PortTraffic.STUN:
            if turn is not None:
                client = _client(addr)
                self._before_turn(client, slot)
                turn.stun(data, client, self)
            else:
                self.core.receive_datagram(data, addr, self._loop.time(), self.index)
        elif kind is PortTraffic.CHANNEL_DATA:
            if turn is not None:
                turn.channel_data(data, _client(addr), self)
            else:
                self.port.stats.drop("channel-data-no-turn")
        else:
            self.port.stats.drop(DROP_NOT_STUN)


@dataclass(eq=False)
class _UdpDispatch(_PortEndpoint):
    """Per-datagram dispatch of one UDP socket of the STUN/TURN port, shared by
    both endpoint kinds: the asyncio endpoint for every datagram, the recvmmsg
    endpoint for each datagram of its drain loop and for those a reader that
    took its socket over (the TURN data plane) hands back.
    """

    port: StunTurnPort
    group: _Group
    index: int
    local: Address
    core: BindingCore = field(init=False)
    transport: Literal["udp"] = field(default="udp", init=False)
    #: Binding requests, and the success and error responses sent.
    requests: int = field(default=0, init=False)
    success: int = field(default=0, init=False)
    errors: int = field(default=0, init=False)
    _loop: asyncio.AbstractEventLoop = field(init=False)

    def __post_init__(self) -> None:
        self.core = self.group.core
        self._loop = asyncio.get_running_loop()

    def _reply(self, data: bytes, addr: Any, slot: int) -> None:
        """A Binding reply to the sender of ``addr`` (received in batch slot
        ``slot``, or -1 outside a batch)."""
        self.send(data, addr)

    def dispatch(self, data: bytes, addr: Any, slot: int = -1) -> None:
        """One datagram from ``addr`` (as the socket reports it: a 4-tuple on
        IPv6, kept for the reply; TURN gets ``(host, port)``); ``slot``: its
        recvmmsg batch slot, or -1."""
        stats = self.port.stats
        try:
            kind = sort_traffic(data)
            if kind is PortTraffic.BINDING:
                self.requests += 1
                # The core's queue-free fast path (BindingCore.answer says why).
                reply = self.core.answer(data, addr, self.index, self._loop.time())
                if reply is not None:
                    response, dest, send_from = reply
                    if send_from != self.index:
                        self.group.udp[send_from].send(response, dest)
                    elif dest is addr:
                        self._reply(response, dest, slot)
                    else:
                        self.send(response, dest)
                    if response[1] == 0x01:
                        self.success += 1
                    else:
                        self.errors += 1
                return
            self._pass_on(kind, data, addr, slot)
        except IndexError:
            stats.drop("empty")
        except Exception:  # never let one datagram kill the socket
            log.exception("STUN datagram handler failed")
            stats.drop("internal-error")


class UdpEndpoint(_UdpDispatch, asyncio.DatagramProtocol):
    """One UDP socket of the STUN/TURN port (an :class:`Endpoint`)."""

    def __init__(
        self, port: StunTurnPort, group: _Group, index: int, local: Address
    ) -> None:
        super().__init__(port, group, index, local)
        self.udp: asyncio.DatagramTransport | None = None
        #: Where each datagram goes: the TURN listener tap in front of the
        #: socket when the port serves TURN (it forwards routed ChannelData
        #: and Send indications and hands the rest to :meth:`dispatch`).
        self.receive: Callable[[bytes, Any], None] = self.dispatch

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's UDPTransport is not a subclass of asyncio.DatagramTransport.
        self.udp = cast(asyncio.DatagramTransport, transport)

    def send(self, data: bytes, addr: Address) -> None:
        """Send from this socket (part of the :class:`Endpoint` interface)."""
        if self.udp is not None:
            self.udp.sendto(data, addr)

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.receive(data, addr)

    def error_received(self, exc: Exception) -> None:
        # ICMP errors for earlier sends (port unreachable...): nothing to do.
        pass

    @property
    def replies_from_destination(self) -> bool:
        """Replies leave from each request's destination address (a wildcard
        bind runs on a :class:`~crossroads.transport.pktinfo.DatagramEndpoint`)."""
        return isinstance(self.udp, DatagramEndpoint)

    def fileno(self) -> int:
        sock = self.udp.get_extra_info("socket") if self.udp is not None else None
        return sock.fileno() if sock is not None else -1


class BatchUdpEndpoint(_UdpDispatch):
    """One UDP socket drained with recvmmsg/sendmmsg (an :class:`Endpoint`).

    Same dispatch as :class:`UdpEndpoint`, but the event loop only reports that
    the socket is readable; each wakeup reads up to :data:`DRAIN_BATCHES` batches
    of 64 datagrams with one system call each, and the Binding replies of a
    batch leave with one ``sendmmsg``. Replies that must leave from another
    socket (CHANGE-REQUEST) or go to another port (RESPONSE-PORT), and whatever
    TURN sends, use a plain non-blocking ``sendto``.
    """

    def __init__(
        self,
        port: StunTurnPort,
        group: _Group,
        index: int,
        local: Address,
        sock: socket.socket,
    ) -> None:
        super().__init__(port, group, index, local)
        self.sock = sock
        # On a wildcard bind, reply from the address the client sent to.
        self.mm = MmsgSocket(sock, pktinfo=is_wildcard(local[0]))
        #: On a wildcard bind, what TURN sends (answers, Data indications,
        #: late responses) leaves from the address the client sent to as well.
        self.replies = ReplySource(sock) if self.mm.pktinfo else None
        self._closed = False
        #: The port reads the socket through a TURN listener tap instead
        #: (decided at bind time, :meth:`StunTurnPort._open_udp`).
        self.tapped = port.taps_read(self)
        if not self.tapped:
            self._loop.add_reader(sock.fileno(), self._readable)

    def send(self, data: bytes, addr: Address) -> None:
        """Send from this socket now (part of the :class:`Endpoint` interface)."""
        try:
            if self.replies is not None:
                self.replies.sendto(data, addr)
            else:
                self.sock.sendto(data, addr)
        except OSError:
            # Full socket buffer (EAGAIN) or an ICMP error from an earlier send.
            self.port.stats.drop("send-failed")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if not self.tapped:
                self._loop.remove_reader(self.sock.fileno())
            self.sock.close()

    def fileno(self) -> int:
        return self.sock.fileno()

    @property
    def replies_from_destination(self) -> bool:
        """Binding replies leave from the request's destination address
        (IP_PKTINFO on a wildcard bind): a reader that takes this socket over
        with a plain recvmmsg would lose that."""
        return self.mm.pktinfo

    def _reply(self, data: bytes, addr: Any, slot: int) -> None:
        # In the batch's sendmmsg when it fits, from the request's own
        # destination address on a wildcard bind (IP_PKTINFO).
        if slot < 0 or not self.mm.queue_reply(slot, data):
            self.send(data, addr)

    def _before_turn(self, addr: Address, slot: int) -> None:
        """Remember where slot ``slot``'s sender sent to, so what TURN sends it
        later leaves from that address (Binding replies take the control
        message straight from the slot)."""
        replies = self.replies
        if replies is not None and slot >= 0:
            control = self.mm.destination_control(slot)
            if control is not None:
                replies.remember(addr, control)

    def _readable(self) -> None:
        self.mm.drain(self.dispatch, self._drop, DRAIN_BATCHES)

    def _drop(self, reason: str, count: int) -> None:
        if reason == "recv-failed":
            log.warning("STUN recvmmsg failed on %s", show_address(self.local))
        self.port.stats.drop(reason, count)


def _client(addr: Any) -> Address:
    return addr if len(addr) == 2 else (addr[0], addr[1])


# ------------------------------------------------------------------ TCP


class TcpConnection(_PortEndpoint, asyncio.Protocol):
    """One accepted TCP connection (an :class:`Endpoint`)."""

    def __init__(self, port: StunTurnPort, group: _Group, index: int) -> None:
        self.port = port
        self.core = group.stream_core
        self.index = index
        self.transport: Literal["tcp"] = "tcp"
        self.local: Address = ("", 0)
        self.peer: Address = ("", 0)
        self.stream: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.last_activity = 0.0
        #: When the connection was accepted; frames completed since then.
        self.accepted = 0.0
        self.frames = 0
        #: When the unfinished frame in ``buffer`` started (None: no partial).
        self.partial_since: float | None = None
        #: Bytes handed to the transport so far; bytes of its write buffer
        #: charged to the listener's table (the budget's buffered bytes).
        self.written = 0
        self.charged = 0
        #: Write progress for the stall deadline: the most bytes seen drained,
        #: and since when nothing more has (None: nothing unsent).
        self.drained = 0
        self.stalled_since: float | None = None
        self._loop = asyncio.get_running_loop()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.stream = cast(asyncio.Transport, transport)
        port = self.port
        peer = transport.get_extra_info("peername")
        refused = port.admission.admit(peer[0])
        if refused is not None:
            port.stats.drop(_TCP_REFUSALS[refused])
            self.stream.abort()
            self.stream = None
            return
        sockname = transport.get_extra_info("sockname")
        self.peer = _client(peer)
        self.local = _client(sockname)
        self.last_activity = self.accepted = self._loop.time()
        port.connections.add(self)
        port.stream_endpoints[(self.peer, self.local)] = self
        port.stats.tcp_connections = len(port.connections)

    def round_trip(self) -> float | None:
        """The kernel's smoothed RTT of this connection (seconds), None if
        unknown; still readable in :meth:`connection_lost` (asyncio closes the
        socket after it returns)."""
        stream = self.stream
        if stream is None:
            return None
        return tcp_round_trip(stream.get_extra_info("socket"))

    def connection_lost(self, exc: Exception | None) -> None:
        port = self.port
        if self in port.connections:
            port.connections.discard(self)
            port.stream_endpoints.pop((self.peer, self.local), None)
            self.uncharge_all()
            port.admission.release(self.peer[0])
            port.stats.tcp_connections = len(port.connections)
            if port.turn is not None:
                try:
                    port.turn.connection_lost(self.peer, self)
                except Exception:
                    log.exception("TURN connection_lost handler failed")
        self.stream = None

    def send(self, data: bytes, addr: Address | None = None) -> None:
        """Write an answer or other control message (part of the
        :class:`Endpoint` interface). It is never dropped; beyond
        :data:`TCP_MAX_UNSENT` + :data:`TCP_CONTROL_ALLOWANCE` unsent bytes the
        client is not reading its own answers and the connection is closed."""
        stream = self.stream
        if stream is None or stream.is_closing():
            return
        stream.write(data)
        self.written += len(data)
        unsent = stream.get_write_buffer_size()
        if unsent > TCP_MAX_UNSENT + TCP_CONTROL_ALLOWANCE:
            self.port.stats.drop("tcp-slow-reader")
            self.port.admission.closed("slow-reader")
            stream.abort()
            return
        self.settle(unsent)

    def send_relayed(self, data: bytes) -> bool:
        """Write relayed data (a ChannelData frame, padded, or a Data
        indication); False, and nothing written, while the client has
        :data:`TCP_MAX_UNSENT` bytes unsent or the listener's memory share is
        spent: the caller drops the datagram and counts it."""
        stream = self.stream
        if stream is None or stream.is_closing():
            return False
        size = len(data)
        unsent = stream.get_write_buffer_size()
        if unsent + size > TCP_MAX_UNSENT:
            return False
        if unsent:
            # Queued behind what is unsent: it will sit in our buffer.
            if not self.port.admission.charge(size):
                return False
            self.charged += size
        stream.write(data)
        self.written += size
        self.settle(stream.get_write_buffer_size())
        return True

    def settle(self, unsent: int) -> None:
        """Make the bytes charged to the listener's table follow the bytes
        the transport holds unsent (``unsent``): give back what drained,
        charge what a partial write left behind (while the share allows)."""
        charged = self.charged
        if unsent < charged:
            self.port.admission.uncharge(charged - unsent)
            self.charged = unsent
        elif unsent > charged and self.port.admission.charge(unsent - charged):
            self.charged = unsent

    def uncharge_all(self) -> None:
        """The connection leaves the listener: its buffered bytes go back."""
        if self.charged:
            self.port.admission.uncharge(self.charged)
            self.charged = 0

    def resume_writing(self) -> None:
        """The transport drained below its low-water mark: refund."""
        if self.stream is not None:
            self.settle(self.stream.get_write_buffer_size())

    def write_stalled(self, now: float) -> bool:
        """Settle the charge and tell whether nothing unsent has drained for
        :data:`TCP_WRITE_STALL_TIMEOUT` (called by the port's sweep)."""
        stream = self.stream
        if stream is None:
            return False
        unsent = stream.get_write_buffer_size()
        self.settle(unsent)
        if not unsent:
            self.stalled_since = None
            return False
        drained = self.written - unsent
        if self.stalled_since is None or drained > self.drained:
            self.drained = max(drained, self.drained)
            self.stalled_since = now
            return False
        return now - self.stalled_since > TCP_WRITE_STALL_TIMEOUT

    def data_received(self, data: bytes) -> None:
        if self.stream is None:
            return
        self.last_activity = self._loop.time()
        buffer = self.buffer
        buffer += data
        while True:
            try:
                size = stream_frame_length(buffer)
            except DecodeError:
                self.port.stats.drop("tcp-not-stun")
                self.stream.abort()
                return
            if size is None or size > len(buffer):
                if buffer:
                    if self.partial_since is None:
                        self.partial_since = self.last_activity
                else:
                    self.partial_since = None
                return
            frame = bytes(buffer[:size])
            del buffer[:size]
            self.frames += 1
            self.partial_since = None
            self._frame(frame)
            if self.stream is None:
                return

    def _frame(self, frame: bytes) -> None:
        stats = self.port.stats
        try:
            kind = sort_traffic(frame)
            if kind is PortTraffic.BINDING:
                stats.tcp_requests += 1
                core = self.core
                now = self._loop.time()
                core.receive_datagram(frame, self.peer, now, self.index)
                for response, _dest, _send_from in core.datagrams_to_send(now):
                    self.send(response)
                    if response[1] == 0x01:
                        stats.tcp_success += 1
                    else:
                        stats.tcp_error += 1
                return
            # The framing let only STUN and ChannelData through.
            self._pass_on(kind, frame, self.peer, -1)
        except Exception:
            log.exception("STUN TCP frame handler failed")
            stats.drop("internal-error")


# ------------------------------------------------------------------ the port


@dataclass
class _Group:
    """The sockets of one address family: 1, 2 or 4 endpoints (see server.py).
    ``core`` answers their UDP datagrams, ``stream_core`` their TCP (or TLS)
    connections; the two share one rate limiter."""

    core: BindingCore
    stream_core: BindingCore
    udp: list[UdpEndpoint | BatchUdpEndpoint]
    tcp_servers: list[asyncio.Server]


def _bind_set(
    hosts: list[str], ports: list[int], tcp: bool, v6only: bool
) -> list[tuple[socket.socket, socket.socket | None]]:
    """Bind UDP (+TCP) on every host x port with the *same* port numbers on each
    host; port 0 picks a free one, retried until one is free everywhere."""
    flexible = 0 in ports
    for attempt in range(BIND_ATTEMPTS if flexible else 1):
        socks: list[tuple[socket.socket, socket.socket | None]] = []
        chosen = list(ports)
        try:
            for host in hosts:
                for i, port in enumerate(chosen):
                    udp = bind_socket(
                        host, port, socket.SOCK_DGRAM, v6only=v6only, shared=True
                    )
                    socks.append((udp, None))
                    if port == 0:
                        chosen[i] = udp.getsockname()[1]
                    if tcp:
                        stream = bind_socket(
                            host, chosen[i], socket.SOCK_STREAM, v6only=v6only
                        )
                        socks[-1] = (udp, stream)
            # Order endpoints ip-major: (A1,P1), (A1,P2), (A2,P1), (A2,P2).
            return socks
        except OSError as exc:
            for udp_sock, tcp_sock in socks:
                udp_sock.close()
                if tcp_sock is not None:
                    tcp_sock.close()
            if (
                not flexible
                or exc.errno != errno.EADDRINUSE
                or attempt == BIND_ATTEMPTS - 1
            ):
                raise
    raise AssertionError("unreachable")


class StunTurnPort:
    """The STUN/TURN port (module docstring): its sockets, connections and
    cores, and the TURN route table when it serves TURN (a ``PortSide`` of
    the TURN plane)."""

    def __init__(
        self,
        config: PortConfig,
        resources: ResourceBudget,
        reflection: Callable[[], ReflectionBudget],
        route_table: RouteTable | None = None,
    ) -> None:
        self.config = config
        self.resources = resources
        self._reflection = reflection
        self.stats = PortStats()
        #: Binding replies over UDP per source IP (docs/security.md).
        self.reflection = reflection()
        self.groups: list[_Group] = []
        self.udp_endpoints: list[UdpEndpoint | BatchUdpEndpoint] = []
        self.connections: set[TcpConnection] = set()
        #: The endpoints by where a client reaches them: UDP sockets and DTLS
        #: listeners by local address, TCP (TLS) connections by (client,
        #: local address).
        self.datagram_endpoints: dict[Address, Endpoint] = {}
        self.stream_endpoints: dict[tuple[Address, Address], TcpConnection] = {}
        #: Per-IP and global caps of the TCP listener (one for all its ports).
        self.admission = resources.listener(
            SERVICE, config.tcp_max_connections, config.tcp_max_connections_per_ip
        )
        #: Where STUN/TURN over TLS listens (see :meth:`listen_tls`).
        self.tls_addresses: list[Address] = []
        self.tls_tables: TlsTables | None = None
        #: TURN over DTLS (see :meth:`listen_dtls`) and its tables.
        self.dtls_listeners: list[DtlsListener] = []
        self.dtls_tables: DtlsTables | None = None
        self._dtls_binding: BindingCore | None = None
        #: TURN's routes, from bind time when the port serves TURN (written
        #: by the runtime's ``route_table``).
        self.routes: TurnRoutes | None = (
            TurnRoutes(RelayStats(), route_table) if config.turn else None
        )
        #: TURN's control core and relays, once the TURN service runs them.
        self.turn: TurnPlane | None = None
        self.descriptions: list[str] = []
        self._sweeper: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def primary(self) -> Address:
        """The bound (host, port) of the primary UDP socket."""
        return self.udp_endpoints[0].local

    # ------------------------------------------------------------ binding

    async def bind(
        self, sets: list[tuple[list[str], bool]], ports: list[int], public: str
    ) -> None:
        """Bind every host x port of each ``(hosts, v6only)`` set (the first
        one must bind; the others, an IPv6 companion of ``0.0.0.0``, may
        fail) and start answering."""
        for index, (group_hosts, v6only) in enumerate(sets):
            try:
                socks = _bind_set(group_hosts, ports, self.config.tcp, v6only)
            except OSError as exc:
                if index == 0:
                    raise
                log.warning("STUN: no IPv6 listener on [::]: %s", exc)
                continue
            ports = [s[0].getsockname()[1] for s in socks[: len(ports)]]
            await self._start_group(socks, public)
        if self.config.tcp:
            self._sweeper = asyncio.create_task(self._sweep_idle())

    async def _start_group(
        self, socks: list[tuple[socket.socket, socket.socket | None]], public: str
    ) -> None:
        loop = asyncio.get_running_loop()
        cfg = self.config
        locals_: list[Address] = [
            (udp.getsockname()[0], udp.getsockname()[1]) for udp, _ in socks
        ]
        advertised: list[Address | None] = []
        for i, (h, p) in enumerate(locals_):
            if i < 2 and public and family_of(public) == family_of(h):
                advertised.append((public, p))
            elif is_wildcard(h):
                advertised.append(None)
            else:
                advertised.append((h, p))
        core = BindingCore(
            advertised,
            software=cfg.software,
            rate_limit=cfg.rate_limit,
            max_sources=cfg.rate_limit_sources,
            reflection=self.reflection,
            drops=self.stats.drops,
        )
        stream_core = BindingCore(
            advertised,
            software=cfg.software,
            stream=True,
            limiter=core.limiter,
            drops=self.stats.drops,
        )
        group = _Group(core=core, stream_core=stream_core, udp=[], tcp_servers=[])
        self.groups.append(group)
        labels = ["", " (alt port)", " (alt host)", " (alt host, alt port)"]
        for index, (udp_sock, tcp_sock) in enumerate(socks):
            local = locals_[index]
            endpoint = await self._open_udp(group, index, local, udp_sock)
            group.udp.append(endpoint)
            self.udp_endpoints.append(endpoint)
            self.datagram_endpoints[local] = endpoint
            self.descriptions.append(f"udp {show_address(local)}{labels[index]}")
            kind = KINDS[index]
            # A Binding keeps nothing per client (the rate limiter and the
            # reflection ledger are bounded LRU maps); what a client can make
            # this socket hold is TURN allocations, admitted by TURN's table.
            udp_table = TURN_TABLE if cfg.turn else ""
            self.resources.listen(SERVICE, kind, "udp", local, udp_table)
            if tcp_sock is not None:
                server = await loop.create_server(
                    lambda i=index: TcpConnection(self, group, i),  # type: ignore[misc]
                    sock=tcp_sock,
                )
                group.tcp_servers.append(server)
                self.descriptions.append(f"tcp {show_address(local)}{labels[index]}")
                self.resources.listen(
                    SERVICE, f"{kind}-tcp", "tcp", local, self.admission.name
                )

    async def _open_udp(
        self, group: _Group, index: int, local: Address, sock: socket.socket
    ) -> UdpEndpoint | BatchUdpEndpoint:
        """One UDP endpoint, with its TURN listener tap when TURN is served."""
        routes = self.routes
        if self.config.batch_io and mmsg.available():
            batch = BatchUdpEndpoint(self, group, index, local, sock)
            if batch.tapped:
                # Without a tap in front (pure-Python plane, wildcard bind),
                # the socket's ChannelData comes in through the port's sort.
                assert routes is not None
                routes.listen(batch, sock, batch.dispatch)
            return batch
        # On a wildcard bind, replies from each client's destination.
        endpoint = UdpEndpoint(self, group, index, local)
        await open_datagram_endpoint(endpoint, sock)
        if routes is not None:
            endpoint.receive = routes.listen(
                endpoint, None, endpoint.dispatch
            ).datagram_received
        return endpoint

    def taps_read(self, endpoint: BatchUdpEndpoint) -> bool:
        """Whether the TURN listener tap reads this recvmmsg socket itself:
        with the C data plane, unless replies must leave from each request's
        destination address (a plain recvmmsg in the tap would lose it)."""
        return (
            self.routes is not None
            and ACCELERATED
            and not endpoint.replies_from_destination
        )

    # ------------------------------------------------------------ TURN

    def serve_turn(self, make_plane: Callable[[TurnRoutes], TurnPlane]) -> TurnPlane:
        """Run TURN on this port: ``make_plane(routes)`` builds the plane on
        the route table the port made when it bound."""
        if self.routes is None:
            raise RuntimeError("the STUN/TURN port was bound without TURN")
        self.turn = make_plane(self.routes)
        return self.turn

    async def stop_turn(self) -> None:
        """TURN stops: every allocation ends; Binding goes on."""
        plane, self.turn = self.turn, None
        if plane is not None:
            await plane.close()

    def endpoint(self, five: FiveTuple) -> Endpoint | None:
        """The endpoint of the 5-tuple ``(transport, client, local)``: the TCP
        (or TLS) connection, or the UDP socket or DTLS listener."""
        transport, client, local = five
        if transport == Transport.TCP:
            return self.stream_endpoints.get((client, local))
        return self.datagram_endpoints.get(local)

    def route_out(self, endpoint: Endpoint) -> SendsTo | None:
        if (
            isinstance(endpoint, UdpEndpoint | BatchUdpEndpoint)
            and not endpoint.replies_from_destination
            and endpoint.fileno() >= 0
        ):
            return EndpointSocket(endpoint)
        return None

    def stream(self, endpoint: Endpoint) -> RelayedStream | None:
        return endpoint if isinstance(endpoint, TcpConnection) else None

    def detach_stream(
        self, endpoint: Endpoint
    ) -> tuple[asyncio.Transport | None, bytes]:
        """Hand a TCP connection over (RFC 6062: after ConnectionBind it carries
        raw application data): the port forgets it and returns its transport
        (None if already closed) and the bytes it had buffered past the last
        frame. The caller sets the transport's new protocol."""
        if not isinstance(endpoint, TcpConnection):
            return None, b""
        conn = endpoint
        stream = conn.stream
        if stream is None:
            return None, b""
        leftover = bytes(conn.buffer)
        conn.buffer.clear()
        conn.stream = None
        if conn in self.connections:
            self.connections.discard(conn)
            self.stream_endpoints.pop((conn.peer, conn.local), None)
            conn.uncharge_all()
            self.admission.release(conn.peer[0])
        self.stats.tcp_connections = len(self.connections)
        return stream, leftover

    def end_session(self, endpoint: Endpoint, client: Address) -> None:
        if isinstance(endpoint, DtlsListener):
            # Its DTLS session ends with the allocation (as coturn's does).
            endpoint.end_session(client)

    # ------------------------------------------------------------ TLS

    def tls_protocol_factory(self) -> Callable[[], asyncio.Protocol]:
        """The protocol of one STUN/TURN-over-TLS connection, given the TLS
        transport once the handshake is done: the port's TLS listeners use
        it, and so does a TLS port shared with HTTPS (the runtime's)."""
        tls_core = self.connection_binding_core(self.config.rate_limit)
        tls_group = _Group(core=tls_core, stream_core=tls_core, udp=[], tcp_servers=[])
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep_idle())
        return lambda: TcpConnection(self, tls_group, 0)

    def connection_binding_core(self, rate_limit: int) -> BindingCore:
        """A Binding core for connections the port's own sockets do not carry
        (TLS, DTLS): one endpoint, no RFC 5780 attributes (RESPONSE-ORIGIN
        would name the plain STUN port, and behaviour discovery does not run
        over them), ``rate_limit`` requests per second per source (0: none),
        drops counted with the port's."""
        return BindingCore(
            [None],
            software=self.config.software,
            rate_limit=rate_limit,
            max_sources=self.config.rate_limit_sources,
            stream=True,
            drops=self.stats.drops,
        )

    def add_tls_address(self, address: Address) -> None:
        """A TLS listener the port does not own serves it at ``address``."""
        self.tls_addresses.append(address)
        self.descriptions.append(f"tls {show_address(address)}")

    async def listen_tls(self, host: str, port: int, context: ssl.SSLContext) -> int:
        """Serve STUN/TURN over TLS (RFC 8656 §3, RFC 7350) on ``port`` of
        ``host`` (and ``::`` beside a ``0.0.0.0`` bind); return the port.

        A TLS connection is a :class:`TcpConnection` once its handshake is done
        (bounded by the listener's own TLS tables, ``tls-handshakes:turn`` and
        ``tls-connections:turn``, failures counted as drops): same framing, same
        caps and idle timeout, TURN and RFC 6062 on it exactly as on TCP, and
        its peer address is the real client's. From accept on, it counts
        against the TCP listener's connection caps.
        """
        loop = asyncio.get_running_loop()
        cfg = self.config
        if self.tls_tables is None:
            self.tls_tables = tls_tables(
                self.resources,
                "turn",
                listener=self.admission,
                max_connections=cfg.tcp_max_connections,
                max_per_source=cfg.tcp_max_connections_per_ip,
            )
        tables = self.tls_tables
        binds = [(host, False)] + ([("::", True)] if host == "0.0.0.0" else [])
        for bind_host, v6only in binds:
            group = next(
                (
                    g
                    for g in self.groups
                    if family_of(g.udp[0].local[0]) == family_of(bind_host)
                ),
                None,
            )
            if group is None:
                continue
            try:
                sock = bind_socket(bind_host, port, socket.SOCK_STREAM, v6only=v6only)
            except OSError as exc:
                if bind_host == host:
                    raise
                log.warning("STUN: no IPv6 TLS listener on [::]: %s", exc)
                continue
            port = sock.getsockname()[1]
            connection = self.tls_protocol_factory()
            server = await loop.create_server(
                functools.partial(
                    TlsAcceptor, context, connection, tables, self.stats.drop
                ),
                sock=sock,
            )
            group.tcp_servers.append(server)
            self.add_tls_address((bind_host, port))
            self.resources.listen(
                "turn", "turn-tls", "tcp", (bind_host, port), tables.handshakes.name
            )
        return port

    # ------------------------------------------------------------ DTLS

    async def listen_dtls(
        self, host: str, port: int, certificates: Certificates
    ) -> None:
        """Serve TURN over DTLS (RFC 8656 §3, RFC 7350) on UDP ``port`` of
        ``host`` (and ``::`` beside a ``0.0.0.0`` bind), the port number of
        TURN over TLS, as coturn does.

        Decrypted datagrams are sorted as plain UDP ones are
        (:meth:`dtls_datagram`); the :class:`~crossroads.transport.dtls.
        DtlsListener` is the allocation's endpoint, so replies and relayed
        data are encrypted for the client's session. Its sessions and
        handshakes have their own tables (``dtls-sessions:turn``,
        ``dtls-handshakes:turn``); a session must send a well-formed STUN
        message within the TCP first-message deadline
        (``--stun-tcp-message-timeout``) of its handshake, as a TCP or TLS
        connection must.
        """
        binds = [(host, False)] + ([("::", True)] if host == "0.0.0.0" else [])
        self._dtls_binding = self.connection_binding_core(rate_limit=0)
        cfg = self.config
        if self.dtls_tables is None:
            self.dtls_tables = dtls_tables(
                self.resources,
                "turn",
                max_sessions_per_source=cfg.tcp_max_connections_per_ip,
                first_message_timeout=cfg.tcp_message_timeout,
            )
        tables = self.dtls_tables
        for bind_host, v6only in binds:
            try:
                listener = await open_dtls_listener(
                    bind_host,
                    port,
                    v6only,
                    DtlsListener(
                        certificates,
                        self.dtls_datagram,
                        tables,
                        self.stats.drop,
                        self._reflection(),
                        first_message=is_stun_message,
                    ),
                )
            except OSError as exc:
                if bind_host == host:
                    raise
                log.warning("TURN: no IPv6 DTLS listener on [::]: %s", exc)
                continue
            self.dtls_listeners.append(listener)
            self.datagram_endpoints[listener.local] = listener
            self.resources.listen(
                "turn", "turn-dtls", "udp", listener.local, tables.sessions.name
            )

    def dtls_datagram(self, data: bytes, client: Address, endpoint: Endpoint) -> None:
        """One decrypted DTLS datagram: sorted as a plain UDP one is."""
        if len(data) < 2:
            self.stats.drop("empty")
            return
        kind = sort_traffic(data)
        if kind is PortTraffic.BINDING:
            # Binding: the DTLS handshake proved the address (no budget).
            binding = self._dtls_binding
            assert binding is not None
            now = asyncio.get_running_loop().time()
            binding.receive_datagram(data, client, now, 0)
            for reply, dest, _send_from in binding.datagrams_to_send(now):
                endpoint.send(reply, dest)
            return
        turn = self.turn
        if turn is None:
            self.stats.drop("dtls-not-stun")
        elif kind is PortTraffic.STUN:
            turn.stun(data, client, endpoint)
        elif kind is PortTraffic.CHANNEL_DATA:
            turn.channel_data(data, client, endpoint)
        else:
            self.stats.drop("dtls-not-stun")

    # ------------------------------------------------------------ deadlines

    async def _sweep_idle(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(TCP_SWEEP_INTERVAL)
            self.sweep(loop.time())

    def sweep(self, now: float) -> None:
        """Close the TCP connections past a deadline: no first message within
        ``tcp_message_timeout`` of connecting, a message started and not
        finished within it (each holds up to 64 KiB of buffer), nothing at
        all for ``tcp_idle_timeout``, or unsent bytes that have not drained for
        :data:`TCP_WRITE_STALL_TIMEOUT`; settle every connection's buffered
        bytes with the budget on the way."""
        cfg = self.config
        idle_deadline = now - cfg.tcp_idle_timeout
        message_deadline = now - cfg.tcp_message_timeout
        for conn in list(self.connections):
            stream = conn.stream
            if stream is None:
                continue
            if conn.partial_since is not None and conn.partial_since < message_deadline:
                reason = "tcp-partial-message-timeout"
            elif conn.frames == 0 and conn.accepted < message_deadline:
                reason = "tcp-first-message-timeout"
            elif conn.last_activity < idle_deadline:
                reason = "tcp-idle-timeout"
            elif conn.write_stalled(now):
                reason = "tcp-write-stall-timeout"
            else:
                continue
            self.stats.drop(reason)
            self.admission.closed(reason.removeprefix("tcp-"))
            stream.abort()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self.stop_turn()
        if self._sweeper is not None:
            await cancel_and_wait(self._sweeper)
        for group in self.groups:
            for server in group.tcp_servers:
                server.close()
        for conn in list(self.connections):
            if conn.stream is not None:
                conn.stream.abort()
        for listener in self.dtls_listeners:
            listener.close()
        if self.routes is not None:
            self.routes.close()
        for group in self.groups:
            for endpoint in group.udp:
                if isinstance(endpoint, BatchUdpEndpoint):
                    endpoint.close()
                elif endpoint.udp is not None:
                    endpoint.udp.close()
            for server in group.tcp_servers:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(server.wait_closed(), 2)
        self.resources.forget(SERVICE)
        if self.tls_tables is not None:
            self.tls_tables.forget()
        if self.dtls_tables is not None:
            self.dtls_tables.forget()
