"""The peer socket, the ladder runner and established peer links.

One UDP socket (the *peer socket*) carries everything of one SDK instance:
rendezvous probes to the server, sealed probes and data to every peer. Sealed
datagrams are routed by their receiver id (:mod:`crossroads.proto.punch.secure`)
to the ladder or link that owns the key, so a peer is recognised by its key, not
by its address — its address is what punching discovers. Birthday sockets
(extra sockets the hard side of a birthday punch opens) feed the same router.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, cast

from crossroads.errors import DecodeError
from crossroads.proto.punch import rendezvous as rv
from crossroads.proto.punch.ladder import Plan, Spray
from crossroads.proto.punch.secure import Kind, SecureChannel, receiver_id
from crossroads.types import Address, frozen, normalize_address

log = logging.getLogger("crossroads.client.p2p")

#: Rendezvous probes: 3 tries per port, 200 ms apart (a lost datagram costs 200 ms,
#: three lost ones mean UDP does not get through). An answer to any earlier try
#: of the port counts, so a server up to 600 ms away (round trip) is measured.
RENDEZVOUS_TRIES = 3
RENDEZVOUS_INTERVAL = 0.2
#: A link sends a keepalive when it sent nothing for this long, which also keeps
#: NAT mappings alive (UDP mappings last at least 2 minutes per RFC 4787 REQ-5, but
#: many home routers use 30 s; Unity's relay pings every 3 s).
KEEPALIVE_INTERVAL = 1.0
#: A link that heard nothing for this long is dead (about 5 missed keepalives).
LINK_TIMEOUT = 6.0

#: The relay step: probes every 100 ms for 3 s (a relay adds a server hop, so
#: allow several round trips through a loaded server).
RELAY_DURATION = 3.0
RELAY_INTERVAL = 0.1

#: Distinct destinations remembered per socket, for :attr:`PeerSocket.flows`
#: (a birthday run sends to 2048; past this the count stops mattering).
MAX_TRACKED_DESTINATIONS = 65536

#: A spray yields to the event loop after this many datagrams (a few ms of
#: sending), so other peers' timers and the answer it waits for are not held up.
SPRAY_CHUNK = 512

_PROBE = struct.Struct("!BHI")  # step index, sequence number, sent-at (ms)
STEP_NAMES = ("lan", "direct", "mapping", "punch", "relay")


Receiver = Callable[[bytes, Address, "Transport"], None]


class Transport:
    """Something a sealed datagram can be sent on: a UDP socket or a relay."""

    def send(self, data: bytes, addr: Address) -> None:  # pragma: no cover
        raise NotImplementedError

    @property
    def local(self) -> Address:  # pragma: no cover
        raise NotImplementedError


class _UdpTransport(Transport, asyncio.DatagramProtocol):
    def __init__(self, owner: PeerSocket, index: int) -> None:
        self.owner = owner
        self.index = index
        self.transport: asyncio.DatagramTransport | None = None
        self._local: Address = ("", 0)
        #: Destinations this socket has sent to (bounded; see PeerSocket.flows).
        self.destinations: set[Address] = set()
        #: The socket itself, for bulk sends that must not queue in the transport.
        self.sock: socket.socket | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)
        sock = transport.get_extra_info("socket")
        self._local = normalize_address(sock.getsockname())

    def datagram_received(self, data: bytes, addr: tuple[str | Any, ...]) -> None:
        self.owner._dispatch(data, normalize_address(addr), self)

    def error_received(self, exc: Exception) -> None:
        pass  # ICMP unreachable for probes to closed ports: expected while punching

    def send(self, data: bytes, addr: Address) -> None:
        if self.transport is not None and not self.transport.is_closing():
            if len(self.destinations) < MAX_TRACKED_DESTINATIONS:
                self.destinations.add(addr)
            self.transport.sendto(data, addr)

    @property
    def local(self) -> Address:
        return self._local

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _send_with_ttl(sock: socket.socket, data: bytes, dest: Address, ttl: int) -> None:
    """One IPv4 datagram with IP TTL ``ttl``; the socket's own TTL is restored
    at once, so answers from it travel normally."""
    if sock.family != socket.AF_INET:
        sock.sendto(data, dest)
        return
    default = sock.getsockopt(socket.IPPROTO_IP, socket.IP_TTL)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_TTL, ttl)
    try:
        sock.sendto(data, dest)
    finally:
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_TTL, default)


def _constant(protocol: _UdpTransport) -> Callable[[], _UdpTransport]:
    return lambda: protocol


class PeerSocket:
    """The SDK's UDP socket and its datagram router."""

    def __init__(self) -> None:
        self.main: _UdpTransport | None = None
        #: An IPv6 socket beside the (IPv4) main one, for IPv6 host candidates:
        #: IPv6 needs no NAT traversal, only a stateful firewall opened by the
        #: ladder's simultaneous sends.
        self.v6: _UdpTransport | None = None
        self._routes: dict[bytes, Receiver] = {}
        self._observed: dict[tuple[int, int], asyncio.Future[rv.Observed]] = {}
        self.dropped = 0

    async def open(
        self, host: str = "0.0.0.0", port: int = 0, sock: socket.socket | None = None
    ) -> None:
        if sock is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.bind((host, port))
        self.main = await self._attach(sock)

    async def open_v6(
        self, host: str = "::", port: int = 0, sock: socket.socket | None = None
    ) -> bool:
        """Open the IPv6 socket (IPv6 only: IPv4 stays on the main socket, whose
        NAT mappings port prediction counts). False when the host has no IPv6."""
        try:
            if sock is None:
                sock = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind((host, port))
        except OSError:
            if sock is not None:
                sock.close()
            return False
        self.v6 = await self._attach(sock)
        return True

    async def _attach(self, sock: socket.socket) -> _UdpTransport:
        """Read and send on ``sock`` (made non-blocking) through this router."""
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        _, protocol = await loop.create_datagram_endpoint(
            lambda: _UdpTransport(self, 0), sock=sock
        )
        return protocol

    def transport_for(self, dest: Address) -> _UdpTransport:
        """The socket that sends to ``dest``: IPv6 destinations leave from the
        IPv6 socket when there is one."""
        if self.v6 is not None and ":" in dest[0]:
            return self.v6
        assert self.main is not None
        return self.main

    @property
    def local(self) -> Address:
        assert self.main is not None
        return self.main.local

    async def open_extra(
        self, count: int, factory: Callable[[], socket.socket] | None = None
    ) -> list[_UdpTransport]:
        """Open ``count`` more sockets routed like the main one (birthday, spray)."""
        loop = asyncio.get_running_loop()
        host = self.local[0]
        out = []
        for i in range(count):
            if factory is not None:
                sock = factory()
            else:
                sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                sock.bind((host, 0))
            sock.setblocking(False)
            protocol = _UdpTransport(self, i + 1)
            await loop.create_datagram_endpoint(_constant(protocol), sock=sock)
            protocol.sock = sock
            out.append(protocol)
        return out

    def flows(self, exclude: list[Address]) -> int:
        """New destinations of the main socket other than ``exclude`` (the
        rendezvous ports): each opened a new NAT mapping."""
        if self.main is None:
            return 0
        return len(self.main.destinations - set(exclude))

    def restart_flow_count(self) -> None:
        """Count flows from here on: the next rendezvous probes go to a new server
        whose first observation already follows every earlier destination."""
        if self.main is not None:
            self.main.destinations.clear()

    def route(self, rid: bytes, receiver: Receiver) -> None:
        self._routes[rid] = receiver

    def unroute(self, rid: bytes, receiver: Receiver | None = None) -> None:
        if receiver is None or self._routes.get(rid) is receiver:
            self._routes.pop(rid, None)

    def _dispatch(self, data: bytes, addr: Address, via: Transport) -> None:
        rid = receiver_id(data)
        if rid is not None:
            receiver = self._routes.get(rid)
            if receiver is not None:
                receiver(data, addr, via)
                return
        elif data[:4] == rv.OBSERVED_MAGIC:
            try:
                observed = rv.Observed.decode(data)
            except DecodeError:
                self.dropped += 1
                return
            future = self._observed.pop((observed.index, observed.seq), None)
            if future is not None and not future.done():
                future.set_result(observed)
            return
        self.dropped += 1

    def deliver(self, data: bytes, addr: Address, via: Transport) -> None:
        """Feed a datagram that arrived some other way (e.g. through a relay)."""
        self._dispatch(data, addr, via)

    async def rendezvous(
        self, servers: list[Address], token: bytes, attempt: int
    ) -> list[rv.Observed | None]:
        """Probe each rendezvous port; the addresses the server saw (None if lost)."""
        assert self.main is not None
        results: list[rv.Observed | None] = []
        loop = asyncio.get_running_loop()
        # Probe the ports one after the other, so that a sequential NAT allocates
        # its mappings in port order and the stride is measurable.
        for index, server in enumerate(servers):
            found = None
            keys: list[tuple[int, int]] = []
            waiting: list[asyncio.Future[rv.Observed]] = []
            for seq in range(RENDEZVOUS_TRIES):
                key = (index, attempt * 16 + seq)
                future: asyncio.Future[rv.Observed] = loop.create_future()
                self._observed[key] = future
                keys.append(key)
                waiting.append(future)
                self.main.send(
                    rv.Probe(token, attempt, key[1] & 0xFFFF).encode(), server
                )
                # Any try's answer will do: with a round trip above 200 ms the
                # first try's answer arrives while the second is out.
                done, _ = await asyncio.wait(waiting, timeout=RENDEZVOUS_INTERVAL)
                if done:
                    found = next(iter(done)).result()
                    break
            for key in keys:
                stale = self._observed.pop(key, None)
                if stale is not None:
                    stale.cancel()
            results.append(found)
            if found is None and index == 0:
                # Nothing came back from the primary port: UDP to the server is
                # blocked (or the server is down); the other ports would only
                # add 2 x 600 ms of waiting before the ladder can fall back.
                results.extend([None] * (len(servers) - 1))
                break
        return results

    def close(self) -> None:
        if self.main is not None:
            self.main.close()
        if self.v6 is not None:
            self.v6.close()


