"""The signalling server core: peers, mesh sessions and punch-through coordination.

Theory of operation
-------------------
A client opens a WebSocket, sends ``hello`` (its X25519 public key) and gets a
``welcome`` with a peer id and a rendezvous token. It then probes the three UDP
rendezvous ports, so the server knows its public endpoint and its NAT's mapping
behaviour from addresses the server *observed* (see :mod:`.rendezvous`).

Punch-through follows RakNet's NatPunchthroughServer (reference §2.1):

1. ``connect{peer}`` queues an attempt. A peer takes part in one attempt at a time
   (RakNet's per-user ``isReady``): concurrent punches from one socket would
   interleave new NAT mappings and break port prediction. A pair already queued
   or running, in either direction, gets ``already_in_progress``.
2. When both peers are free the server sends ``punch_prepare`` to both; each
   re-probes the rendezvous ports with the attempt number (RakNet's
   GET_MOST_RECENT_PORT) and answers ``punch_ready`` with its local candidates.
3. With both ready the server picks ``t_go = now + max(4 x max(rtt_a, rtt_b),
   100 ms)`` (``now + 1.5 s`` if an RTT is unknown) and sends each side
   ``punch_start`` with ``delay_ms = t_go - now - rtt/2``: the frame takes half
   an RTT to arrive, so both sides start the ladder at the same instant.
4. A phase that does not reach ``punch_start`` within 10 s ends with
   ``target_unresponsive`` to both (RakNet's server timeout); a peer that
   disconnects ends its attempts with ``connection_lost`` to the other side.
5. Each side reports ``punch_result`` when its ladder ends (RakNet's
   CLIENT_READY); it is then free for its next queued attempt.

Mesh sessions follow FullyConnectedMesh2's verified join (reference §2.6): the
joiner gets ``join_start`` with every member, connects to each (punch attempts
above), reports ``join_result``; when it reached all current members the host
gets ``join_capable`` and answers ``join_answer``; an accepted joiner gets the
next seniority number and everyone gets ``member_joined``. The host is always the
present member with the lowest seniority, so when the host leaves the next-oldest
member is host without any vote, and every client computes the same answer from
the membership it already has.

The core does no I/O and has the core API's stream shape
(:class:`~crossroads.proto.core.StreamCore`): the transport feeds frames
(``receive_data``), connection events, rendezvous datagrams and the clock, and
collects frames to send (``data_to_send``) and connections to close.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from crossroads.errors import DecodeError
from crossroads.proto.admission import Admitter, LocalTable
from crossroads.proto.budget import BudgetConfig, FailureBudget
from crossroads.proto.core import EventQueue
from crossroads.proto.punch import signalling as sig
from crossroads.proto.punch.rendezvous import (
    OBSERVED_SIZE,
    TOKEN_BYTES,
    Observed,
    Probe,
    classify_mapping,
)
from crossroads.proto.reflection import DROP_REFLECTION, ReflectionBudget
from crossroads.types import Address, frozen

#: RakNet's server-side phase timeout: "after 10 000 ms in phase" the attempt is
#: declared unresponsive (reference §2.1 step 4).
PHASE_TIMEOUT = 10.0
#: Start-time formula of RakNet (reference §2.1 step 3): 4 x the larger RTT, at
#: least 100 ms; 1.5 s when an RTT is unknown.
START_RTT_FACTOR = 4.0
START_MINIMUM = 0.1
START_UNKNOWN_RTT = 1.5
#: How long after ``t_go`` a started attempt may run before the server frees both
#: peers even without ``punch_result``: the client ladder's longest run (the
#: birthday step, about 12 s) plus margin.
LADDER_TIMEOUT = 30.0
#: Application-level RTT probes, so the start time follows current conditions.
PING_INTERVAL = 10.0
#: A connection that answers no ping for this long is dead (3 missed pings).
PING_DEAD_AFTER = 3 * PING_INTERVAL
#: A verified join must finish within this (punching N members, one at a time).
JOIN_TIMEOUT = 90.0
#: The host must answer ``join_capable`` within this (RakNet leaves it to the
#: game; we bound it so a dead host cannot hold joiners forever).
JOIN_ANSWER_TIMEOUT = 10.0
#: Attempts one peer may have queued: a 32-member join needs 31.
MAX_QUEUED_ATTEMPTS = 32
#: Sessions one peer may host at once.
MAX_HOSTED_SESSIONS = 4
#: Per-connection frame budget: 20 frames/s sustained, bursts of 60 (a 32-member
#: join sends about two frames per member in a burst).
FRAME_RATE = 20.0
FRAME_BURST = 60.0
#: Rendezvous probes per peer: 10/s, bursts of 30 (three ports, retransmitted).
PROBE_RATE = 10.0
PROBE_BURST = 30.0
#: After this many bad or rate-limited frames a connection is closed (1008).
MAX_STRIKES = 50
#: Invite code alphabet: no 0/O, 1/I/L; prime length (31) like OpenTTD's codes so
#: that nearby values give unlike codes (reference openttd-coordinator.md).
CODE_ALPHABET = "23456789ABCDEFGHJKMNPQRSTUVWXYZ"
CODE_LENGTH = 8


CLOSE_POLICY = 1008
CLOSE_TRY_AGAIN = 1013
CLOSE_PROTOCOL = 1002


#: Relay frames over the WebSocket (binary, see docs/p2p-protocol.md): the last
#: resort when no UDP path exists (even with UDP blocked: the WebSocket is TCP).
#: 256 KiB/s per connection with 64 KiB bursts carries chat, lobby and modest game
#: state; heavy traffic belongs on TURN. One frame holds one sealed datagram.
RELAY_BYTES_RATE = 256 * 1024
RELAY_BYTES_BURST = 64 * 1024
RELAY_MAX_FRAME = 1 + 8 + 1400 + 64
RELAY_FRAME = 0x01


@frozen
class CoordinatorConfig:
    """Limits of one coordinator (the service fills these from its config)."""

    max_connections: int = 10_000
    max_connections_per_ip: int = 64
    #: Rendezvous endpoints handed to clients in ``welcome`` (primary, alt, alt2).
    udp: tuple[sig.TransportAddress, ...] = ()
    #: Relay budget per connection, bytes per second (bursts of a quarter of it,
    #: at least 64 KiB).
    relay_bytes_per_second: int = RELAY_BYTES_RATE


# ------------------------------------------------------------------------ events


@frozen
class FrameRejected:
    """A frame was refused; ``reason`` is a metric label."""

    reason: str


@frozen
class ProbeDropped:
    reason: str


@frozen
class PunchFinished:
    """One side's ladder outcome, or a server-side failure (``side`` = "server")."""

    ok: bool
    step: str
    seconds: float
    side: str


