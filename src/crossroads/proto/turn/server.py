"""The TURN server core (RFC 8656, RFC 6062), sans-I/O.

Theory of operation
-------------------
The core has the core API of a core on several sockets
(:class:`~crossroads.proto.core.MultiSocketCore`), a socket being named by the
server's side of the 5-tuple, a :data:`~crossroads.proto.turn.allocation.Listener`
``(transport, server address)``. The transport hands each non-Binding STUN
message from a client, raw, to :meth:`TurnServer.receive_datagram` with the
client's address, ``now`` and that listener; the core decodes it (codec:
:mod:`crossroads.proto.stun`; integrity is checked on the raw bytes) and queues
its answer, if any, for :meth:`TurnServer.datagrams_to_send` as
``(bytes, client, listener)``, with whatever else goes to a client (a
ConnectionAttempt indication, a late Connect response). Side effects the
transport must carry out are queued as *events* (:meth:`TurnServer.pop_events`):
an allocation appeared or went away (update the data-plane routes), connect to
a peer, pipe or close a TCP connection.

Relay sockets are opened through the injected :class:`RelayBinder` — the one
synchronous call into the I/O layer, because whether a port can be bound is only
known by trying. Everything else the core owns: the allocation table keyed by
5-tuple, per-user, per-client-IP and total quotas, the port allocator, the nonce
minter, the peer policy, the memory of deleted allocations (an Allocate replayed
after Refresh 0 gets 437, not a new allocation), and one heap of deadlines
(``get_timer`` / ``handle_timer``). Deleting an allocation cancels its deadlines,
so nothing of it stays referenced.

Peers (:meth:`TurnServer.peer_verdict`): the shared
:class:`~crossroads.proto.policy.AddressPolicy` refuses internal ranges and the
server's own addresses, with two TURN rules on top. The relayed transport address
of a live allocation is always a valid peer: two clients both forced to relay
(WebRTC ``iceTransportPolicy: "relay"``) talk through each other's relayed
addresses, which on a server with a private address are private -- coturn allows
the same, and RFC 8656 §9 only asks the server to refuse what its policy
forbids. And a peer on one of the server's own addresses (allowed explicitly,
e.g. ``--allow-loopback-peers``) is still refused on a port this process listens
on (``own_ports``), so no client reaches the server's HTTP API or its STUN, relay
or natneg sockets through the relay. Because a permission covers an IP and not a
port (RFC 8656 §9), Send indications to such an IP are checked per datagram
(:meth:`TurnServer.self_peer_refused`); channels are checked when bound.

Per-packet forwarding (ChannelData, Send and Data indications) does not come
here: the transport reads the forwarding tables kept in :mod:`.allocation`.
Only Send indications the fast parser cannot take go through
:meth:`TurnServer.send_route` (the slow path, which counts each drop); one
given to :meth:`TurnServer.receive_datagram` is counted and dropped.

Request processing order (RFC 8656 §6-§12, RFC 8489 §9.2.4): class and method;
authentication (401 / 400 / 438 / 401, each unauthenticated answer rate-limited
per source IP and, over UDP, sent only within the source's reflection budget,
:mod:`crossroads.proto.reflection`; the one exception to 438 is a correctly signed
Refresh with LIFETIME 0 whose nonce is ours but stale, see
:meth:`TurnServer._authenticate`); unknown comprehension-required attributes
(420); then the method.
Every answer after successful authentication carries MESSAGE-INTEGRITY (or
MESSAGE-INTEGRITY-SHA256, whichever the request used), and FINGERPRINT when the
request had one.
"""

from __future__ import annotations

import hashlib
import ipaddress
import struct
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Protocol, cast

from crossroads.errors import DecodeError, LocalProtocolError
from crossroads.proto.admission import (
    REFUSED_OVER_IP_LIMIT,
    UNBOUNDED,
    Admitter,
    LocalTable,
)
from crossroads.proto.core import EventQueue, Outbox, SocketDatagram
from crossroads.proto.counting import decrement
from crossroads.proto.policy import AddressPolicy, Verdict
from crossroads.proto.reflection import DROP_REFLECTION, ReflectionBudget
from crossroads.proto.stun import (
    AdditionalAddressFamily,
    AddressErrorCode,
    AlternateServer,
    Attribute,
    ChannelNumber,
    Class,
    ConnectionId,
    Data,
    DontFragment,
    ErrorCodeAttribute,
    EvenPort,
    Fingerprint,
    Lifetime,
    Message,
    MessageIntegrity,
    MessageIntegritySha256,
    Method,
    Nonce,
    PasswordAlgorithm,
    PasswordAlgorithmId,
    PasswordAlgorithms,
    Realm,
    RequestedAddressFamily,
    RequestedTransport,
    ReservationToken,
    UnknownAttribute,
    UnknownAttributes,
    Userhash,
    Username,
    XorMappedAddress,
    XorPeerAddress,
    XorRelayedAddress,
    check_message_integrity,
    check_message_integrity_sha256,
    decode,
    encode,
    error_response,
    indication,
    long_term_key,
    success_response,
)
from crossroads.proto.turn.allocation import (
    Allocation,
    Channel,
    Deadlines,
    FiveTuple,
    Kind,
    Listener,
    Permission,
    RelayPort,
    Schedule,
    TimerHandle,
)
from crossroads.proto.turn.auth import (
    Credentials,
    Lookup,
    NonceCheck,
    NonceMinter,
    parse_rest_username,
)
from crossroads.proto.turn.constants import (
    CHANNEL_MAX_RFC5766,
    CHANNEL_MIN,
    CONNECT_TIMEOUT,
    CONNECTION_BIND_TIMEOUT,
    DEFAULT_ALLOCATION_LIFETIME,
    DEFAULT_MAX_ALLOCATION_LIFETIME,
    REASONS,
    Family,
    Transport,
    TurnError,
)
from crossroads.proto.turn.fastpath import (
    data_indication,
    parse_send_indication,
    xor_peer_address,
)
from crossroads.proto.turn.ports import PortAllocator, Reservation
from crossroads.proto.turn.ratelimit import TokenBuckets
from crossroads.types import Address, frozen

#: Distinct peer IPs on this host that may hold permissions. Only reachable with
#: an explicit opt-in (``--allow-loopback-peers`` or an allowed range covering
#: the host) or through relayed addresses, so a handful in practice; the bound
#: keeps 127.0.0.0/8 from growing the set without limit.
MAX_SELF_PEERS = 4096

#: ChannelData header: channel number, length (RFC 8656 §12.4).
_CHANNEL_HEADER = struct.Struct("!HH").pack
#: Padding after a ChannelData payload of length n over TCP: PAD[n & 3]
#: (RFC 8656 §12.5).
PAD = (b"", b"\x00\x00\x00", b"\x00\x00", b"\x00")
#: XOR-PEER-ADDRESS attributes of IPv4 peers kept for Data indications (the
#: attribute does not depend on the transaction id of an IPv4 peer); the
#: cache starts again past this many.
MAX_PEER_ATTRIBUTES = 1024

#: The algorithms offered in PASSWORD-ALGORITHMS, in preference order
#: (RFC 8489 §14.11; SHA-256 first, MD5 for RFC 5389 clients).
OFFERED_ALGORITHMS: tuple[tuple[int, bytes], ...] = (
    (PasswordAlgorithmId.SHA256, b""),
    (PasswordAlgorithmId.MD5, b""),
)


# ------------------------------------------------------------------ settings


