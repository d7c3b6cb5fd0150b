"""The ``stun`` service: STUN Binding (RFC 8489) and NAT behaviour discovery
(RFC 5780) over UDP and TCP, IPv4 and IPv6 — and the sockets TURN shares.

Sockets
-------
Port ``--stun-port`` (3478) on ``--host``, UDP and TCP. With RFC 5780 on
(``--stun-rfc5780``, the default) also ``--stun-alt-port`` (3479) on the same IP,
and, when ``--stun-alt-host`` names a second IP, both ports on that IP too: four
UDP and four TCP endpoints, as RFC 5780 §6 asks. When ``--host`` is the IPv4
wildcard (``0.0.0.0``), the same ports are also bound on ``::`` (IPv6 only), so
the server answers both families; a machine without IPv6 just skips that.

UDP sockets are drained in batches with ``recvmmsg`` and answered with one
``sendmmsg`` per batch (:class:`BatchUdpEndpoint`, Linux, ``--stun-batch-io``,
on by default); elsewhere, or with ``--no-stun-batch-io``, each datagram is one
asyncio callback (:class:`UdpEndpoint`). Either path looks at the first two
bytes of a datagram only:

- ``0x00 0x01`` (Binding request) and other Binding messages: the sans-I/O
  :class:`~crossroads.proto.stun.server.BindingCore`, which never allocates a
  message object for a Binding request;
- any other STUN message (first bits ``00``): the attached TURN handler, or,
  without one, a counted drop (``unsupported-method``): RFC 8489 §6.3 discards
  messages of unsupported methods silently;
- ChannelData (first byte 0x40-0x7F): the attached TURN handler, or a counted
  drop;
- anything else: counted drop (``not-stun``).

Over TCP the stream is cut into STUN / ChannelData frames (RFC 8489 §6.2.2,
RFC 8656 §12.5 — ChannelData is padded to 4 bytes over TCP) and each frame takes
the same path. Connections are bounded in number (in total and per source, by
the runtime's shared :mod:`~crossroads.transport.admission`), idle time, time
to send the first message and to finish any started one, and unsent bytes.

Extension point for TURN
------------------------
TURN (RFC 8656) runs on these same sockets. Another service attaches itself
with :meth:`StunService.attach_turn`; see :class:`TurnHooks` for what it
receives and :class:`Endpoint` for how it answers from the same socket.

Metrics (in the runtime registry, counted in plain ints on the hot path and
exported at scrape time): ``crossroads_stun_requests_total{transport}``,
``crossroads_stun_responses_total{transport,class}``,
``crossroads_stun_dropped_total{reason}`` (``rate-limited`` is the rate-limit
counter), ``crossroads_stun_tcp_connections``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import socket
import ssl
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, cast

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

import crossroads
from crossroads.config import check_non_negative, check_positive, setting
from crossroads.errors import ConfigError, DecodeError
from crossroads.metrics import counter_by, unregister
from crossroads.proto.admission import REFUSED_OVER_IP_LIMIT, REFUSED_OVER_LIMIT
from crossroads.proto.stun.message import (
    PortTraffic,
    sort_traffic,
    stream_frame_length,
)
from crossroads.proto.stun.server import DROP_NOT_STUN, BindingCore
from crossroads.services.base import ServiceContext, show_address
from crossroads.transport import mmsg
from crossroads.transport.mmsg import MmsgSocket
from crossroads.transport.pktinfo import (
    DatagramEndpoint,
    ReplySource,
    is_wildcard,
    open_datagram_endpoint,
)
from crossroads.transport.sockets import bind_socket, family_of, tcp_round_trip
from crossroads.transport.tasks import cancel_and_wait
from crossroads.transport.tls import TlsAcceptor, TlsTables, tls_tables
from crossroads.types import Address, frozen

NAME = "stun"
log = logging.getLogger("crossroads.stun")
#: Listener kinds in the resource registry, by socket index of a group (the
#: RFC 5780 primary, alternate port, alternate host, both alternates).
KINDS = ("stun", "stun-alt-port", "stun-alt-host", "stun-alt-host-alt-port")
#: The table of TURN allocations (registered by the TURN service): the state a
#: client makes a STUN/TURN UDP socket hold.
TURN_TABLE = "turn-allocations"

#: How often TCP deadlines are checked (seconds). Deadlines are coarse on
#: purpose: one timer for every connection of the service, not one each.
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
class Config:
    """``[stun]`` settings."""

    port: int = setting(3478, kind="port", help="STUN/TURN port, UDP and TCP.")
    alt_port: int = setting(
        3479,
        kind="port",
        help="RFC 5780 alternate port (CHANGE-REQUEST change-port, OTHER-ADDRESS).",
    )
    alt_host: str = setting(
        "",
        kind="host",
        help="Second IP of this host for RFC 5780 (change-IP, OTHER-ADDRESS); "
        "empty = none: OTHER-ADDRESS is then never sent.",
    )
    rfc5780: bool = setting(
        True,
        help="RFC 5780 behaviour discovery: alternate port, RESPONSE-ORIGIN, "
        "CHANGE-REQUEST, RESPONSE-PORT, PADDING.",
    )
    software: str = setting(
        f"crossroads {crossroads.__version__}",
        help="SOFTWARE attribute in responses; empty to leave it out.",
    )
    tcp: bool = setting(True, help="Also serve STUN over TCP.")
    batch_io: bool = setting(
        True,
        help="Read and answer UDP in batches with recvmmsg/sendmmsg (Linux); "
        "off, or where unavailable: one asyncio callback per datagram.",
    )
    rate_limit: int = setting(
        100,
        check=check_non_negative,
        help="Binding requests answered per second per source IP; 0 = unlimited.",
    )
    rate_limit_sources: int = setting(
        100_000,
        check=check_positive,
        help="Source IPs tracked by the rate limiter per second (memory bound).",
    )
    tcp_max_connections: int = setting(
        10_000,
        check=check_positive,
        help="Concurrent TCP connections (also capped by the descriptor share "
        "of the listener, see docs/security.md); more are closed at once.",
    )
    tcp_max_connections_per_ip: int = setting(
        128,
        check=check_positive,
        help="Concurrent TCP connections from one IPv4 address or IPv6 /64.",
    )
    tcp_message_timeout: float = setting(
        10.0,
        check=check_positive,
        help="Seconds a TCP client has to send its first complete message after "
        "connecting, and to finish any message it has started (slowloris).",
    )
    tcp_idle_timeout: float = setting(
        900.0,
        check=check_positive,
        help="Seconds before an idle TCP connection is closed.",
    )

    def __post_init__(self) -> None:
        if self.rfc5780 and self.port and self.port == self.alt_port:
            raise ValueError("alt_port: must differ from port")


# ------------------------------------------------------------------ extension


class Endpoint(Protocol):
    """A place STUN traffic arrived on: one UDP socket or one TCP connection.

    ``transport`` is ``"udp"`` or ``"tcp"``; ``local`` the bound address;
    ``send(data, addr)`` sends from that same socket (for TCP, ``addr`` is
    ignored: data goes down the connection, which must already be framed — STUN
    messages as they are, ChannelData padded to 4 bytes).
    """

    @property
    def transport(self) -> Literal["udp", "tcp"]: ...

    @property
    def local(self) -> Address: ...

    def send(self, data: bytes, addr: Address) -> None: ...


#: ``(data, client, endpoint)``: a message for TURN, unparsed.
MessageHook = Callable[[bytes, Address, Endpoint], None]


@frozen
class TurnHooks:
    """Where the STUN/TURN port sends what is TURN's (see
    :meth:`StunService.attach_turn`).

    All three are called synchronously from the transport's receive callback:
    keep them quick (no awaits; schedule tasks for slow work) and never raise.
    With batched UDP (the default on Linux) they run inside the socket's drain
    loop, once per datagram; ``endpoint.send`` is then a non-blocking
    ``sendto`` that drops (and counts ``send-failed``) if the socket buffer is
    full. ``data`` is a private copy: keep it if you like. On a wildcard-bound
    socket the STUN Binding replies leave from the client's destination address
    (IP_PKTINFO), but ``endpoint.send`` leaves from the kernel's routed choice:
    on a multi-homed host, run with a specific ``--host``.
    ``client`` is ``(host, port)`` as the socket reports it (on a dual-stack
    ``::`` socket an IPv4 client appears as ``::ffff:a.b.c.d``); answer with
    ``endpoint.send(data, client)``.
    """

    #: A STUN message whose method is not Binding (first bits 00), whole and
    #: unparsed: the hook decodes it.
    stun: MessageHook
    #: A ChannelData message (first bits 01), unparsed; over TCP the frame
    #: includes its padding.
    channel_data: MessageHook
    #: A TCP connection closed (RFC 8656 §3.1: allocations made over it end).
    connection_lost: Callable[[Address, Endpoint], None]


# ------------------------------------------------------------------ stats


class _Stats:
    """Plain counters; the hot path increments ints, the collector exports."""

    def __init__(self) -> None:
        self.drops: dict[str, int] = {}
        self.tcp_requests = 0
        self.tcp_success = 0
        self.tcp_error = 0
        self.tcp_connections = 0

    def drop(self, reason: str, count: int = 1) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + count


class _Collector(Collector):
    def __init__(self, service: StunService) -> None:
        self.service = service

    def collect(self) -> Iterator[Any]:
        service = self.service
        stats = service.stats
        udp = service.udp_endpoints
        requests = CounterMetricFamily(
            "crossroads_stun_requests",
            "STUN Binding messages handled by the STUN server.",
            labels=["transport"],
        )
        requests.add_metric(["udp"], sum(e.requests for e in udp))
        requests.add_metric(["tcp"], stats.tcp_requests)
        yield requests
        responses = CounterMetricFamily(
            "crossroads_stun_responses",
            "STUN responses sent by the STUN server.",
            labels=["transport", "class"],
        )
        responses.add_metric(["udp", "success"], sum(e.success for e in udp))
        responses.add_metric(["udp", "error"], sum(e.errors for e in udp))
        responses.add_metric(["tcp", "success"], stats.tcp_success)
        responses.add_metric(["tcp", "error"], stats.tcp_error)
        yield responses
        yield counter_by(
            "crossroads_stun_dropped",
            "Input dropped by the STUN service, by reason.",
            "reason",
            stats.drops,
        )
        gauge = GaugeMetricFamily(
            "crossroads_stun_tcp_connections", "Open STUN/TURN TCP connections."
        )
        gauge.add_metric([], stats.tcp_connections)
        yield gauge


# ------------------------------------------------------------------ UDP


class _PortEndpoint:
    """What a UDP socket and a TCP connection of the STUN/TURN port do alike
    with a message that is not a Binding request (an :class:`Endpoint`)."""

    service: StunService
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
        """STUN to TURN's ``stun`` hook and ChannelData to its ``channel_data``,
        from ``(host, port)``; with no TURN attached, a STUN message goes to
        the core, which counts it and discards it silently (RFC 8489 §6.3), and
        ChannelData is dropped and counted. ``addr``: as the socket reports it;
        ``slot``: the recvmmsg batch slot, or -1."""
        turn = self.service.turn
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
                self.service.stats.drop("channel-data-no-turn")
        else:
            self.service.stats.drop(DROP_NOT_STUN)


@dataclass(eq=False)
class _UdpDispatch(_PortEndpoint):
    """Per-datagram dispatch of one UDP socket of the STUN/TURN port, shared by
    both endpoint kinds: the asyncio endpoint for every datagram, the recvmmsg
    endpoint for each datagram of its drain loop and for those a reader that
    took its socket over (the TURN data plane) hands back.
    """

    service: StunService
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
        stats = self.service.stats
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
    """One UDP socket of the STUN service (an :class:`Endpoint`)."""

    def __init__(
        self, service: StunService, group: _Group, index: int, local: Address
    ) -> None:
        super().__init__(service, group, index, local)
        self.udp: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's UDPTransport is not a subclass of asyncio.DatagramTransport.
        self.udp = cast(asyncio.DatagramTransport, transport)

    def send(self, data: bytes, addr: Address) -> None:
        """Send from this socket (part of the :class:`Endpoint` interface)."""
        if self.udp is not None:
            self.udp.sendto(data, addr)

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.dispatch(data, addr)

    def error_received(self, exc: Exception) -> None:
        # ICMP errors for earlier sends (port unreachable...): nothing to do.
        pass

    # -- hand-over to a faster reader (the TURN data plane) --------------------

    @property
    def replies_from_destination(self) -> bool:
        """Replies leave from each request's destination address (a wildcard
        bind runs on a :class:`~crossroads.transport.pktinfo.DatagramEndpoint`)."""
        return isinstance(self.udp, DatagramEndpoint)

    def fileno(self) -> int:
        sock = self.udp.get_extra_info("socket") if self.udp is not None else None
        return sock.fileno() if sock is not None else -1

    def divert(self, protocol: asyncio.BaseProtocol) -> bool:
        """Let ``protocol`` receive this socket's datagrams instead (it calls
        :meth:`dispatch` for those it does not handle). False if closed."""
        if self.udp is None or self.udp.is_closing():
            return False
        self.udp.set_protocol(protocol)
        return True

    def restore(self) -> None:
        """Receive this socket's datagrams again (undoes :meth:`divert`)."""
        if self.udp is not None and not self.udp.is_closing():
            self.udp.set_protocol(self)


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
        service: StunService,
        group: _Group,
        index: int,
        local: Address,
        sock: socket.socket,
    ) -> None:
        super().__init__(service, group, index, local)
        self.sock = sock
        # On a wildcard bind, reply from the address the client sent to.
        self.mm = MmsgSocket(sock, pktinfo=is_wildcard(local[0]))
        #: On a wildcard bind, what TURN sends (answers, Data indications,
        #: late responses) leaves from the address the client sent to as well.
        self.replies = ReplySource(sock) if self.mm.pktinfo else None
        self._loop.add_reader(sock.fileno(), self._readable)
        self._closed = False
        #: Another reader drains the socket (see :meth:`divert`).
        self._diverted = False

    def send(self, data: bytes, addr: Address) -> None:
        """Send from this socket now (part of the :class:`Endpoint` interface)."""
        try:
            if self.replies is not None:
                self.replies.sendto(data, addr)
            else:
                self.sock.sendto(data, addr)
        except OSError:
            # Full socket buffer (EAGAIN) or an ICMP error from an earlier send.
            self.service.stats.drop("send-failed")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if not self._diverted:
                self._loop.remove_reader(self.sock.fileno())
            self.sock.close()

    # -- hand-over to a faster reader (the TURN data plane) --------------------

    def fileno(self) -> int:
        return self.sock.fileno()

    @property
    def replies_from_destination(self) -> bool:
        """Binding replies leave from the request's destination address
        (IP_PKTINFO on a wildcard bind): a reader that takes this socket over
        with a plain recvmmsg would lose that."""
        return self.mm.pktinfo

    def divert(self) -> bool:
        """Stop reading this socket: another reader (registered by the caller)
        drains it and calls :meth:`dispatch` for what it does not handle.
        False if closed."""
        if self._closed or self._diverted:
            return False
        self._loop.remove_reader(self.sock.fileno())
        self._diverted = True
        return True

    def restore(self) -> None:
        """Read this socket again (undoes :meth:`divert`)."""
        if self._diverted and not self._closed:
            self._loop.add_reader(self.sock.fileno(), self._readable)
        self._diverted = False

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
        self.service.stats.drop(reason, count)


