"""The connection ladder: one client joining one server by invite code.

Theory of operation
-------------------
A :class:`ConnectAttempt` is created when a client sends CLIENT_CONNECT for a
known invite code. It answers GC_CONNECTING (which tells the client the token)
and then walks the ladder of reference ``openttd-coordinator.md`` section 7,
one method at a time, each with its own *tracking number* (1, 2, 3, ...):

1. **Direct**: for each address the registration probe reached (IPv4 first),
   GC_DIRECT_CONNECT to the client.
2. **STUN** (both peers at protocol 3+): GC_STUN_REQUEST to both. Each peer opens
   one STUN connection per address family and reports SERCLI_STUN_RESULT per
   family; the STUN service reports the address it saw. When each side has two
   results (or :attr:`stun_wait` passes) the families both sides reached are
   paired, IPv4 first, and each pair gets GC_STUN_CONNECT to both sides with the
   other side's public address: a TCP simultaneous open. Each side sends its SYN
   when GC_STUN_CONNECT arrives, and a SYN that reaches the other router before
   that router's side has sent its own is dropped (or, on a router that accepts
   unsolicited input, makes it remap the later SYN). So the message to the side
   nearer to the coordinator is held back by the difference of the one-way times
   (:func:`crossroads.proto.timing.crossing_leads`, from the round trips the
   service reports with :meth:`ConnectAttempt.round_trip`): both SYNs leave at
   once and cross in flight. A peer also takes its time to *react*: OpenTTD
   reads the message on its game-loop tick (30 ms on a dedicated server) and
   starts each connect through a resolver thread. GC_STUN_REQUEST goes through
   the same path (read on a tick, a connect, SERCLI_STUN_RESULT sent from the
   connect callback on a later tick), so the time it takes to be answered,
   ``m = 2 rtt + 2 R`` on average, gives that side's reaction time ``R`` and
   its effective one-way time ``rtt / 2 + R = (m - rtt) / 2``. When both sides'
   ``m`` and ``rtt`` are known, the leads come from those effective times; else
   from the round trips alone. In the NAT lab (server 100 ms from one remapping
   router, 20 ms from the other, 40 ms between them) the round trips alone left
   the dedicated server's SYN 27-29 ms after the client's, most of the 40 ms
   margin; a path shorter than that failed the first attempt (a SYN that knocks
   on a router accepting input is answered with a RST).
3. **TURN** (both peers at protocol 5+ and a relay known): a ticket, then
   GC_TURN_CONNECT to both; the relay pairs them by ticket.

SERCLI_CONNECT_FAILED with the current tracking number moves to the next
method; an older number is stale and ignored; number 0 means the client gave
up. CLIENT_CONNECTED (only the client reports success) ends the attempt. When
the ladder runs out, or after :attr:`timeout` overall, both sides get
GC_CONNECT_FAILED.

The core never does I/O: events come in with ``now``, and it returns
:data:`Command` lists for the service to carry out in order (an
:class:`IssueTicket` must be stored before the GC_TURN_CONNECT after it is sent).
The families in STUN messages are opaque ``AF_*`` bytes of each peer's own OS,
so pairs are matched on the IP version of the *observed* addresses and each side
gets its own byte back.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum, auto

from crossroads.proto.core import EventQueue
from crossroads.proto.openttd.codes import TokenSide, token_for
from crossroads.proto.openttd.coordinator import (
    VERSION_STUN,
    VERSION_TURN,
    GcConnectFailed,
    GcConnecting,
    GcDirectConnect,
    GcMessage,
    GcStunConnect,
    GcStunRequest,
    GcTurnConnect,
)
from crossroads.proto.timing import crossing_leads
from crossroads.types import frozen

#: Overall limit of one join (reference section 7: the reference GC's 20 s
#: timeout; an OpenTTD client gives up its own connecter well within it).
CONNECT_TIMEOUT = 20.0
#: How long to wait for both sides' STUN results before pairing what arrived.
#: A peer without IPv6 may take OpenTTD's 3 s TCP connect timeout to report that
#: family as failed, so wait a little longer than that.
STUN_WAIT = 5.0
#: Each OpenTTD peer opens one STUN connection per family (AF_INET6, AF_INET)
#: and reports both (``Receive_GC_STUN_REQUEST``).
STUN_RESULTS_PER_SIDE = 2
#: Longest hold of one side's GC_STUN_CONNECT. OpenTTD's SYN retransmits after
#: Linux's 1 s initial RTO (RFC 6298 section 2), so a lead near that would only
#: delay; a side that fakes a slow round trip holds the other back no longer.
MAX_STUN_LEAD = 0.5


@frozen
class SendToClient:
    message: GcMessage
    #: Seconds to hold the message first (timed GC_STUN_CONNECT); 0: at once.
    delay: float = 0.0


@frozen
class SendToServer:
    message: GcMessage
    #: Seconds to hold the message first (timed GC_STUN_CONNECT); 0: at once.
    delay: float = 0.0


@frozen
class IssueTicket:
    """Store this TURN ticket (with its TTL) before sending what follows."""

    ticket: str


@frozen
class Finished:
    """The attempt is over. ``method`` names what worked (or was last tried)."""

    success: bool
    method: str
    reason: str


Command = SendToClient | SendToServer | IssueTicket | Finished


@frozen
class LadderStep:
    """One rung tried, for the attempt's insight record: ``start`` and
    ``duration`` in seconds from the attempt's start; ``outcome`` "ok",
    "failed" (the client or server reported SERCLI_CONNECT_FAILED), "no-pair"
    (STUN found no family both sides reached) or the reason the attempt ended
    on it ("timeout", "client gave up", ...)."""

    name: str
    start: float
    duration: float
    outcome: str


class Side(Enum):
    CLIENT = auto()
    SERVER = auto()


class _Stage(Enum):
    METHOD = auto()  # a method with a tracking number is under way
    STUN_COLLECT = auto()  # waiting for STUN results and observations
    DONE = auto()


@dataclass(slots=True)
class _StunSide:
    results: dict[int, bool]
    seen: dict[int, tuple[str, int]]
    #: Seconds from GC_STUN_REQUEST to this side's successful SERCLI_STUN_RESULT
    #: per family: its round trip plus its reaction time, twice (see above).
    answered: dict[int, float] = field(default_factory=dict)

    def ready(self) -> bool:
        if len(self.results) < STUN_RESULTS_PER_SIDE:
            return False
        return all(f in self.seen for f, ok in self.results.items() if ok)

    def usable(self, ip_version: int) -> tuple[int, tuple[str, int]] | None:
        for family, ok in self.results.items():
            address = self.seen.get(family)
            if ok and address is not None and _ip_version(address[0]) == ip_version:
                return family, address
        return None


def _ip_version(host: str) -> int:
    try:
        return ipaddress.ip_address(host).version
    except ValueError:
        return 0


class ConnectAttempt(EventQueue[Command]):
    """One join by invite code; see the module docstring. The commands an
    input causes are its return value; those of the timer are queued for
    :meth:`pop_events` (the core API's :class:`~crossroads.proto.core.TimedCore`
    and :class:`~crossroads.proto.core.EventSource`)."""

    def __init__(
        self,
        *,
        attempt_key: str,
        invite_code: str,
        client_version: int,
        server_version: int,
        direct: Sequence[tuple[str, int]],
        turn_address: str | None,
        ticket: str,
        now: float,
        timeout: float = CONNECT_TIMEOUT,
        stun_wait: float = STUN_WAIT,
    ) -> None:
        super().__init__()
        self.attempt_key = attempt_key
        self.invite_code = invite_code
        self.client_token = token_for(TokenSide.CLIENT, attempt_key)
        self.server_token = token_for(TokenSide.SERVER, attempt_key)
        self.client_version = client_version
        self.server_version = server_version
        self.stun_wait = stun_wait
        self.ticket = ticket
        self.turn_address = turn_address
        self.started = now
        self._deadline = now + timeout
        self._stun_deadline: float | None = None
        self._stage = _Stage.METHOD
        self._tracking = 0
        self._open = False  # the current tracking number still awaits its outcome
        self._method = "none"
        self._server_involved = False
        self._client_gone = False
        self._server_gone = False
        self._stun: dict[Side, _StunSide] = {
            Side.CLIENT: _StunSide({}, {}),
            Side.SERVER: _StunSide({}, {}),
        }
        self._rtt: dict[Side, float | None] = {Side.CLIENT: None, Side.SERVER: None}
        self._stun_requested_at: float | None = None
        self._pairs: list[
            tuple[int, tuple[int, tuple[str, int]], tuple[int, tuple[str, int]]]
        ] = []
        steps: list[tuple[str, str, int]] = []
        ordered = sorted(direct, key=lambda a: _ip_version(a[0]))
        for host, port in ordered:
            steps.append((f"direct-ipv{_ip_version(host)}", host, port))
        lowest = min(client_version, server_version)
        if lowest >= VERSION_STUN:
            steps.append(("stun", "", 0))
        if lowest >= VERSION_TURN and turn_address:
            steps.append(("turn", "", 0))
        self._steps = steps
        #: Rungs tried so far (bounded: one per direct address, STUN's
        #: request and pairs, TURN), the last one open while it runs.
        self._history: list[LadderStep] = []
        self._current: tuple[str, float] | None = None

    # ----------------------------------------------------------------- queries

    @property
    def history(self) -> tuple[LadderStep, ...]:
        """The rungs tried, in order (the record's steps)."""
        return tuple(self._history)

    @property
    def done(self) -> bool:
        return self._stage is _Stage.DONE

    @property
    def method(self) -> str:
        return self._method

    @property
    def tracking_number(self) -> int:
        return self._tracking

    def get_timer(self) -> float | None:
        if self._stage is _Stage.DONE:
            return None
        if self._stage is _Stage.STUN_COLLECT and self._stun_deadline is not None:
            return min(self._deadline, self._stun_deadline)
        return self._deadline

    # ------------------------------------------------------------------ events

    def start(self, now: float) -> list[Command]:
        commands: list[Command] = [
            SendToClient(GcConnecting(self.client_token, self.invite_code))
        ]
        return commands + self._advance(now)

    def connect_failed(
        self, side: Side, tracking_number: int, now: float
    ) -> list[Command]:
        """SERCLI_CONNECT_FAILED from ``side``."""
        if self._stage is _Stage.DONE:
            return []
        if tracking_number == 0:
            who = "client" if side is Side.CLIENT else "server"
            return self._finish(False, f"{who} gave up", now)
        if tracking_number != self._tracking or not self._open:
            return []  # stale: a method we already moved past
        self._open = False
        return self._advance(now)

    def connected(self, now: float) -> list[Command]:
        """CLIENT_CONNECTED: the client holds a game connection to the server."""
        if self._stage is _Stage.DONE:
            return []
        return self._finish(True, "connected", now)

    def round_trip(self, side: Side, rtt: float | None) -> None:
        """The current round-trip time of ``side``'s coordinator connection
        (None: unknown), for timing GC_STUN_CONNECT."""
        self._rtt[side] = rtt

    def stun_result(
        self, side: Side, family: int, ok: bool, now: float
    ) -> list[Command]:
        """SERCLI_STUN_RESULT from ``side``."""
        if self._stage is not _Stage.STUN_COLLECT:
            return []
        results = self._stun[side].results
        if family not in results and len(results) >= STUN_RESULTS_PER_SIDE * 2:
            return []  # bounded: a peer cannot grow this with made-up families
        results[family] = ok
        if ok and self._stun_requested_at is not None:
            self._stun[side].answered.setdefault(family, now - self._stun_requested_at)
        return self._maybe_pair(now)

    def stun_observed(
        self, side: Side, family: int, host: str, port: int, now: float
    ) -> list[Command]:
        """The STUN service saw ``side``'s packet for ``family`` from host:port."""
        if self._stage is _Stage.DONE:
            return []
        seen = self._stun[side].seen
        if family not in seen and len(seen) >= STUN_RESULTS_PER_SIDE * 2:
            return []
        seen[family] = (host, port)
        if self._stage is _Stage.STUN_COLLECT:
            return self._maybe_pair(now)
        return []

    def peer_gone(self, side: Side, now: float) -> list[Command]:
        """The client's or server's coordinator connection closed."""
        if self._stage is _Stage.DONE:
            return []
        if side is Side.CLIENT:
            self._client_gone = True
            return self._finish(False, "client left", now)
        self._server_gone = True
        return self._finish(False, "server left", now)

    def handle_timer(self, now: float) -> None:
        """Give up at the deadline, or pair what STUN found at the end of its
        wait; the commands go to :meth:`pop_events`."""
        if self._stage is _Stage.DONE:
            return
        if now >= self._deadline:
            self._events += self._finish(False, "timeout", now)
        elif (
            self._stage is _Stage.STUN_COLLECT
            and self._stun_deadline is not None
            and now >= self._stun_deadline
        ):
            self._events += self._pair(now)

    # --------------------------------------------------------------- internals

    def _begin(self, name: str, now: float) -> None:
        self._current = (name, now)

    def _end(self, outcome: str, now: float) -> None:
        if self._current is not None:
            name, began = self._current
            self._history.append(
                LadderStep(name, began - self.started, now - began, outcome)
            )
            self._current = None

    def _advance(self, now: float) -> list[Command]:
        self._end("failed", now)
        if self._pairs:
            self._begin(f"stun-ipv{self._pairs[0][0]}", now)
            return self._stun_connect(self._pairs.pop(0))
        if not self._steps:
            return self._finish(False, "no method left", now)
        method, host, port = self._steps.pop(0)
        if method == "stun":
            self._begin("stun-request", now)
            self._stage = _Stage.STUN_COLLECT
            self._stun_deadline = now + self.stun_wait
            self._stun_requested_at = now
            self._server_involved = True
            return [
                SendToClient(GcStunRequest(self.client_token)),
                SendToServer(GcStunRequest(self.server_token)),
            ]
        self._begin(method, now)
        self._tracking += 1
        self._open = True
        self._method = method
        self._stage = _Stage.METHOD
        if method == "turn":
            self._server_involved = True
            assert self.turn_address is not None
            return [
                IssueTicket(self.ticket),
                SendToClient(
                    GcTurnConnect(
                        self.client_token,
                        self._tracking,
                        self.ticket,
                        self.turn_address,
                    )
                ),
                SendToServer(
                    GcTurnConnect(
                        self.server_token,
                        self._tracking,
                        self.ticket,
                        self.turn_address,
                    )
                ),
            ]
        return [
            SendToClient(GcDirectConnect(self.client_token, self._tracking, host, port))
        ]

    def _maybe_pair(self, now: float) -> list[Command]:
        if self._stun[Side.CLIENT].ready() and self._stun[Side.SERVER].ready():
            return self._pair(now)
        return []

    def _pair(self, now: float) -> list[Command]:
        self._stun_deadline = None
        for version in (4, 6):
            client = self._stun[Side.CLIENT].usable(version)
            server = self._stun[Side.SERVER].usable(version)
            if client is not None and server is not None:
                self._pairs.append((version, client, server))
        self._stage = _Stage.METHOD
        self._end("ok" if self._pairs else "no-pair", now)
        return self._advance(now)

    def _stun_connect(
        self,
        pair: tuple[int, tuple[int, tuple[str, int]], tuple[int, tuple[str, int]]],
    ) -> list[Command]:
        version, (client_family, client_addr), (server_family, server_addr) = pair
        client_lead, server_lead = self._leads(client_family, server_family)
        self._tracking += 1
        self._open = True
        self._method = f"stun-ipv{version}"
        self._stage = _Stage.METHOD
        return [
            SendToClient(
                GcStunConnect(
                    self.client_token,
                    self._tracking,
                    client_family,
                    server_addr[0],
                    server_addr[1],
                ),
                client_lead,
            ),
            SendToServer(
                GcStunConnect(
                    self.server_token,
                    self._tracking,
                    server_family,
                    client_addr[0],
                    client_addr[1],
                ),
                server_lead,
            ),
        ]

    def _leads(self, client_family: int, server_family: int) -> tuple[float, float]:
        """How long to hold GC_STUN_CONNECT to the client and to the server.

        From each side's effective one-way time to its SYN, ``(m - rtt) / 2``
        (see the module docstring; at least ``rtt / 2``: a side cannot answer
        faster than its round trips), when both sides' ``m`` and ``rtt`` are
        known; else from the round trips alone (or no lead, when one is
        unknown). :func:`crossing_leads` takes round-trip terms, so it gets
        ``m - rtt``, twice the effective time."""
        rtts = (self._rtt[Side.CLIENT], self._rtt[Side.SERVER])
        answers = (
            self._stun[Side.CLIENT].answered.get(client_family),
            self._stun[Side.SERVER].answered.get(server_family),
        )
        client_rtt, server_rtt = rtts
        client_m, server_m = answers
        if None in (client_m, server_m) or None in rtts:
            return crossing_leads(client_rtt, server_rtt, MAX_STUN_LEAD)
        assert client_rtt is not None and server_rtt is not None
        assert client_m is not None and server_m is not None
        return crossing_leads(
            max(client_rtt, client_m - client_rtt),
            max(server_rtt, server_m - server_rtt),
            MAX_STUN_LEAD,
        )

    def _finish(self, success: bool, reason: str, now: float) -> list[Command]:
        self._end("ok" if success else reason, now)
        self._stage = _Stage.DONE
        self._open = False
        commands: list[Command] = []
        if not success:
            if not self._client_gone:
                commands.append(SendToClient(GcConnectFailed(self.client_token)))
            if self._server_involved and not self._server_gone:
                commands.append(SendToServer(GcConnectFailed(self.server_token)))
        commands.append(Finished(success, self._method, reason))
        return commands