@frozen
class TurnSettings:
    """Policy knobs of the core (built from the service configuration)."""

    realm: str = "crossroads"
    #: Upper bound on allocation lifetime (RFC 8656 §7.2 lets the server cap it).
    max_lifetime: float = DEFAULT_MAX_ALLOCATION_LIFETIME
    #: Allocations per user (0 = no limit); 486 beyond (RFC 8656 §7.2).
    user_quota: int = 0
    #: Allocations in this process (0 = no limit); 486, or 300 to an alternate.
    total_quota: int = 0
    #: Allocations per client source, an IPv4 address or IPv6 /64 (0 = no
    #: limit); 486 beyond. Stops one host with one credential (or many) from
    #: taking every relay port.
    ip_quota: int = 0
    #: Permissions per allocation; 508 beyond. Bounds per-allocation state.
    max_permissions: int = 1024
    #: RFC 6062 peer connections per allocation; 508 beyond.
    max_connections: int = 64
    #: Highest channel number accepted (0x4FFF per RFC 8656, 0x7FFF per 5766).
    channel_max: int = CHANNEL_MAX_RFC5766
    #: Serve TURN without credentials. Off unless explicitly configured.
    allow_unauthenticated: bool = False
    #: Where to send clients when this server is full (300 + ALTERNATE-SERVER).
    alternate_servers: tuple[Address, ...] = ()
    #: Accept REQUESTED-TRANSPORT=TCP (RFC 6062).
    tcp_relay: bool = True
    #: Unauthenticated answers (401/438) per source IP: sustained rate and burst.
    #: A 401 is ~100 bytes, so 100/s caps what a spoofed victim can be sent at
    #: ~10 kB/s, while a NAT full of clients starting at once still gets in.
    unauthenticated_rate: float = 100.0
    unauthenticated_burst: float = 200.0
    #: Loopback peers for clients that are themselves on loopback (development
    #: mode, crossroads.firstrun): such a client already reaches every loopback
    #: port directly, so relaying gives it nothing new; a remote client still
    #: gets 403. The server's own listening ports stay refused either way.
    same_host_loopback_peers: bool = False


class RelayBinder(Protocol):
    """Opens relay sockets for the core (implemented by the transport)."""

    def has_relay_address(self, family: Family) -> bool:
        """Whether this server can relay in ``family`` (else 440)."""
        ...

    def open_relay(
        self,
        allocation: Allocation,
        family: Family,
        port: int,
        transport: Transport,
        dont_fragment: bool,
    ) -> RelayPort | None:
        """Bind a relay socket on ``port``; None when the port is taken."""
        ...


# ------------------------------------------------------------------ events


@frozen
class AllocationCreated:
    """A new allocation: the transport installs its data-plane routes."""

    allocation: Allocation


@frozen
class AllocationDeleted:
    """An allocation is gone (relays already closed): drop its routes."""

    allocation: Allocation
    reason: str


@frozen
class ConnectPeer:
    """RFC 6062 Connect: open a TCP connection from ``relay`` to ``peer``.

    Report the outcome with :meth:`TurnServer.peer_connected` or
    :meth:`TurnServer.peer_connect_failed`.
    """

    connection_id: int
    relay: RelayPort
    peer: Address


@frozen
class BindConnection:
    """ConnectionBind succeeded: after sending the response on ``five_tuple``, pipe
    that client data connection to the peer data connection."""

    connection_id: int
    five_tuple: FiveTuple


@frozen
class CloseConnection:
    """Close the peer data connection (and its client data connection, if any)."""

    connection_id: int


@frozen
class PeerRefused:
    """A request named a peer the policy refuses (answered 403): for the log.
    Only requests emit it, never the data path, so a flood of Send indications
    cannot queue events."""

    five_tuple: FiveTuple
    peer: Address
    verdict: Verdict


@frozen
class AuthFailed:
    """A signed request failed authentication (unknown or expired user, bad
    MESSAGE-INTEGRITY), answered with 401: for the log, never with a secret.
    The first, unsigned request of every client (the normal challenge) and a
    stale nonce (438) are not failures."""

    reason: str
    username: str
    client: Address


TurnEvent = (
    AllocationCreated
    | AllocationDeleted
    | ConnectPeer
    | BindConnection
    | CloseConnection
    | PeerRefused
    | AuthFailed
)


# ------------------------------------------------------------------ state


@frozen
class Auth:
    """Who sent an authenticated request, and how to sign the answer."""

    username: str
    quota_user: str
    #: Long-term key (None: unauthenticated mode).
    key: bytes | None = field(repr=False)
    #: The request used MESSAGE-INTEGRITY-SHA256 (answer the same way).
    sha256: bool = False
    #: Unix issue time of the request's nonce (0: unauthenticated mode).
    nonce_issued: int = 0


class ConnState(IntEnum):
    """RFC 6062 peer data connection states."""

    CONNECTING = 0  # Connect sent, TCP handshake under way
    PENDING = 1  # established, waiting for ConnectionBind
    BOUND = 2  # piped to a client data connection


@dataclass(slots=True, eq=False)
class PeerConnection:
    """An RFC 6062 peer data connection."""

    id: int
    allocation: Allocation
    peer: Address
    state: ConnState
    expires: float
    #: The Connect request waiting for the outcome (CONNECTING only).
    request: Message | None = None
    auth: Auth | None = None
    client: FiveTuple | None = None
    dead: bool = False
    timer: TimerHandle | None = None


@dataclass(slots=True, eq=False)
class Freed:
    """What is remembered of a deleted allocation: the transaction id of the
    Allocate that made it, until no nonce that could sign a replay of that
    Allocate is fresh any more."""

    five_tuple: FiveTuple
    transaction_id: bytes
    timer: TimerHandle | None = None


#: Deleted allocations remembered at once (oldest forgotten first): bounds the
#: replay table under an allocate/free flood (~200 bytes each, so ~13 MB at most).
MAX_FREED = 65536


@dataclass(slots=True)
class Counters:
    """Plain counters the metrics layer reads (no Prometheus in the core)."""

    #: (method name, response code or 0 for success) -> count.
    responses: dict[tuple[str, int], int] = field(default_factory=dict)
    #: Drop reason -> count.
    drops: dict[str, int] = field(default_factory=dict)
    allocations_created: int = 0
    #: Deletion reason -> count.
    allocations_deleted: dict[str, int] = field(default_factory=dict)
    #: Refresh(LIFETIME=0) honoured although its nonce was stale (see
    #: :meth:`TurnServer._authenticate`).
    stale_nonce_releases: int = 0
    #: Allocations taken over by a later time-limited username of their user.
    credential_renewals: int = 0

    def drop(self, reason: str) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + 1

    def response(self, method: str, code: int) -> None:
        key = (method, int(code))
        self.responses[key] = self.responses.get(key, 0) + 1


def _method_name(method: int) -> str:
    try:
        return Method(method).name.lower()
    except ValueError:
        return "unknown"


class _Reject(Exception):
    """Internal: abort a request with an error code."""

    def __init__(self, code: int, attributes: tuple[Attribute, ...] = ()) -> None:
        super().__init__(code)
        self.code = code
        self.attributes = attributes


# ------------------------------------------------------------------ core


