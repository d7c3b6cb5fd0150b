"""RakNet's UDPProxyCoordinator (with a built-in UDPProxyServer), sans-I/O
(reference raknet-wire.md §5).

Theory of operation
-------------------
Two RakNet clients that cannot punch through ask for a relay. The requester
sends ``5c 06`` (FORWARDING_REQUEST_FROM_CLIENT_TO_COORDINATOR): its source
address (unassigned: "as you see me"), a bit usesAddress, the target's
SystemAddress or GUID, u32 timeoutOnNoDataMS and a bit (plus a bitstream) for
server selection (UDPProxyCoordinator.cpp:170-200). The coordinator answers
(215-256):

- a pair already being set up (either direction): IN_PROGRESS (``5c 05``);
- no proxy server at all: NO_SERVERS_ONLINE (``5c 02``);
- a target not connected here: RECIPIENT_GUID_NOT_CONNECTED (``5c 03``; stock
  RakNet says so only for targets given by GUID, and relays to any target
  address -- here both ends must be connected, so no forwarder can be aimed
  at a third party; a request for a source that is not connected is dropped);
- otherwise a forwarder is started -- by the built-in forwarder of this
  process (:class:`Forwarders`, a UDP port that relays between the two), or by
  an external UDPProxyServer that logged in (``5c 0b`` password: ``0c`` ok,
  ``0d`` already, ``0e`` no password set here, ``0f`` wrong), asked with
  ``5c 09`` and answering ``5c 0a`` (UDPProxyServer.cpp:155-176).

On success the requester gets FORWARDING_SUCCEEDED (``5c 00``) and the target
FORWARDING_NOTIFICATION (``5c 01``): both addresses, the other side's GUID,
RakString proxy IP, u16 proxy port (383-405). Both then RakNet-connect to that
address: the relayed bytes are an ordinary RakNet connection between the two
games. The request is remembered for ``timeoutOnNoDataMS`` after success, so
a late duplicate from the other side is IN_PROGRESS, not a second forwarder.

Choosing a server (UDPProxyCoordinator.cpp
OnForwardingRequestFromClientToCoordinator,
OnPingServersReplyFromClientToCoordinator,
ForwardingRequest::OrderRemainingServersToTry; UDPProxyClient.cpp
SendPingedServersToCoordinator): with one logged-in server it is asked at
once. With several, the coordinator sends both
clients PING_SERVERS_FROM_COORDINATOR_TO_CLIENT (``5c 07``: source, target,
target GUID, u16 count, count x SystemAddress); each client pings them
(unconnected ping) and answers PING_SERVERS_REPLY_FROM_CLIENT_TO_COORDINATOR
(``5c 08``: source, target, u16 count, count x (SystemAddress, u16 ping ms)).
Once both have answered, or after ``SERVER_REPLY_TIMEOUT_MS``, the servers are
ordered by the sum of both ends' pings (a side that did not report a server
counts ``UNRESPONSIVE_PING_MS`` for it) and tried in that order: a server that
answers NO_SOCKETS/BIND_FAILED, stays silent for ``SERVER_REPLY_TIMEOUT_MS``
or disconnects is followed by the next one. When no external server is left
the built-in forwarder (if enabled) does the work, else ALL_SERVERS_BUSY.
Differences from stock RakNet, on purpose: stock files the target's pings
under the source's list (so it always waits for the timeout), trusts a
reply from anyone, and ends with ALL_SERVERS_BUSY where this one falls back
to its own forwarder; here only the request's two ends may report pings, only
for servers they were asked about, each end once.

Relay nodes (crossroads' own, ``--raknet-proxy-relay-nodes``): other
crossroads instances sharing the Store run the same built-in forwarder. The
service tells the coordinator their RakNet addresses (where they answer
unconnected pings) with :meth:`UDPProxyCoordinator.set_relay_nodes`, this
instance's own address among them. They are servers like the logged-in ones:
listed in the ping round and tried best first; this instance's own address
means its built-in forwarder, another node's means a
:class:`RemoteForwardingRequest` that the service carries to that instance
through the Store and whose answer comes back with
:meth:`UDPProxyCoordinator.on_remote_reply` -- the same answer and the same
``SERVER_REPLY_TIMEOUT_MS`` as an external server's ``5c 0a``.

Bounds: requests in progress, the logged-in servers and relay nodes (so the
servers to ping and the pings kept per request), the remote requests waiting
for the service, and (in the forwarder) the forwarding ports. A request's
``timeoutOnNoDataMS`` must be within RakNet's own range (1 ms to
``UDP_FORWARDER_MAXIMUM_TIMEOUT``, 10 min); else it is answered as stock
RakNet answers a server's UDPFORWARDER_INVALID_PARAMETERS. When a client's
connection here closes, the requests it made or is an end of are forgotten and
the built-in forwarder ends the forwarders tied to it that nobody used yet
(:meth:`Forwarders.end_client`); a forwarder in use ends when it has been idle
for its timeout, as in stock RakNet, since the game may still run through it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Protocol

from crossroads.errors import DecodeError
from crossroads.proto.raknet.bitstream import UNASSIGNED_ADDRESS, BitReader, BitWriter
from crossroads.proto.raknet.messages import MessageId
from crossroads.proto.raknet.peer import RakNetServer
from crossroads.proto.sweep import SweepTimer
from crossroads.types import Address, frozen

#: A server that does not answer a forwarding request within this long is
#: skipped (``DEFAULT_UNRESPONSIVE_PING_TIME_COORDINATOR`` = 2000 + 1000 ms,
#: UDPProxyCoordinator.cpp:24-25).
SERVER_REPLY_TIMEOUT_MS = 3000
#: The ping a client is assumed to have to a server it did not report
#: (``DEFAULT_CLIENT_UNRESPONSIVE_PING_TIME``, UDPProxyCoordinator.cpp:24).
UNRESPONSIVE_PING_MS = 2000
#: Requests being set up or remembered at once, and proxy servers logged in.
MAX_REQUESTS = 10_000
MAX_SERVERS = 64
#: Relay nodes considered for one request (the ping list stays one datagram).
MAX_RELAY_NODES = 64
#: Remote forwarding requests waiting for the service to carry them.
MAX_REMOTE_OUTBOX = 1024
#: How often remembered requests are forgotten.
SWEEP_INTERVAL = 0.25
#: The longest ``timeoutOnNoDataMS`` a forwarder takes: 10 minutes
#: (``UDP_FORWARDER_MAXIMUM_TIMEOUT``, UDPProxyCommon.h). Stock
#: UDPForwarder::StartForwarding answers UDPFORWARDER_INVALID_PARAMETERS for 0
#: or more (UDPForwarder.cpp:121-123) and UDPProxyServer asserts the same range
#: (UDPProxyServer.cpp OnForwardingRequestFromCoordinatorToServer). RakNet's
#: own NATCompleteClient sample asks for exactly this maximum, so nothing
#: lower is refused; an idle forwarder is closed after it, a forwarder nobody
#: used yet as soon as one of its clients leaves the coordinator.
UDP_FORWARDER_MAXIMUM_TIMEOUT_MS = 60_000 * 10


def timeout_valid(timeout_ms: int) -> bool:
    """Whether a forwarder may be started with ``timeoutOnNoDataMS`` (stock
    RakNet's rule: 0 < timeout <= :data:`UDP_FORWARDER_MAXIMUM_TIMEOUT_MS`)."""
    return 0 < timeout_ms <= UDP_FORWARDER_MAXIMUM_TIMEOUT_MS


class Sub(IntEnum):
    """``UDPProxyMessages`` (UDPProxyCommon.h)."""

    FORWARDING_SUCCEEDED = 0
    FORWARDING_NOTIFICATION = 1
    NO_SERVERS_ONLINE = 2
    RECIPIENT_GUID_NOT_CONNECTED_TO_COORDINATOR = 3
    ALL_SERVERS_BUSY = 4
    IN_PROGRESS = 5
    FORWARDING_REQUEST_FROM_CLIENT_TO_COORDINATOR = 6
    PING_SERVERS_FROM_COORDINATOR_TO_CLIENT = 7
    PING_SERVERS_REPLY_FROM_CLIENT_TO_COORDINATOR = 8
    FORWARDING_REQUEST_FROM_COORDINATOR_TO_SERVER = 9
    FORWARDING_REPLY_FROM_SERVER_TO_COORDINATOR = 10
    LOGIN_REQUEST_FROM_SERVER_TO_COORDINATOR = 11
    LOGIN_SUCCESS_FROM_COORDINATOR_TO_SERVER = 12
    ALREADY_LOGGED_IN_FROM_COORDINATOR_TO_SERVER = 13
    NO_PASSWORD_SET_FROM_COORDINATOR_TO_SERVER = 14
    WRONG_PASSWORD_FROM_COORDINATOR_TO_SERVER = 15


class ForwarderResult(IntEnum):
    """``UDPForwarderResult`` (UDPForwarder.h)."""

    FORWARDING_ALREADY_EXISTS = 0
    NO_SOCKETS = 1
    BIND_FAILED = 2
    INVALID_PARAMETERS = 3
    NOT_RUNNING = 4
    SUCCESS = 5


class Forwarders(Protocol):
    """The built-in forwarder (an I/O object the service provides)."""

    def start(
        self,
        source: Address,
        target: Address,
        timeout_ms: int,
        requester: Address | None = None,
    ) -> tuple[ForwarderResult, int]:
        """Relay between ``source`` and ``target`` for ``requester`` (the
        client that asked, charged for it; None: ``source``); (result,
        forwarding port). INVALID_PARAMETERS for a timeout outside
        :func:`timeout_valid`, NO_SOCKETS when full."""
        ...

    def end_client(self, address: Address) -> int:
        """The coordinator connection of ``address`` closed: end the
        forwarders it asked for or serves that have not forwarded anything
        yet; return how many ended."""
        ...


@frozen
class RemoteForwardingRequest:
    """Ask the relay node at ``node`` (another crossroads instance, known by
    its RakNet address) to forward between ``source`` and ``target``: the
    Store-borne equivalent of ``5c 09``."""

    node: Address
    source: Address
    target: Address
    timeout_ms: int


@frozen
class ForwardingReply:
    """A server's ``5c 0a`` (or a relay node's answer) to a forwarding request
    between ``source`` and ``target``: its UDPForwarderResult, and the IP
    (empty: the server's own) and port the forwarder listens on."""

    source: Address
    target: Address
    ip: str
    result: int
    port: int


@dataclass(eq=False, slots=True)
class Request:
    source: Address
    target: Address
    sender_guid: int
    target_guid: int
    requester: Address
    timeout_ms: int
    server: Address | None = None
    asked_ms: int = 0
    forget_ms: int | None = None
    #: External servers still to try, best first.
    remaining: list[Address] = field(default_factory=list)
    #: While the clients ping the servers: when they were asked (else None),
    #: and each end's report (server -> ping ms), None until it arrives.
    pings_asked_ms: int | None = None
    source_pings: dict[Address, int] | None = None
    target_pings: dict[Address, int] | None = None
    #: Whether this instance's built-in forwarder was already asked.
    built_in_tried: bool = False


@dataclass
class ProxyStats:
    requests: int = 0
    succeeded: int = 0
    results: Counter[str] = field(default_factory=Counter)
    dropped: Counter[str] = field(default_factory=Counter)


@dataclass(eq=False)
class UDPProxyCoordinator:
    """See the module docstring."""

    peer: RakNetServer
    forwarders: Forwarders | None
    public_ip: str
    password: str = field(default="", repr=False)
    servers: list[Address] = field(default_factory=list, init=False)
    #: crossroads relay nodes (RakNet addresses), and which one is this
    #: instance (its built-in forwarder); see the module docstring.
    relay_nodes: list[Address] = field(default_factory=list, init=False)
    own_address: Address | None = field(default=None, init=False)
    _remote: list[RemoteForwardingRequest] = field(default_factory=list, init=False)
    requests: dict[tuple[Address, Address], Request] = field(
        default_factory=dict, init=False
    )
    stats: ProxyStats = field(default_factory=ProxyStats, init=False)
    _sweep: SweepTimer = field(
        default_factory=lambda: SweepTimer(SWEEP_INTERVAL), init=False
    )

    # ------------------------------------------------------------- hooks

    def set_relay_nodes(self, nodes: list[Address], own: Address | None) -> None:
        """The live crossroads relay nodes (``own`` is this instance's)."""
        self.relay_nodes = nodes[:MAX_RELAY_NODES]
        self.own_address = own

    def pop_remote_requests(self) -> list[RemoteForwardingRequest]:
        """Forwarding requests for other relay nodes, for the service to carry."""
        remote, self._remote = self._remote, []
        return remote

    def on_remote_reply(
        self,
        node: Address,
        source: Address,
        target: Address,
        ip: str,
        result: int,
        port: int,
        now: float,
    ) -> None:
        """A relay node's answer to a :class:`RemoteForwardingRequest`."""
        try:
            self._server_answered(
                node, ForwardingReply(source, target, ip, result, port), now
            )
        except DecodeError as exc:
            self.stats.dropped[f"relay-node-{exc.reason}"] += 1

    def on_message(
        self, guid: int, address: Address, payload: bytes, now: float
    ) -> bool:
        if payload[0] != MessageId.UDP_PROXY_GENERAL or len(payload) < 2:
            return False
        try:
            match payload[1]:
                case Sub.FORWARDING_REQUEST_FROM_CLIENT_TO_COORDINATOR:
                    self._on_request(address, payload, now)
                case Sub.LOGIN_REQUEST_FROM_SERVER_TO_COORDINATOR:
                    self._on_login(address, payload, now)
                case Sub.FORWARDING_REPLY_FROM_SERVER_TO_COORDINATOR:
                    self._on_server_reply(address, payload, now)
                case Sub.PING_SERVERS_REPLY_FROM_CLIENT_TO_COORDINATOR:
                    self._on_ping_reply(address, payload, now)
                case _:
                    self.stats.dropped["unknown-sub-id"] += 1
        except DecodeError as exc:
            self.stats.dropped[exc.reason] += 1
        return True

    def on_disconnected(self, address: Address, now: float) -> None:
        # Stock RakNet forgets only the requests ``address`` made
        # (UDPProxyCoordinator::OnClosedConnection); here also those it is an
        # end of, since its unused forwarders end with it (below): a request
        # remembered for a forwarder that is gone would answer IN_PROGRESS.
        for key, request in list(self.requests.items()):
            if address in (request.requester, request.source, request.target):
                del self.requests[key]
        if self.forwarders is not None:
            self.forwarders.end_client(address)
        if address in self.servers:
            self.servers.remove(address)
            for request in list(self.requests.values()):
                if request.server == address and request.forget_ms is None:
                    self._try_next(request, now)

    def get_timer(self) -> float | None:
        return self._sweep.deadline if self.requests else None

    def handle_timer(self, now: float) -> None:
        if not self._sweep.due(now):
            return
        now_ms = int(now * 1000)
        for key, request in list(self.requests.items()):
            if request.forget_ms is not None:
                if now_ms > request.forget_ms:
                    del self.requests[key]
            elif request.pings_asked_ms is not None:
                if now_ms > request.pings_asked_ms + SERVER_REPLY_TIMEOUT_MS:
                    self._order_by_ping(request)
                    self._try_next(request, now)
            elif (
                request.server is not None
                and now_ms > request.asked_ms + SERVER_REPLY_TIMEOUT_MS
            ):
                self._try_next(request, now)

    # ---------------------------------------------------------- internals

    def _send(self, to: Address, sub: Sub, body: BitWriter | None, now: float) -> None:
        writer = BitWriter()
        writer.write_u8(MessageId.UDP_PROXY_GENERAL)
        writer.write_u8(sub)
        data = writer.data() + (body.data() if body is not None else b"")
        self.peer.send(to, data, now=now)

    def _pair(
        self, request: Request, guid: int, ip: str | None, port: int | None
    ) -> BitWriter:
        writer = BitWriter()
        writer.write_address(request.source)
        writer.write_address(request.target)
        writer.write_u64(guid)
        if ip is not None and port is not None:
            writer.write_rakstring(ip.encode())
            writer.write_u16(port)
        return writer

    def _on_request(self, address: Address, payload: bytes, now: float) -> None:
        reader = BitReader(payload, start_bits=16)
        source = reader.read_address()
        if source == UNASSIGNED_ADDRESS:
            source = address
        uses_address = reader.read_bool()
        if uses_address:
            target = reader.read_address()
            conn = self.peer.connection(target)
            target_guid = conn.guid if conn is not None else (2**64 - 1)
        else:
            target_guid = reader.read_u64()
            target = self.peer.address_of(target_guid) or UNASSIGNED_ADDRESS
        timeout_ms = reader.read_u32()
        self.stats.requests += 1
        sender = self.peer.connection(source)
        request = Request(
            source,
            target,
            sender.guid if sender is not None else 2**64 - 1,
            target_guid,
            address,
            timeout_ms,
        )
        if (source, target) in self.requests or (target, source) in self.requests:
            self._result(request, Sub.IN_PROGRESS, target_guid, "", 0, now)
            return
        if self.forwarders is None and not self.servers and not self.relay_nodes:
            self._result(request, Sub.NO_SERVERS_ONLINE, target_guid, None, None, now)
            return
        if self.peer.connection(source) is None:
            # Hardening: stock RakNet relays for any source address it is told;
            # here both ends must hold a RakNet connection to this server, so a
            # forwarder can never be aimed at a third party.
            self.stats.dropped["source-not-connected"] += 1
            return
        if self.peer.connection(target) is None or target == source:
            self._result(
                request,
                Sub.RECIPIENT_GUID_NOT_CONNECTED_TO_COORDINATOR,
                target_guid,
                None,
                None,
                now,
            )
            return
        if not timeout_valid(timeout_ms):
            # Stock RakNet passes the value on and its server refuses it with
            # UDPFORWARDER_INVALID_PARAMETERS, which the coordinator answers
            # with IN_PROGRESS, the server's IP and port 0 (the last branch of
            # OnForwardingReplyFromServerToCoordinator). Refused here, before
            # any server is asked: a debug build of a stock UDPProxyServer
            # asserts on it, and no forwarder may live 49.7 days (2^32-1 ms).
            self._invalid(request, now)
            return
        if len(self.requests) >= MAX_REQUESTS:
            self.stats.dropped["requests-full"] += 1
            self._result(request, Sub.ALL_SERVERS_BUSY, target_guid, None, None, now)
            return
        self.requests[(source, target)] = request
        self._sweep.arm(now)
        self._start(request, now)

    def _candidates(self) -> list[Address]:
        """Logged-in servers, then relay nodes (this one's own only when it
        has a forwarder)."""
        candidates = list(self.servers)
        for node in self.relay_nodes:
            if node in candidates:
                continue
            if node == self.own_address and self.forwarders is None:
                continue
            candidates.append(node)
        if candidates == [self.own_address]:
            return []  # only ourselves: the built-in fallback, no ping round
        return candidates

    def _start(self, request: Request, now: float) -> None:
        """One server: ask it; several: have both ends ping them."""
        request.remaining = self._candidates()
        if len(request.remaining) > 1:
            writer = BitWriter()
            writer.write_address(request.source)
            writer.write_address(request.target)
            writer.write_u64(request.target_guid)
            writer.write_u16(len(request.remaining))
            for server in request.remaining:
                writer.write_address(server)
            for end in (request.source, request.target):
                self._send(
                    end, Sub.PING_SERVERS_FROM_COORDINATOR_TO_CLIENT, writer, now
                )
            request.pings_asked_ms = int(now * 1000)
            return
        self._try_next(request, now)

    def _order_by_ping(self, request: Request) -> None:
        """Best first by the two ends' summed pings; ties keep login order."""
        request.pings_asked_ms = None
        source = request.source_pings or {}
        target = request.target_pings or {}
        request.remaining.sort(
            key=lambda server: (
                source.get(server, UNRESPONSIVE_PING_MS)
                + target.get(server, UNRESPONSIVE_PING_MS)
            )
        )

    def _try_next(self, request: Request, now: float) -> None:
        """Ask the next server still there (logged in, or a live relay node),
        else the built-in forwarder."""
        while request.remaining:
            server = request.remaining.pop(0)
            if server == self.own_address and server not in self.servers:
                if self._try_built_in(request, now):
                    return
                continue
            if server in self.servers:
                writer = BitWriter()
                writer.write_address(request.source)
                writer.write_address(request.target)
                writer.write_u32(request.timeout_ms)
                self._send(
                    server,
                    Sub.FORWARDING_REQUEST_FROM_COORDINATOR_TO_SERVER,
                    writer,
                    now,
                )
            elif server in self.relay_nodes:
                if len(self._remote) >= MAX_REMOTE_OUTBOX:
                    self.stats.dropped["relay-node-outbox-full"] += 1
                    continue
                self._remote.append(
                    RemoteForwardingRequest(
                        server, request.source, request.target, request.timeout_ms
                    )
                )
            else:
                continue
            request.server = server
            request.asked_ms = int(now * 1000)
            return
        request.server = None
        if not self._try_built_in(request, now):
            self._busy(request, now)

    def _try_built_in(self, request: Request, now: float) -> bool:
        """Ask this instance's forwarder (once); False when it cannot help."""
        if self.forwarders is None or request.built_in_tried:
            return False
        request.built_in_tried = True
        request.server = None
        result, port = self.forwarders.start(
            request.source, request.target, request.timeout_ms, request.requester
        )
        if result in (ForwarderResult.NO_SOCKETS, ForwarderResult.BIND_FAILED):
            self.stats.results[result.name.lower()] += 1
            return False
        self._forwarded(request, result, self._public_ip(request), port, now)
        return True

    def _on_ping_reply(self, address: Address, payload: bytes, now: float) -> None:
        reader = BitReader(payload, start_bits=16)
        key = (reader.read_address(), reader.read_address())
        count = reader.read_u16()
        request = self.requests.get(key)
        if request is None or request.pings_asked_ms is None:
            self.stats.dropped["unexpected-ping-reply"] += 1
            return
        if count > len(request.remaining):
            # Each end pings exactly the servers it was sent: no more.
            raise DecodeError("more pings than servers", "too-many-pings")
        pings: dict[Address, int] = {}
        for _ in range(count):
            server = reader.read_address()
            ping = reader.read_u16()
            if server in request.remaining:
                pings[server] = ping
        if address == request.source and request.source_pings is None:
            request.source_pings = pings
        elif address == request.target and request.target_pings is None:
            request.target_pings = pings
        else:
            # Stock RakNet takes a report from anyone as the target's; here
            # a stranger or a second report cannot steer the choice.
            self.stats.dropped["ping-reply-not-from-an-end"] += 1
            return
        if request.source_pings is not None and request.target_pings is not None:
            self._order_by_ping(request)
            self._try_next(request, now)

    def _public_ip(self, request: Request) -> str:
        """The configured public IP, else the address the requester dialled."""
        if self.public_ip:
            return self.public_ip
        conn = self.peer.connection(request.requester)
        return conn.dialled[0] if conn is not None else ""

    def _busy(self, request: Request, now: float) -> None:
        self.requests.pop((request.source, request.target), None)
        self._result(
            request, Sub.ALL_SERVERS_BUSY, request.target_guid, None, None, now
        )

    def _forwarded(
        self, request: Request, result: ForwarderResult, ip: str, port: int, now: float
    ) -> None:
        if result == ForwarderResult.SUCCESS:
            self.stats.succeeded += 1
            self._send(
                request.requester,
                Sub.FORWARDING_SUCCEEDED,
                self._pair(request, request.target_guid, ip, port),
                now,
            )
            self._send(
                request.target,
                Sub.FORWARDING_NOTIFICATION,
                self._pair(request, request.sender_guid, ip, port),
                now,
            )
            request.forget_ms = int(now * 1000) + request.timeout_ms
        elif result == ForwarderResult.FORWARDING_ALREADY_EXISTS:
            self.requests.pop((request.source, request.target), None)
            self._result(request, Sub.IN_PROGRESS, request.target_guid, ip, port, now)
        elif result == ForwarderResult.INVALID_PARAMETERS:
            self.requests.pop((request.source, request.target), None)
            self._invalid(request, now, ip)
        else:
            self.stats.results[result.name.lower()] += 1
            self._busy(request, now)

    def _invalid(self, request: Request, now: float, ip: str | None = None) -> None:
        """Answer a request a forwarder refuses as UDPFORWARDER_INVALID_PARAMETERS
        the way stock RakNet's coordinator does: IN_PROGRESS with the server's
        IP and forwarding port 0 (counted as ``invalid_parameters``)."""
        self.stats.results["invalid_parameters"] += 1
        if ip is None:
            ip = self._public_ip(request)
        self._result(request, Sub.IN_PROGRESS, request.target_guid, ip, 0, now)

    def _result(
        self,
        request: Request,
        sub: Sub,
        guid: int,
        ip: str | None,
        port: int | None,
        now: float,
    ) -> None:
        self.stats.results[sub.name.lower()] += 1
        self._send(request.requester, sub, self._pair(request, guid, ip, port), now)

    def _on_login(self, address: Address, payload: bytes, now: float) -> None:
        password = BitReader(payload, start_bits=16).read_rakstring()
        echo = BitWriter()
        echo.write_rakstring(password)
        if not self.password:
            sub = Sub.NO_PASSWORD_SET_FROM_COORDINATOR_TO_SERVER
        elif password != self.password.encode():
            sub = Sub.WRONG_PASSWORD_FROM_COORDINATOR_TO_SERVER
        elif address in self.servers:
            sub = Sub.ALREADY_LOGGED_IN_FROM_COORDINATOR_TO_SERVER
        elif len(self.servers) >= MAX_SERVERS:
            self.stats.dropped["servers-full"] += 1
            return
        else:
            self.servers.append(address)
            sub = Sub.LOGIN_SUCCESS_FROM_COORDINATOR_TO_SERVER
        self._send(address, sub, echo, now)

    def _on_server_reply(self, address: Address, payload: bytes, now: float) -> None:
        reader = BitReader(payload, start_bits=16)
        source = reader.read_address()
        target = reader.read_address()
        ip = reader.read_rakstring().decode("latin-1")
        reply = ForwardingReply(source, target, ip, reader.read_u8(), reader.read_u16())
        self._server_answered(address, reply, now)

    def _server_answered(
        self, address: Address, reply: ForwardingReply, now: float
    ) -> None:
        """A server's (or relay node's) answer to a forwarding request."""
        request = self.requests.get((reply.source, reply.target))
        if (
            request is None
            or request.server != address
            or request.forget_ms is not None
        ):
            self.stats.dropped["unexpected-server-reply"] += 1
            return
        try:
            outcome = ForwarderResult(reply.result)
        except ValueError:
            raise DecodeError("unknown UDPForwarderResult", "bad-result") from None
        if outcome in (ForwarderResult.NO_SOCKETS, ForwarderResult.BIND_FAILED):
            self._try_next(request, now)
            return
        self._forwarded(request, outcome, reply.ip or address[0], reply.port, now)