def _client(addr: Any) -> Address:
    return addr if len(addr) == 2 else (addr[0], addr[1])


# ------------------------------------------------------------------ TCP


class TcpConnection(_PortEndpoint, asyncio.Protocol):
    """One accepted TCP connection (an :class:`Endpoint`)."""

    def __init__(self, service: StunService, group: _Group, index: int) -> None:
        self.service = service
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
        service = self.service
        peer = transport.get_extra_info("peername")
        refused = service.admission.admit(peer[0])
        if refused is not None:
            service.stats.drop(_TCP_REFUSALS[refused])
            self.stream.abort()
            self.stream = None
            return
        sockname = transport.get_extra_info("sockname")
        self.peer = _client(peer)
        self.local = _client(sockname)
        self.last_activity = self.accepted = self._loop.time()
        service.connections.add(self)
        service.stats.tcp_connections = len(service.connections)

    def round_trip(self) -> float | None:
        """The kernel's smoothed RTT of this connection (seconds), None if
        unknown; still readable in :meth:`connection_lost` (asyncio closes the
        socket after it returns)."""
        stream = self.stream
        if stream is None:
            return None
        return tcp_round_trip(stream.get_extra_info("socket"))

    def connection_lost(self, exc: Exception | None) -> None:
        service = self.service
        if self in service.connections:
            service.connections.discard(self)
            self.uncharge_all()
            service.admission.release(self.peer[0])
            service.stats.tcp_connections = len(service.connections)
            if service.turn is not None:
                try:
                    service.turn.connection_lost(self.peer, self)
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
            self.service.stats.drop("tcp-slow-reader")
            self.service.admission.closed("slow-reader")
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
            if not self.service.admission.charge(size):
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
            self.service.admission.uncharge(charged - unsent)
            self.charged = unsent
        elif unsent > charged and self.service.admission.charge(unsent - charged):
            self.charged = unsent

    def uncharge_all(self) -> None:
        """The connection leaves the listener: its buffered bytes go back."""
        if self.charged:
            self.service.admission.uncharge(self.charged)
            self.charged = 0

    def resume_writing(self) -> None:
        """The transport drained below its low-water mark: refund."""
        if self.stream is not None:
            self.settle(self.stream.get_write_buffer_size())

    def write_stalled(self, now: float) -> bool:
        """Settle the charge and tell whether nothing unsent has drained for
        :data:`TCP_WRITE_STALL_TIMEOUT` (called by the service's sweep)."""
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
                self.service.stats.drop("tcp-not-stun")
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
        stats = self.service.stats
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