class TurnServer(Outbox[SocketDatagram[Listener]], EventQueue[TurnEvent]):
    """The TURN control plane. See the module docstring."""

    def __init__(
        self,
        settings: TurnSettings,
        credentials: Credentials,
        nonces: NonceMinter,
        policy: AddressPolicy,
        ports: PortAllocator,
        binder: RelayBinder,
        own_ports: Callable[[], Collection[int]] = frozenset,
        reflection: ReflectionBudget | None = None,
        admission: Admitter | None = None,
    ) -> None:
        super().__init__()
        self.settings = settings
        #: Admits allocations per client source and in total: the resource
        #: budget's allocation table, which derives its caps from the
        #: descriptors and memory an allocation costs; without one, a
        #: :class:`LocalTable` of the settings' ``total_quota`` and
        #: ``ip_quota`` (0: no cap).
        self.admission: Admitter = admission or LocalTable(
            settings.total_quota or UNBOUNDED, settings.ip_quota or UNBOUNDED
        )
        #: Unauthenticated answers over UDP per source IP (docs/security.md,
        #: "Reflection budget"); None: no budget.
        self.reflection = ReflectionBudget.or_unlimited(reflection)
        self.credentials = credentials
        self.nonces = nonces
        self.policy = policy
        self.ports = ports
        self.binder = binder
        #: Ports this process listens on (the transport's hook: read from the
        #: OS, so ``port 0`` listeners are known too).
        self.own_ports = own_ports
        #: Relayed transport address -> its allocation, for live allocations.
        self.relayed: dict[Address, Allocation] = {}
        #: IP of relayed addresses -> how many live ones (permissions are per IP).
        self._relayed_hosts: dict[str, int] = {}
        #: Relayed address -> the other allocations with a channel bound to
        #: it: their channels end with it (see :meth:`_orphan_peer`).
        self._channels_to_relayed: dict[Address, set[Allocation]] = {}
        #: The latest ``now`` seen (deletions outside a request or timer, such
        #: as a closed TCP connection, date a quarantine from it).
        self._now = 0.0
        #: Peer IPs on this host that hold a permission: the data path checks
        #: the port of every Send indication to them (module docstring).
        self.self_peers: set[str] = set()
        self.allocations: dict[FiveTuple, Allocation] = {}
        self.connections: dict[int, PeerConnection] = {}
        self.user_allocations: dict[str, int] = {}
        #: 5-tuple -> the deleted allocation it last had (replayed Allocate: 437).
        self._freed: dict[FiveTuple, Freed] = {}
        self.counters = Counters()
        #: Wall-clock minus ``now``: REST credentials and nonces use Unix time,
        #: timers use the monotonic ``now``. The transport keeps it current.
        self.wall_offset = 0.0
        self._deadlines = Deadlines()
        self._limiter = TokenBuckets(
            settings.unauthenticated_rate, settings.unauthenticated_burst
        )
        self._alternate_index = 0
        #: Data indications (RFC 8656 §11.3) get a fresh transaction id: 8
        #: random bytes of this core and a counter.
        self._txid_prefix = ports.entropy.token_bytes(8)
        self._txid_counter = 0
        self._peer_attributes: dict[Address, bytes] = {}
        #: Set by :meth:`drain`: new allocations are refused (300 to a peer
        #: node of the client's family, else 486); live ones go on.
        self.draining = False
        #: Where a draining server sends new allocations (its peer nodes).
        self.drain_alternates: tuple[Address, ...] = ()
        self._userhashes: dict[bytes, str] = {
            hashlib.sha256(f"{name}:{credentials.realm}".encode()).digest(): name
            for name in credentials.users
        }
        self._handlers: dict[
            int, Callable[[Message, FiveTuple, Auth, float], bytes | None]
        ] = {
            Method.ALLOCATE: self._allocate,
            Method.REFRESH: self._refresh,
            Method.CREATE_PERMISSION: self._create_permission,
            Method.CHANNEL_BIND: self._channel_bind,
            Method.CONNECT: self._connect,
            Method.CONNECTION_BIND: self._connection_bind,
        }

    # ------------------------------------------------------------ driving

    def reconfigure(self, settings: TurnSettings, credentials: Credentials) -> None:
        """New users, secrets and limits (a reload). Live allocations stay:
        they keep the key they were created with (RFC 8656 §7.2), a removed
        user just cannot refresh beyond its lifetime; quotas apply to new
        Allocates. The realm is part of every key, so it cannot change here."""
        if settings.realm != self.settings.realm or (
            credentials.realm != self.credentials.realm
        ):
            raise ValueError("the realm cannot change without a restart")
        self.settings = settings
        self.credentials = credentials

    def _to_client(self, five: FiveTuple, data: bytes) -> None:
        self._outbox.append((data, five[1], (five[0], five[2])))

    def get_timer(self) -> float | None:
        """The next deadline, or None."""
        return self._deadlines.next_deadline()

    def handle_timer(self, now: float) -> None:
        """Expire whatever is due at ``now``."""
        self._now = now
        schedule = self._deadlines.schedule
        for _deadline, kind, subject in self._deadlines.pop_due(now):
            match kind:
                case Kind.ALLOCATION:
                    assert isinstance(subject, Allocation)
                    if not _not_due(subject, now, schedule, kind, subject):
                        self.delete_allocation(subject, "expired", now)
                case Kind.PERMISSION:
                    allocation, permission = cast(
                        tuple[Allocation, Permission], subject
                    )
                    if allocation.dead:
                        continue
                    if not _not_due(permission, now, schedule, kind, subject):
                        allocation.expire_permission(permission)
                case Kind.CHANNEL | Kind.QUARANTINE:
                    allocation, channel = cast(tuple[Allocation, Channel], subject)
                    if allocation.dead:
                        continue
                    again = Kind.CHANNEL if channel.active else Kind.QUARANTINE
                    if _not_due(channel, now, schedule, again, subject):
                        continue
                    if channel.active:
                        allocation.expire_channel(channel, now, schedule)
                    else:
                        allocation.forget_channel(channel)
                case Kind.RESERVATION:
                    assert isinstance(subject, Reservation)
                    self.ports.expire(subject)
                case Kind.CONNECTION:
                    assert isinstance(subject, PeerConnection)
                    if not _not_due(subject, now, schedule, kind, subject):
                        self._connection_timeout(subject)
                case Kind.FREED:
                    assert isinstance(subject, Freed)
                    if self._freed.get(subject.five_tuple) is subject:
                        del self._freed[subject.five_tuple]

    # ------------------------------------------------------------ counts

    @property
    def permission_count(self) -> int:
        return sum(len(a.permissions) for a in self.allocations.values())

    @property
    def channel_count(self) -> int:
        return sum(a.active_channels for a in self.allocations.values())

    # ------------------------------------------------------------ messages

    def receive_datagram(
        self, data: bytes, addr: Address, now: float, socket: Listener
    ) -> None:
        """One STUN message (not Binding) from client ``addr`` on ``socket``.

        The answer, if any, is queued for :meth:`datagrams_to_send`. Never
        raises on bad input (what does not decode is counted, ``decode-*``).
        An answer that is not signed (400, 401, 438, or any answer with
        ``allow_unauthenticated``) goes to a source that has proved nothing:
        over UDP it is sent only within the reflection budget.
        """
        self._now = now
        try:
            msg = decode(data)
        except DecodeError as exc:
            self.counters.drop(f"decode-{exc.reason}")
            return
        five: FiveTuple = (socket[0], addr, socket[1])
        udp = five[0] == Transport.UDP
        if udp:
            self.reflection.received(addr[0], len(data), now)
        answer, signed = self._handle(msg, data, five, now)
        if answer is None:
            return
        if signed or not udp or self.reflection.allow(addr[0], len(answer), now):
            self._outbox.append((answer, addr, socket))
        else:
            self.counters.drop(DROP_REFLECTION)

    def _handle(
        self, msg: Message, raw: bytes, five: FiveTuple, now: float
    ) -> tuple[bytes | None, bool]:
        """:meth:`receive_datagram` before the reflection budget: (answer,
        signed)."""
        if msg.msg_class == Class.INDICATION:
            if msg.method == Method.SEND:
                self.counters.drop("send-slow-path-unused")
            else:
                self.counters.drop("unexpected-indication")
            return None, False
        if msg.msg_class != Class.REQUEST:
            self.counters.drop("not-a-request")
            return None, False
        handler = self._handlers.get(msg.method)
        name = _method_name(msg.method)
        if handler is None:
            self.counters.drop("unknown-method")
            return self._answer(
                msg, None, self._error(msg, TurnError.BAD_REQUEST)
            ), False
        auth = self._authenticate(msg, raw, five, now)
        if not isinstance(auth, Auth):
            return auth, False
        signed = auth.key is not None
        unknown = msg.unknown_comprehension_required()
        if unknown:
            self.counters.response(name, 420)
            return self._answer(
                msg,
                auth,
                self._error(
                    msg, TurnError.UNKNOWN_ATTRIBUTE, (UnknownAttributes(unknown),)
                ),
            ), signed
        try:
            answer = handler(msg, five, auth, now)
        except _Reject as reject:
            self.counters.response(name, reject.code)
            return self._answer(
                msg, auth, self._error(msg, reject.code, reject.attributes)
            ), signed
        except LocalProtocolError:
            # A value we cannot encode (should not happen): answer 500, never crash.
            self.counters.response(name, 500)
            return self._answer(
                msg, auth, self._error(msg, TurnError.SERVER_ERROR)
            ), signed
        if answer is not None:
            self.counters.response(name, 0)
        return answer, signed

    def send_route(
        self, data: bytes, addr: Address, socket: Listener
    ) -> tuple[RelayPort, Address, bytes] | None:
        """Slow path of a Send indication (RFC 8656 §11.2) from client ``addr``
        on ``socket``, raw: where to send what.

        None when it must be dropped (counted by reason).
        """
        try:
            msg = decode(data)
        except DecodeError as exc:
            self.counters.drop(f"decode-{exc.reason}")
            return None
        if msg.msg_class != Class.INDICATION or msg.method != Method.SEND:
            self.counters.drop("send-not-a-send-indication")
            return None
        allocation = self.allocations.get((socket[0], addr, socket[1]))
        if allocation is None:
            self.counters.drop("send-no-allocation")
            return None
        if msg.unknown_comprehension_required():
            self.counters.drop("send-unknown-attribute")
            return None
        peer = msg.get(XorPeerAddress)
        payload = msg.get(Data)
        if peer is None or payload is None:
            self.counters.drop("send-malformed")
            return None
        relay = allocation.relay_for(6 if ":" in peer.host else 4)
        if relay is None:
            self.counters.drop("send-family-mismatch")
            return None
        if peer.host not in allocation.permissions:
            self.counters.drop("send-no-permission")
            return None
        if self.self_peer_refused((peer.host, peer.port), addr[0]):
            return None
        return relay, (peer.host, peer.port), payload.value

    # ------------------------------------------------------------ answers

    def _error(
        self, msg: Message, code: int, attributes: tuple[Attribute, ...] = ()
    ) -> Message:
        return error_response(msg, code, REASONS.get(code), attributes)

    def _answer(self, request: Message, auth: Auth | None, answer: Message) -> bytes:
        fingerprint = request.get(Fingerprint) is not None
        if auth is None or auth.key is None:
            return encode(answer, fingerprint=fingerprint)
        if auth.sha256:
            return encode(
                answer, integrity_sha256_key=auth.key, fingerprint=fingerprint
            )
        return encode(answer, integrity_key=auth.key, fingerprint=fingerprint)

    def _challenge(
        self, msg: Message, code: int, five: FiveTuple, now: float
    ) -> bytes | None:
        """401 or 438 with REALM and a fresh NONCE (rate-limited per IP)."""
        client_ip = five[1][0]
        name = _method_name(msg.method)
        if not self._limiter.allow(client_ip, now):
            self.counters.drop("unauthenticated-rate-limit")
            return None
        self.counters.response(name, code)
        attributes: list[Attribute] = [
            Realm(self.credentials.realm),
            Nonce(
                self.nonces.mint(_nonce_scope(five), five[1][1], now + self.wall_offset)
            ),
        ]
        if self.nonces.offers_password_algorithms:
            attributes.append(PasswordAlgorithms(OFFERED_ALGORITHMS))
        return self._answer(msg, None, self._error(msg, code, tuple(attributes)))

    # ------------------------------------------------------------ authentication

    def _authenticate(
        self, msg: Message, raw: bytes, five: FiveTuple, now: float
    ) -> Auth | bytes | None:
        """RFC 8489 §9.2.4. Returns :class:`Auth`, or the error to send (or None)."""
        mi = msg.get(MessageIntegrity)
        mi256 = msg.get(MessageIntegritySha256)
        if mi is None and mi256 is None:
            if self.settings.allow_unauthenticated:
                return Auth("", "", None)
            return self._challenge(msg, TurnError.UNAUTHENTICATED, five, now)
        username_attr = msg.get(Username)
        userhash_attr = msg.get(Userhash)
        realm = msg.get(Realm)
        nonce = msg.get(Nonce)
        name = _method_name(msg.method)
        if (username_attr is None and userhash_attr is None) or (
            realm is None or nonce is None
        ):
            self.counters.response(name, 400)
            return self._answer(msg, None, self._error(msg, TurnError.BAD_REQUEST))
        unix_now = now + self.wall_offset
        # RFC 6062 §5.4: ConnectionBind comes on a new TCP connection, signed
        # with the nonce of the control connection (same client IP): any port.
        any_port = msg.method == Method.CONNECTION_BIND and five[0] == Transport.TCP
        verdict = self.nonces.check(
            nonce.value, _nonce_scope(five), None if any_port else five[1][1], unix_now
        )
        releasing = _is_release(msg)
        issued = self.nonces.issued(nonce.value)
        stale_release = False
        if verdict is NonceCheck.EXPIRED and releasing:
            # A closing Refresh (LIFETIME 0) with a nonce that is ours, minted
            # for this very 5-tuple, only too old. Chromium sends it once and
            # does not retry after a 438, so a 438 here would keep the ports
            # until the allocation expires. The integrity check below still
            # proves the key; the nonce must not predate the allocation (a
            # Refresh captured from an earlier allocation on the same 5-tuple
            # cannot free a newer one). Freeing is the only thing it can do.
            current = self.allocations.get(five)
            if current is not None and issued >= current.nonce_issued:
                stale_release = True
        if verdict is not NonceCheck.VALID and not stale_release:
            self.counters.drop(
                "nonce-expired" if verdict is NonceCheck.EXPIRED else "nonce-invalid"
            )
            return self._challenge(msg, TurnError.STALE_NONCE, five, now)
        algorithm = PasswordAlgorithmId.MD5
        if self.nonces.offers_password_algorithms:
            offered = msg.get(PasswordAlgorithms)
            chosen = msg.get(PasswordAlgorithm)
            if offered is not None or chosen is not None:
                # RFC 8489 §9.2.4: both or neither; the list must be the one we
                # sent (downgrade protection); the choice must be in it.
                if (
                    offered is None
                    or chosen is None
                    or offered.algorithms != OFFERED_ALGORITHMS
                    or chosen.algorithm
                    not in (PasswordAlgorithmId.MD5, PasswordAlgorithmId.SHA256)
                    or chosen.parameters
                ):
                    self.counters.response(name, 400)
                    return self._answer(
                        msg, None, self._error(msg, TurnError.BAD_REQUEST)
                    )
                algorithm = PasswordAlgorithmId(chosen.algorithm)
        if username_attr is not None:
            username = username_attr.value
        else:
            assert userhash_attr is not None
            found = self._userhashes.get(userhash_attr.value)
            if found is None:
                self.counters.drop("auth-unknown-userhash")
                self._events.append(AuthFailed("auth-unknown-userhash", "", five[1]))
                return self._challenge(msg, TurnError.UNAUTHENTICATED, five, now)
            username = found
        # A closing Refresh may use a time-limited username that has expired
        # since: it can only free what that username already holds.
        result, passwords = self.credentials.passwords(
            username, unix_now, allow_expired=releasing
        )
        if result is not Lookup.FOUND:
            reason = _LOOKUP_DROPS[result]
            self.counters.drop(reason)
            self._events.append(AuthFailed(reason, username, five[1]))
            return self._challenge(msg, TurnError.UNAUTHENTICATED, five, now)
        check = (
            check_message_integrity_sha256
            if mi256 is not None
            else check_message_integrity
        )
        for password in passwords:
            try:
                key = long_term_key(
                    username, self.credentials.realm, password, algorithm
                )
            except LocalProtocolError:
                continue
            if check(raw, key):
                if stale_release:
                    self.counters.stale_nonce_releases += 1
                return Auth(
                    username,
                    self._quota_user(username),
                    key,
                    mi256 is not None,
                    issued,
                )
        self.counters.drop("auth-bad-integrity")
        self._events.append(AuthFailed("auth-bad-integrity", username, five[1]))
        return self._challenge(msg, TurnError.UNAUTHENTICATED, five, now)

    def _quota_user(self, username: str) -> str:
        if username in self.credentials.users:
            return username
        _head, sep, tail = username.partition(self.credentials.separator)
        return tail if sep and tail else username

    def _owned(self, five: FiveTuple, auth: Auth) -> Allocation:
        """The allocation on ``five`` made with the same credentials (437 / 441).

        One extension to RFC 8656's "same credentials": a *later* time-limited
        username of the same user, minted with the same shared secret, takes
        the allocation over (the p2p service's ``turn_refresh``). Time-limited
        credentials exist to expire; without this an allocation could not
        outlive the ones it was made with, however long the call. Only the
        holder of the secret mints such a username, so the authority is the
        same.
        """
        allocation = self.allocations.get(five)
        if allocation is None:
            raise _Reject(TurnError.ALLOCATION_MISMATCH)
        if allocation.username != auth.username:
            if not self._renews(allocation.username, auth.username):
                raise _Reject(TurnError.WRONG_CREDENTIALS)
            allocation.username = auth.username
            allocation.key = auth.key or b""
            self.counters.credential_renewals += 1
        return allocation

    def _renews(self, old: str, new: str) -> bool:
        """Whether ``new`` is a later time-limited username of ``old``'s user."""
        credentials = self.credentials
        if not credentials.secrets or old in credentials.users:
            return False
        if new in credentials.users:
            return False
        before = parse_rest_username(old, credentials.separator)
        after = parse_rest_username(new, credentials.separator)
        return (
            before is not None
            and after is not None
            and bool(after[1])
            and after[1] == before[1]
            and after[0] > before[0]
        )

    def _lifetime(self, msg: Message) -> float:
        """RFC 8656 §7.2 / §8 "desired lifetime" (non-zero case)."""
        requested = msg.get(Lifetime)
        if requested is None:
            return DEFAULT_ALLOCATION_LIFETIME
        return max(
            min(float(requested.value), self.settings.max_lifetime),
            DEFAULT_ALLOCATION_LIFETIME,
        )

    # ------------------------------------------------------------ Allocate

    def _allocate(
        self, msg: Message, five: FiveTuple, auth: Auth, now: float
    ) -> bytes | None:
        existing = self.allocations.get(five)
        if existing is not None:
            if existing.transaction_id == msg.transaction_id and existing.response:
                return existing.response  # retransmission: same answer
            raise _Reject(TurnError.ALLOCATION_MISMATCH)
        freed = self._freed.get(five)
        if freed is not None and freed.transaction_id == msg.transaction_id:
            # The Allocate of an allocation already deleted on this 5-tuple,
            # sent again (a late retransmission or a replay): RFC 8656 §7.2
            # step 1 only lets a retransmission get the *same* answer while the
            # allocation exists; recreating it would undo the Refresh 0 and hold
            # ports nobody asked for. 437 as for any transaction mismatch.
            self.counters.drop("allocate-replayed-after-delete")
            raise _Reject(TurnError.ALLOCATION_MISMATCH)
        requested = msg.get(RequestedTransport)
        if requested is None:
            raise _Reject(TurnError.BAD_REQUEST)
        if requested.value == Transport.UDP:
            transport = Transport.UDP
        elif requested.value == Transport.TCP and self.settings.tcp_relay:
            transport = Transport.TCP
        else:
            raise _Reject(TurnError.UNSUPPORTED_TRANSPORT_PROTOCOL)
        dont_fragment = msg.get(DontFragment) is not None
        token = msg.get(ReservationToken)
        even = msg.get(EvenPort)
        if transport == Transport.TCP:
            # RFC 6062 §5.1: only over a TCP (or TLS) control connection, and
            # the UDP-only port and fragment options make no sense.
            if five[0] != Transport.TCP or token or even or dont_fragment:
                raise _Reject(TurnError.BAD_REQUEST)
        requested_family = msg.get(RequestedAddressFamily)
        additional = msg.get(AdditionalAddressFamily) or _legacy_additional(msg)
        # RFC 8656 §7.2: these combinations are 400.
        if (token and even) or (token and (requested_family or additional)):
            raise _Reject(TurnError.BAD_REQUEST)
        if requested_family and additional:
            raise _Reject(TurnError.BAD_REQUEST)
        if additional is not None and additional.value != Family.IPV6:
            raise _Reject(TurnError.BAD_REQUEST)
        reservation: Reservation | None = None
        if token is not None:
            reservation = self.ports.claim(token.value, now)
            if reservation is None:
                raise _Reject(TurnError.INSUFFICIENT_CAPACITY)
        families: list[Family]
        if requested_family is not None:
            if requested_family.value not in (Family.IPV4, Family.IPV6):
                raise _Reject(TurnError.ADDRESS_FAMILY_NOT_SUPPORTED)
            families = [Family(requested_family.value)]
        elif additional is not None:
            families = [Family.IPV4, Family.IPV6]
        elif reservation is not None:
            families = [Family(reservation.family)]
        else:
            families = [Family.IPV4]
        try:
            self._check_quota(auth, five[1][0])
        except _Reject:
            if reservation is not None:
                self.ports.release(reservation.port)
            raise
        lifetime = self._lifetime(msg)
        client_ip = five[1][0]
        allocation = Allocation(
            five_tuple=five,
            username=auth.username,
            quota_user=auth.quota_user,
            realm=self.credentials.realm,
            key=auth.key or b"",
            relays={},
            requested_transport=transport,
            expires=now + lifetime,
            transaction_id=msg.transaction_id,
            nonce_issued=auth.nonce_issued,
        )
        address_errors: list[Attribute] = []
        reserved: Reservation | None = None
        for index, family in enumerate(families):
            code = self._open_relay(
                allocation, family, transport, dont_fragment, reservation, even
            )
            if code:
                if index == 0:
                    self._close_relays(allocation)
                    if reservation is not None:
                        self.ports.release(reservation.port)
                    self.admission.release(client_ip)
                    raise _Reject(code)
                address_errors.append(
                    AddressErrorCode(family, code, REASONS.get(code, ""))
                )
        if even is not None and even.reserve:
            primary = allocation.relays[families[0]]
            next_port = primary.address[1] + 1
            if next_port <= self.ports.high and next_port not in self.ports.in_use:
                reserved = self.ports.reserve(next_port, families[0], now)
                self._deadlines.schedule(reserved.expires, Kind.RESERVATION, reserved)
        attributes: list[Attribute] = [
            XorRelayedAddress(*relay.address) for relay in allocation.relays.values()
        ]
        attributes.append(Lifetime(int(lifetime)))
        attributes.append(XorMappedAddress(*five[1]))
        if reserved is not None:
            attributes.append(ReservationToken(reserved.token))
        attributes.extend(address_errors)
        response = self._answer(msg, auth, success_response(msg, attributes))
        allocation.response = response
        self.allocations[five] = allocation
        self.user_allocations[auth.quota_user] = (
            self.user_allocations.get(auth.quota_user, 0) + 1
        )
        self.counters.allocations_created += 1
        allocation.timer = self._deadlines.schedule(
            allocation.expires, Kind.ALLOCATION, allocation
        )
        self._events.append(AllocationCreated(allocation))
        return response

    def drain(self, alternates: Collection[Address] = ()) -> None:
        """Take no new allocation from now on: an Allocate is answered 300 Try
        Alternate with ALTERNATE-SERVER naming one of ``alternates`` (RFC 8656
        §7.2: "the server MAY choose to reject the request with a 300 (Try
        Alternate) error if it wishes to redirect the client to a different
        server"; RFC 8489 §10), or 486 Allocation Quota Reached when none is of
        the client's address family. Refreshes, permissions, channels and data
        of live allocations are untouched. Called again to update the peers."""
        self.draining = True
        self.drain_alternates = tuple(alternates)

    def _drain_alternate(self, client_ip: str) -> Address | None:
        """The next peer node of ``client_ip``'s family (RFC 8489 §14.15:
        ALTERNATE-SERVER's "IP address family MUST be identical to that of the
        source IP address of the request"), round robin; None when none is."""
        family = ipaddress.ip_address(client_ip).version
        servers = [
            server
            for server in self.drain_alternates
            if ipaddress.ip_address(server[0]).version == family
        ]
        if not servers:
            return None
        server = servers[self._alternate_index % len(servers)]
        self._alternate_index += 1
        return server

    def _check_quota(self, auth: Auth, client_ip: str) -> None:
        """Admit one more allocation of ``auth``'s user from ``client_ip``
        (counted in the admission: the caller releases it when the
        allocation fails or ends), or raise 486 / 300."""
        settings = self.settings
        if self.draining:
            alternate = self._drain_alternate(client_ip)
            if alternate is not None:
                self.counters.drop("draining-redirected")
                raise _Reject(TurnError.TRY_ALTERNATE, (AlternateServer(*alternate),))
            self.counters.drop("draining-refused")
            raise _Reject(TurnError.ALLOCATION_QUOTA_REACHED)
        if settings.user_quota and (
            self.user_allocations.get(auth.quota_user, 0) >= settings.user_quota
        ):
            self.counters.drop("quota-user")
            raise _Reject(TurnError.ALLOCATION_QUOTA_REACHED)
        refused = self.admission.admit(client_ip)
        over_ip = refused == REFUSED_OVER_IP_LIMIT
        over_total = refused is not None and not over_ip
        if over_ip:
            self.counters.drop("quota-ip")
            raise _Reject(TurnError.ALLOCATION_QUOTA_REACHED)
        if over_total:
            if settings.alternate_servers:
                # Over capacity: redirect (RFC 8656 §7.2, RFC 8489 §10), round robin.
                servers = settings.alternate_servers
                host, port = servers[self._alternate_index % len(servers)]
                self._alternate_index += 1
                raise _Reject(TurnError.TRY_ALTERNATE, (AlternateServer(host, port),))
            self.counters.drop("quota-total")
            raise _Reject(TurnError.ALLOCATION_QUOTA_REACHED)

    def _open_relay(
        self,
        allocation: Allocation,
        family: Family,
        transport: Transport,
        dont_fragment: bool,
        reservation: Reservation | None,
        even: EvenPort | None,
    ) -> int:
        """Bind one relay port of ``family``; returns 0 or the error code."""
        if not self.binder.has_relay_address(family):
            return TurnError.ADDRESS_FAMILY_NOT_SUPPORTED
        if reservation is not None:
            relay = self.binder.open_relay(
                allocation, family, reservation.port, transport, dont_fragment
            )
            if relay is None:
                return TurnError.INSUFFICIENT_CAPACITY
            allocation.relays[family] = relay
            self._add_relayed(relay, allocation)
            return 0
        candidates = self.ports.candidates(
            even=even is not None, pair=even is not None and even.reserve
        )
        for port in candidates:
            relay = self.binder.open_relay(
                allocation, family, port, transport, dont_fragment
            )
            if relay is not None:
                self.ports.take(port)
                allocation.relays[family] = relay
                self._add_relayed(relay, allocation)
                return 0
        return TurnError.INSUFFICIENT_CAPACITY

    def _close_relays(self, allocation: Allocation) -> None:
        for relay in allocation.relays.values():
            address = _canonical(relay.address)
            if self.relayed.get(address) is allocation:
                del self.relayed[address]
                decrement(self._relayed_hosts, address[0])
                self._orphan_peer(address)
            self.ports.release(relay.address[1])
            relay.close()

    def _orphan_peer(self, address: Address) -> None:
        """The relayed ``address`` is gone: channels other allocations bound
        to it stop forwarding now (both ways), as if they had expired; the
        number and the address stay reserved for the quarantine (RFC 8656
        §12). Its port goes back to the kernel, whose ephemeral range the
        relay range overlaps: whatever socket of the server takes it next is
        no peer anyone was allowed. A ChannelBind to it is judged anew (403
        unless the policy allows the address itself). Send indications and
        datagrams from it are judged per port on the data path
        (:meth:`self_peer_refused`); the transport drops the routes it
        learned for it when the relay closes."""
        for other in self._channels_to_relayed.pop(address, ()):
            if other.dead:
                continue
            channel = other.channel_of_peer.get(address)
            if channel is not None and channel.active and not channel.dead:
                other.expire_channel(channel, self._now, self._deadlines.schedule)

    def _add_relayed(self, relay: RelayPort, allocation: Allocation) -> None:
        address = _canonical(relay.address)
        self.relayed[address] = allocation
        host = address[0]
        self._relayed_hosts[host] = self._relayed_hosts.get(host, 0) + 1

    def delete_allocation(
        self, allocation: Allocation, reason: str, now: float | None = None
    ) -> None:
        """Delete an allocation now: close relays and peer connections.

        With ``now``, the Allocate that made it is remembered until no fresh
        nonce could sign a replay of it (see :meth:`_allocate`).
        """
        if allocation.dead:
            return
        five = allocation.five_tuple
        if self.allocations.get(five) is allocation:
            del self.allocations[five]
        decrement(self.user_allocations, allocation.quota_user)
        self.admission.release(five[1][0])
        if now is not None and allocation.transaction_id:
            self._remember_freed(five, allocation.transaction_id, now)
        for peer in allocation.channel_of_peer:
            bound = self._channels_to_relayed.get(peer)
            if bound is not None:
                bound.discard(allocation)
                if not bound:
                    del self._channels_to_relayed[peer]
        for connection_id in list(allocation.connections):
            connection = self.connections.get(connection_id)
            if connection is not None:
                self._forget_connection(connection)
                self._events.append(CloseConnection(connection_id))
        allocation.clear(self._deadlines.cancel)
        self._close_relays(allocation)
        deleted = self.counters.allocations_deleted
        deleted[reason] = deleted.get(reason, 0) + 1
        self._events.append(AllocationDeleted(allocation, reason))

    def _remember_freed(
        self, five: FiveTuple, transaction_id: bytes, now: float
    ) -> None:
        deadlines = self._deadlines
        previous = self._freed.pop(five, None)
        if previous is not None:
            deadlines.cancel(previous.timer)
        elif len(self._freed) >= MAX_FREED:
            oldest = self._freed.pop(next(iter(self._freed)))
            deadlines.cancel(oldest.timer)
        freed = Freed(five, transaction_id)
        # A replay needs a nonce that is still fresh: after one nonce lifetime
        # (and the 5 s of skew NonceMinter.check tolerates) it gets 438 anyway.
        freed.timer = deadlines.schedule(
            now + self.nonces.lifetime + 5, Kind.FREED, freed
        )
        self._freed[five] = freed

    @property
    def freed_count(self) -> int:
        """Deleted allocations still remembered for replay protection."""
        return len(self._freed)

    def client_disconnected(self, five: FiveTuple) -> None:
        """A TCP connection from a client closed (RFC 8656 §3.1 / RFC 6062 §5.5)."""
        allocation = self.allocations.get(five)
        if allocation is not None:
            self.delete_allocation(allocation, "disconnected")
        for connection in list(self.connections.values()):
            if connection.client == five:
                self._forget_connection(connection)
                self._events.append(CloseConnection(connection.id))

    def close(self) -> None:
        """Delete every allocation (server shutdown)."""
        for allocation in list(self.allocations.values()):
            self.delete_allocation(allocation, "shutdown")

    # ------------------------------------------------------------ Refresh

    def _refresh(
        self, msg: Message, five: FiveTuple, auth: Auth, now: float
    ) -> bytes | None:
        allocation = self._owned(five, auth)
        family = msg.get(RequestedAddressFamily)
        if family is not None and family.value not in allocation.relays:
            raise _Reject(TurnError.PEER_ADDRESS_FAMILY_MISMATCH)
        requested = msg.get(Lifetime)
        if requested is not None and requested.value == 0:
            self.delete_allocation(allocation, "refresh", now)
            return self._answer(msg, auth, success_response(msg, [Lifetime(0)]))
        lifetime = self._lifetime(msg)
        allocation.expires = now + lifetime
        return self._answer(msg, auth, success_response(msg, [Lifetime(int(lifetime))]))

    # ------------------------------------------------------------ permissions

    def peer_verdict(self, peer: Address, client: str | None = None) -> Verdict:
        """Whether a relay may exchange data with ``peer`` (module docstring),
        for a client at ``client`` (None: judged as a remote client)."""
        verdict = self.policy.judge(peer[0])
        if peer in self.relayed:
            # One of our own relayed addresses: allowed unless explicitly denied.
            return Verdict.DENIED if verdict == Verdict.DENIED else Verdict.ALLOWED
        if (
            verdict == Verdict.LOOPBACK
            and client is not None
            and self.settings.same_host_loopback_peers
            and _is_loopback(client)
        ):
            verdict = Verdict.ALLOWED
        if (
            verdict == Verdict.ALLOWED
            and self.policy.is_self(peer[0])
            and peer[1] in self.own_ports()
        ):
            return Verdict.SERVICE_PORT
        return verdict

    def self_peer_refused(self, peer: Address, client: str | None = None) -> bool:
        """Data path check of a Send indication from ``client``: True (and
        counted) when it goes to a port of this host it must not reach. Cheap
        for every other peer: one set lookup."""
        if peer[0] not in self.self_peers:
            return False
        verdict = self.peer_verdict(peer, client)
        if verdict == Verdict.ALLOWED:
            return False
        self.counters.drop(f"peer-{verdict.reason}")
        return True

    def _permission_verdict(self, host: str, client: str) -> Verdict:
        """Whether ``host`` may hold a permission (which covers every port of
        it, RFC 8656 §9): the host of a live relayed address may, since the
        data path checks each datagram's port to it."""
        verdict = self.peer_verdict((host, 0), client)
        if verdict == Verdict.SERVICE_PORT:  # port 0 is no port: judge the IP
            verdict = Verdict.ALLOWED
        if verdict not in (Verdict.ALLOWED, Verdict.DENIED) and host in (
            self._relayed_hosts
        ):
            return Verdict.ALLOWED
        return verdict

    def _peer(
        self, allocation: Allocation, peer: XorPeerAddress, exact: bool = True
    ) -> RelayPort:
        """Check a peer against the relay families and the policy: the exact
        transport address (ChannelBind, Connect), or only the IP (``exact``
        False: CreatePermission, whose port means nothing)."""
        relay = allocation.relay_for(6 if ":" in peer.host else 4)
        if relay is None:
            raise _Reject(TurnError.PEER_ADDRESS_FAMILY_MISMATCH)
        client = allocation.five_tuple[1][0]
        if exact:
            verdict = self.peer_verdict((peer.host, peer.port), client)
        else:
            verdict = self._permission_verdict(peer.host, client)
        if verdict != Verdict.ALLOWED:
            self.counters.drop(f"peer-{verdict.reason}")
            self._events.append(
                PeerRefused(allocation.five_tuple, (peer.host, peer.port), verdict)
            )
            raise _Reject(TurnError.FORBIDDEN)
        if peer.host not in self.self_peers and (
            self.policy.is_self(peer.host) or peer.host in self._relayed_hosts
        ):
            if len(self.self_peers) >= MAX_SELF_PEERS:
                self.counters.drop("peer-self-table-full")
                raise _Reject(TurnError.FORBIDDEN)
            self.self_peers.add(peer.host)
        return relay

    def _create_permission(
        self, msg: Message, five: FiveTuple, auth: Auth, now: float
    ) -> bytes | None:
        allocation = self._owned(five, auth)
        peers = msg.get_all(XorPeerAddress)
        if not peers:
            raise _Reject(TurnError.BAD_REQUEST)
        for peer in peers:
            self._peer(allocation, peer, exact=False)
        new = {p.host for p in peers} - allocation.permissions.keys()
        if len(allocation.permissions) + len(new) > self.settings.max_permissions:
            raise _Reject(TurnError.INSUFFICIENT_CAPACITY)
        # RFC 8656 §10.2: all or nothing — every check passed, install them all.
        for peer in peers:
            allocation.install_permission(peer.host, now, self._deadlines.schedule)
        return self._answer(msg, auth, success_response(msg))

    def _channel_bind(
        self, msg: Message, five: FiveTuple, auth: Auth, now: float
    ) -> bytes | None:
        allocation = self._owned(five, auth)
        if allocation.requested_transport != Transport.UDP:
            raise _Reject(TurnError.BAD_REQUEST)  # RFC 6062: no channels on TCP
        number = msg.get(ChannelNumber)
        peer = msg.get(XorPeerAddress)
        if number is None or peer is None:
            raise _Reject(TurnError.BAD_REQUEST)
        if not CHANNEL_MIN <= number.value <= self.settings.channel_max:
            raise _Reject(TurnError.BAD_REQUEST)
        relay = self._peer(allocation, peer)
        address = (peer.host, peer.port)
        if allocation.channel_conflict(number.value, address):
            raise _Reject(TurnError.BAD_REQUEST)
        if (
            peer.host not in allocation.permissions
            and len(allocation.permissions) >= self.settings.max_permissions
        ):
            raise _Reject(TurnError.INSUFFICIENT_CAPACITY)
        allocation.bind_channel(
            number.value, address, relay, now, self._deadlines.schedule
        )
        if address in self.relayed:
            self._channels_to_relayed.setdefault(address, set()).add(allocation)
        return self._answer(msg, auth, success_response(msg))

    # ------------------------------------------------------------ RFC 6062

    def _new_connection_id(self) -> int:
        while True:
            candidate = self.ports.entropy.randbelow(0xFFFFFFFF) + 1
            if candidate not in self.connections:
                return candidate

    def _connect(
        self, msg: Message, five: FiveTuple, auth: Auth, now: float
    ) -> bytes | None:
        allocation = self._owned(five, auth)
        if allocation.requested_transport != Transport.TCP:
            raise _Reject(TurnError.BAD_REQUEST)
        peer = msg.get(XorPeerAddress)
        if peer is None:
            raise _Reject(TurnError.BAD_REQUEST)
        relay = self._peer(allocation, peer)
        address = (peer.host, peer.port)
        for connection_id in allocation.connections:
            if self.connections[connection_id].peer == address:
                raise _Reject(TurnError.CONNECTION_ALREADY_EXISTS)
        if len(allocation.connections) >= self.settings.max_connections:
            raise _Reject(TurnError.INSUFFICIENT_CAPACITY)
        connection = PeerConnection(
            id=self._new_connection_id(),
            allocation=allocation,
            peer=address,
            state=ConnState.CONNECTING,
            # RFC 6062 §5.2: give up (447) if the peer does not answer in time.
            expires=now + CONNECT_TIMEOUT,
            request=msg,
            auth=auth,
        )
        self._add_connection(connection)
        self._events.append(ConnectPeer(connection.id, relay, address))
        return None

    def _add_connection(self, connection: PeerConnection) -> None:
        self.connections[connection.id] = connection
        connection.allocation.connections.add(connection.id)
        connection.timer = self._deadlines.schedule(
            connection.expires, Kind.CONNECTION, connection
        )

    def _forget_connection(self, connection: PeerConnection) -> None:
        connection.dead = True
        self._deadlines.cancel(connection.timer)
        connection.timer = None
        self.connections.pop(connection.id, None)
        connection.allocation.connections.discard(connection.id)

    def peer_connected(self, connection_id: int, now: float) -> None:
        """The TCP connection asked by Connect is up: answer with CONNECTION-ID."""
        connection = self.connections.get(connection_id)
        if connection is None or connection.state != ConnState.CONNECTING:
            self._events.append(CloseConnection(connection_id))
            return
        request, auth = connection.request, connection.auth
        assert request is not None and auth is not None
        connection.state = ConnState.PENDING
        connection.request = None
        # RFC 6062 §5.2: the client has 30 s to send ConnectionBind.
        connection.expires = now + CONNECTION_BIND_TIMEOUT
        answer = self._answer(
            request, auth, success_response(request, [ConnectionId(connection_id)])
        )
        self.counters.response("connect", 0)
        self._to_client(connection.allocation.five_tuple, answer)

    def peer_connect_failed(self, connection_id: int) -> None:
        """Connect could not reach the peer: 447."""
        connection = self.connections.get(connection_id)
        if connection is None or connection.state != ConnState.CONNECTING:
            return
        self._fail_connect(connection)

    def _fail_connect(self, connection: PeerConnection) -> None:
        request, auth = connection.request, connection.auth
        assert request is not None and auth is not None
        self._forget_connection(connection)
        self._events.append(CloseConnection(connection.id))
        self.counters.response("connect", 447)
        answer = self._answer(
            request, auth, self._error(request, TurnError.CONNECTION_TIMEOUT_OR_FAILURE)
        )
        if not connection.allocation.dead:
            self._to_client(connection.allocation.five_tuple, answer)

    def peer_accepted(
        self, allocation: Allocation, peer: Address, now: float
    ) -> int | None:
        """A peer connected to a TCP relay (RFC 6062 §5.3).

        Returns the new connection id, or None when the connection must be closed
        (no permission for the peer, allocation gone or full).
        """
        if allocation.dead or allocation.five_tuple not in self.allocations:
            return None
        if peer[0] not in allocation.permissions:
            self.counters.drop("tcp-peer-no-permission")
            return None
        if len(allocation.connections) >= self.settings.max_connections:
            self.counters.drop("tcp-peer-over-limit")
            return None
        connection = PeerConnection(
            id=self._new_connection_id(),
            allocation=allocation,
            peer=peer,
            state=ConnState.PENDING,
            expires=now + CONNECTION_BIND_TIMEOUT,
        )
        self._add_connection(connection)
        attempt = indication(
            Method.CONNECTION_ATTEMPT,
            self.ports.entropy.token_bytes(12),
            [XorPeerAddress(*peer), ConnectionId(connection.id)],
        )
        self._to_client(allocation.five_tuple, encode(attempt))
        return connection.id

    def connection_closed(self, connection_id: int) -> None:
        """The peer or client data connection closed."""
        connection = self.connections.get(connection_id)
        if connection is None:
            return
        if connection.state == ConnState.CONNECTING:
            self._fail_connect(connection)
            return
        self._forget_connection(connection)
        self._events.append(CloseConnection(connection_id))

    def _connection_timeout(self, connection: PeerConnection) -> None:
        if connection.state == ConnState.CONNECTING:
            self._fail_connect(connection)
        elif connection.state == ConnState.PENDING:
            self.counters.drop("tcp-bind-timeout")
            self._forget_connection(connection)
            self._events.append(CloseConnection(connection.id))
        # BOUND connections live as long as both TCP connections do.

    def _connection_bind(
        self, msg: Message, five: FiveTuple, auth: Auth, now: float
    ) -> bytes | None:
        if five[0] != Transport.TCP or five in self.allocations:
            raise _Reject(TurnError.BAD_REQUEST)
        connection_id = msg.get(ConnectionId)
        if connection_id is None:
            raise _Reject(TurnError.BAD_REQUEST)
        connection = self.connections.get(connection_id.value)
        if connection is None or connection.state != ConnState.PENDING:
            raise _Reject(TurnError.BAD_REQUEST)
        if connection.allocation.username != auth.username:
            raise _Reject(TurnError.WRONG_CREDENTIALS)
        connection.state = ConnState.BOUND
        connection.client = five
        self._events.append(BindConnection(connection.id, five))
        return self._answer(msg, auth, success_response(msg))

    # ------------------------------------------------------------ data path

    # What the data plane's routes do not forward comes here (the Python slow
    # path): the core decides from its tables and frames; the transport sends
    # and counts what it sent.

    def send_indication(
        self, data: bytes, addr: Address, socket: Listener
    ) -> tuple[RelayPort, Address, bytes] | None:
        """A Send indication (RFC 8656 §11.2) from client ``addr`` on
        ``socket``, raw: ``(relay, peer, payload)`` to send from the relayed
        address, the relay's bandwidth budget spent; None when it is dropped
        (counted by reason). The walk of
        :func:`~crossroads.proto.turn.fastpath.parse_send_indication` first,
        without a message object; what it does not take, the full codec
        (:meth:`send_route`)."""
        allocation = self.allocations.get((socket[0], addr, socket[1]))
        parsed = parse_send_indication(data) if allocation is not None else None
        if allocation is None or parsed is None:
            route = self.send_route(data, addr, socket)
            if route is None:
                return None
            relay, peer, payload = route
        else:
            peer, payload, _dont_fragment = parsed
            found = allocation.relays.get(
                Family.IPV6 if ":" in peer[0] else Family.IPV4
            )
            if found is None:
                self.counters.drop("send-family-mismatch")
                return None
            if peer[0] not in allocation.permissions:
                self.counters.drop("send-no-permission")
                return None
            if self.self_peer_refused(peer, addr[0]):
                return None
            relay = found
        if relay.bps and not relay.allow(len(payload)):
            return None
        return relay, peer, payload

    def peer_data(
        self, allocation: Allocation, relay: RelayPort, data: bytes, peer: Address
    ) -> tuple[bytes, bool] | None:
        """A datagram from ``peer`` on ``relay`` of ``allocation`` that no
        route forwarded: ``(message for the client, is ChannelData)``, the
        relay's bandwidth budget spent, or None when it is dropped.

        ChannelData when a live channel is bound to ``peer`` and its
        permission is live (RFC 8656 §12.6; padded to 4 bytes over TCP,
        §12.5), else a Data indication when ``peer``'s IP has a permission
        (§11.3), else nothing (``peer-no-permission``, §9). A peer on one of
        this host's addresses is judged per port (:meth:`self_peer_refused`).
        """
        size = len(data)
        channel = allocation.channel_of_peer.get(peer)
        if channel is not None and channel.active and peer[0] in allocation.permissions:
            if relay.bps and not relay.allow(size):
                return None
            frame = _CHANNEL_HEADER(channel.number, size) + data
            if allocation.five_tuple[0] == Transport.TCP:
                frame += PAD[size & 3]
            return frame, True
        if peer[0] not in allocation.permissions:
            self.counters.drop("peer-no-permission")
            return None
        if peer[0] in self.self_peers and self.self_peer_refused(
            peer, allocation.five_tuple[1][0]
        ):
            # A permission covers the IP; the port is judged here (a freed
            # relayed port may belong to any socket of the server now).
            return None
        if relay.bps and not relay.allow(size):
            return None
        attribute = self._peer_attributes.get(peer)
        if attribute is None and ":" not in peer[0]:
            if len(self._peer_attributes) >= MAX_PEER_ATTRIBUTES:
                self._peer_attributes.clear()
            attribute = self._peer_attributes[peer] = xor_peer_address(peer, b"")
        self._txid_counter = (self._txid_counter + 1) & 0xFFFFFFFF
        txid = self._txid_prefix + self._txid_counter.to_bytes(4, "big")
        return data_indication(peer, data, txid, attribute), False

    def channel_data_unrouted(
        self, data: bytes, addr: Address, socket: Listener
    ) -> None:
        """ChannelData from client ``addr`` on ``socket`` that no route
        forwarded: count why (RFC 8656 §12.5: discarded silently)."""
        allocation = self.allocations.get((socket[0], addr, socket[1]))
        if allocation is None:
            self.counters.drop("channel-no-allocation")
        elif len(data) < 4 or allocation.routes.get((data[0] << 8) | data[1]) is None:
            self.counters.drop("channel-unbound")
        else:
            self.counters.drop("channel-unroutable")


