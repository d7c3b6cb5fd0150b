"""RakNet's NatPunchthroughServer, sans-I/O (reference raknet-wire.md §3).

Theory of operation
-------------------
Every system connected to the server is a *user* (GUID, address as seen,
``isReady``, most recent port). A client's ``ID_NAT_PUNCHTHROUGH_REQUEST``
names a target GUID: an unknown target (or itself) gets
``ID_NAT_TARGET_NOT_CONNECTED``; a pair that already has an attempt gets
``ID_NAT_ALREADY_IN_PROGRESS``; otherwise an *attempt* with a new u16 session
id joins both users' lists (NatPunchthroughServer.cpp:379-422).

An attempt starts when both users are ready (570-620): both become busy, and
both get ``ID_NAT_GET_MOST_RECENT_PORT`` (session id). Each answers with the
port its NAT most recently used. When both ports are in (433-565) each side
gets ``ID_TIMESTAMP`` t_go ``ID_NAT_CONNECT_AT_TIME``: session id, the peer's
public IP with its reported port, the peer's LAN addresses (from its
NEW_INCOMING_CONNECTION), the peer's GUID and one bit "we are the sender".
t_go is 1500 ms ahead while either round trip is unknown, else four times the
larger round trip, at least 100 ms (480-495); clients shift ID_TIMESTAMP by the
clock offset they learnt from this server's pongs, so both punch at once.
``ID_NAT_CLIENT_READY`` makes a user ready again, which starts its next
queued attempt.

Failure: an attempt still collecting ports 10 s after it started gets
``ID_NAT_TARGET_UNRESPONSIVE`` to both (checked every 250 ms, 152-210); a user
who disconnects causes ``ID_NAT_CONNECTION_TO_TARGET_LOST`` to the other side
of each of its attempts (300-360).

Port stride (237-281): ``ID_NAT_REQUEST_BOUND_ADDRESSES`` is answered with the
server's socket addresses; the client then sends an out-of-band ``ID_NAT_PING``
(its external port) to the *second* address, and gets an out-of-band
``ID_NAT_PONG`` (port as reported, port as seen there) from the first.

Bounds: attempts queued per user and in total; requests beyond are dropped
and counted.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from enum import Enum

from crossroads.errors import DecodeError
from crossroads.proto.raknet.bitstream import UNASSIGNED_ADDRESS, BitReader, BitWriter
from crossroads.proto.raknet.messages import MAXIMUM_NUMBER_OF_INTERNAL_IDS, MessageId
from crossroads.proto.raknet.peer import RakNetServer
from crossroads.proto.sweep import SweepTimer
from crossroads.types import Address

#: ``ID_NAT_PING`` / ``ID_NAT_PONG``, the sub-ids of out-of-band messages.
NAT_PING = 0x0A
NAT_PONG = 0x0B
#: An attempt collecting ports this long is abandoned (NatPunchthroughServer.cpp
#: ~170, "Formerly 5000, but sometimes false positives").
ATTEMPT_TIMEOUT_MS = 10_000
#: How often abandoned attempts are looked for (``time > lastUpdate+250``).
UPDATE_INTERVAL = 0.25
#: CONNECT_AT_TIME lead when a round trip is unknown, the multiple of the larger
#: round trip otherwise, and the least lead (NatPunchthroughServer.cpp:480-495).
UNKNOWN_PING_LEAD_MS = 1500
PING_MULTIPLE = 4
MIN_LEAD_MS = 100
#: Attempts one user may have queued, and in total: stock RakNet has no bound;
#: a game opens one punch per peer, so 32 is generous.
MAX_ATTEMPTS_PER_USER = 32
MAX_ATTEMPTS = 100_000
#: Concluded attempts kept for the service to read (drained after every
#: input, so a few are enough; the oldest go first if it falls behind).
MAX_CONCLUDED = 256


class Phase(Enum):
    NOT_STARTED = "not-started"
    GETTING_RECENT_PORTS = "getting-recent-ports"


@dataclass(eq=False, slots=True)
class Attempt:
    session_id: int
    sender: int
    recipient: int
    phase: Phase = Phase.NOT_STARTED
    start_ms: int = 0
    #: When the request came (seconds, the caller's clock).
    requested: float = 0.0


@dataclass(frozen=True, slots=True)
class PunchConcluded:
    """What the server saw of one attempt, for its insight record. The server
    never learns whether the punch itself worked: after CONNECT_AT_TIME the
    two clients punch each other and tell the server nothing
    (NatPunchthroughClient reports success or failure to its own game only).
    ``outcome``: "coordinated" (CONNECT_AT_TIME sent to both),
    "unresponsive" (a side never sent its port), "target-lost" (a side
    disconnected)."""

    session_id: int
    sender: Address
    recipient: Address | None
    requested: float
    #: When both sides were free and asked for their ports (None: never).
    started: float | None
    ended: float
    outcome: str
    #: Each side's round trip to the server in ms (RakNet's pings), if known.
    rtt_ms: tuple[int | None, int | None] = (None, None)


@dataclass(eq=False, slots=True)
class User:
    guid: int
    address: Address
    internal_addresses: tuple[Address, ...]
    ready: bool = True
    most_recent_port: int = 0
    attempts: list[Attempt] = field(default_factory=list)


@dataclass
class PunchStats:
    requests: int = 0
    connect_at_time: int = 0
    unresponsive: int = 0
    lost: int = 0
    dropped: Counter[str] = field(default_factory=Counter)


class NatPunchthroughServer:
    """See the module docstring. Sends through ``peer``."""

    def __init__(self, peer: RakNetServer, bound_addresses: list[Address]) -> None:
        self.peer = peer
        self.bound_addresses = bound_addresses[:MAXIMUM_NUMBER_OF_INTERNAL_IDS]
        self.users: dict[int, User] = {}
        self.stats = PunchStats()
        self._session = 0
        self._attempts = 0
        self._updates = SweepTimer(UPDATE_INTERVAL)
        #: Attempts that ended, for the service's insight records.
        self.concluded: deque[PunchConcluded] = deque(maxlen=MAX_CONCLUDED)

    def pop_concluded(self) -> list[PunchConcluded]:
        found = list(self.concluded)
        self.concluded.clear()
        return found

    def _conclude(
        self, attempt: Attempt, now: float, outcome: str, gone: User | None = None
    ) -> None:
        def side(guid: int) -> User | None:
            if gone is not None and gone.guid == guid:
                return gone
            return self.users.get(guid)

        sender, recipient = side(attempt.sender), side(attempt.recipient)
        if sender is None:
            return
        self.concluded.append(
            PunchConcluded(
                session_id=attempt.session_id,
                sender=sender.address,
                recipient=None if recipient is None else recipient.address,
                requested=attempt.requested,
                started=(
                    attempt.start_ms / 1000
                    if attempt.phase is Phase.GETTING_RECENT_PORTS
                    else None
                ),
                ended=now,
                outcome=outcome,
                rtt_ms=(
                    self._ping(sender),
                    None if recipient is None else self._ping(recipient),
                ),
            )
        )

    # ------------------------------------------------------------- hooks

    def on_connected(
        self, guid: int, address: Address, internal: tuple[Address, ...]
    ) -> None:
        self.users[guid] = User(guid, address, internal)

    def on_disconnected(self, guid: int, now: float) -> None:
        user = self.users.pop(guid, None)
        if user is None:
            return
        freed: list[User] = []
        for attempt in user.attempts:
            other_guid = (
                attempt.sender if attempt.recipient == guid else attempt.recipient
            )
            other = self.users.get(other_guid)
            self._attempts -= 1
            if other is None:
                continue
            self._conclude(attempt, now, "target-lost", gone=user)
            self._send(
                other.address,
                _guid_session(
                    MessageId.NAT_CONNECTION_TO_TARGET_LOST, guid, attempt.session_id
                ),
                now,
            )
            self.stats.lost += 1
            if attempt.phase is Phase.GETTING_RECENT_PORTS:
                other.ready = True
                freed.append(other)
            other.attempts.remove(attempt)
        for other in freed:
            self._start(other, now)

    def on_message(
        self, guid: int, address: Address, payload: bytes, now: float
    ) -> bool:
        """Handle one plugin message; False if it is not this plugin's."""
        kind = payload[0]
        try:
            if kind == MessageId.NAT_PUNCHTHROUGH_REQUEST:
                self._on_request(guid, address, payload, now)
            elif kind == MessageId.NAT_GET_MOST_RECENT_PORT:
                self._on_most_recent_port(guid, payload, now)
            elif kind == MessageId.NAT_CLIENT_READY:
                user = self.users.get(guid)
                if user is not None:
                    user.ready = True
                    self._start(user, now)
            elif kind == MessageId.NAT_REQUEST_BOUND_ADDRESSES:
                writer = BitWriter()
                writer.write_u8(MessageId.NAT_RESPOND_BOUND_ADDRESSES)
                writer.write_u8(len(self.bound_addresses))
                for addr in self.bound_addresses:
                    writer.write_address(addr)
                self._send(address, writer.data(), now)
            else:
                return False
        except DecodeError as exc:
            self.stats.dropped[exc.reason] += 1
        return True

    def on_out_of_band(self, address: Address, payload: bytes) -> bool:
        """``ID_NAT_PING`` (on any socket) gets ``ID_NAT_PONG`` from socket 0."""
        if len(payload) < 3 or payload[0] != NAT_PING:
            return False
        reported = int.from_bytes(payload[1:3], "big")
        pong = (
            bytes([NAT_PONG])
            + reported.to_bytes(2, "big")
            + address[1].to_bytes(2, "big")
        )
        self.peer.send_out_of_band(address, pong)
        return True

    def get_timer(self) -> float | None:
        return self._updates.deadline if self._attempts else None

    def handle_timer(self, now: float) -> None:
        if not self._updates.due(now):
            return
        now_ms = int(now * 1000)
        for user in list(self.users.values()):
            for attempt in user.attempts:
                if (
                    attempt.sender == user.guid
                    and attempt.phase is not Phase.NOT_STARTED
                    and now_ms > attempt.start_ms + ATTEMPT_TIMEOUT_MS
                ):
                    self._unresponsive(user, attempt, now)
                    break

    # ---------------------------------------------------------- internals

    def _send(self, address: Address, payload: bytes, now: float) -> None:
        self.peer.send(address, payload, now=now)

    def _on_request(
        self, guid: int, address: Address, payload: bytes, now: float
    ) -> None:
        target = BitReader(payload, start_bits=8).read_u64()
        sender = self.users.get(guid)
        if sender is None:
            self.stats.dropped["not-a-user"] += 1
            return
        self.stats.requests += 1
        session = self._session
        self._session = (session + 1) % 65536
        recipient = self.users.get(target)
        if recipient is None or recipient is sender:
            self._send(address, _guid(MessageId.NAT_TARGET_NOT_CONNECTED, target), now)
            return
        if any(guid in (a.sender, a.recipient) for a in recipient.attempts):
            self._send(address, _guid(MessageId.NAT_ALREADY_IN_PROGRESS, target), now)
            return
        if (
            len(sender.attempts) >= MAX_ATTEMPTS_PER_USER
            or len(recipient.attempts) >= MAX_ATTEMPTS_PER_USER
            or self._attempts >= MAX_ATTEMPTS
        ):
            self.stats.dropped["attempts-full"] += 1
            return
        attempt = Attempt(session, guid, target, requested=now)
        sender.attempts.append(attempt)
        recipient.attempts.append(attempt)
        self._attempts += 1
        self._updates.arm(now)
        self._start(sender, now)

    def _start(self, user: User, now: float) -> None:
        if not user.ready:
            return
        for attempt in user.attempts:
            other_guid = (
                attempt.recipient if attempt.sender == user.guid else attempt.sender
            )
            other = self.users.get(other_guid)
            if other is None or not other.ready:
                continue
            user.ready = other.ready = False
            attempt.phase = Phase.GETTING_RECENT_PORTS
            attempt.start_ms = int(now * 1000)
            user.most_recent_port = other.most_recent_port = 0
            message = bytes(
                [MessageId.NAT_GET_MOST_RECENT_PORT]
            ) + attempt.session_id.to_bytes(2, "big")
            sender = self.users[attempt.sender]
            recipient = self.users[attempt.recipient]
            self._send(sender.address, message, now)
            self._send(recipient.address, message, now)
            return

    def _on_most_recent_port(self, guid: int, payload: bytes, now: float) -> None:
        reader = BitReader(payload, start_bits=8)
        session = reader.read_u16()
        port = reader.read_u16()
        user = self.users.get(guid)
        if user is None:
            return
        user.most_recent_port = port
        for attempt in user.attempts:
            sender = self.users.get(attempt.sender)
            recipient = self.users.get(attempt.recipient)
            if (
                sender is None
                or recipient is None
                or attempt.phase is not Phase.GETTING_RECENT_PORTS
                or not sender.most_recent_port
                or not recipient.most_recent_port
                or attempt.session_id != session
            ):
                continue
            now_ms = int(now * 1000)
            pings = [self._ping(sender), self._ping(recipient)]
            if None in pings:
                go = now_ms + UNKNOWN_PING_LEAD_MS
            else:
                go = now_ms + max(
                    MIN_LEAD_MS, PING_MULTIPLE * max(p or 0 for p in pings)
                )
            self._send(
                recipient.address,
                _connect_at_time(go, attempt.session_id, sender, False),
                now,
            )
            self._send(
                sender.address,
                _connect_at_time(go, attempt.session_id, recipient, True),
                now,
            )
            self.stats.connect_at_time += 1
            self._conclude(attempt, now, "coordinated")
            sender.attempts.remove(attempt)
            recipient.attempts.remove(attempt)
            self._attempts -= 1
            return

    def _ping(self, user: User) -> int | None:
        conn = self.peer.connection(user.address)
        return None if conn is None else conn.rtt_ms

    def _unresponsive(self, user: User, attempt: Attempt, now: float) -> None:
        recipient = self.users.get(attempt.recipient)
        self._attempts -= 1
        self.stats.unresponsive += 1
        self._conclude(attempt, now, "unresponsive")
        self._give_up(user, attempt.recipient, attempt, now)
        if recipient is not None:
            self._give_up(recipient, user.guid, attempt, now)
            self._start(recipient, now)
        self._start(user, now)

    def _give_up(self, side: User, other: int, attempt: Attempt, now: float) -> None:
        """Tell ``side`` that ``other`` did not answer and free it for its next
        attempt (NatPunchthroughServer's ID_NAT_TARGET_UNRESPONSIVE to each)."""
        self._send(
            side.address,
            _guid_session(MessageId.NAT_TARGET_UNRESPONSIVE, other, attempt.session_id),
            now,
        )
        side.ready = True
        side.attempts.remove(attempt)


def _guid(kind: MessageId, guid: int) -> bytes:
    return bytes([kind]) + guid.to_bytes(8, "big")


def _guid_session(kind: MessageId, guid: int, session: int) -> bytes:
    return _guid(kind, guid) + session.to_bytes(2, "big")


def _connect_at_time(
    go_ms: int, session: int, peer: User, we_are_sender: bool
) -> bytes:
    """``1b`` Time ``3b`` u16 session SystemAddress 10×SystemAddress u64 bit → 98 B."""
    writer = BitWriter()
    writer.write_u8(MessageId.TIMESTAMP)
    writer.write_u64(go_ms)
    writer.write_u8(MessageId.NAT_CONNECT_AT_TIME)
    writer.write_u16(session)
    writer.write_address((peer.address[0], peer.most_recent_port))
    internal = list(peer.internal_addresses[:MAXIMUM_NUMBER_OF_INTERNAL_IDS])
    internal += [UNASSIGNED_ADDRESS] * (MAXIMUM_NUMBER_OF_INTERNAL_IDS - len(internal))
    for addr in internal:
        writer.write_address(addr)
    writer.write_u64(peer.guid)
    writer.write_bool(we_are_sender)
    return writer.data()