# ------------------------------------------------------------------ service


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


class StunService:
    """The running STUN service. Other services find it in
    ``ctx.running["stun"]``."""

    name = NAME

    def __init__(self, ctx: ServiceContext, config: Config) -> None:
        self.ctx = ctx
        self.config = config
        self.stats = _Stats()
        #: Binding replies over UDP per source IP (docs/security.md).
        self.reflection = ctx.reflection_budget()
        self.groups: list[_Group] = []
        self.udp_endpoints: list[UdpEndpoint | BatchUdpEndpoint] = []
        self.connections: set[TcpConnection] = set()
        #: Per-IP and global caps of the TCP listener (one for all its ports).
        self.admission = ctx.resources.listener(
            "stun",
            config.tcp_max_connections,
            config.tcp_max_connections_per_ip,
        )
        #: Where STUN/TURN over TLS listens (see :meth:`listen_tls`).
        self.tls_addresses: list[Address] = []
        #: The TLS tables of its own TLS listener (None until it listens).
        self.tls_tables: TlsTables | None = None
        #: The attached TURN hooks, if any (see :meth:`attach_turn`).
        self.turn: TurnHooks | None = None
        self._descriptions: list[str] = []
        self._collector = _Collector(self)
        self._sweeper: asyncio.Task[None] | None = None
        self._closed = False

    def attach_turn(self, hooks: TurnHooks) -> None:
        """Route non-Binding STUN messages and ChannelData, on every UDP socket
        and TCP connection of this service, to TURN's ``hooks``.

        Binding stays with the STUN server. TURN answers through the
        :class:`Endpoint` it is given, from the same socket the client used.
        Call it once, from the TURN service's ``serve()``; ``detach_turn``
        undoes it.
        """
        self.turn = hooks

    def detach_turn(self) -> None:
        """Forget the TURN handler (non-Binding messages are dropped again)."""
        self.turn = None

    def detach_tcp(self, conn: TcpConnection) -> tuple[asyncio.Transport | None, bytes]:
        """Hand a TCP connection over (RFC 6062: after ConnectionBind it carries
        raw application data): the service forgets it and returns its transport
        (None if already closed) and the bytes it had buffered past the last
        frame. The caller sets the transport's new protocol."""
        stream = conn.stream
        if stream is None:
            return None, b""
        leftover = bytes(conn.buffer)
        conn.buffer.clear()
        conn.stream = None
        if conn in self.connections:
            self.connections.discard(conn)
            conn.uncharge_all()
            self.admission.release(conn.peer[0])
        self.stats.tcp_connections = len(self.connections)
        return stream, leftover

    @property
    def primary(self) -> Address:
        """The bound (host, port) of the primary UDP socket."""
        return self.udp_endpoints[0].local

    def describe(self) -> list[str]:
        return list(self._descriptions)

    async def start(self) -> None:
        cfg = self.config
        host = self.ctx.host
        public = self.ctx.config.core.public_host
        ports = [cfg.port, cfg.alt_port] if cfg.rfc5780 else [cfg.port]
        hosts = [host]
        if cfg.alt_host:
            if not cfg.rfc5780:
                raise ConfigError("stun.alt_host: needs RFC 5780 (--stun-rfc5780)")
            if is_wildcard(host):
                raise ConfigError(
                    "stun.alt_host: RFC 5780 with a second IP needs --host set to "
                    "this host's first IP, not a wildcard"
                )
            if family_of(host) != family_of(cfg.alt_host) or cfg.alt_host == host:
                raise ConfigError(
                    "stun.alt_host: must be another address of --host's family"
                )
            hosts.append(cfg.alt_host)
        sets = [(hosts, False)]
        if host == "0.0.0.0":
            sets.append((["::"], True))
        for index, (group_hosts, v6only) in enumerate(sets):
            try:
                socks = _bind_set(group_hosts, ports, cfg.tcp, v6only)
            except OSError as exc:
                if index == 0:
                    raise
                # IPv6 companion of a 0.0.0.0 bind: optional.
                log.warning("STUN: no IPv6 listener on [::]: %s", exc)
                continue
            ports = [s[0].getsockname()[1] for s in socks[: len(ports)]]
            await self._start_group(socks, public)
        self.ctx.metrics.register(self._collector)
        if cfg.tcp:
            self._sweeper = asyncio.create_task(self._sweep_idle())

    async def _start_group(
        self, socks: list[tuple[socket.socket, socket.socket | None]], public: str
    ) -> None:
        loop = asyncio.get_running_loop()
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
            software=self.config.software,
            rate_limit=self.config.rate_limit,
            max_sources=self.config.rate_limit_sources,
            reflection=self.reflection,
            drops=self.stats.drops,
        )
        stream_core = BindingCore(
            advertised,
            software=self.config.software,
            stream=True,
            limiter=core.limiter,
            drops=self.stats.drops,
        )
        group = _Group(core=core, stream_core=stream_core, udp=[], tcp_servers=[])
        self.groups.append(group)
        labels = ["", " (alt port)", " (alt host)", " (alt host, alt port)"]
        for index, (udp_sock, tcp_sock) in enumerate(socks):
            local = locals_[index]
            endpoint: UdpEndpoint | BatchUdpEndpoint
            if self.config.batch_io and mmsg.available():
                endpoint = BatchUdpEndpoint(self, group, index, local, udp_sock)
            else:
                # On a wildcard bind, replies from each client's destination.
                endpoint = UdpEndpoint(self, group, index, local)
                await open_datagram_endpoint(endpoint, udp_sock)
            group.udp.append(endpoint)
            self.udp_endpoints.append(endpoint)
            self._descriptions.append(f"udp {show_address(local)}{labels[index]}")
            kind = KINDS[index]
            # A Binding keeps nothing per client (the rate limiter and the
            # reflection ledger are bounded LRU maps); what a client can make
            # this socket hold is TURN allocations, admitted by TURN's table.
            udp_table = TURN_TABLE if self.ctx.config.enabled("turn") else ""
            self.ctx.resources.listen(NAME, kind, "udp", local, udp_table)
            if tcp_sock is not None:
                server = await loop.create_server(
                    lambda i=index: TcpConnection(self, group, i),  # type: ignore[misc]
                    sock=tcp_sock,
                )
                group.tcp_servers.append(server)
                self._descriptions.append(f"tcp {show_address(local)}{labels[index]}")
                self.ctx.resources.listen(
                    NAME, f"{kind}-tcp", "tcp", local, self.admission.name
                )

    def tls_protocol_factory(self) -> Callable[[], asyncio.Protocol]:
        """The protocol of one STUN/TURN-over-TLS connection, given the TLS
        transport once the handshake is done: this service's TLS listeners
        use it, and so does a TLS port shared with HTTPS (the runtime's)."""
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
        drops counted with the service's."""
        return BindingCore(
            [None],
            software=self.config.software,
            rate_limit=rate_limit,
            max_sources=self.config.rate_limit_sources,
            stream=True,
            drops=self.stats.drops,
        )

    def add_tls_address(self, address: Address) -> None:
        """A TLS listener the service does not own serves it at ``address``."""
        self.tls_addresses.append(address)
        self._descriptions.append(f"tls {show_address(address)}")

    async def listen_tls(self, port: int, context: ssl.SSLContext) -> int:
        """Serve STUN/TURN over TLS (RFC 8656 §3, RFC 7350) on ``port`` of
        ``--host`` (and ``::`` beside a ``0.0.0.0`` bind); return the port.

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
                self.ctx.resources,
                "turn",
                listener=self.admission,
                max_connections=cfg.tcp_max_connections,
                max_per_source=cfg.tcp_max_connections_per_ip,
            )
        tables = self.tls_tables
        host = self.ctx.host
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
            self.ctx.resources.listen(
                "turn", "turn-tls", "tcp", (bind_host, port), tables.handshakes.name
            )
        return port

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
        if self._sweeper is not None:
            await cancel_and_wait(self._sweeper)
        for group in self.groups:
            for server in group.tcp_servers:
                server.close()
        for conn in list(self.connections):
            if conn.stream is not None:
                conn.stream.abort()
        for group in self.groups:
            for endpoint in group.udp:
                if isinstance(endpoint, BatchUdpEndpoint):
                    endpoint.close()
                elif endpoint.udp is not None:
                    endpoint.udp.close()
            for server in group.tcp_servers:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(server.wait_closed(), 2)
        unregister(self.ctx.metrics, self._collector)
        self.ctx.resources.forget("stun")
        if self.tls_tables is not None:
            self.tls_tables.forget()


async def serve(ctx: ServiceContext) -> StunService:
    """Bind the STUN sockets and start answering."""
    service = StunService(ctx, ctx.section(NAME, Config))
    try:
        await service.start()
    except BaseException:
        await service.close()
        raise
    return service