class _Expiring(Protocol):
    """What a deadline of the heap refers to: an allocation, a permission, a
    channel binding or a TCP connection (each refreshed by moving ``expires``
    on, not by touching the heap)."""

    expires: float
    dead: bool
    timer: TimerHandle | None


def _not_due(
    item: _Expiring, now: float, schedule: Schedule, kind: Kind, subject: object
) -> bool:
    """True when ``item``'s deadline needs nothing now: it was deleted early,
    or it was refreshed since its heap entry was made (the entry is made again
    for ``expires``, as ``kind`` for ``subject``). False: it lapsed."""
    if item.dead:
        return True
    if item.expires > now:
        item.timer = schedule(item.expires, kind, subject)
        return True
    return False


def _canonical(address: Address) -> Address:
    """``address`` spelled as decoded XOR-PEER-ADDRESS hosts are (an advertised
    address comes from configuration, where ``2001:DB8::1`` is as good)."""
    try:
        return str(ipaddress.ip_address(address[0])), address[1]
    except ValueError:
        return address


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _is_release(msg: Message) -> bool:
    """A Refresh with LIFETIME 0: "delete my allocation" (RFC 8656 §8)."""
    if msg.method != Method.REFRESH:
        return False
    lifetime = msg.get(Lifetime)
    return lifetime is not None and lifetime.value == 0