@frozen
class LadderSide:
    """One side of a concluded attempt, as the server saw it."""

    #: Its public IP as the rendezvous port saw it ("" if never probed).
    host: str
    #: The mapping behaviour classified from its three probes ("unknown").
    mapping: str
    #: Its signalling round trip in seconds, if measured.
    rtt: float | None
    #: Its punch_result: (ok, step, ms), or None if it never reported.
    result: tuple[bool, str, int] | None


@frozen
class LadderConcluded:
    """One punch attempt is over (both reported, the server gave up on it,
    or a side left): what the insight record is written from. The server
    sees each side's outcome and winning step (``punch_result``), not the
    rungs below it."""

    attempt: int
    #: When it was queued, started (t_go; None: never) and ended.
    created: float
    started: float | None
    ended: float
    initiator: LadderSide
    responder: LadderSide
    #: Why the server ended it without both results ("target_unresponsive",
    #: "connection_lost", "ladder_timeout"), "" when both reported.
    reason: str


@frozen
class CodeClaim:
    """Directory mode: claim ``code`` for ``session`` in the store shared by the
    instances; answer with :meth:`Coordinator.code_claimed`."""

    session: str
    code: str


@frozen
class CodeReleased:
    """Directory mode: the session behind ``code`` ended (drop its claim)."""

    code: str


@frozen
class CodeLookup:
    """Directory mode: ``join`` named a code no local session holds; find the
    instance that holds it and answer with :meth:`Coordinator.code_located`."""

    peer: str
    code: str


Event = (
    FrameRejected
    | ProbeDropped
    | PunchFinished
    | LadderConcluded
    | CodeClaim
    | CodeReleased
    | CodeLookup
)


# ------------------------------------------------------------------------- state


@dataclass(slots=True)
class _Bucket:
    rate: float
    burst: float
    tokens: float
    last: float

    def take(self, now: float) -> bool:
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


@frozen
class SessionSummary:
    """One open mesh session as an operator sees it."""

    session: str
    code: str
    members: int
    max_members: int
    #: IP of the host's signalling connection ("" while unknown).
    host_ip: str


@dataclass(slots=True)
class _Conn:
    id: int
    ip: str
    bucket: _Bucket
    relay_bucket: _Bucket
    peer: str | None = None
    strikes: int = 0
    last_rate_error: float = -1e9


@dataclass(slots=True)
class _Peer:
    id: str
    conn: int
    key: bytes
    name: str
    token: bytes
    probe_bucket: _Bucket
    rtt: float | None = None
    ping_id: int = 0
    ping_sent: float | None = None
    last_pong: float = 0.0
    next_ping: float = 0.0
    #: Rendezvous observations: attempt -> port index -> address.
    observed: dict[int, dict[int, Address]] = field(default_factory=dict)
    attempt: int | None = None
    queued: int = 0
    sessions: set[str] = field(default_factory=set)
    joining: set[str] = field(default_factory=set)
    #: TURN credentials were handed to this peer (hosted before a second
    #: member came, a member gets them pushed once when one does).
    has_turn: bool = False


@dataclass(slots=True)
class _Attempt:
    id: int
    a: str
    b: str
    created: float
    phase: str = "queued"  # queued -> preparing -> started
    deadline: float = 0.0
    ready: dict[str, sig.Candidates] = field(default_factory=dict)
    reported: set[str] = field(default_factory=set)
    t_go: float = 0.0
    #: Each side's punch_result (ok, step, ms) and what the server knew of
    #: it at the start (public IP, mapping), for :class:`LadderConcluded`.
    results: dict[str, tuple[bool, str, int]] = field(default_factory=dict)
    seen: dict[str, tuple[str, str]] = field(default_factory=dict)


@dataclass(slots=True)
class _Join:
    peer: str
    deadline: float
    capable: bool = False


@dataclass(slots=True)
class _Session:
    id: str
    code: str
    max_members: int
    #: The IP that opened the session: its admission is charged to it until
    #: the session ends, whoever is host by then.
    source: str = ""
    members: dict[str, sig.Member] = field(default_factory=dict)
    next_seniority: int = 0
    joins: dict[str, _Join] = field(default_factory=dict)
    #: False while the code's claim in the shared directory is pending.
    claimed: bool = True

    def host(self) -> str:
        if not self.members:
            return ""
        return min(self.members.values(), key=lambda m: m.seniority).peer