@frozen
class RelayPath:
    """One way through a relay: send on ``transport`` to ``addr``, starting
    ``offset`` seconds into the relay step."""

    transport: Transport
    addr: Address
    offset: float = 0.0


@frozen
class LadderResult:
    """How a ladder ended: the step that won and the time from t_go, or failure."""

    ok: bool
    step: str = ""
    seconds: float = 0.0
    via: Transport | None = None
    addr: Address | None = None
    #: Application data that arrived before our side saw the path established
    #: (the peer established first and already sent); delivered by the caller.
    first_data: bytes | None = None


@dataclass(eq=False)
class LadderRun:
    """Executes this side's half of a :class:`Plan` and waits for a path.

    Probes carry (step, seq, time); the peer answers each with PROBE_ACK from the
    socket it arrived on. A PROBE_ACK (or any later sealed datagram) proves both
    directions, and the path it came on is the link's path. The step reported is
    the step of the acknowledged probe.
    """

    socket: PeerSocket
    channel: SecureChannel
    plan: Plan
    role: str
    extra: list[_UdpTransport]
    #: Relay paths, each probed every 100 ms from its offset into the relay
    #: step: TURN first, the WebSocket relay a moment later.
    relays: list[RelayPath] = field(default_factory=list)
    _: KW_ONLY
    #: False in relay-only mode: only datagrams that came through a relay
    #: transport count.
    udp: bool = True
    result: asyncio.Future[LadderResult] = field(init=False)
    _start: float = field(default=0.0, init=False)
    _handles: list[asyncio.TimerHandle] = field(default_factory=list, init=False)
    _sprays: set[asyncio.Task[None]] = field(default_factory=set, init=False)
    _seq: int = field(default=0, init=False)
    #: Datagrams the sprays sent, counted per chunk of SPRAY_CHUNK (and
    #: those the kernel refused: a full socket buffer).
    sprayed: int = field(default=0, init=False)
    spray_errors: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.result = asyncio.get_running_loop().create_future()

    def _transport(self, index: int, dest: Address) -> Transport:
        if index == 0:
            return self.socket.transport_for(dest)
        return self.extra[index - 1]

    def receive(self, data: bytes, addr: Address, via: Transport) -> None:
        if not self.udp and not any(via is path.transport for path in self.relays):
            return
        try:
            kind, body = self.channel.open(data)
        except DecodeError:
            self.socket.dropped += 1
            return
        if kind == Kind.PROBE:
            via.send(self.channel.seal(Kind.PROBE_ACK, body), addr)
            return
        if self.result.done():
            return
        if kind == Kind.PROBE_ACK and len(body) == _PROBE.size:
            step_index, _, _ = _PROBE.unpack(body)
            step = STEP_NAMES[step_index] if step_index < len(STEP_NAMES) else "punch"
        elif kind == Kind.KEEPALIVE:
            # The side that established first sends a keepalive naming the step.
            name = body.decode("ascii", "replace")
            step = name if name in STEP_NAMES else ""
        elif kind in (Kind.DATA, Kind.CONTROL):
            step = ""
        else:
            return
        first: bytes | None = body if kind == Kind.DATA else None
        # Half an RTT of skew between the two starts can make this negative.
        elapsed = max(0.0, time.monotonic() - self._start)
        self.result.set_result(LadderResult(True, step, elapsed, via, addr, first))

    def start(self, t_go: float, extra_delay: float = 0.0) -> None:
        """Schedule every send; ``t_go`` is in ``loop.time()`` terms."""
        loop = asyncio.get_running_loop()
        self._start = time.monotonic() + max(0.0, t_go - loop.time())
        for send in self.plan.sends(self.role):
            handle = loop.call_at(
                t_go + send.at,
                self._send,
                send.step,
                send.dest,
                send.socket,
                send.ttl,
            )
            self._handles.append(handle)
        for spray in self.plan.sprays(self.role):
            if spray.ports:
                handle = loop.call_at(t_go + spray.at, self._start_spray, spray)
                self._handles.append(handle)
        end = t_go + self.plan.duration
        if self.relays:
            # Relay step: both sides reach it at the same moment (the plan is
            # shared), and probe every path every 100 ms from its offset.
            for path in self.relays:
                at = end + path.offset
                while at < end + RELAY_DURATION:
                    handle = loop.call_at(at, self._send_relay, path)
                    self._handles.append(handle)
                    at += RELAY_INTERVAL
            end += RELAY_DURATION
        self._handles.append(loop.call_at(end + extra_delay, self._timeout))

    def _send(self, step: str, dest: Address, index: int, ttl: int = 0) -> None:
        if self.result.done():
            return
        transport = self._transport(index, dest)
        with contextlib.suppress(OSError):
            if ttl and isinstance(transport, _UdpTransport) and transport.sock:
                _send_with_ttl(transport.sock, self._probe(step), dest, ttl)
            else:
                transport.send(self._probe(step), dest)

    def _probe(self, step: str) -> bytes:
        self._seq = (self._seq + 1) & 0xFFFF
        stamp = int((time.monotonic() - self._start) * 1000) & 0xFFFFFFFF
        body = _PROBE.pack(STEP_NAMES.index(step), self._seq, stamp)
        return self.channel.seal(Kind.PROBE, body)

    def _start_spray(self, spray: Spray) -> None:
        if self.result.done():
            return
        task = asyncio.ensure_future(self._spray(spray))
        self._sprays.add(task)
        task.add_done_callback(self._sprays.discard)

    async def _spray(self, spray: Spray) -> None:
        """Send ``spray`` paced at its rate until it ends or a path is found.

        The random side's sockets send straight on the socket (hundreds of
        thousands of datagrams must not queue in asyncio transports); a
        datagram the kernel refuses is counted and skipped, like a lost one.
        """
        loop = asyncio.get_running_loop()
        began = loop.time()
        sent = 0
        addresses = [(spray.host, port) for port in spray.ports]
        if spray.sockets == 0:
            assert self.socket.main is not None
            main = self.socket.main
            for i, address in enumerate(addresses):
                with contextlib.suppress(OSError):
                    main.send(self._probe(spray.step), address)
                sent += 1
                self.sprayed += 1
                if i % SPRAY_CHUNK == SPRAY_CHUNK - 1:
                    if not await self._pace(began, sent, spray.rate):
                        return
            return
        # One sealed probe per port, shared by every socket: the peer answers
        # the first that gets through; later copies fail its replay check.
        probes = [self._probe(spray.step) for _ in addresses]
        sockets = [t.sock for t in self.extra[: spray.sockets] if t.sock is not None]
        for sock in sockets:
            for start in range(0, len(addresses), SPRAY_CHUNK):
                for probe, address in zip(
                    probes[start : start + SPRAY_CHUNK],
                    addresses[start : start + SPRAY_CHUNK],
                    strict=True,
                ):
                    try:
                        sock.sendto(probe, address)
                    except OSError:
                        self.spray_errors += 1
                chunk = min(SPRAY_CHUNK, len(addresses) - start)
                sent += chunk
                self.sprayed += chunk
                if not await self._pace(began, sent, spray.rate):
                    return

    async def _pace(self, began: float, sent: int, rate: float) -> bool:
        """Yield (and wait if ahead of ``rate``); False once a path is found."""
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, began + sent / rate - loop.time()))
        return not self.result.done()

    def _send_relay(self, path: RelayPath) -> None:
        if self.result.done():
            return
        transport, addr = path.transport, path.addr
        transport.send(self._probe("relay"), addr)

    def _timeout(self) -> None:
        if not self.result.done():
            self.result.set_result(
                LadderResult(False, "", time.monotonic() - self._start)
            )

    def stop(self) -> None:
        for handle in self._handles:
            handle.cancel()
        self._handles.clear()
        for task in self._sprays:
            task.cancel()
