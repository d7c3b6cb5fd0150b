"""The peer-to-peer SDK: mesh sessions over hole-punched, end-to-end encrypted UDP.

Usage::

    client = P2PClient("ws://coordinator.example:8080/p2p/v1/ws")
    await client.start()
    code = await client.host()            # or: await client.join("ABCD-EFGH")
    client.broadcast(b"hello")
    peer, data = await client.recv()
    await client.close()

Every connection to a peer runs the connection ladder (LAN -> direct -> port
mapping -> punch-through -> relay; see :mod:`crossroads.proto.punch.ladder`),
started by the server at the same instant on both sides. The ladder's outcome —
which step won and how long it took — is in :attr:`P2PClient.links`.

Sessions are full meshes: a joiner connects to every member before it is
accepted (FullyConnectedMesh2's verified join); the host is the member with the
lowest seniority, so when it leaves the next-oldest member becomes host and every
member computes the same answer (:class:`HostChanged`).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import ipaddress
import logging
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import urlparse

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from crossroads.client.nat import NatReport, detect_nat
from crossroads.client.peer import (
    KEEPALIVE_INTERVAL,
    LINK_TIMEOUT,
    LadderResult,
    LadderRun,
    PeerSocket,
    RelayPath,
    Transport,
    _UdpTransport,
)
from crossroads.client.portmap import PortMapper
from crossroads.client.signalling import SignallingClient
from crossroads.client.turnrelay import welcome_factory
from crossroads.errors import CrossroadsError, DecodeError
from crossroads.proto.punch import ladder
from crossroads.proto.punch import signalling as sig
from crossroads.proto.punch.coordinator import RELAY_FRAME, Coordinator
from crossroads.proto.punch.secure import Kind, SecureChannel, derive_keys
from crossroads.types import Address, frozen

log = logging.getLogger("crossroads.client.p2p")

#: How long one ``connect`` may take: prepare (up to the server's 10 s phase
#: timeout) + the longest ladder (about 7 s with the birthday step) + relay.
CONNECT_TIMEOUT = 30.0
#: In the relay step TURN paths get this head start over the WebSocket relay:
#: UDP through TURN has no head-of-line blocking, so it is the better relay.
TURN_HEAD_START = 1.0
#: A verified join against N members punches them one after the other.
JOIN_TIMEOUT = 120.0
#: Redirects one ``join`` follows (one is the norm: to the code's holder).
MAX_REDIRECTS = 2
#: Links to a peer that never became a member (a joiner the host rejected) are
#: closed after this.
STRANGER_TIMEOUT = 120.0
#: Ask for fresh TURN credentials this long before the server's expire: a few
#: keepalive rounds (KEEPALIVE_INTERVAL / 2 apart) to get the answer.
TURN_REFRESH_MARGIN = 300.0


class JoinRejected(CrossroadsError):
    """The session refused us (the host said no, a member was unreachable, ...)."""


# ---------------------------------------------------------------------- events


@frozen
class MemberJoined:
    peer: str


@frozen
class MemberLeft:
    peer: str


@frozen
class HostChanged:
    old: str
    new: str


@frozen
class LinkUp:
    peer: str
    step: str
    seconds: float


@frozen
class LinkDown:
    peer: str
    reason: str


@frozen
class SignalReceived:
    peer: str
    data: object


Event = MemberJoined | MemberLeft | HostChanged | LinkUp | LinkDown | SignalReceived


@frozen
class ConnectResult:
    """Outcome of one connection attempt to ``peer``."""

    peer: str
    ok: bool
    step: str = ""
    seconds: float = 0.0
    reason: str = ""


# ----------------------------------------------------------------------- links


class _RelayTransport(Transport):
    """Sealed datagrams to a peer through the signalling WebSocket (binary frames
    ``0x01 | peer id | datagram``): the server forwards without reading them."""

    def __init__(self, client: P2PClient) -> None:
        self.client = client

    def send(self, data: bytes, addr: Address) -> None:
        peer = addr[0].removeprefix("relay:")
        self.client._relay_out(peer, data)

    @property
    def local(self) -> Address:
        return ("relay", 0)


class TurnRelay(Protocol):
    """A TURN allocation as the SDK uses it (``crossroads.client.turn`` or any
    RFC 8656 client wrapped to this shape)."""

    #: Our relayed transport address on the TURN server.
    relayed: Address

    def set_receiver(self, receiver: Callable[[bytes, Address], None]) -> None:
        """Deliver every datagram relayed to us: (data, peer address)."""
        ...

    async def permit(self, *hosts: str) -> None:
        """Install permissions for these peer IPs (RFC 8656 §9)."""
        ...

    def send(self, data: bytes, peer: Address) -> None:
        """Relay ``data`` to ``peer`` (fire and forget, like a UDP send)."""
        ...

    async def close(self) -> None: ...


TurnFactory = Callable[[], Awaitable[TurnRelay]]


class _TurnTransport(Transport):
    """Sealed datagrams through our TURN allocation."""

    def __init__(self, relay: TurnRelay) -> None:
        self.relay = relay

    def send(self, data: bytes, addr: Address) -> None:
        self.relay.send(data, addr)

    @property
    def local(self) -> Address:
        return self.relay.relayed


@dataclass(eq=False)
class PeerLink:
    """An established, encrypted path to one peer."""

    peer: str
    channel: SecureChannel
    via: Transport
    addr: Address
    step: str
    seconds: float
    owner: P2PClient
    #: Datagrams this side's prediction spray sent before the path was found
    #: (to within SPRAY_CHUNK); 0 when no spray ran.
    sprayed: int = 0
    created: float = field(default_factory=time.monotonic)
    last_heard: float = field(default_factory=time.monotonic)
    last_sent: float = field(default_factory=time.monotonic)
    closed: bool = False

    def send(self, data: bytes, kind: Kind = Kind.DATA) -> None:
        if self.closed:
            return
        self.last_sent = time.monotonic()
        with contextlib.suppress(OSError):
            self.via.send(self.channel.seal(kind, data), self.addr)

    def receive(self, data: bytes, addr: Address, via: Transport) -> None:
        try:
            kind, body = self.channel.open(data)
        except DecodeError:
            self.owner.socket.dropped += 1
            return
        self.last_heard = time.monotonic()
        if addr != self.addr and via is self.via:
            # Authenticated datagram from a new address: the peer's NAT rebound
            # its mapping. Follow it (as WireGuard roams).
            self.addr = addr
        match kind:
            case Kind.DATA:
                self.owner._incoming(self.peer, body)
            case Kind.PROBE:
                via.send(self.channel.seal(Kind.PROBE_ACK, body), addr)
            case Kind.CLOSE:
                self.owner._link_closed(self, "closed by peer")
            case _:
                pass


# ---------------------------------------------------------------------- client


def _local_ip_towards(host: str) -> str | None:
    """The local address the kernel would use to reach ``host`` (no packet sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return str(s.getsockname()[0])
    except OSError:
        return None


#: A global IPv6 destination for a route lookup (documentation prefix: the
#: lookup sends nothing); the answer is this host's global source address.
IPV6_ROUTE_PROBE = "2001:db8::1"


def _ipv6_host_address(bound: str) -> str | None:
    """The IPv6 address peers can reach this host on: the bound one, else the
    kernel's source for global destinations (None without global IPv6;
    link-local addresses need a scope no peer could supply)."""
    ip = ipaddress.ip_address(bound)
    if ip.is_unspecified:
        found = _local_ip_towards(IPV6_ROUTE_PROBE)
        if found is None:
            return None
        ip = ipaddress.ip_address(found.split("%")[0])
    return None if ip.is_link_local else str(ip)


class P2PClient:
    """One peer of the p2p SDK (see module docstring)."""

    def __init__(
        self,
        url: str,
        *,
        name: str = "",
        bind: Address = ("0.0.0.0", 0),
        bind6: Address | None | bool = True,
        relay: str = "allow",
        accept_join: Callable[[str], bool] | None = None,
        mapped: sig.TransportAddress | None = None,
        socket_factory: Callable[[], socket.socket] | None = None,
        socket6_factory: Callable[[], socket.socket] | None = None,
        birthday_rate: float = ladder.BIRTHDAY_RATE,
        portmap: bool | Callable[[int], PortMapper] = False,
        tcp_factory: Callable[[], socket.socket] | None = None,
        turn: TurnFactory | None = None,
        stun: Address | None = None,
        auto_turn: bool = True,
    ) -> None:
        self.url = url
        self.name = name
        self.bind = bind
        #: The IPv6 socket: an address binds there, None/False opens none, True
        #: follows ``bind``: ``::`` beside ``0.0.0.0``, ``::1`` beside a
        #: loopback address, none beside another specific address or when
        #: ``socket_factory`` makes the IPv4 socket (e.g. in a lab namespace).
        self.bind6: Address | None = None
        if bind6 is True:
            bind_ip = ipaddress.ip_address(bind[0])
            if socket_factory is None and bind_ip.is_unspecified:
                self.bind6 = ("::", 0)
            elif socket_factory is None and bind_ip.is_loopback:
                self.bind6 = ("::1", 0)
        elif bind6:
            self.bind6 = bind6
        if relay not in ("allow", "force", "never"):
            raise ValueError("relay must be 'allow', 'force' or 'never'")
        #: EOS-style relay control (reference §3.2): "allow" tries every direct
        #: step first, "force" uses only the relay, "never" never relays.
        self.relay_mode = relay
        self.accept_join = accept_join or (lambda peer: True)
        #: A port mapping held for the peer socket (see crossroads.client.portmap).
        self.mapped = mapped
        self._socket_factory = socket_factory
        #: Makes the IPv6 socket, bound (e.g. in a lab namespace); beats bind6.
        self._socket6_factory = socket6_factory
        #: Makes the signalling TCP socket (e.g. inside a lab namespace).
        self._tcp_factory = tcp_factory
        #: Allocates a TURN relay for the relay step (tried before the
        #: WebSocket relay); None: no TURN.
        self._turn_factory = turn
        #: Credentials the server handed out (None: none, or the
        #: application's own factory is used).
        self._turn_info: sig.TurnInfo | None = None
        self._turn_learned = 0.0
        self._turn_refresh_sent = False
        #: Use the TURN credentials of ``welcome`` when no factory is given.
        self._auto_turn = auto_turn
        self.turn: TurnRelay | None = None
        #: The allocation being made after credentials arrived unasked (a
        #: host's first joiner); the next punch waits for it.
        self._turn_opening: asyncio.Task[None] | None = None
        #: An RFC 5780 STUN server (two addresses) for NAT type detection.
        self._stun = stun
        #: The detected NAT type (RFC 5780 + RakNet's names), if ``stun`` given.
        self.nat: NatReport | None = None
        self._turn_transport: _TurnTransport | None = None
        self.birthday_rate = birthday_rate
        #: Ask the gateway for a port mapping (PCP, NAT-PMP, UPnP) at start.
        self.portmap = portmap
        self.portmapper: PortMapper | None = None
        self._key = X25519PrivateKey.generate()
        self.public_key = self._key.public_key().public_bytes_raw()
        self.socket = PeerSocket()
        self.signalling = SignallingClient(url, self._on_message, self.relay_in)
        self.peer_id = ""
        self.public: Address | None = None
        self.mapping = "unknown"
        self.links: dict[str, PeerLink] = {}
        self.session = ""
        self.code = ""
        self.members: dict[str, sig.Member] = {}
        self.events: asyncio.Queue[Event] = asyncio.Queue(maxsize=1000)
        self._subscribers: list[asyncio.Queue[Event]] = []
        self._data: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue(maxsize=10_000)
        self._connecting: dict[str, asyncio.Future[ConnectResult]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._rendezvous: list[Address] = []
        self._relay = _RelayTransport(self)
        #: Relayed datagrams waiting for the WebSocket (bounded: 256 x ~1.4 KB).
        self._relay_queue: asyncio.Queue[bytes] = asyncio.Queue(maxsize=256)
        self._relay_writer: asyncio.Task[None] | None = None
        self._keepalive: asyncio.Task[None] | None = None
        self._closed = False

    # ----------------------------------------------------------------- life

    async def start(self, timeout: float = 10.0) -> None:
        """Open the peer socket, connect to the server, learn our public endpoint."""
        if self._socket_factory is not None:
            await self.socket.open(sock=self._socket_factory())
        else:
            await self.socket.open(*self.bind)
        if self._socket6_factory is not None:
            await self.socket.open_v6(sock=self._socket6_factory())
        elif self.bind6 is not None and not await self.socket.open_v6(*self.bind6):
            log.info("no IPv6 socket on %s: IPv4 only", self.bind6)
        if self.portmap and self.mapped is None:
            port = self.socket.local[1]
            self.portmapper = (
                self.portmap(port) if callable(self.portmap) else PortMapper(port)
            )
            mapping = await self.portmapper.start()
            if mapping is not None:
                self.mapped = sig.TransportAddress(
                    mapping.external_ip, mapping.external_port
                )
        welcome = await self._hello(timeout)
        # NAT detection and the TURN allocation open flows of their own; on a
        # sequential NAT each takes a port, so they go before the rendezvous
        # probes, whose ports are then the latest (port prediction needs that).
        # Credentials from the server come only with a session (hosted,
        # join_start); a server that still puts them in welcome is honoured.
        if welcome.turn is not None:
            self._learn_turn(welcome.turn)
        if self._stun is not None:
            try:
                self.nat = await detect_nat(self._stun)
            except Exception as exc:  # noqa: BLE001 - detection is informational
                log.warning("NAT type detection failed: %r", exc)
        await self._open_turn()
        await self._probe(0)
        self._keepalive = asyncio.create_task(self._keepalive_loop())

    def _learn_turn(self, info: sig.TurnInfo) -> None:
        """Use credentials the server handed out (unless the application gave
        its own TURN factory): the next allocation is made with them."""
        if not self._auto_turn or (
            self._turn_factory is not None and self._turn_info is None
        ):
            return
        if importlib.util.find_spec("crossroads.client.turn") is None:
            return
        self._turn_info = info
        self._turn_learned = time.time()
        self._turn_factory = welcome_factory(info, self._server_ip)

    async def _open_turn(self) -> None:
        """Allocate the TURN relay once a factory is known (idempotent)."""
        if (
            self.turn is not None
            or self._turn_factory is None
            or self.relay_mode == "never"
        ):
            return
        try:
            self.turn = await self._turn_factory()
        except Exception as exc:  # noqa: BLE001 - TURN is optional
            log.warning("no TURN allocation: %r", exc)
            return
        transport = _TurnTransport(self.turn)
        self._turn_transport = transport
        self.turn.set_receiver(
            lambda data, peer: self.socket.deliver(data, peer, transport)
        )

    def _refresh_turn_credentials(self) -> None:
        """Ask for fresh TURN credentials shortly before the server's expire
        (only a session member gets them), so that an allocation made later —
        after a TURN error or a redirect — is made with valid ones."""
        info = self._turn_info
        if info is None or not self.session or self._turn_refresh_sent:
            return
        # Half the credentials' life for short ones, else TURN_REFRESH_MARGIN.
        margin = min(TURN_REFRESH_MARGIN, (info.expires - self._turn_learned) / 2)
        if info.expires - time.time() > margin:
            return
        self._turn_refresh_sent = True
        self._spawn(self.signalling.send(sig.TurnRefresh()))

    async def _hello(self, timeout: float) -> sig.Welcome:
        """Open the signalling WebSocket to :attr:`url`; learn our peer id and
        the rendezvous ports of that server instance."""
        tcp = self._tcp_factory() if self._tcp_factory is not None else None
        welcome = await self.signalling.connect(
            self.public_key, self.name, timeout, sock=tcp
        )
        self.peer_id = welcome.peer
        server_host = urlparse(self.url).hostname or "127.0.0.1"
        try:
            server_ip = socket.getaddrinfo(server_host, None, socket.AF_INET)[0][4][0]
        except OSError:
            server_ip = server_host
        self._rendezvous = []
        for endpoint in welcome.udp:
            host = endpoint.host
            if ipaddress.ip_address(host).is_unspecified:
                host = str(server_ip)
            self._rendezvous.append((host, endpoint.port))
        self._server_ip = str(server_ip)
        return welcome

    async def _move(self, url: str, timeout: float = 10.0) -> None:
        """Follow a ``redirect``: the session lives on another server instance.
        Only a peer outside any session moves (its links and membership belong
        to the instance it is on); the peer socket, port mapping and TURN
        allocation stay, the peer id and rendezvous observations are renewed."""
        if self.session or self.links:
            raise JoinRejected(
                f"that session is on another server ({url}): leave this one first"
            )
        log.info("session is on %s: reconnecting there", url)
        await self.signalling.close()
        self.url = url
        self.signalling = SignallingClient(url, self._on_message, self.relay_in)
        await self._hello(timeout)
        self.socket.restart_flow_count()
        await self._probe(0)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for link in list(self.links.values()):
            link.send(b"", Kind.CLOSE)
            link.closed = True
        if self._keepalive is not None:
            self._keepalive.cancel()
        if self._relay_writer is not None:
            self._relay_writer.cancel()
        for task in list(self._tasks):
            task.cancel()
        await self.signalling.close()
        if self.turn is not None:
            with contextlib.suppress(Exception):
                await self.turn.close()
        if self.portmapper is not None:
            await self.portmapper.close()
        self.socket.close()

    async def __aenter__(self) -> P2PClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -------------------------------------------------------------- sessions

    @property
    def host_peer(self) -> str:
        """The session host: the present member with the lowest seniority."""
        if not self.members:
            return ""
        return min(self.members.values(), key=lambda m: m.seniority).peer

    @property
    def is_host(self) -> bool:
        return self.host_peer == self.peer_id

    async def host(self, max_members: int = sig.MAX_MEMBERS) -> str:
        """Create a session; returns its invite code."""
        hosted = await self.signalling.request(
            sig.Host(max_members), lambda m: isinstance(m, sig.Hosted)
        )
        assert isinstance(hosted, sig.Hosted)
        self.session, self.code = hosted.session, hosted.code
        self.members = {self.peer_id: sig.Member(self.peer_id, self.public_key, 0)}
        if hosted.turn is not None:
            self._learn_turn(hosted.turn)
            await self._open_turn()
        return hosted.code

    async def join(self, code: str, timeout: float = JOIN_TIMEOUT) -> None:
        """Join the session behind ``code``: connect to every member, then wait
        for the host's acceptance. Raises :class:`JoinRejected`."""
        for _ in range(MAX_REDIRECTS + 1):
            answer = await self.signalling.request(
                sig.Join(code),
                lambda m: isinstance(m, sig.JoinStart | sig.Redirect),
                ref="join",
            )
            if not isinstance(answer, sig.Redirect):
                break
            await self._move(answer.url)
        else:
            raise JoinRejected(f"more than {MAX_REDIRECTS} redirects")
        deadline = time.monotonic() + timeout
        while True:
            assert isinstance(answer, sig.JoinStart)
            session = answer.session
            if answer.turn is not None:
                # Before connecting: the relay step offers the relayed address.
                self._learn_turn(answer.turn)
                await self._open_turn()
            connected: list[str] = []
            failed: list[str] = []
            for member in answer.members:
                link = self.links.get(member.peer)
                if link is None or link.closed:
                    result = await self.connect(member.peer)
                    if not result.ok:
                        failed.append(member.peer)
                        break
                connected.append(member.peer)
            future = self.signalling.expect(
                lambda m, s=session: (  # type: ignore[misc]
                    isinstance(m, sig.JoinAccepted | sig.JoinRejected | sig.JoinStart)
                    and m.session == s
                )
            )
            await self.signalling.send(
                sig.JoinResult(session, tuple(connected), tuple(failed))
            )
            try:
                answer = await asyncio.wait_for(
                    future, max(1.0, deadline - time.monotonic())
                )
            except TimeoutError:
                raise JoinRejected("join timed out") from None
            if isinstance(answer, sig.JoinRejected):
                raise JoinRejected(answer.reason)
            if isinstance(answer, sig.JoinAccepted):
                self.session = answer.session
                self.code = Coordinator.normalize_code(code)
                self.members = {m.peer: m for m in answer.members}
                return

    async def leave(self) -> None:
        if self.session:
            await self.signalling.send(sig.Leave(self.session))
            self.session = ""
            self.members = {}

    async def connect(
        self, peer: str, timeout: float = CONNECT_TIMEOUT
    ) -> ConnectResult:
        """Run the connection ladder to ``peer`` (through the coordinator)."""
        future: asyncio.Future[ConnectResult] = (
            asyncio.get_running_loop().create_future()
        )
        self._connecting[peer] = future
        await self.signalling.send(sig.Connect(peer))
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            return ConnectResult(peer, False, reason="timeout")
        finally:
            if self._connecting.get(peer) is future:
                del self._connecting[peer]

    # ------------------------------------------------------------------ data

    def send(self, peer: str, data: bytes) -> bool:
        """Send one datagram to ``peer`` (unreliable, like UDP). False if no link."""
        link = self.links.get(peer)
        if link is None or link.closed:
            return False
        link.send(data)
        return True

    def broadcast(self, data: bytes) -> int:
        """Send to every linked member; returns how many links it went to."""
        return sum(
            self.send(peer, data) for peer in list(self.links) if peer in self.members
        )

    async def recv(self) -> tuple[str, bytes]:
        """The next datagram from any peer: (peer id, payload)."""
        return await self._data.get()

    async def signal(self, peer: str, data: object) -> None:
        """Send JSON data to a member through the signalling server."""
        await self.signalling.send(sig.Signal(peer, data))

    def _incoming(self, peer: str, data: bytes) -> None:
        with contextlib.suppress(asyncio.QueueFull):
            self._data.put_nowait((peer, data))

    def subscribe(self) -> asyncio.Queue[Event]:
        """A private queue that receives every event from now on (besides
        :attr:`events`), for helpers such as listing advertisement."""
        queue: asyncio.Queue[Event] = asyncio.Queue(maxsize=1000)
        self._subscribers.append(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[Event]) -> None:
        with contextlib.suppress(ValueError):
            self._subscribers.remove(queue)

    def _emit(self, event: Event) -> None:
        for queue in (self.events, *self._subscribers):
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(event)

    # ------------------------------------------------------------ signalling

    def _spawn(self, coro: object) -> None:
        task = asyncio.ensure_future(coro)  # type: ignore[call-overload]
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("p2p task failed", exc_info=task.exception())

    def _on_message(self, message: sig.Message) -> None:
        match message:
            case sig.PunchPrepare(attempt=attempt):
                self._spawn(self._prepare(attempt))
            case sig.PunchStart():
                self._spawn(self._run_ladder(message))
            case sig.PunchFailed(peer=peer, reason=reason):
                future = self._connecting.get(peer)
                if future is not None and not future.done():
                    future.set_result(ConnectResult(peer, False, reason=reason))
            case sig.Turn(turn=turn):
                self._learn_turn(turn)
                self._turn_refresh_sent = False
                if self.turn is None and self._turn_opening is None:
                    # A host gets credentials only when its first joiner
                    # arrives (docs/p2p-protocol.md §7): allocate now, so the
                    # joiner's punch can offer the relayed address.
                    opening = asyncio.create_task(self._open_turn())
                    self._turn_opening = opening
                    self._tasks.add(opening)
                    opening.add_done_callback(self._task_done)
                renew = getattr(self.turn, "renew", None)
                if self._turn_info is turn and callable(renew):
                    # The allocation's own credentials are about to expire
                    # (TURN_REFRESH_MARGIN): its refreshes go on with these.
                    renew(turn.username, turn.password)
            case sig.JoinCapable(session=session, peer=peer):
                accept = bool(self.accept_join(peer))
                self._spawn(
                    self.signalling.send(
                        sig.JoinAnswer(
                            session, peer, accept, "" if accept else "refused"
                        )
                    )
                )
            case sig.MemberJoined(session=session, member=member):
                if session == self.session:
                    self.members[member.peer] = member
                    self._emit(MemberJoined(member.peer))
            case sig.MemberLeft(session=session, peer=peer):
                if session == self.session and peer in self.members:
                    old = self.host_peer
                    del self.members[peer]
                    link = self.links.get(peer)
                    if link is not None:
                        self._link_closed(link, "left the session")
                    self._emit(MemberLeft(peer))
                    if self.host_peer != old:
                        self._emit(HostChanged(old, self.host_peer))
            case sig.SignalFrom(sender=sender, data=data):
                self._emit(SignalReceived(sender, data))
            case sig.Error(code=code, message=text):
                log.warning("signalling error %s: %s", code, text)
            case _:
                pass

    def _candidates(self) -> sig.Candidates:
        if self.relay_mode == "force":
            # Relay only: peers learn no address of ours (no host candidates;
            # no rendezvous either, so the server has no public one to pass on).
            return sig.Candidates(
                relay=sig.TransportAddress(*self.turn.relayed) if self.turn else None,
                nat=self.mapping,
            )
        local = []
        port = self.socket.local[1]
        bound = self.socket.local[0]
        ip = bound if not ipaddress.ip_address(bound).is_unspecified else None
        ip = ip or _local_ip_towards(self._server_ip)
        if ip is not None:
            local.append(sig.TransportAddress(ip, port))
        if self.socket.v6 is not None:
            bound6, port6 = self.socket.v6.local
            ip6 = _ipv6_host_address(bound6)
            if ip6 is not None:
                local.insert(0, sig.TransportAddress(ip6, port6))  # IPv6 first, as ICE
        return sig.Candidates(
            local=tuple(local),
            mapped=self.mapped,
            relay=sig.TransportAddress(*self.turn.relayed) if self.turn else None,
            nat=self.nat.name if self.nat is not None else self.mapping,
            flows=self.socket.flows(self._rendezvous),
        )

    async def _probe(self, attempt: int) -> None:
        if self.relay_mode == "force":
            return  # see _candidates: the server must not learn our endpoint
        welcome = self.signalling.welcome
        assert welcome is not None
        observed = await self.socket.rendezvous(
            self._rendezvous, bytes.fromhex(welcome.token), attempt
        )
        if observed[0] is not None:
            self.public = (observed[0].host, observed[0].port)
        ports = tuple(o.port for o in observed if o is not None)
        if len(ports) == 3:
            from crossroads.proto.punch.rendezvous import classify_mapping

            self.mapping = classify_mapping(ports)[0]

    async def _prepare(self, attempt: int) -> None:
        opening = self._turn_opening
        if opening is not None and not opening.done():
            # Candidates name the relayed address: wait for the allocation.
            with contextlib.suppress(Exception):
                await asyncio.shield(opening)
        await self._probe(attempt)
        await self.signalling.send(sig.PunchReady(attempt, self._candidates()))

    async def _run_ladder(self, start: sig.PunchStart) -> None:
        loop = asyncio.get_running_loop()
        t_go = loop.time() + start.delay_ms / 1000
        if start.role == "initiator":
            initiator, responder = start.you, start.them
        else:
            initiator, responder = start.them, start.you
        try:
            keys = derive_keys(self._key, start.key, start.attempt.to_bytes(4, "big"))
        except DecodeError as exc:
            log.warning("bad key from %s: %s", start.peer, exc)
            await self.signalling.send(sig.PunchResult(start.attempt, False))
            return
        channel = SecureChannel(keys)
        if self.relay_mode == "force":
            plan = ladder.Plan()
        else:
            plan = ladder.plan(
                initiator,
                responder,
                own_role=start.role,
                randbelow=secrets.randbelow,
                birthday_rate=self.birthday_rate,
            )
        extra: list[_UdpTransport] = []
        if plan.sockets(start.role):
            extra = await self.socket.open_extra(
                plan.sockets(start.role), self._socket_factory
            )
        theirs = start.them
        relays = await self._relay_paths(start.peer, theirs)
        run = LadderRun(
            self.socket,
            channel,
            plan,
            start.role,
            extra,
            relays,
            udp=self.relay_mode != "force",
        )
        self.socket.route(keys.recv_id, run.receive)
        run.start(t_go)
        try:
            result: LadderResult = await run.result
        finally:
            run.stop()
        keep = result.via if result.ok else None
        for transport in extra:
            if transport is not keep:
                transport.close()
        if not result.ok or result.via is None or result.addr is None:
            self.socket.unroute(keys.recv_id, run.receive)
            await self.signalling.send(sig.PunchResult(start.attempt, False))
            self._resolve(ConnectResult(start.peer, False, reason="no path"))
            return
        step = result.step or "punch"
        old = self.links.get(start.peer)
        if old is not None:
            self.socket.unroute(old.channel.keys.recv_id)
            old.closed = True
        link = PeerLink(
            start.peer,
            channel,
            result.via,
            result.addr,
            step,
            result.seconds,
            self,
            sprayed=run.sprayed,
        )
        self.links[start.peer] = link
        self.socket.route(keys.recv_id, link.receive)
        # Tell the other side which step won (ends its ladder if it has not seen
        # an acknowledgement yet).
        link.send(step.encode(), Kind.KEEPALIVE)
        ms = min(600_000, round(result.seconds * 1000))
        await self.signalling.send(sig.PunchResult(start.attempt, True, step, ms))
        if result.first_data is not None:
            self._incoming(start.peer, result.first_data)
        self._emit(LinkUp(start.peer, step, result.seconds))
        self._resolve(ConnectResult(start.peer, True, step, result.seconds))

    async def _relay_paths(self, peer: str, them: sig.PeerInfo) -> list[RelayPath]:
        """The relay step's paths, best first: TURN (UDP, no head-of-line
        blocking), then the WebSocket relay a second later."""
        if self.relay_mode == "never":
            return []
        paths: list[RelayPath] = []
        their_relay = them.candidates.relay
        force = self.relay_mode == "force"
        if self.turn is not None and self._turn_transport is not None:
            hosts = {e.host for e in (their_relay, them.public) if e is not None}
            if force and their_relay is not None:
                hosts = {their_relay.host}
            with contextlib.suppress(Exception):
                await self.turn.permit(*sorted(hosts))
            if their_relay is not None:
                paths.append(RelayPath(self._turn_transport, their_relay.address()))
            if them.public is not None and not force:
                paths.append(RelayPath(self._turn_transport, them.public.address()))
        if their_relay is not None and not force and self.socket.main is not None:
            # Our UDP to their relayed address (their TURN server relays it).
            paths.append(RelayPath(self.socket.main, their_relay.address()))
        offset = TURN_HEAD_START if paths else 0.0
        paths.append(RelayPath(self._relay, (f"relay:{peer}", 0), offset))
        return paths

    def _resolve(self, result: ConnectResult) -> None:
        future = self._connecting.get(result.peer)
        if future is not None and not future.done():
            future.set_result(result)

    # ----------------------------------------------------------------- relay

    def _relay_out(self, peer: str, datagram: bytes) -> None:
        frame = bytes([RELAY_FRAME]) + bytes.fromhex(peer) + datagram
        try:
            self._relay_queue.put_nowait(frame)
        except asyncio.QueueFull:
            return  # a datagram path may drop, like a full UDP socket buffer
        if self._relay_writer is None or self._relay_writer.done():
            self._relay_writer = asyncio.create_task(self._relay_write())

    async def _relay_write(self) -> None:
        """One writer drains the relay queue in order (no task per datagram)."""
        signalling = self.signalling
        while not self._relay_queue.empty() and signalling.connected:
            frame = self._relay_queue.get_nowait()
            try:
                await signalling.send_frame(frame)
            except Exception:  # noqa: BLE001 - the signalling connection is gone
                return

    def relay_in(self, frame: bytes) -> None:
        """A binary frame from the server: a relayed datagram."""
        if len(frame) < 10 or frame[0] != RELAY_FRAME:
            return
        peer = frame[1:9].hex()
        self.socket.deliver(frame[9:], (f"relay:{peer}", 0), self._relay)

    # ------------------------------------------------------------- liveness

    def _link_closed(self, link: PeerLink, reason: str) -> None:
        if link.closed and self.links.get(link.peer) is not link:
            return
        link.closed = True
        self.socket.unroute(link.channel.keys.recv_id)
        if self.links.get(link.peer) is link:
            del self.links[link.peer]
            self._emit(LinkDown(link.peer, reason))

    async def _keepalive_loop(self) -> None:
        while True:
            await asyncio.sleep(KEEPALIVE_INTERVAL / 2)
            self._refresh_turn_credentials()
            now = time.monotonic()
            for link in list(self.links.values()):
                if now - link.last_heard > LINK_TIMEOUT:
                    self._link_closed(link, "timeout")
                elif (
                    link.peer not in self.members
                    and now - link.created > STRANGER_TIMEOUT
                ):
                    self._link_closed(link, "not a member")
                elif now - link.last_sent >= KEEPALIVE_INTERVAL:
                    link.send(b"", Kind.KEEPALIVE)