class Coordinator(EventQueue[Event]):
    """The sans-I/O signalling server (see the module docstring)."""

    def __init__(
        self,
        config: CoordinatorConfig,
        random_bytes: Callable[[int], bytes],
        turn_credentials: Callable[[str], sig.TurnInfo | None] | None = None,
        *,
        directory: bool = False,
        reflection: ReflectionBudget | None = None,
        guesses: FailureBudget | None = None,
        sessions: Admitter | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        #: Hosted sessions per source and in total (docs/security.md, issue
        #: 24: three sessions from one IP took the whole TURN quota).
        self.session_admission: Admitter = sessions or LocalTable()
        #: Rendezvous answers per source IP (docs/security.md, "Reflection
        #: budget"): a token holder can spoof the source; None: no budget.
        self.reflection = ReflectionBudget.or_unlimited(reflection)
        #: Budget of joins naming a code no session holds, per source IP and in
        #: total (without it, one IP guessed 1,272 codes a second over 64 WebSockets).
        self.guesses = guesses or FailureBudget(BudgetConfig(0.0, 1.0, 0.0, 1.0))
        #: Invite codes are shared with other instances through a directory (the
        #: service's store): codes are claimed before ``hosted`` and a join for a
        #: code held elsewhere is redirected there (see :class:`CodeClaim`).
        self.directory = directory
        self._random = random_bytes
        #: Makes TURN credentials for a peer id (the service supplies the wall
        #: clock and the shared secret); None: no TURN for anyone.
        self._turn_credentials = turn_credentials
        self._conns: dict[int, _Conn] = {}
        self._per_ip: dict[str, int] = {}
        self._peers: dict[str, _Peer] = {}
        self._tokens: dict[bytes, str] = {}
        self._sessions: dict[str, _Session] = {}
        self._codes: dict[str, str] = {}
        self._attempts: dict[int, _Attempt] = {}
        self._next_attempt = 1
        self._out: list[tuple[int, str]] = []
        self._close: list[tuple[int, int, str]] = []

    def set_turn_credentials(
        self, make: Callable[[str], sig.TurnInfo | None] | None
    ) -> None:
        """Hand out TURN credentials (``make(peer_id)``) to session members in
        ``hosted``, ``join_start`` and ``turn``."""
        self._turn_credentials = make

    # ------------------------------------------------------------- introspection

    @property
    def peer_count(self) -> int:
        return len(self._peers)

    @property
    def session_count(self) -> int:
        return len(self._sessions)

    @property
    def attempt_count(self) -> int:
        return len(self._attempts)

    def live_codes(self) -> list[str]:
        """Codes of the sessions whose directory claim succeeded."""
        return [s.code for s in self._sessions.values() if s.claimed]

    def session_members(self, session: str) -> list[str]:
        s = self._sessions.get(session)
        return [] if s is None else list(s.members)

    def session_summaries(self) -> list[SessionSummary]:
        """Every open session, for operators (no keys or tokens)."""
        out = []
        for s in self._sessions.values():
            host = self._peers.get(s.host())
            out.append(
                SessionSummary(
                    session=s.id,
                    code=s.code,
                    members=len(s.members),
                    max_members=s.max_members,
                    host_ip=self._conns[host.conn].ip
                    if host is not None and host.conn in self._conns
                    else "",
                )
            )
        return out

    def end_session(self, session: str) -> bool:
        """Close every member's signalling connection (an operator's kick); the
        usual connection-lost path then dissolves the session."""
        s = self._sessions.get(session)
        if s is None:
            return False
        for peer_id in list(s.members):
            peer = self._peers.get(peer_id)
            if peer is not None:
                self._close.append((peer.conn, CLOSE_POLICY, "removed by the operator"))
        return True

    # ------------------------------------------------------------------- outputs

    def data_to_send(self) -> list[tuple[int, str]]:
        """(connection id, text frame) pairs, in order (the core API's
        :class:`~crossroads.proto.core.StreamCore` output)."""
        out, self._out = self._out, []
        return out

    def connections_to_close(self) -> list[tuple[int, int, str]]:
        """(connection id, WebSocket close code, reason)."""
        out, self._close = self._close, []
        return out

    def get_timer(self) -> float | None:
        deadlines = [a.deadline for a in self._attempts.values() if a.phase != "queued"]
        deadlines.extend(p.next_ping for p in self._peers.values())
        for s in self._sessions.values():
            deadlines.extend(j.deadline for j in s.joins.values())
        return min(deadlines) if deadlines else None

    # -------------------------------------------------------------------- inputs

    def connection_made(self, conn: int, ip: str, now: float) -> bool:
        """A WebSocket was accepted. Returns False (and queues a close) when a
        connection limit is reached."""
        if len(self._conns) >= self.config.max_connections:
            self._close.append((conn, CLOSE_TRY_AGAIN, "server full"))
            self._events.append(FrameRejected("server-full"))
            return False
        if self._per_ip.get(ip, 0) >= self.config.max_connections_per_ip:
            self._close.append((conn, CLOSE_TRY_AGAIN, "too many connections from IP"))
            self._events.append(FrameRejected("ip-limit"))
            return False
        self._per_ip[ip] = self._per_ip.get(ip, 0) + 1
        relay_rate = float(self.config.relay_bytes_per_second)
        relay_burst = max(float(RELAY_BYTES_BURST), relay_rate / 4)
        self._conns[conn] = _Conn(
            conn,
            ip,
            _Bucket(FRAME_RATE, FRAME_BURST, FRAME_BURST, now),
            _Bucket(relay_rate, relay_burst, relay_burst, now),
        )
        return True

    def connection_lost(self, conn: int, now: float) -> None:
        c = self._conns.pop(conn, None)
        if c is None:
            return
        left = self._per_ip.get(c.ip, 1) - 1
        if left <= 0:
            self._per_ip.pop(c.ip, None)
        else:
            self._per_ip[c.ip] = left
        if c.peer is not None:
            self._remove_peer(c.peer, now)

    def receive_data(self, conn: int, data: str | bytes, now: float) -> None:
        """One WebSocket message from a client (text, or binary holding UTF-8
        JSON): the core API's :class:`~crossroads.proto.core.StreamCore` input."""
        c = self._conns.get(conn)
        if c is None:
            return
        if not c.bucket.take(now):
            self._events.append(FrameRejected("rate-limited"))
            if now - c.last_rate_error >= 1.0:
                # At most one error frame per second: the answer to a flood must
                # not be a flood.
                c.last_rate_error = now
                self._error(conn, "rate_limited", "too many frames; slow down", "")
            self._strike(c)
            return
        try:
            message = sig.decode_client(data)
        except DecodeError as exc:
            self._events.append(FrameRejected(exc.reason))
            code = {
                "bad-json": "bad_json",
                "not-object": "bad_json",
                "unknown-type": "unknown_type",
                "too-large": "too_large",
            }.get(exc.reason, "bad_message")
            self._error(conn, code, str(exc), sig.message_type(data))
            self._strike(c)
            return
        if c.peer is None:
            if not isinstance(message, sig.Hello):
                self._events.append(FrameRejected("hello-required"))
                self._error(
                    conn,
                    "hello_required",
                    "the first frame must be hello",
                    message.TYPE,
                )
                self._strike(c)
                return
            self._hello(c, message, now)
            return
        peer = self._peers[c.peer]
        match message:
            case sig.Hello():
                self._error(conn, "already_hello", "hello was already sent", "hello")
            case sig.Ping(id=ping_id):
                self._send(peer, sig.Pong(ping_id))
            case sig.Pong(id=pong_id):
                self._pong(peer, pong_id, now)
            case sig.Host():
                self._host(peer, message)
            case sig.Join():
                self._join(peer, message, now)
            case sig.JoinResult():
                self._join_result(peer, message, now)
            case sig.JoinAnswer():
                self._join_answer(peer, message)
            case sig.Leave(session=session_id):
                self._leave(peer, session_id, now)
            case sig.Connect(peer=target):
                self._connect(peer, target, now)
            case sig.PunchReady():
                self._punch_ready(peer, message, now)
            case sig.PunchResult():
                self._punch_result(peer, message, now)
            case sig.Signal():
                self._signal(peer, message)
            case sig.TurnRefresh():
                self._turn_refresh(peer)
            case _:  # pragma: no cover - every client type is handled above
                self._error(conn, "unknown_type", "not a client message", message.TYPE)

    def relay_route(
        self, conn: int, frame: bytes, now: float
    ) -> tuple[int, bytes] | None:
        """Route a binary relay frame ``0x01 | peer id (8) | datagram``.

        Returns (target connection, frame to send it) or None (dropped and
        counted). This is the relay's data plane: a few dict lookups, no parsing
        of the datagram, which is end-to-end sealed and opaque to the server.
        """
        c = self._conns.get(conn)
        if c is None or c.peer is None:
            self._events.append(FrameRejected("relay-before-hello"))
            return None
        if len(frame) < 10 or len(frame) > RELAY_MAX_FRAME or frame[0] != RELAY_FRAME:
            self._events.append(FrameRejected("relay-bad-frame"))
            return None
        c.relay_bucket.tokens = min(
            c.relay_bucket.burst,
            c.relay_bucket.tokens + (now - c.relay_bucket.last) * c.relay_bucket.rate,
        )
        c.relay_bucket.last = now
        if c.relay_bucket.tokens < len(frame):
            self._events.append(FrameRejected("relay-rate-limited"))
            return None
        c.relay_bucket.tokens -= len(frame)
        target = self._peers.get(frame[1:9].hex())
        source = self._peers[c.peer]
        if target is None or target is source or not self._related(source, target):
            self._events.append(FrameRejected("relay-no-route"))
            return None
        return target.conn, bytes([RELAY_FRAME]) + bytes.fromhex(source.id) + frame[9:]

    def receive_rendezvous(
        self, data: bytes, addr: Address, index: int, now: float
    ) -> bytes | None:
        """A datagram on rendezvous port ``index``; returns the answer, if any."""
        self.reflection.received(addr[0], len(data), now)
        try:
            probe = Probe.decode(data)
        except DecodeError as exc:
            self._events.append(ProbeDropped(exc.reason))
            return None
        peer_id = self._tokens.get(probe.token)
        if peer_id is None:
            self._events.append(ProbeDropped("unknown-token"))
            return None
        peer = self._peers[peer_id]
        if not peer.probe_bucket.take(now):
            self._events.append(ProbeDropped("rate-limited"))
            return None
        # Record only the initial probes (attempt 0) and the peer's current
        # attempt, so a stale or forged attempt number cannot grow the table.
        if probe.attempt == 0 or probe.attempt == peer.attempt:
            peer.observed.setdefault(probe.attempt, {})[index] = addr
            for stale in [a for a in peer.observed if a not in (0, peer.attempt)]:
                del peer.observed[stale]
        if not self.reflection.allow(addr[0], OBSERVED_SIZE, now):
            self._events.append(ProbeDropped(DROP_REFLECTION))
            return None
        return Observed(probe.attempt, probe.seq, index, addr[0], addr[1]).encode()

    def handle_timer(self, now: float) -> None:
        for peer in list(self._peers.values()):
            if peer.ping_sent is not None and now - peer.last_pong >= PING_DEAD_AFTER:
                self._close.append((peer.conn, CLOSE_POLICY, "no pong"))
                self.connection_lost(peer.conn, now)
                continue
            if now >= peer.next_ping:
                self._ping(peer, now)
        for attempt in list(self._attempts.values()):
            if attempt.phase == "preparing" and now >= attempt.deadline:
                self._fail_attempt(attempt, "target_unresponsive", now)
            elif attempt.phase == "started" and now >= attempt.deadline:
                self._end_attempt(attempt, now, "ladder_timeout")
        for session in list(self._sessions.values()):
            for join in list(session.joins.values()):
                if now >= join.deadline:
                    self._reject_join(session, join.peer, "join timed out")
        self._schedule(now)

    # ------------------------------------------------------------------- helpers

    def _send(self, peer: _Peer, message: sig.Message) -> None:
        self._out.append((peer.conn, sig.encode(message)))

    def _error(self, conn: int, code: str, message: str, ref: str) -> None:
        self._out.append((conn, sig.encode(sig.Error(code, message[:400], ref))))

    def _strike(self, c: _Conn) -> None:
        c.strikes += 1
        if c.strikes == MAX_STRIKES:
            self._close.append((c.id, CLOSE_POLICY, "too many bad frames"))

    def _new_id(self) -> str:
        return self._random(8).hex()

    def _hello(self, c: _Conn, hello: sig.Hello, now: float) -> None:
        if hello.v != sig.PROTOCOL_VERSION:
            self._error(
                c.id,
                "unsupported_version",
                f"this server speaks version {sig.PROTOCOL_VERSION}",
                "hello",
            )
            self._close.append((c.id, CLOSE_PROTOCOL, "unsupported version"))
            return
        peer_id = self._new_id()
        while peer_id in self._peers:  # pragma: no cover - 64 random bits
            peer_id = self._new_id()
        token = self._random(TOKEN_BYTES)
        peer = _Peer(
            id=peer_id,
            conn=c.id,
            key=hello.key,
            name=hello.name,
            token=token,
            probe_bucket=_Bucket(PROBE_RATE, PROBE_BURST, PROBE_BURST, now),
            last_pong=now,
        )
        c.peer = peer_id
        self._peers[peer_id] = peer
        self._tokens[token] = peer_id
        self._send(
            peer,
            sig.Welcome(
                sig.PROTOCOL_VERSION,
                peer_id,
                token.hex(),
                c.ip,
                self.config.udp,
                # No TURN credentials for an anonymous socket (with
                # them one IP made 3,000 allocations): hosted / join_start /
                # turn_refresh hand them to peers in a session.
                None,
            ),
        )
        self._ping(peer, now)

    def _turn(self, peer: _Peer) -> sig.TurnInfo | None:
        """TURN credentials for a peer that is joining a session or in one
        with somebody else (:meth:`_entitled`)."""
        if self._turn_credentials is None or not self._entitled(peer):
            return None
        peer.has_turn = True
        return self._turn_credentials(peer.id)

    def _entitled(self, peer: _Peer) -> bool:
        """The relay is for reaching other members: a peer is entitled to TURN
        credentials while it joins a session, or while a session of its has a
        second member or joiner. A host alone in its session is not (otherwise
        three ``host`` frames from one IP, no account, gave three credentials
        and the whole TURN quota); nor is an anonymous socket (a free relay)."""
        if peer.joining:
            return True
        for session_id in peer.sessions:
            session = self._sessions.get(session_id)
            if session is not None and len(session.members) + len(session.joins) > 1:
                return True
        return False

    def _share_turn(self, session: _Session) -> None:
        """A session just got a second participant: members that never had
        credentials get them now (an SDK host allocates on this ``turn``)."""
        if self._turn_credentials is None:
            return
        for member in session.members.values():
            other = self._peers.get(member.peer)
            if other is not None and not other.has_turn:
                turn = self._turn(other)
                if turn is not None:
                    self._send(other, sig.Turn(turn))

    def _turn_refresh(self, peer: _Peer) -> None:
        """Fresh credentials, for a peer entitled to them only: the relay is
        for reaching session members, not for anyone who opens a WebSocket
        or hosts a session nobody joined."""
        if not self._entitled(peer):
            self._error(
                peer.conn, "not_in_session", "TURN is for session members", "turn"
            )
            return
        turn = self._turn(peer)
        if turn is None:
            self._error(peer.conn, "no_turn", "this server hands out no TURN", "turn")
            return
        self._send(peer, sig.Turn(turn))

    def _ping(self, peer: _Peer, now: float) -> None:
        peer.ping_id += 1
        peer.ping_sent = now
        peer.next_ping = now + PING_INTERVAL
        self._send(peer, sig.Ping(peer.ping_id))

    def _pong(self, peer: _Peer, pong_id: int, now: float) -> None:
        if pong_id != peer.ping_id or peer.ping_sent is None:
            return
        sample = max(0.0, now - peer.ping_sent)
        # EWMA with gain 1/4, TCP's SRTT smoothing (RFC 6298 uses 1/8; ping samples
        # are 10 s apart, so we follow changes faster).
        peer.rtt = sample if peer.rtt is None else 0.75 * peer.rtt + 0.25 * sample
        peer.last_pong = now
        peer.ping_sent = None

    def _remove_peer(self, peer_id: str, now: float) -> None:
        peer = self._peers.pop(peer_id, None)
        if peer is None:
            return
        self._tokens.pop(peer.token, None)
        for attempt in list(self._attempts.values()):
            if peer_id in (attempt.a, attempt.b):
                other = attempt.b if attempt.a == peer_id else attempt.a
                other_peer = self._peers.get(other)
                if other_peer is not None and attempt.phase != "started":
                    self._send(
                        other_peer,
                        sig.PunchFailed(attempt.id, peer_id, "connection_lost"),
                    )
                self._drop_attempt(attempt, now, "connection_lost")
        for session_id in list(peer.sessions | peer.joining):
            self._leave(peer, session_id, now, removing=True)
        self._schedule(now)

    # ------------------------------------------------------------------ sessions

    def _new_code(self) -> str:
        while True:
            raw = int.from_bytes(self._random(8), "big")
            chars = []
            for _ in range(CODE_LENGTH):
                raw, digit = divmod(raw, len(CODE_ALPHABET))
                chars.append(CODE_ALPHABET[digit])
            code = "".join(chars[:4]) + "-" + "".join(chars[4:])
            if code not in self._codes:
                return code

    def _host(self, peer: _Peer, host: sig.Host) -> None:
        hosted = sum(1 for s in peer.sessions if self._sessions[s].host() == peer.id)
        if hosted >= MAX_HOSTED_SESSIONS:
            self._error(peer.conn, "limit", "too many hosted sessions", "host")
            return
        source = self._source(peer)
        refused = self.session_admission.admit(source)
        if refused is not None:
            self._events.append(FrameRejected(f"sessions-{refused}"))
            self._error(
                peer.conn,
                "limit",
                "too many sessions from this address"
                if refused == "over-ip-limit"
                else "too many sessions on this server",
                "host",
            )
            return
        session = _Session(
            self._new_id(), self._new_code(), host.max_members, source=source
        )
        member = sig.Member(peer.id, peer.key, 0)
        session.members[peer.id] = member
        session.next_seniority = 1
        self._sessions[session.id] = session
        self._codes[session.code] = session.id
        peer.sessions.add(session.id)
        if self.directory:
            session.claimed = False
            self._events.append(CodeClaim(session.id, session.code))
            return
        # No TURN yet: the session has nobody to relay to (see _entitled).
        self._send(peer, sig.Hosted(session.id, session.code, 0, None))

    def code_claimed(self, session_id: str, ok: bool) -> None:
        """The directory's answer to :class:`CodeClaim`: ``ok`` False means
        another instance holds the code, so the session draws another."""
        session = self._sessions.get(session_id)
        if session is None or session.claimed:
            return  # the host left meanwhile (its CodeReleased follows the claim)
        if not ok:
            self._codes.pop(session.code, None)
            session.code = self._new_code()
            self._codes[session.code] = session.id
            self._events.append(CodeClaim(session.id, session.code))
            return
        session.claimed = True
        host = self._peers.get(session.host())
        if host is not None:
            self._send(host, sig.Hosted(session.id, session.code, 0, None))

    def code_located(self, peer_id: str, code: str, url: str | None) -> None:
        """The directory's answer to :class:`CodeLookup`: the signalling URL of
        the instance holding ``code``, or None when no instance does."""
        peer = self._peers.get(peer_id)
        if peer is None:
            return
        if url is None:
            self._error(peer.conn, "unknown_code", "no session has this code", "join")
        else:
            self.guesses.refund(self._source(peer))
            self._send(peer, sig.Redirect(code, url))

    @staticmethod
    def normalize_code(code: str) -> str:
        """Invite codes are case-insensitive and the dash is optional."""
        text = code.strip().upper().replace("-", "").replace(" ", "")
        return text[:4] + "-" + text[4:] if len(text) == CODE_LENGTH else text

    @staticmethod
    def looks_like_code(code: str) -> bool:
        """A normalized code of the right shape (worth asking the directory)."""
        head, dash, tail = code.partition("-")
        return (
            bool(dash)
            and len(head) + len(tail) == CODE_LENGTH
            and all(c in CODE_ALPHABET for c in head + tail)
        )

    def _source(self, peer: _Peer) -> str:
        conn = self._conns.get(peer.conn)
        return conn.ip if conn is not None else ""

    def _join(self, peer: _Peer, join: sig.Join, now: float) -> None:
        source = self._source(peer)
        # The guess is paid for before the lookup and refunded when the code
        # was right (proto/budget.py), so a spent budget says nothing of a code.
        if not self.guesses.try_spend(source, now):
            self._events.append(FrameRejected("guess-budget"))
            self._error(
                peer.conn, "rate_limited", "too many unknown codes; retry later", "join"
            )
            return
        code = self.normalize_code(join.code)
        session_id = self._codes.get(code)
        session = self._sessions.get(session_id) if session_id else None
        if session is None or not session.claimed:
            if self.directory and session is None and self.looks_like_code(code):
                self._events.append(CodeLookup(peer.id, code))
                return
            self._error(peer.conn, "unknown_code", "no session has this code", "join")
            return
        self.guesses.refund(source)
        if peer.id in session.members:
            self._error(peer.conn, "already_member", "already in this session", "join")
            return
        if (
            len(session.members) + len(session.joins) - (peer.id in session.joins)
            >= session.max_members
        ):
            self._error(peer.conn, "session_full", "the session is full", "join")
            return
        session.joins[peer.id] = _Join(peer.id, now + JOIN_TIMEOUT)
        peer.joining.add(session.id)
        self._send_join_start(peer, session)
        self._share_turn(session)

    def _send_join_start(self, peer: _Peer, session: _Session) -> None:
        """Step 1 of a verified join: the members ``peer`` must reach first."""
        self._send(
            peer,
            sig.JoinStart(
                session.id,
                session.host(),
                tuple(session.members.values()),
                self._turn(peer),
            ),
        )

    def _join_result(self, peer: _Peer, result: sig.JoinResult, now: float) -> None:
        session = self._sessions.get(result.session)
        join = session.joins.get(peer.id) if session else None
        if session is None or join is None:
            self._error(peer.conn, "not_joining", "no join in progress", "join_result")
            return
        if result.failed:
            self._reject_join(
                session, peer.id, "could not reach " + ", ".join(result.failed[:4])
            )
            return
        missing = set(session.members) - set(result.connected)
        if missing:
            # Members changed during the join: repeat step 1 (reference §2.6).
            self._send_join_start(peer, session)
            return
        join.capable = True
        join.deadline = now + JOIN_ANSWER_TIMEOUT
        self._send(
            self._peers[session.host()],
            sig.JoinCapable(session.id, peer.id, peer.key),
        )

    def _join_answer(self, peer: _Peer, answer: sig.JoinAnswer) -> None:
        session = self._sessions.get(answer.session)
        if session is None or session.host() != peer.id:
            self._error(
                peer.conn, "not_host", "only the host answers joins", "join_answer"
            )
            return
        join = session.joins.get(answer.peer)
        if join is None or not join.capable:
            self._error(
                peer.conn, "not_joining", "no such capable joiner", "join_answer"
            )
            return
        if not answer.accept:
            self._reject_join(session, answer.peer, answer.reason or "rejected by host")
            return
        del session.joins[answer.peer]
        joiner = self._peers[answer.peer]
        joiner.joining.discard(session.id)
        member = sig.Member(joiner.id, joiner.key, session.next_seniority)
        session.next_seniority += 1
        for other in session.members.values():
            self._send(self._peers[other.peer], sig.MemberJoined(session.id, member))
        session.members[joiner.id] = member
        joiner.sessions.add(session.id)
        self._send(
            joiner,
            sig.JoinAccepted(
                session.id,
                member.seniority,
                session.host(),
                tuple(session.members.values()),
            ),
        )

    def _reject_join(self, session: _Session, peer_id: str, reason: str) -> None:
        session.joins.pop(peer_id, None)
        joiner = self._peers.get(peer_id)
        if joiner is not None:
            joiner.joining.discard(session.id)
            self._send(joiner, sig.JoinRejected(session.id, reason))

    def _leave(
        self, peer: _Peer, session_id: str, now: float, *, removing: bool = False
    ) -> None:
        session = self._sessions.get(session_id)
        if session is None or (
            peer.id not in session.members and peer.id not in session.joins
        ):
            if not removing:
                self._error(peer.conn, "not_member", "not in this session", "leave")
            return
        peer.sessions.discard(session_id)
        peer.joining.discard(session_id)
        if session.joins.pop(peer.id, None) is not None:
            return
        old_host = session.host()
        del session.members[peer.id]
        if not session.members:
            for join in list(session.joins.values()):
                self._reject_join(session, join.peer, "session closed")
            del self._sessions[session_id]
            self.session_admission.release(session.source)
            self._codes.pop(session.code, None)
            if self.directory:
                self._events.append(CodeReleased(session.code))
            return
        new_host = session.host()
        for member in session.members.values():
            self._send(
                self._peers[member.peer], sig.MemberLeft(session_id, peer.id, new_host)
            )
        if new_host != old_host:
            # Host migration: capable joiners wait on the old host's answer; ask
            # the new host instead.
            for join in session.joins.values():
                if join.capable:
                    joiner = self._peers[join.peer]
                    join.deadline = now + JOIN_ANSWER_TIMEOUT
                    self._send(
                        self._peers[new_host],
                        sig.JoinCapable(session_id, joiner.id, joiner.key),
                    )

    def _related(self, a: _Peer, b: _Peer) -> bool:
        """Peers may punch or signal each other when they share a session or one
        is joining a session the other belongs to."""
        if a.sessions & b.sessions:
            return True
        return bool(a.joining & b.sessions) or bool(b.joining & a.sessions)

    def _signal(self, peer: _Peer, signal: sig.Signal) -> None:
        target = self._peers.get(signal.to)
        if target is None:
            self._error(peer.conn, "unknown_peer", "no such peer", "signal")
            return
        if not self._related(peer, target):
            self._error(
                peer.conn, "not_permitted", "peer is not in your session", "signal"
            )
            return
        self._send(target, sig.SignalFrom(peer.id, signal.data))

    # ------------------------------------------------------------------ punching

    def _connect(self, peer: _Peer, target_id: str, now: float) -> None:
        target = self._peers.get(target_id)
        if target is None or target is peer:
            self._send(peer, sig.PunchFailed(0, target_id, "target_not_connected"))
            return
        if not self._related(peer, target):
            self._error(
                peer.conn, "not_permitted", "peer is not in your session", "connect"
            )
            return
        for attempt in self._attempts.values():
            if {attempt.a, attempt.b} == {peer.id, target.id}:
                self._send(
                    peer, sig.PunchFailed(attempt.id, target_id, "already_in_progress")
                )
                return
        if peer.queued >= MAX_QUEUED_ATTEMPTS or target.queued >= MAX_QUEUED_ATTEMPTS:
            self._send(peer, sig.PunchFailed(0, target_id, "too_many_attempts"))
            return
        attempt = _Attempt(self._next_attempt, peer.id, target.id, now)
        self._next_attempt += 1
        self._attempts[attempt.id] = attempt
        peer.queued += 1
        target.queued += 1
        self._schedule(now)

    def _schedule(self, now: float) -> None:
        """Start every queued attempt whose two peers are free, oldest first."""
        for attempt in list(self._attempts.values()):
            if attempt.phase != "queued":
                continue
            a, b = self._peers.get(attempt.a), self._peers.get(attempt.b)
            if a is None or b is None:  # pragma: no cover - removed with the peer
                continue
            if a.attempt is not None or b.attempt is not None:
                continue
            attempt.phase = "preparing"
            attempt.deadline = now + PHASE_TIMEOUT
            a.attempt = b.attempt = attempt.id
            self._send(a, sig.PunchPrepare(attempt.id, b.id))
            self._send(b, sig.PunchPrepare(attempt.id, a.id))

    def _attempt_of(self, peer: _Peer, attempt_id: int, phase: str) -> _Attempt | None:
        """Attempt ``attempt_id`` if ``peer`` is one of its two sides and it is
        in ``phase``; None for anything else a client may claim."""
        attempt = self._attempts.get(attempt_id)
        if attempt is None or peer.id not in (attempt.a, attempt.b):
            return None
        return attempt if attempt.phase == phase else None

    def _punch_ready(self, peer: _Peer, ready: sig.PunchReady, now: float) -> None:
        attempt = self._attempt_of(peer, ready.attempt, "preparing")
        if attempt is None:
            self._error(
                peer.conn,
                "unknown_attempt",
                "no such attempt in preparation",
                "punch_ready",
            )
            return
        attempt.ready[peer.id] = ready.candidates
        if len(attempt.ready) < 2:
            return
        a, b = self._peers[attempt.a], self._peers[attempt.b]
        if a.rtt is None or b.rtt is None:
            delay = START_UNKNOWN_RTT
        else:
            delay = max(START_RTT_FACTOR * max(a.rtt, b.rtt), START_MINIMUM)
        attempt.t_go = now + delay
        attempt.phase = "started"
        attempt.deadline = attempt.t_go + LADDER_TIMEOUT
        info_a = self._peer_info(a, attempt)
        info_b = self._peer_info(b, attempt)
        for peer, info in ((a, info_a), (b, info_b)):
            host = info.public.host if info.public is not None else ""
            attempt.seen[peer.id] = (host, info.mapping)
        for me, other, mine, theirs, role in (
            (a, b, info_a, info_b, "initiator"),
            (b, a, info_b, info_a, "responder"),
        ):
            half = (me.rtt or 0.0) / 2
            delay_ms = max(0, round((delay - half) * 1000))
            self._send(
                me,
                sig.PunchStart(
                    attempt.id, other.id, other.key, role, delay_ms, mine, theirs
                ),
            )

    def _concluded(self, attempt: _Attempt, now: float, reason: str) -> LadderConcluded:
        def side(peer_id: str) -> LadderSide:
            peer = self._peers.get(peer_id)
            host, mapping = attempt.seen.get(peer_id, ("", "unknown"))
            return LadderSide(
                host,
                mapping,
                None if peer is None else peer.rtt,
                attempt.results.get(peer_id),
            )

        return LadderConcluded(
            attempt=attempt.id,
            created=attempt.created,
            started=attempt.t_go if attempt.phase == "started" else None,
            ended=now,
            initiator=side(attempt.a),
            responder=side(attempt.b),
            reason="" if len(attempt.results) == 2 else reason or "unreported",
        )

    def _peer_info(self, peer: _Peer, attempt: _Attempt) -> sig.PeerInfo:
        seen = peer.observed.get(attempt.id) or peer.observed.get(0) or {}
        ports = tuple(seen[i][1] for i in sorted(seen))
        mapping, stride = classify_mapping(ports) if len(seen) == 3 else ("unknown", 0)
        public = sig.TransportAddress(*seen[0]) if 0 in seen else None
        candidates = attempt.ready[peer.id]
        if candidates.mapped is not None and (
            public is None or candidates.mapped.host != public.host
        ):
            # A port mapping lives on the peer's public address; any other
            # address is either useless (a mapping inside a carrier-grade NAT)
            # or an attempt to make the other peer send probes somewhere else.
            candidates = dataclasses.replace(candidates, mapped=None)
        return sig.PeerInfo(
            public=public,
            ports=ports,
            mapping=mapping,
            stride=stride,
            candidates=candidates,
        )

    def _punch_result(self, peer: _Peer, result: sig.PunchResult, now: float) -> None:
        attempt = self._attempt_of(peer, result.attempt, "started")
        if attempt is None:
            self._error(
                peer.conn, "unknown_attempt", "no such running attempt", "punch_result"
            )
            return
        if peer.id in attempt.reported:
            return
        attempt.reported.add(peer.id)
        attempt.results[peer.id] = (result.ok, result.step, result.ms)
        self._events.append(
            PunchFinished(
                result.ok,
                result.step,
                result.ms / 1000,
                "initiator" if peer.id == attempt.a else "responder",
            )
        )
        if peer.attempt == attempt.id:
            peer.attempt = None
        if len(attempt.reported) == 2:
            self._end_attempt(attempt, now)
        self._schedule(now)

    def _fail_attempt(self, attempt: _Attempt, reason: str, now: float) -> None:
        for peer_id, other in ((attempt.a, attempt.b), (attempt.b, attempt.a)):
            peer = self._peers.get(peer_id)
            if peer is not None:
                self._send(peer, sig.PunchFailed(attempt.id, other, reason))
        self._events.append(PunchFinished(False, "", 0.0, "server"))
        self._drop_attempt(attempt, now, reason)
        self._schedule(now)

    def _end_attempt(self, attempt: _Attempt, now: float, reason: str = "") -> None:
        self._drop_attempt(attempt, now, reason)

    def _drop_attempt(self, attempt: _Attempt, now: float, reason: str) -> None:
        if self._attempts.pop(attempt.id, None) is not None:
            self._events.append(self._concluded(attempt, now, reason))
        for peer_id in (attempt.a, attempt.b):
            peer = self._peers.get(peer_id)
            if peer is None:
                continue
            peer.queued = max(0, peer.queued - 1)
            if peer.attempt == attempt.id:
                peer.attempt = None