_LOOKUP_DROPS = {
    Lookup.EXPIRED: "auth-expired",
    Lookup.UNKNOWN_USER: "auth-unknown-user",
    Lookup.TTL_TOO_LONG: "auth-ttl-too-long",
}


def _nonce_scope(five: FiveTuple) -> str:
    """What a nonce is bound to besides the client port: protocol and client IP.

    A request captured and replayed from any other address or port — even
    behind the same NAT — carries a nonce that is not valid there: 438, and
    the replayer has no password to sign a new one.
    """
    return f"{int(five[0])}/{five[1][0]}"


#: draft-ietf-tram-turnbis numbered ADDITIONAL-ADDRESS-FAMILY 0x8032 before RFC
#: 8656 moved it to 0x8000; coturn 4.6.1 (Debian 12) still sends 0x8032.
LEGACY_ADDITIONAL_ADDRESS_FAMILY = 0x8032


def _legacy_additional(msg: Message) -> AdditionalAddressFamily | None:
    for attr in msg.get_all(UnknownAttribute):
        if attr.type_code == LEGACY_ADDITIONAL_ADDRESS_FAMILY and len(attr.value) == 4:
            return AdditionalAddressFamily(attr.value[0])
    return None


def error_code_of(message: Message) -> int | None:
    """The ERROR-CODE of a response, for tests and clients."""
    attr = message.get(ErrorCodeAttribute)
    return None if attr is None else attr.code
