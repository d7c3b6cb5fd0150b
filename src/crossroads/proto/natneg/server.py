"""The natneg server as a sans-I/O state machine.

Theory of operation
-------------------
A GameSpy SDK client negotiates in four steps (``shared/reference/gamespy-natneg.md``,
"ref §N" below):

1. It sends INITs, one per *port type*: GP from the game's own socket to natneg1
   (only when the game lent its socket), NN1/NN2/NN3 from the SDK's negotiate socket
   to natneg1/natneg2/natneg3 (v2 stops at NN2). Every un-acked INIT is resent every
   500 ms (ref §6). We answer each with a 21-byte INIT_ACK from the address it was
   sent to and remember the *mapping*: the public address and the local endpoint
   it arrived on.
2. Both clients of a session share the 32-bit *cookie* (the game passed it through
   its master server) and take slot 0 or 1 by their ``clientindex``. A client is
   *complete* when every port type it sends has arrived (NN1+NN2, +NN3 for v3/v4,
   +GP if ``usegameport``). When both are complete we pick, for each client, the
   address of its peer (:meth:`NatNegServer._peer_address`) or a relay pair
   (:class:`RelayNeeded`), and send CONNECT to *every* mapping the client used, each
   from the endpoint that received it, so every NAT filter lets one through. The
   SDK uses only the first CONNECT it accepts and ACKs every CONNECT with finished=0
   (ref §6 step 3); we resend every ``connect_interval`` to each client that has not
   ACKed, ``connect_attempts`` times at most.
3. The clients then ping each other directly (CONNECT_PING); we are not involved.
   *CONNECT timing.* Each client sends its first ping the moment its CONNECT
   arrives (ref §6 step 3). If client A's ping reaches B's router before B has sent
   anything toward A, a port-restricted router drops it and, if it accepts
   unsolicited input, keeps a conntrack entry that makes it *remap* B's later ping
   to a new port -- and the first attempt fails (docs/natneg.md, "CONNECT timing"). So when a client is
   complete we send it one ERT_TEST from the endpoint its NN1 INIT reached; every
   SDK version answers with ERT_ACK (ref §3.2), which gives its round-trip time
   ``rtt``. CONNECT to the client with the longer one-way time ``rtt/2`` goes out
   first and the other one ``|rtt_A - rtt_B| / 2`` later (capped by
   ``max_connect_lead``), so both arrive, and both first pings leave, at the same
   moment: each ping then reaches the other router one peer-to-peer delay after
   that router's own ping went out, and the pings cross in flight. This is what
   RakNet's NatPunchthroughServer does with CONNECT_AT_TIME; no GameSpy server did.
   CONNECTs wait at most ``rtt_wait`` for an ERT_ACK (state TIMING).
4. v3/v4 clients send a 73-byte REPORT; we always answer REPORT_ACK (a v3 client
   without it waits ~7 s more, ref §6) and remember the outcome per public IP, which
   feeds the relay decision of later negotiations between the same addresses.

If the partner never comes, or a client never completes, within ``session_timeout``
of the session's first INIT, each present client gets CONNECT with ``finished`` =
1 (deadbeat partner: the partner never appeared) or 2 (INIT packets timed out: the
session has two clients but one never completed) -- ref §8. The client does not ACK
error CONNECTs, so they are sent ``error_attempts`` times.

*First-attempt relay.* A pair is relayed at once where pinging is predicted to
fail (:meth:`NatNegServer._relay_reason`, docs/natneg.md): both NATs map per
destination, or one does and the other filters by address and port. Mapping
shows in the NN1/NN2/NN3 INITs; filtering in one ERT_TEST from
``unsolicited_port`` that the server sends, when it decides the pair, to the
non-symmetric client's negotiate socket (:meth:`NatNegServer._send_probes`):
unanswered while our own ERT is answered, the filter drops another server port.

Stateless requests are answered from the endpoint that received them: ADDRESS_CHECK
(NAT mapping probes), NATIFY_REQUEST (reachability probes: the ERT answers come from
*other* endpoints, :class:`NatNegSocket`), BACKUP_TEST and the v4 PREINIT handshake.

Sessions are found by cookie (ref §8 "Matching key"), but games reuse cookies (the
SDK test program always uses 666; a game retries a failed negotiation with the same
one), so a session's *identity* is its :class:`SessionId`: the cookie plus a serial
number that never repeats in this process. Every deadline, relay pair and event
belongs to one SessionId, so nothing left over from an earlier negotiation on the same
cookie (its timeout, its linger, its relay pair) can touch a later one.

*Restarts, linger and third clients.* What identifies a client is what the
protocol gives: the cookie, its ``clientindex`` (the slot) and its public IP plus
the ``localip`` every INIT carries (:meth:`_Client.is_same`). What identifies an
*attempt* is its sockets: the SDK sends each port type from one socket (GP from
the game socket, NN1/NN2/NN3 from a negotiate socket it opens per negotiation) to
one server address (ref §3.1, §6 "Sockets"), so one attempt's INITs of a port type
all show one public address, and the SDK never resends an ACKed INIT. Hence
(:meth:`NatNegServer._classify`):

* the same client's INIT of a port type from an address its record does not have
  for it comes from new sockets: the client *restarted* (a new process, or a retry
  in-process) and replaces its own record. Before any CONNECT went out, its
  partner's record is kept (that client will not send its INITs again) and the
  pair continues in a new session with a fresh ``session_timeout``; after CONNECT,
  a new session starts with the restarting client alone (its partner was told the
  old address and will retry by itself). Either way the CONNECT goes to the live
  sockets. A game socket kept across attempts repeats its known mapping and comes
  first: that GP INIT is kept aside and counted in the new record if an NN INIT
  from a new negotiate socket follows;
* a waiting client is silent, so a dead one looks the same: when its partner
  completes the pair and it has been silent for ``stale_after``, one ERT_TEST
  asks it first (:meth:`NatNegServer._check_liveness`); its restart replaces
  it meanwhile, and no answer while it answered ERTs before drops its record
  (outcome ``gone``), so the partner is never told a dead process's ports;
* once a session's outcome is settled (FAILING, DONE), its cookie is free: an INIT
  from another client starts a new session at once. While a pair still
  negotiates (WAITING to CONNECTING), another client is refused (``third-client``);
* a replaced session is kept aside until its own deadlines end (error CONNECTs,
  ``linger``), only to recognise its clients' late packets by their *address*: a
  repeated INIT is ACKed and not recorded (so a reordered INIT of a dead process
  never takes its record back), a CONNECT_ACK or REPORT counts for it, not for the
  negotiation that replaced it. A session replaced because its clients restarted
  is closed at once (``SessionClosed.replaced``: its relay pair will not be used);
  one replaced by another pair ends as usual (its clients may be playing through
  its relay pair).

Spoofing: replacing a record needs an INIT from the client's own public IP and
naming its private IP, and only moves the CONNECT to another port of that IP.

Outcomes (:class:`Outcome`) say what happened, not what the server hoped: a session
is *connected* only when a client REPORTs success; CONNECTs acknowledged without a
REPORT (v1/v2 clients never report) are *unreported*. Each carries whether it was a
first attempt or a retry of a pair whose earlier negotiation failed.

Every bad input is dropped and counted in :attr:`Stats.dropped` by reason; nothing
raises out of :meth:`NatNegServer.receive_datagram`.

Where the product seed (``seeds/002_*.txt``) and the real client disagree the real
client wins:

* no fixed 100 ms delay before CONNECT (seed "Step 3"): the SDK accepts CONNECT in
  any state before pinging, even while still sending INITs (ref §6 step 3), and
  OpenSpy sends at once (ref §7.1); the only wait is the measured one of step 3
  (one round trip of the later client, then the lead);
* INIT_ACK and REPORT_ACK are 21 bytes, not 14 (the SDK drops shorter ones, ref §2);
* the seed's "4 INITs from different source ports" is wrong: GP comes from the game
  socket, NN1-3 from one negotiate socket (ref §3.1), which is what makes the
  NN1/NN2/NN3 mappings comparable for symmetric-NAT detection below;
* readiness is "every port type the client sends", not "port type 2 or 3 seen"
  (seed "Session Ready Check"): a v2 client never sends NN3 (ref §1);
* the seed's LAN detection compares the first three octets of *public* IPs; two
  different households in one /24 are not a LAN, so only equal public IPs count.
"""

from __future__ import annotations

import heapq
import ipaddress
from dataclasses import dataclass, field
from enum import Enum, IntEnum

from crossroads.errors import DecodeError
from crossroads.proto.admission import REFUSED_OVER_IP_LIMIT, Admitter, LocalTable
from crossroads.proto.bounded import BoundedMap
from crossroads.proto.core import EventQueue, Outbox, SocketDatagram
from crossroads.proto.counting import spend_token
from crossroads.proto.natneg.packets import (
    NATIFY_COOKIE,
    AddressCheck,
    AddressReply,
    BackupAck,
    BackupTest,
    Connect,
    ConnectAck,
    ErtAck,
    ErtTest,
    Finished,
    Init,
    NatifyRequest,
    NatType,
    Packet,
    PacketType,
    PortType,
    Preinit,
    PreinitAck,
    PreinitState,
    Report,
    ReportAck,
    decode,
    ip_to_bytes,
)
from crossroads.proto.reflection import DROP_REFLECTION, ReflectionBudget
from crossroads.proto.sweep import SweepTimer
from crossroads.proto.timing import crossing_leads
from crossroads.types import Address, frozen


class NatNegSocket(IntEnum):
    """The server's local sockets, as the core knows them.

    The transport tells :meth:`NatNegServer.receive_datagram` which one received a
    datagram and sends each reply from the endpoint the core names. Endpoints that
    share one socket (a single-IP deployment: natneg1/2/3 all resolve to one
    address) are all reported as :attr:`PRIMARY`.
    """

    PRIMARY = 0  # natneg1: GP/NN1 INITs, REPORT, ADDRESS_CHECK map1a/1b, NATIFY pt1/2
    NATNEG2 = 1  # natneg2: NN2 INIT, ADDRESS_CHECK map2, NATIFY pt3
    NATNEG3 = 2  # natneg3: NN3 INIT, ADDRESS_CHECK map3
    PROBE_PORT = 3  # natneg1's IP, another port: the "unsolicited port" ERT source
    PROBE_IP = 4  # an IP clients never send to: the "unsolicited IP" ERT source


class RelayMode(Enum):
    """When negotiations go through a relay instead of a direct path."""

    AUTO = "auto"  # when the NAT behaviour makes a direct path impossible
    ALWAYS = "always"  # every negotiation (testing, or networks known to be hostile)
    NEVER = "never"


class Outcome(Enum):
    """How a session ended, as far as the server can tell."""

    CONNECTED = "connected"  # a client REPORTed success (v3/v4, ref §3.4)
    FAILED = "failed"  # a client REPORTed failure: its pings timed out (ref §6)
    UNREPORTED = "unreported"  # both ACKed CONNECT, no REPORT came (v1/v2 never send)
    UNACKED = "unacked"  # CONNECT resends ran out before one client ACKed
    DEADBEAT = "deadbeat"  # a client waited for a partner who never came
    INIT_TIMEOUT = "init-timeout"  # both came, one never sent all its INITs
    RESTARTED = "restarted"  # a client began again on the cookie before it ended
    #: A client silent since its INITs did not answer the liveness ERT when its
    #: partner came: its process is gone (the partner waits on in a new session).
    GONE = "gone"


@dataclass(frozen=True, slots=True, order=True)
class SessionId:
    """One negotiation: its cookie and a serial number that never repeats.

    The cookie alone does not identify a negotiation: games reuse cookies. Relay
    pairs and everything else that outlives a packet are keyed by this.
    """

    cookie: int
    serial: int


@frozen
class ServerConfig:
    """Behaviour of the core; every timer and limit has its reason beside it."""

    #: Seconds from a session's first INIT until a missing or incomplete client makes
    #: it fail. The seed's ``session_timeout`` (30 s default). SDK clients wait 60 s
    #: for the partner after their INITs are acked (PARTNER_WAIT_TIME), DWC v2 only
    #: 10 s (ref §6): 30 s answers PC clients before their own timeout.
    session_timeout: float = 30.0
    #: CONNECT resend interval until CONNECT_ACK. ref §8: "every ~1-2 s"; OpenSpy
    #: resends every 2 s (ref §7.1). The client ACKs each one within milliseconds.
    connect_interval: float = 1.0
    #: CONNECT sends per client before giving up; with 1 s that covers the v3/v4
    #: client's ping phase (7 x 700 ms, ref §6) several times over.
    connect_attempts: int = 10
    #: Time the two clients' CONNECTs so that both reach their clients at the same
    #: moment (see "CONNECT timing" above), for the pairs where it can change the
    #: outcome (:meth:`NatNegServer._timing_helps`). False: send both at once, as
    #: GameSpy's and every emulator's server did. benchmarks/natneg_first_attempt.py
    #: set the default: 95/96 remap cells on the first attempt timed against 81/96
    #: together, for ~0.15-0.2 s more per pair that waits (docs/natneg.md).
    timed_connect: bool = True
    #: How long the CONNECTs may wait for a client's round-trip time (its ERT_ACK).
    #: The ERT goes out when the client's last INIT arrives, so its ACK is one
    #: round trip away; 500 ms covers any terrestrial path, and a client that does
    #: not answer by then costs the pair half a second, once.
    rtt_wait: float = 0.5
    #: Longest head start one client's CONNECT gets over the other's. The SDK pings
    #: every 700 ms (ref §6): beyond ~half of that the second ping of the early
    #: side would cross anyway, and a client faking a slow ERT_ACK must not be able
    #: to hold its partner's CONNECT back for long.
    max_connect_lead: float = 0.35
    #: How often the clients read their sockets: a measured round trip includes up
    #: to one interval of the client's own delay, so the lead is shortened by half
    #: of it and never overshoots (proto/timing.py, "Poll delay"). The SDK's natneg
    #: sample (natneg/simpletest/simpletest.c) calls ``NNThink`` then sleeps 10 ms.
    client_poll: float = 0.01
    #: Learn, at INIT, whether a client's NAT filters by port when its partner's
    #: mapping is endpoint-dependent (the one case where filtering decides the
    #: pair): one ERT_TEST from ``unsolicited_port`` (natneg1's IP, another port)
    #: to its negotiate socket, which every SDK version answers from wherever it
    #: came (ref §3.2, what OpenSpy's three probe drivers rely on, ref §7.1). No
    #: answer while the client answers our own ERT: address-and-port-dependent
    #: filtering, so pinging cannot work and the first attempt is relayed.
    probe_filtering: bool = True
    #: How long after the client's answer to our own ERT its answer to the probe
    #: may still come: both leave back to back on one path and the SDK answers
    #: each in its next ``NNThink``, which the SDK asks games to call about every
    #: 100 ms (ref §6); an early client's round trip was measured before, so this
    #: also absorbs the difference of two poll phases.
    probe_grace: float = 0.1
    #: A complete client silent this long when its partner completes is asked
    #: whether it is still there before the pair is made: a waiting SDK client
    #: sends nothing once its INITs are ACKed (ref §6), so a waiting client and
    #: one whose process died look the same, and a CONNECT naming a dead
    #: process's ports makes its partner ping them for the SDK's 6.4 s. One
    #: ERT_TEST to its negotiate socket, which every SDK version answers in any
    #: state (ref §3.2); asked only of a client that answered our timing ERT
    #: before, so no answer within its round trip plus ``probe_grace`` (at most
    #: ``rtt_wait``) means it is gone: its record is dropped and the partner
    #: waits for it (or its restart) in a new session. 0.5 s is the SDK's INIT
    #: resend interval (ref §6): a client younger than that has just been heard,
    #: and both players of one game start within that of each other, so only a
    #: client that really waited pays the (usually hidden) extra round trip.
    stale_after: float = 0.5
    #: Error CONNECTs (finished=1/2) are never ACKed by the client (ref §6 step 3),
    #: so they are sent a fixed number of times, ``connect_interval`` apart.
    error_attempts: int = 3
    #: How long a finished session is kept to answer late duplicates. A v3 client's
    #: REPORT comes ~5 s after CONNECT and is retried 7 x 1 s (ref §6): 20 s covers it.
    linger: float = 20.0
    #: The seed's ``force_lan_mode``: always give the peer's private INIT address.
    force_lan_mode: bool = False
    relay_mode: RelayMode = RelayMode.AUTO
    #: Live sessions in one process (memory bound: a session is ~1 KB).
    max_sessions: int = 100_000
    #: Sessions one public IP may open at once: games open several (data, voice);
    #: a cookie flood from one address stops here. CGNAT users share an IP, hence
    #: a generous default.
    max_sessions_per_ip: int = 64
    #: Token bucket per source IP, packets per second and burst. A negotiation is
    #: ~10 packets per client, so 200/s lets dozens run at once from one IP.
    rate_limit: float = 200.0
    rate_burst: float = 400.0
    #: Bound on the rate limiter's table (one entry per recent source IP).
    max_tracked_ips: int = 100_000
    #: How long a REPORT's outcome is remembered for later relay decisions. Games
    #: retry a failed negotiation with a new cookie within seconds (RA3: 5 tries,
    #: ref §7.4); 10 minutes covers a player's retries without pinning them forever.
    history_ttl: float = 600.0
    max_history: int = 100_000
    #: Source of the NATIFY pt2 ERT ("unsolicited IP", ref §5): must be an IP the
    #: client's ERT socket never sent to. None: fall back to ``unsolicited_port``.
    unsolicited_ip: NatNegSocket | None = None
    #: Source of the NATIFY pt3 ERT ("unsolicited port"): natneg1's IP, other port.
    #: None: pt3 (and pt2 without ``unsolicited_ip``) get no answer.
    unsolicited_port: NatNegSocket | None = None


# ------------------------------------------------------------------------ events


@frozen
class RelayNeeded:
    """Both clients are complete and a direct path looks impossible.

    Answer with :meth:`NatNegServer.relay_allocated` (the relay address each client
    should be told) or :meth:`NatNegServer.relay_unavailable`.
    """

    session: SessionId
    #: Public IPv4 of client 0 and client 1 (the only sources the relay may accept).
    client_ips: tuple[str, str]
    #: Why punching is predicted to fail, one of :data:`RELAY_REASONS` (a metric
    #: label).
    reason: str
    #: The evidence, for the log (mappings seen, probe answers).
    detail: str = field(default="", compare=False)


@frozen
class NegotiationFinished:
    """A session's outcome is known (a REPORT came, or it failed, or it ended)."""

    session: SessionId
    outcome: Outcome
    relayed: bool
    #: Seconds from the session's first INIT to the outcome.
    duration: float
    #: False when the same two public IPs had a failed negotiation within
    #: ``history_ttl`` (a game's retry); True otherwise.
    first_attempt: bool
    #: What the server learnt of each client that came, for connection
    #: insight: public IP, NAT kind (:meth:`_Client.nat_kind`) and the round
    #: trip its ERT measured (seconds, None when none came back). Not compared:
    #: evidence, like :attr:`RelayNeeded.detail`.
    clients: tuple[tuple[str, str, float | None], ...] = field(
        default=(), compare=False
    )


@frozen
class SessionClosed:
    """A session is over: its deadlines ended, or it was ``replaced`` because its
    own clients started over on the cookie. The transport releases what it holds
    for a replaced session (its relay pair is no longer the one clients are told);
    a session another pair took the cookie from ends with ``replaced`` False."""

    session: SessionId
    replaced: bool


@frozen
class ReportReceived:
    """A client reported its result (v3/v4)."""

    cookie: int
    client_index: int
    success: bool
    nat_type: int | None
    game_name: str


Event = RelayNeeded | NegotiationFinished | ReportReceived | SessionClosed

#: Every :attr:`RelayNeeded.reason` (docs/natneg.md, "First-attempt relay"):
#: ``forced`` (relay mode always), two endpoint-dependent mappings, one against
#: address-and-port-dependent filtering seen by the INIT-time probe or reported
#: by an earlier REPORT from the peer's IP, a failed negotiation between the two
#: IPs within ``history_ttl``.
RELAY_REASONS = (
    "forced",
    "both-symmetric",
    "symmetric-vs-port-filtering",
    "symmetric-vs-restricted",
    "failed-before",
)


@dataclass(slots=True)
class Stats:
    """Counters the transport exports (read at scrape time, not per packet)."""

    #: Decoded packets by :class:`PacketType`.
    received: list[int] = field(default_factory=lambda: [0] * len(PacketType))
    #: Dropped datagrams by reason.
    dropped: dict[str, int] = field(default_factory=dict)
    sent: int = 0
    #: Liveness ERTs to silent waiting clients (``stale_after``), by result:
    #: ``asked``, then ``alive`` (answered), ``replaced`` (the client's restart
    #: came first) or ``gone`` (no answer: its record was dropped).
    liveness: dict[str, int] = field(default_factory=dict)

    def count_liveness(self, result: str) -> None:
        self.liveness[result] = self.liveness.get(result, 0) + 1


# ----------------------------------------------------------------------- state

#: Port types a client must have sent before it is "complete", by version (ref §6:
#: the client waits for acks of NN1+NN2, v3+ also NN3; GP is added for usegameport).
_REQUIRED: dict[int, frozenset[int]] = {
    1: frozenset({PortType.NN1, PortType.NN2}),
    2: frozenset({PortType.NN1, PortType.NN2}),
    3: frozenset({PortType.NN1, PortType.NN2, PortType.NN3}),
    4: frozenset({PortType.NN1, PortType.NN2, PortType.NN3}),
}
_NEGOTIATE_SOCKET_PORTS = (PortType.NN1, PortType.NN2, PortType.NN3)
#: What the real GameSpy server put in CONNECT's gotyourdata (ref §3.3); the SDK
#: ignores it, so we copy the original.
_GOT_YOUR_DATA = 0x42
#: Housekeeping (rate-limiter, history and PREINIT tables) runs this often.
_HOUSEKEEPING_INTERVAL = 10.0


@frozen
class NegotiationSummary:
    """One negotiation as an operator sees it."""

    cookie: int
    #: IP of the first client that named the cookie.
    owner_ip: str
    #: waiting, relay-pending, connecting, failing or done (lingering).
    state: str
    #: Clients (of two) that have shown up.
    clients: int
    age: float


class _State(Enum):
    WAITING = "waiting"  # for both clients to complete
    TIMING = "timing"  # both complete, waiting for a round-trip time (ERT_ACK)
    RELAY_PENDING = "relay-pending"  # waiting for the transport's relay answer
    CONNECTING = "connecting"  # sending CONNECT until ACKed
    FAILING = "failing"  # sending error CONNECTs
    DONE = "done"  # lingering for duplicates


#: States before any CONNECT went out: a restarting client's record is replaced
#: and its partner's kept.
_BEFORE_CONNECT = frozenset({_State.WAITING, _State.TIMING, _State.RELAY_PENDING})
#: States whose outcome is settled: the cookie is free for another pair.
_CONCLUDED = frozenset({_State.FAILING, _State.DONE})


class _Verdict(Enum):
    """What an INIT is to the session that holds its cookie."""

    DUPLICATE = "duplicate"  # repeats a mapping the session recorded
    JOIN = "join"  # a new port type of a client, or a client in a free slot
    RESTART = "restart"  # the same client from a new socket: a new attempt
    TAKEOVER = "takeover"  # another client on a concluded session's cookie
    THIRD = "third"  # another client while the pair negotiates


class _Client:
    __slots__ = (
        "index",
        "version",
        "public_ip",
        "local_ip",
        "local_port",
        "use_game_port",
        "mappings",
        "acked",
        "ert_sent",
        "rtt",
        "next_connect",
        "connects_left",
        "gp_echo",
        "probe_sent",
        "probe_open",
        "heard",
        "check_sent",
        "alive",
    )

    def __init__(self, packet: Init, public_ip: str, now: float) -> None:
        self.index = packet.client_index
        self.version = packet.version
        self.public_ip = public_ip
        self.local_ip = packet.local_ip
        self.local_port = 0
        self.use_game_port = bool(packet.use_game_port)
        #: port type -> (public address, endpoint it arrived on); first one wins,
        #: so a late spoofed INIT cannot redirect a client's CONNECT.
        self.mappings: dict[int, tuple[Address, NatNegSocket]] = {}
        self.acked = False
        #: When our ERT_TEST went out, and the round trip its ERT_ACK measured.
        self.ert_sent: float | None = None
        self.rtt: float | None = None
        #: When this client's next CONNECT is due, and how many are left.
        self.next_connect = 0.0
        self.connects_left = 0
        #: A GP INIT that repeated the known game-socket mapping and has not been
        #: followed by an INIT from the known negotiate socket: a late duplicate,
        #: or the first INIT of a new attempt on a game socket the game kept (see
        #: "Restarts" in the module docstring).
        self.gp_echo: tuple[Init, Address, NatNegSocket] | None = None
        #: When the filtering probe (an ERT from ``unsolicited_port``) went out,
        #: and whether it was answered: True answered, False not in time while
        #: our own ERT was, None not (yet) known.
        self.probe_sent: float | None = None
        self.probe_open: bool | None = None
        #: When a datagram of this attempt (an INIT, an ERT_ACK) last came in.
        self.heard = now
        #: When the liveness ERT went out (``stale_after``), and True once it
        #: was answered from the client's negotiate socket.
        self.check_sent: float | None = None
        self.alive = False

    def is_same(self, packet: Init, ip: str) -> bool:
        """Is this INIT from this client (this process or its restart) rather than
        a third one on the cookie?

        Same public IP and same private IP (the SDK puts the same ``localip`` in
        every INIT; its ``clientindex`` chose the slot). Two hosts behind one NAT
        with the same private address and the same ``clientindex`` cannot be told
        apart; nothing in the packet could.
        """
        return ip == self.public_ip and (
            packet.version == 1 or packet.local_ip == self.local_ip
        )

    def knows(self, port_type: int, addr: Address) -> bool:
        """Did this client's INIT of ``port_type`` come from ``addr``?"""
        mapping = self.mappings.get(port_type)
        return mapping is not None and mapping[0] == addr

    def owns(self, addr: Address) -> bool:
        """Is ``addr`` one of this client's mappings (its negotiate socket sends
        CONNECT_ACK and REPORT, ref §3.2, §3.4, along a mapping an INIT made)?"""
        return any(mapping[0] == addr for mapping in self.mappings.values())

    def complete(self) -> bool:
        need = _REQUIRED[self.version]
        if self.use_game_port and PortType.GP not in self.mappings:
            return False
        return need <= self.mappings.keys()

    def nat_kind(self) -> str:
        """What the INITs and the probe showed: ``symmetric`` (endpoint-
        dependent mapping), ``port-restricted`` (the probe from another port
        got no answer), ``cone`` (it did), ``unknown`` (no probe result)."""
        if self.symmetric():
            return "symmetric"
        if self.probe_open is None:
            return "unknown"
        return "cone" if self.probe_open else "port-restricted"

    def unnated(self) -> bool:
        """Does the client sit on its public address (the private IP its INITs
        name is the one they came from)? Then no router of its own can be
        knocked: nothing filters its partner's first ping."""
        return self.local_ip == self.public_ip

    def symmetric(self) -> bool:
        """Did the NAT give the negotiate socket different public addresses for
        natneg1/2/3? That is endpoint-dependent ("symmetric") mapping (ref §5)."""
        seen = {
            self.mappings[pt][0]
            for pt in _NEGOTIATE_SOCKET_PORTS
            if pt in self.mappings
        }
        return len(seen) > 1


class _Session:
    __slots__ = (
        "id",
        "cookie",
        "created",
        "owner_ip",
        "clients",
        "state",
        "timer",
        "targets",
        "codes",
        "sends_left",
        "relayed",
        "first_attempt",
        "outcome",
        "closed",
        "holds_slot",
    )

    def __init__(self, session_id: SessionId, owner_ip: str, now: float) -> None:
        self.id = session_id
        self.cookie = session_id.cookie
        self.created = now
        self.owner_ip = owner_ip
        self.clients: list[_Client | None] = [None, None]
        self.state = _State.WAITING
        #: Sequence number of the one live deadline in the heap (0: none). Sequence
        #: numbers never repeat, so a deadline of another session never matches.
        self.timer = 0
        #: What CONNECT tells client 0 and client 1: (ip, port).
        self.targets: list[Address] = []
        #: ``finished`` code per slot while FAILING.
        self.codes: list[int | None] = [None, None]
        self.sends_left = 0
        self.relayed = False
        self.first_attempt = True
        #: Set once :class:`NegotiationFinished` was emitted (one per session).
        self.outcome: Outcome | None = None
        #: Set once :class:`SessionClosed` was emitted (one per session).
        self.closed = False
        #: Whether it holds the slot its owner was admitted with (a restart
        #: hands it to the session that replaces it).
        self.holds_slot = True

    def knows(self, p: Init, addr: Address) -> bool:
        """Is this INIT a repeat of one this session recorded?"""
        client = self.clients[p.client_index]
        return client is not None and client.knows(p.port_type, addr)

    def owner_of(self, addr: Address) -> _Client | None:
        """The client ``addr`` is a mapping of, if any."""
        for client in self.clients:
            if client is not None and client.owns(addr):
                return client
        return None


class _PreinitEntry:
    __slots__ = ("slots", "expires")

    def __init__(self, expires: float) -> None:
        self.slots: list[tuple[Address, NatNegSocket, int] | None] = [None, None]
        self.expires = expires


def _valid_private_ip(local_ip: str, public_ip: str) -> bool:
    """Is an INIT's ``localip`` usable as a destination for the peer?

    The SDK reports the first private address of the host, else the last one it
    saw, possibly 0.0.0.0 (ref §3.1); Linux hosts may report 127.0.1.1. Loopback is
    only meaningful when the public address is loopback too (both on one machine).
    """
    try:
        ip = ipaddress.IPv4Address(local_ip)
    except ValueError:
        return False
    if (
        ip.is_unspecified
        or ip.is_multicast
        or ip == ipaddress.IPv4Address("255.255.255.255")
    ):
        return False
    if ip.is_loopback:
        return public_ip.startswith("127.")
    return True


# ------------------------------------------------------------------------ core


class NatNegServer(Outbox[SocketDatagram[NatNegSocket]], EventQueue[Event]):
    """The natneg server core: feed it datagrams and time, send what it returns.

    ``receive_datagram`` / ``datagrams_to_send`` / ``get_timer`` / ``handle_timer``
    follow DESIGN.md's datagram-core shape, with one addition: every datagram comes
    in with the :class:`NatNegSocket` that received it and goes out with the one to send
    it from. Lifecycle events (:data:`Event`) are collected by :meth:`pop_events`.
    """

    def __init__(
        self,
        config: ServerConfig | None = None,
        reflection: ReflectionBudget | None = None,
        admission: Admitter | None = None,
    ) -> None:
        super().__init__()
        self.config = config or ServerConfig()
        #: natneg has no authentication: every datagram it sends goes through
        #: this budget (docs/security.md, "Reflection budget"); None: no budget.
        self.reflection = ReflectionBudget.or_unlimited(reflection)
        self.stats = Stats()
        #: The negotiation each cookie's new INITs join.
        self._sessions: dict[int, _Session] = {}
        #: The session a newer one replaced on its cookie, kept until its own
        #: deadlines end only to answer its clients' late packets (one per cookie).
        self._lingering: dict[int, _Session] = {}
        #: Admits every new session by its owner's IP (global and per-source
        #: caps); the service injects its table of the process's resource
        #: budget, tests get a :class:`LocalTable` with the config's caps.
        self.admission: Admitter = admission or LocalTable(
            self.config.max_sessions, self.config.max_sessions_per_ip
        )
        #: Deadlines: (when, sequence number, cookie). A session's entry is live
        #: only while the session's ``timer`` holds that sequence number.
        self._heap: list[tuple[float, int, int]] = []
        self._seq = 0
        #: Last :class:`SessionId` serial handed out; serials never repeat.
        self._serial = 0
        self._buckets: dict[str, list[float]] = {}
        #: Bounded by ``max_history`` each, oldest report forgotten first.
        self._nat_history: BoundedMap[str, tuple[int, float]] = BoundedMap(
            self.config.max_history, lru=False
        )
        self._failed_pairs: BoundedMap[tuple[str, str], float] = BoundedMap(
            self.config.max_history, lru=False
        )
        self._preinits: dict[int, _PreinitEntry] = {}
        self._housekeeping_timer = SweepTimer(_HOUSEKEEPING_INTERVAL)

    # ------------------------------------------------------------ public API

    @property
    def session_count(self) -> int:
        """Sessions currently held (any state, including lingering ones)."""
        return len(self._sessions) + len(self._lingering)

    def session_summaries(self, now: float) -> list[NegotiationSummary]:
        """Every session held, for operators (admin console, CLI)."""
        return [
            NegotiationSummary(
                cookie=session.cookie,
                owner_ip=session.owner_ip,
                state=session.state.value,
                clients=sum(client is not None for client in session.clients),
                age=max(0.0, now - session.created),
            )
            for session in (*self._sessions.values(), *self._lingering.values())
        ]

    def receive_datagram(
        self,
        data: bytes,
        addr: Address,
        now: float,
        socket: NatNegSocket = NatNegSocket.PRIMARY,
    ) -> None:
        """Process one datagram that ``socket`` received from ``addr``."""
        ip = addr[0]
        if ":" in ip:
            # Every natneg address field is 4 bytes: an IPv6 client cannot be
            # described to its peer.
            self._drop("not-ipv4")
            return
        self.reflection.received(ip, len(data), now)
        if not self._allow(ip, now):
            self._drop("rate-limit")
            return
        try:
            packet = decode(data)
        except DecodeError as exc:
            self._drop(exc.reason)
            return
        ptype = packet.TYPE
        self.stats.received[ptype] += 1
        match packet:
            case Init():
                self._on_init(packet, data, addr, socket, now)
            case ConnectAck():
                self._on_connect_ack(packet, addr, now)
            case Report():
                self._on_report(packet, addr, socket, now)
            case AddressCheck():
                self._on_address_check(packet, addr, socket)
            case NatifyRequest():
                self._on_natify(packet, addr, socket)
            case Preinit():
                self._on_preinit(packet, addr, socket, now)
            case BackupTest():
                self._on_backup_test(packet, addr, socket)
            case ErtAck():
                self._on_ert_ack(packet, addr, socket, now)
            case _:
                # Server-to-client types (INIT_ACK, CONNECT, ...), CONNECT_PING
                # (client to client) and STATE_UPDATE (never sent, ref §2).
                self._drop("unexpected-type")
        self._housekeeping_timer.arm(now)

    def datagrams_to_send(
        self, now: float
    ) -> list[tuple[bytes, Address, NatNegSocket]]:
        """Datagrams to send: (bytes, destination, endpoint to send from).

        natneg authenticates nobody (a cookie is no secret), so every datagram,
        INIT_ACKs and delayed CONNECTs alike, is sent only within the
        destination's reflection budget; the rest are dropped and counted.
        """
        out = super().datagrams_to_send(now)
        budget = self.reflection
        if budget.enabled:
            allowed = [
                item for item in out if budget.allow(item[1][0], len(item[0]), now)
            ]
            if len(allowed) < len(out):
                dropped = self.stats.dropped
                dropped[DROP_REFLECTION] = (
                    dropped.get(DROP_REFLECTION, 0) + len(out) - len(allowed)
                )
            out = allowed
        self.stats.sent += len(out)
        return out

    def get_timer(self) -> float | None:
        """When :meth:`handle_timer` must next run, or None."""
        deadline = self._heap[0][0] if self._heap else None
        house = self._housekeeping_timer.deadline
        if house is not None and (deadline is None or house < deadline):
            return house
        return deadline

    def handle_timer(self, now: float) -> None:
        """Run every deadline that is due."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, seq, cookie = heapq.heappop(heap)
            session = self._sessions.get(cookie)
            if session is None or session.timer != seq:
                session = self._lingering.get(cookie)
            if session is not None and session.timer == seq:
                self._on_session_timer(session, now)
        if self._housekeeping_timer.due(now):
            self._housekeeping(now)

    def relay_allocated(
        self,
        session_id: SessionId,
        for_client0: Address,
        for_client1: Address,
        now: float,
    ) -> bool:
        """The relay for ``session_id`` exists: tell client 0 to ping
        ``for_client0`` and client 1 ``for_client1`` (each its own side of the
        relay pair). False if that session no longer waits for it (the caller
        then releases the pair)."""
        session = self._relay_pending(session_id)
        if session is None:
            return False
        session.targets = [for_client0, for_client1]
        session.relayed = True
        self._begin_connecting(session, now)
        return True

    def relay_unavailable(self, session_id: SessionId, now: float) -> None:
        """No relay could be allocated: negotiate a direct path anyway."""
        session = self._relay_pending(session_id)
        if session is not None:
            self._connect_direct(session, now)

    def _relay_pending(self, session_id: SessionId) -> _Session | None:
        session = self._sessions.get(session_id.cookie)
        if (
            session is None
            or session.id != session_id
            or session.state is not _State.RELAY_PENDING
        ):
            return None
        return session

    def _connect_direct(self, session: _Session, now: float) -> None:
        session.targets = self._direct_targets(session)
        self._begin_connecting(session, now)

    # ------------------------------------------------------------ helpers

    def _drop(self, reason: str) -> None:
        dropped = self.stats.dropped
        dropped[reason] = dropped.get(reason, 0) + 1

    def _send(self, packet: Packet, addr: Address, endpoint: NatNegSocket) -> None:
        self._outbox.append((packet.encode(), addr, endpoint))

    def _schedule(self, session: _Session, when: float) -> None:
        """Make ``when`` the session's one deadline (earlier entries go stale)."""
        self._seq += 1
        session.timer = self._seq
        heapq.heappush(self._heap, (when, self._seq, session.cookie))

    def _allow(self, ip: str, now: float) -> bool:
        """Per-source-IP token bucket (``rate_limit``/``rate_burst``)."""
        rate = self.config.rate_limit
        if rate <= 0:
            return True
        bucket = self._buckets.get(ip)
        if bucket is None:
            if len(self._buckets) >= self.config.max_tracked_ips:
                self._prune_buckets(now)
            self._buckets[ip] = [self.config.rate_burst - 1.0, now]
            return True
        return spend_token(bucket, now, rate, self.config.rate_burst)

    def _prune_buckets(self, now: float) -> None:
        rate, burst = self.config.rate_limit, self.config.rate_burst
        full = [
            ip
            for ip, (tokens, last) in self._buckets.items()
            if tokens + (now - last) * rate >= burst
        ]
        for ip in full:
            del self._buckets[ip]
        if len(self._buckets) >= self.config.max_tracked_ips:
            # A flood from more distinct sources than the table holds: forget them
            # all rather than grow without bound (each gets a fresh burst).
            self._buckets.clear()

    def _housekeeping(self, now: float) -> None:
        self._prune_buckets(now)
        history = self._nat_history
        for ip in [ip for ip, (_, expires) in history.items() if expires <= now]:
            history.pop(ip)
        for pair in [p for p, expires in self._failed_pairs.items() if expires <= now]:
            self._failed_pairs.pop(pair)
        for cookie in [c for c, e in self._preinits.items() if e.expires <= now]:
            del self._preinits[cookie]
        busy = (
            self._buckets or self._nat_history or self._failed_pairs or self._preinits
        )
        if not busy:
            self._housekeeping_timer.stop()

    # ------------------------------------------------------------ INIT

    def _on_init(
        self, p: Init, data: bytes, addr: Address, endpoint: NatNegSocket, now: float
    ) -> None:
        if p.port_type > PortType.NN3:
            self._drop("bad-port-type")
            return
        if p.client_index > 1:
            self._drop("bad-client-index")
            return
        ip = addr[0]
        session = self._sessions.get(p.cookie)
        verdict = None if session is None else self._classify(session, p, addr)
        if self._late_duplicate(p, addr, verdict):
            # A repeat from a replaced negotiation's socket: answered (its sender
            # may still be waiting for the ACK), never recorded.
            self._ack_init(data, addr, endpoint)
            return
        replayed: list[tuple[Init, Address, NatNegSocket]] = []
        if session is not None:
            if verdict is _Verdict.THIRD:
                self._drop("third-client")
                return
            if verdict is _Verdict.RESTART and session.state in _BEFORE_CONNECT:
                session = self._renew(session, p, now)
            elif verdict in (_Verdict.RESTART, _Verdict.TAKEOVER):
                replayed = _echoes(session, p, ip)
                self._retire(session, now, restarted=verdict is _Verdict.RESTART)
                session = None
        if session is None:
            # A client that restarts takes its own retired session's slot (it
            # only lingers as an address book now); any other new session is
            # admitted by its owner's IP: the global and the per-source caps.
            retired = self._lingering.get(p.cookie)
            inherits = (
                verdict is _Verdict.RESTART
                and retired is not None
                and retired.holds_slot
                and retired.owner_ip == ip
            )
            if inherits:
                assert retired is not None
                retired.holds_slot = False
            else:
                refused = self.admission.admit(ip)
                if refused is not None:
                    over_source = refused == REFUSED_OVER_IP_LIMIT
                    self._drop("source-limit" if over_source else "session-limit")
                    return
            session = self._open(p.cookie, ip, now)
            for echo, echo_addr, echo_endpoint in replayed:
                self._record_init(session, echo, echo_addr, echo_endpoint, now)
        if not self._record_init(session, p, addr, endpoint, now):
            # A replayed echo took the slot, but this INIT is from another client.
            self._drop("third-client")
            return
        self._ack_init(data, addr, endpoint)
        client = session.clients[p.client_index]
        assert client is not None
        if (
            self.config.timed_connect
            and client.ert_sent is None
            and client.version >= 2
            and client.complete()
        ):
            self._send_ert(session, client, now)
        if session.state is _State.WAITING:
            first, second = session.clients
            if first is not None and second is not None:
                if first.complete() and second.complete():
                    self._both_complete(session, now)

    def _ack_init(self, data: bytes, addr: Address, endpoint: NatNegSocket) -> None:
        # INIT_ACK: the INIT's bytes 0-14 with type 1, then the public address we
        # saw (UniSpy does the same; the client reads only byte 12, ref §3.2).
        # Built from the INIT's bytes directly: this is the hottest reply.
        self._outbox.append(
            (
                data[:7]
                + b"\x01"
                + data[8:15]
                + ip_to_bytes(addr[0])
                + addr[1].to_bytes(2, "big"),
                addr,
                endpoint,
            )
        )

    def _classify(self, session: _Session, p: Init, addr: Address) -> _Verdict:
        """What an INIT is to the session holding its cookie (see "Restarts").

        A client sends each port type from one socket (GP from the game socket,
        NN1-3 from one negotiate socket, ref §3.1) to one server address, so the
        same client's INIT of a port type from another address comes from a new
        socket: a new attempt. The SDK never resends an ACKed INIT and stops
        sending INITs once it accepts a CONNECT (ref §6), so nothing else explains
        it but a late, reordered duplicate of a replaced attempt, which
        :meth:`_late_duplicate` recognises by its address.
        """
        client = session.clients[p.client_index]
        if client is not None and client.knows(p.port_type, addr):
            return _Verdict.DUPLICATE
        concluded = session.state in _CONCLUDED
        if client is None:
            return _Verdict.TAKEOVER if concluded else _Verdict.JOIN
        if not client.is_same(p, addr[0]):
            return _Verdict.TAKEOVER if concluded else _Verdict.THIRD
        if p.port_type not in client.mappings:
            if session.state in _BEFORE_CONNECT:
                return _Verdict.JOIN
            if client.owns(addr):
                # A late INIT from a socket this attempt already used (NN3 after
                # NN1 through a cone NAT): the same attempt, not a new one.
                return _Verdict.DUPLICATE
        return _Verdict.RESTART

    def _late_duplicate(self, p: Init, addr: Address, verdict: _Verdict | None) -> bool:
        """Is this INIT a repeat of the replaced session still lingering on the
        cookie, rather than news for the current one?

        Its negotiate socket is gone with its attempt, so an NN INIT from there is
        a late duplicate whatever the current session would make of it. A game
        socket may be kept across attempts, so a GP INIT from there counts for the
        current session unless that would restart a client or be refused.
        """
        previous = self._lingering.get(p.cookie)
        if previous is None or not previous.knows(p, addr):
            return False
        if p.port_type != PortType.GP:
            return verdict is not _Verdict.DUPLICATE
        return verdict in (_Verdict.RESTART, _Verdict.THIRD)

    def _record_init(
        self,
        session: _Session,
        p: Init,
        addr: Address,
        endpoint: NatNegSocket,
        now: float,
    ) -> bool:
        """Note the mapping an INIT shows; False if its slot holds another client."""
        ip = addr[0]
        client = session.clients[p.client_index]
        if client is None:
            client = _Client(p, ip, now)
            session.clients[p.client_index] = client
        elif not client.is_same(p, ip):
            return False
        mapping = client.mappings.get(p.port_type)
        if mapping is None:
            client.mappings[p.port_type] = (addr, endpoint)
        elif mapping[0] == addr:
            # A repeat. Of the game socket: kept aside in case NN INITs from a new
            # negotiate socket follow (an attempt on the kept game socket). Of the
            # negotiate socket: that attempt is still the live one.
            client.gp_echo = (p, addr, endpoint) if p.port_type == PortType.GP else None
        if p.port_type >= PortType.NN2 and p.local_port:
            # GP and NN1 INITs carry port 0; NN2/NN3 the socket the game pings from.
            client.local_port = p.local_port
        client.heard = now
        return True

    def _open(self, cookie: int, owner_ip: str, now: float) -> _Session:
        """A new session on ``cookie`` with a fresh serial and its own deadline."""
        self._serial += 1
        session = _Session(SessionId(cookie, self._serial), owner_ip, now)
        self._sessions[cookie] = session
        self._schedule(session, now + self.config.session_timeout)
        return session

    def _renew(self, session: _Session, p: Init, now: float) -> _Session:
        """A client restarted before any CONNECT: it replaces its own record.

        Its partner's record moves to a new session unchanged (a client that has
        its INITs ACKed sends none again, ref §6, so the partner's record is the
        only one there will be). The restarting client starts empty but for a GP
        INIT that repeated its game socket just before (a kept game socket); the
        new session gets the full ``session_timeout`` from now.
        """
        old = session.clients[p.client_index]
        assert old is not None
        if old.check_sent is not None and not old.alive:
            self.stats.count_liveness("replaced")
        renewed = self._replace(session, p.client_index, now, Outcome.RESTARTED)
        if old.gp_echo is not None and p.port_type != PortType.GP:
            self._record_init(renewed, *old.gp_echo, now)
        return renewed

    def _replace(
        self, session: _Session, index: int, now: float, outcome: Outcome
    ) -> _Session:
        """End ``session`` (with ``outcome``) without the record in slot
        ``index``; a new session on the cookie, with the full
        ``session_timeout`` from now, keeps the partner's record unchanged."""
        partner = session.clients[1 - index]
        session.clients[1 - index] = None
        self._retire(session, now, restarted=True, outcome=outcome)
        # The renewed session takes over the retired one's admission slot.
        session.holds_slot = False
        renewed = self._open(session.cookie, session.owner_ip, now)
        renewed.clients[1 - index] = partner
        return renewed

    def _retire(
        self,
        session: _Session,
        now: float,
        *,
        restarted: bool,
        outcome: Outcome = Outcome.RESTARTED,
    ) -> None:
        """Take ``session`` off its cookie for a newer one; it lingers aside.

        ``restarted``: its own clients started over, so it is closed now (its
        relay pair will not be used) and kept only as an address book for late
        duplicates until ``linger`` ends. Otherwise (another pair on a concluded
        session's cookie) it runs its remaining deadlines (error CONNECTs, linger)
        and ends as usual: its clients may be playing through its relay pair.
        """
        del self._sessions[session.cookie]
        older = self._lingering.pop(session.cookie, None)
        if older is not None:
            self._delete(older, now)
        self._lingering[session.cookie] = session
        if not restarted:
            return
        if session.state is not _State.DONE:
            self._conclude(session, outcome, now)
            session.state = _State.DONE
            self._schedule(session, now + self.config.linger)
        self._close(session, replaced=True)

    # ------------------------------------------------------------ CONNECT timing

    def _send_ert(self, session: _Session, client: _Client, now: float) -> None:
        """One ERT_TEST to the client's negotiate socket, to time its ERT_ACK.

        Sent once per client, when it is complete: after three or four INITs (each
        at least 22 bytes), so the replies to a spoofed client (its INIT_ACKs and
        this) are no larger in total than what it sent.
        """
        mapping = client.mappings.get(PortType.NN1)
        if mapping is None:
            return
        addr, endpoint = mapping
        client.ert_sent = now
        self._send(
            ErtTest(client.version, session.cookie, PortType.NN1, client.index),
            addr,
            endpoint,
        )

    def _on_ert_ack(
        self, p: ErtAck, addr: Address, endpoint: NatNegSocket, now: float
    ) -> None:
        session = self._sessions.get(p.cookie)
        client = (
            session.clients[p.client_index]
            if session is not None and p.client_index <= 1
            else None
        )
        probe = (
            client is not None
            and client.probe_sent is not None
            and endpoint == self.config.unsolicited_port
        )
        if (
            session is None
            or client is None
            or (client.ert_sent is None and not probe)
            or client.public_ip != addr[0]
        ):
            # NATify ERTs are not ACKed (ref §3.2): nothing else of ours is.
            self._drop("unsolicited-ert-ack")
            return
        if probe:
            # The ACK of the probe went to the probe socket: the NAT let a packet
            # from a port the client never sent to through.
            if client.probe_open is None:
                client.probe_open = True
        elif client.rtt is None:
            assert client.ert_sent is not None
            client.rtt = now - client.ert_sent
        elif (
            client.check_sent is not None
            and not client.alive
            and client.mappings.get(PortType.NN1) == (addr, endpoint)
        ):
            # The liveness ERT came back from the negotiate socket it went to:
            # the process that INITed is still there.
            client.alive = True
            self.stats.count_liveness("alive")
        else:
            return
        client.heard = now
        if session.state is _State.TIMING:
            self._settle(session, now)

    def _send_probes(self, session: _Session, now: float) -> None:
        """Probe the filtering of a client whose partner's mapping is
        endpoint-dependent (``probe_filtering``).

        Only then does filtering decide the pair (docs/nat-matrix.md): a symmetric
        NAT opens a new port toward the peer, which only a filter that ignores the
        source port lets in. Sent when both are complete (each client's own ERT
        already left, so its round trip times the probe) and only when it
        decides something, so a pair of cones gets no more than before. The
        probed client's replies (INIT_ACKs, our ERT, the probe: 105 bytes for
        three INITs of at least 22) may outweigh its INITs by up to 1.6x, only
        here, within the reflection budget.
        """
        config = self.config
        source = config.unsolicited_port
        first, second = session.clients
        if (
            not config.probe_filtering
            or source is None
            or config.relay_mode is not RelayMode.AUTO
            or config.force_lan_mode
            or first is None
            or second is None
            or first.public_ip == second.public_ip
            or first.symmetric() == second.symmetric()
        ):
            return
        client = second if first.symmetric() else first
        mapping = client.mappings.get(PortType.NN1)
        if client.version < 2 or client.probe_sent is not None or mapping is None:
            return
        client.probe_sent = now
        self._send(
            ErtTest(client.version, session.cookie, PortType.NN1, client.index),
            mapping[0],
            source,
        )

    def _settle_time(self, session: _Session) -> float | None:
        """When every round trip and probe asked for is measured or given up on
        (None: nothing is pending).

        Our own ERT gets ``rtt_wait``; an unanswered probe counts as filtered
        ``probe_grace`` after the client's own ERT came back (or would have, by
        the round trip measured before), at most ``rtt_wait`` after it left.
        """
        config = self.config
        pending: list[float] = []
        timing = self._timing_helps(session)
        for c in session.clients:
            if c is None:
                continue
            probing = c.probe_sent is not None and c.probe_open is None
            if c.ert_sent is not None and c.rtt is None and (timing or probing):
                pending.append(c.ert_sent + config.rtt_wait)
            if c.check_sent is not None and not c.alive:
                pending.append(self._check_deadline(c))
            if c.probe_sent is not None and c.probe_open is None:
                limit = c.probe_sent + config.rtt_wait
                if c.rtt is not None:
                    limit = min(limit, c.probe_sent + c.rtt + config.probe_grace)
                pending.append(limit)
        return max(pending) if pending else None

    def _settle(self, session: _Session, now: float) -> None:
        """Connect if nothing is pending any more, else wait (state TIMING)."""
        when = self._settle_time(session)
        if when is None or when <= now:
            self._start_connect(session, now)
            return
        session.state = _State.TIMING
        self._schedule(session, when)

    def _both_complete(self, session: _Session, now: float) -> None:
        self._check_liveness(session, now)
        self._send_probes(session, now)
        self._settle(session, now)

    def _check_liveness(self, session: _Session, now: float) -> None:
        """Ask a client that has been silent for ``stale_after`` whether its
        process is still there, before its partner is told its ports.

        A waiting SDK client sends nothing once its INITs are ACKed (ref §6), so
        a waiting client and a dead one (a game stopped while it waited, a
        process killed and started again on the same cookie) look the same; a
        CONNECT naming the dead one's ports makes the partner ping them until
        the SDK's ping timeout (6.4 s). The SDK answers an ERT_TEST on its
        negotiate socket in any state (ref §3.2), so one ERT tells: answered, the
        pair is made; not answered while it answered our timing ERT before
        (:meth:`_start_connect`), the record is dropped. Its restart, if one is
        coming, replaces it meanwhile (a restart before CONNECT, :meth:`_renew`).
        Only a client known to answer ERTs is asked: for any other no answer
        would prove nothing. One 21-byte datagram, once per record.
        """
        for client in session.clients:
            if (
                client is None
                or client.alive
                or client.check_sent is not None
                or client.rtt is None
                or now - client.heard < self.config.stale_after
            ):
                continue
            mapping = client.mappings.get(PortType.NN1)
            if mapping is None:
                continue
            client.check_sent = now
            self.stats.count_liveness("asked")
            self._send(
                ErtTest(client.version, session.cookie, PortType.NN1, client.index),
                *mapping,
            )

    def _check_deadline(self, client: _Client) -> float:
        """When an unanswered liveness ERT means the client is gone: its round
        trip measured before, plus ``probe_grace`` for its poll, at most
        ``rtt_wait`` after it left."""
        assert client.check_sent is not None and client.rtt is not None
        config = self.config
        return client.check_sent + min(config.rtt_wait, client.rtt + config.probe_grace)

    def _timing_helps(self, session: _Session) -> bool:
        """Can the CONNECTs' timing change this pair's outcome or cost it a ping
        interval? Only then is the wait for the round trips worth it: it adds the
        later client's round trip to every negotiation (docs/natneg.md, "Where
        timing pays").

        An early first ping knocks on a router that filters: it drops it and, if
        it accepts it in its input chain, remaps its own client's later pings to
        a new port. That breaks the pair when the other NAT filters by port (it
        drops the new port), and costs a ping interval (700 ms, ref §6) when the
        knocking side maps per destination (the knocked side's own ping went to a
        port the symmetric NAT did not open). Elsewhere the SDK answers the
        partner's ping at once (ref §6) and a knock costs one round trip. So no
        timing when one side does not filter at all (it sits on its public
        address, :meth:`_Client.unnated`, or its IP's last REPORT named no NAT or
        a full cone: its own NAT detection, ref §5), or when neither maps per
        destination and neither filters by port (both REPORTed restricted cones);
        nor when both map per destination (relayed), on a LAN, or when every
        pair is relayed.
        """
        first, second = session.clients
        config = self.config
        if (
            not config.timed_connect
            or first is None
            or second is None
            or config.relay_mode is RelayMode.ALWAYS
            or config.force_lan_mode
            or first.public_ip == second.public_ip
            or (first.symmetric() and second.symmetric())
        ):
            return False
        known = [self._known_nat(c.public_ip) for c in (first, second)]
        unfiltered = (NatType.NO_NAT, NatType.FULL_CONE)
        if first.unnated() or second.unnated() or any(k in unfiltered for k in known):
            return False
        if first.symmetric() or second.symmetric():
            return True
        return not all(k in (*unfiltered, NatType.RESTRICTED_CONE) for k in known)

    def _connect_leads(self, session: _Session) -> tuple[float, float]:
        """Seconds each client's first CONNECT waits so both arrive together.

        With one-way times ``d = rtt / 2``, the farther client's CONNECT goes at
        once and the nearer one's ``d_far - d_near`` later (at most
        ``max_connect_lead``). Unknown round trips (a v1 client, a lost ERT): no
        wait, as before.
        """
        first, second = session.clients
        assert first is not None and second is not None
        if not self._timing_helps(session):
            return (0.0, 0.0)
        return crossing_leads(
            first.rtt,
            second.rtt,
            self.config.max_connect_lead,
            self.config.client_poll,
        )

    # ------------------------------------------------------------ CONNECT

    def _start_connect(self, session: _Session, now: float) -> None:
        for index, client in enumerate(session.clients):
            if (
                client is not None
                and client.check_sent is not None
                and not client.alive
            ):
                # Silent since its INITs and no answer to the liveness ERT: its
                # process is gone. Its partner waits for it (or its restart) in
                # a new session instead of pinging dead ports.
                self.stats.count_liveness("gone")
                self._replace(session, index, now, Outcome.GONE)
                return
        first, second = session.clients
        assert first is not None and second is not None
        for client in (first, second):
            if client.probe_sent is not None and client.probe_open is None:
                # Given up on. It says "filtered" only if the client answered our
                # own ERT (it answers ERTs and the path works); else nothing.
                client.probe_open = False if client.rtt is not None else None
        pair = _pair(first.public_ip, second.public_ip)
        session.first_attempt = pair not in self._failed_pairs
        verdict = self._relay_reason(first, second)
        if verdict is None:
            self._connect_direct(session, now)
            return
        reason, detail = verdict
        session.state = _State.RELAY_PENDING
        self._events.append(
            RelayNeeded(session.id, (first.public_ip, second.public_ip), reason, detail)
        )
        # Safety net: if the transport never answers, negotiate directly.
        self._schedule(session, now + self.config.connect_interval)

    def _relay_reason(self, a: _Client, b: _Client) -> tuple[str, str] | None:
        """Why a direct path between ``a`` and ``b`` is predicted to fail (a
        :data:`RELAY_REASONS` label and the evidence), or None.

        The prediction is docs/nat-matrix.md's: pinging the addresses the server
        saw fails when both mappings are endpoint-dependent ("symmetric": a
        client's NN1/NN2/NN3 INITs, one socket to three server addresses, came
        from different public ports), or when one is and the other NAT filters by
        address and port: the symmetric side pings from a port nobody saw, which
        such a filter drops. Mapping shows in the INITs; filtering in the probe of
        :meth:`_send_probes`, else in an earlier REPORT of the same public IP (the
        natType its client detected). Failed REPORTs between the same two
        addresses relay the retry (games retry with a new cookie, ref §7.4).
        """
        mode = self.config.relay_mode
        if mode is RelayMode.NEVER:
            return None
        if mode is RelayMode.ALWAYS:
            return ("forced", "relay mode always")
        if a.public_ip == b.public_ip or self.config.force_lan_mode:
            return None  # the LAN path needs no NAT traversal
        sym_a, sym_b = a.symmetric(), b.symmetric()
        if sym_a and sym_b:
            return (
                "both-symmetric",
                f"{_ports(a)} and {_ports(b)}: both NATs map per destination",
            )
        hard = (NatType.PORT_RESTRICTED_CONE, NatType.SYMMETRIC)
        if sym_a or sym_b:
            sym, other = (a, b) if sym_a else (b, a)
            if other.probe_open is False:
                return (
                    "symmetric-vs-port-filtering",
                    f"{_ports(sym)} maps per destination; client {other.index}"
                    " dropped the ERT from another server port (filters by port)",
                )
            if self._known_nat(other.public_ip) in hard:
                return (
                    "symmetric-vs-restricted",
                    f"{_ports(sym)} maps per destination; client {other.index}'s"
                    " IP reported a port-restricted or symmetric NAT",
                )
        if _pair(a.public_ip, b.public_ip) in self._failed_pairs:
            return ("failed-before", "these two IPs failed to connect directly")
        return None

    def _known_nat(self, ip: str) -> int | None:
        entry = self._nat_history.get(ip)
        return entry[0] if entry is not None else None

    def _direct_targets(self, session: _Session) -> list[Address]:
        first, second = session.clients
        assert first is not None and second is not None
        return [self._peer_address(first, second), self._peer_address(second, first)]

    def _peer_address(self, me: _Client, peer: _Client) -> Address:
        """Where ``me`` should ping ``peer``.

        The peer's private INIT address when ``force_lan_mode`` is set or when both
        share a public IP (they are behind one NAT; hairpinning is not assumed) and
        the address is usable; otherwise the peer's public mapping of the socket it
        will ping from: the game socket (GP INIT) if it lent one, else the negotiate
        socket (NN1 INIT) -- ref §8 "Peer address".
        """
        if self.config.force_lan_mode or me.public_ip == peer.public_ip:
            if peer.local_port and _valid_private_ip(peer.local_ip, peer.public_ip):
                return (peer.local_ip, peer.local_port)
        for port_type in (
            (PortType.GP, PortType.NN1) if peer.use_game_port else (PortType.NN1,)
        ):
            mapping = peer.mappings.get(port_type)
            if mapping is not None:
                return mapping[0]
        return next(iter(peer.mappings.values()))[0]

    def _begin_connecting(self, session: _Session, now: float) -> None:
        session.state = _State.CONNECTING
        for client, lead in zip(
            session.clients, self._connect_leads(session), strict=True
        ):
            assert client is not None
            client.next_connect = now + lead
            client.connects_left = self.config.connect_attempts
        self._connect_tick(session, now)

    def _connect_tick(self, session: _Session, now: float) -> None:
        """Send the CONNECTs that are due; re-arm for the next one, or give up
        ``connect_interval`` after a client's last CONNECT went unACKed."""
        self._send_connects(session, now)
        pending = [c for c in session.clients if c is not None and not c.acked]
        if any(c.connects_left == 0 and c.next_connect <= now for c in pending):
            self._conclude(session, Outcome.UNACKED, now)
            session.state = _State.DONE
            self._schedule(session, now + self.config.linger)
        elif pending:
            self._schedule(session, min(c.next_connect for c in pending))

    def _send_connects(self, session: _Session, now: float) -> None:
        for index, client in enumerate(session.clients):
            if (
                client is None
                or client.acked
                or client.connects_left == 0
                or client.next_connect > now
            ):
                continue
            client.connects_left -= 1
            client.next_connect = now + self.config.connect_interval
            ip, port = session.targets[index]
            packet = Connect(
                client.version,
                session.cookie,
                ip,
                port,
                _GOT_YOUR_DATA,
                Finished.NOERROR,
            )
            wire = packet.encode()
            for addr, endpoint in client.mappings.values():
                self._outbox.append((wire, addr, endpoint))

    def _session_of(self, cookie: int, index: int, addr: Address) -> _Session | None:
        """The session whose client ``index`` has ``addr`` among its mappings:
        the current one on the cookie, else the one lingering beside it.

        CONNECT_ACK and REPORT come from the negotiate socket (ref §3.2, §3.4),
        along the mapping of an INIT to the same server address, so a late packet
        of a replaced attempt is told from the live one by its address, not its IP.
        """
        for session in (self._sessions.get(cookie), self._lingering.get(cookie)):
            if session is None:
                continue
            client = session.clients[index]
            if client is not None and client.owns(addr):
                return session
        return None

    def _on_connect_ack(self, p: ConnectAck, addr: Address, now: float) -> None:
        # Only the cookie and byte 13 are set by the SDK; the rest is stack garbage.
        if p.client_index > 1:
            self._drop("bad-client-index")
            return
        session = self._session_of(p.cookie, p.client_index, addr)
        if session is None:
            current = self._sessions.get(p.cookie) or self._lingering.get(p.cookie)
            if current is None:
                self._drop("unknown-cookie")
                return
            client = current.clients[p.client_index]
            # From the client's IP but none of its sockets: an ACK of an earlier
            # attempt on the cookie (it must not stop this one's CONNECTs).
            self._drop(
                "stale-connect-ack"
                if client is not None and client.public_ip == addr[0]
                else "bad-source"
            )
            return
        client = session.clients[p.client_index]
        assert client is not None
        if session.state is not _State.CONNECTING:
            if session.state is not _State.DONE:
                # No CONNECT of this session was sent yet (or only error CONNECTs,
                # which are never ACKed): an ACK of an earlier session on the
                # cookie, which must not stop this one's CONNECTs.
                self._drop("stale-connect-ack")
            return
        client.acked = True
        if all(c is not None and c.acked for c in session.clients):
            session.state = _State.DONE
            self._schedule(session, now + self.config.linger)

    # ------------------------------------------------------------ failures

    def _fail(self, session: _Session, now: float) -> None:
        """``session_timeout`` passed before both clients were complete."""
        outcome = Outcome.INIT_TIMEOUT
        for index, client in enumerate(session.clients):
            if client is None:
                continue
            partner = session.clients[1 - index]
            if partner is None:
                session.codes[index] = Finished.DEADBEAT_PARTNER
                outcome = Outcome.DEADBEAT
            else:
                session.codes[index] = Finished.INIT_PACKETS_TIMEDOUT
        if all(c is not None for c in session.clients):
            a, b = session.clients
            assert a is not None and b is not None
            session.first_attempt = (
                _pair(a.public_ip, b.public_ip) not in self._failed_pairs
            )
        self._conclude(session, outcome, now)
        session.state = _State.FAILING
        session.sends_left = self.config.error_attempts
        self._send_errors(session)
        self._schedule(session, now + self.config.connect_interval)

    def _send_errors(self, session: _Session) -> None:
        session.sends_left -= 1
        for index, client in enumerate(session.clients):
            code = session.codes[index]
            if client is None or code is None:
                continue
            wire = Connect(
                client.version, session.cookie, "0.0.0.0", 0, 0, code
            ).encode()
            for addr, endpoint in client.mappings.values():
                self._outbox.append((wire, addr, endpoint))

    def _conclude(self, session: _Session, outcome: Outcome, now: float) -> None:
        """Emit the session's one :class:`NegotiationFinished` (later calls: no-op)."""
        if session.outcome is not None:
            return
        session.outcome = outcome
        self._events.append(
            NegotiationFinished(
                session.id,
                outcome,
                session.relayed,
                now - session.created,
                session.first_attempt,
                tuple(
                    (client.public_ip, client.nat_kind(), client.rtt)
                    for client in session.clients
                    if client is not None
                ),
            )
        )

    def _on_session_timer(self, session: _Session, now: float) -> None:
        state = session.state
        if state is _State.WAITING:
            self._fail(session, now)
        elif state is _State.RELAY_PENDING:
            self._connect_direct(session, now)
        elif state is _State.TIMING:
            self._start_connect(session, now)
        elif state is _State.CONNECTING:
            self._connect_tick(session, now)
        elif state is _State.FAILING:
            if session.sends_left > 0:
                self._send_errors(session)
                self._schedule(session, now + self.config.connect_interval)
            else:
                session.state = _State.DONE
                self._schedule(session, now + self.config.linger)
        else:
            self._delete(session, now)

    def _delete(self, session: _Session, now: float) -> None:
        # CONNECTs acknowledged but no REPORT: a v1/v2 client (they never report)
        # or a lost REPORT.
        self._conclude(
            session,
            Outcome.UNREPORTED if session.state is _State.DONE else Outcome.RESTARTED,
            now,
        )
        cookie = session.cookie
        if self._sessions.get(cookie) is session:
            del self._sessions[cookie]
        elif self._lingering.get(cookie) is session:
            del self._lingering[cookie]
        session.timer = 0  # its heap entry, if any, is now stale
        self._close(session, replaced=False)
        if session.holds_slot:
            session.holds_slot = False
            self.admission.release(session.owner_ip)

    def _close(self, session: _Session, *, replaced: bool) -> None:
        """Emit the session's one :class:`SessionClosed`."""
        if not session.closed:
            session.closed = True
            self._events.append(SessionClosed(session.id, replaced))

    # ------------------------------------------------------------ stateless

    def _on_report(
        self, p: Report, addr: Address, endpoint: NatNegSocket, now: float
    ) -> None:
        # REPORT_ACK as the real server sent it: the REPORT's first 21 bytes, type
        # 0x0E, byte 14 (negResult) cleared (ref §3.2). Always answered: a v3 client
        # without it delays its success callback by ~7 s (ref §6).
        wire = p.encode()
        ack = ReportAck(
            p.version,
            p.cookie,
            p.port_type,
            p.client_index,
            0,
            f"{wire[15]}.{wire[16]}.{wire[17]}.{wire[18]}",
            int.from_bytes(wire[19:21], "big"),
        )
        self._send(ack, addr, endpoint)
        nat_type = p.nat_type
        ip = addr[0]
        if nat_type is not None and nat_type < NatType.UNKNOWN:
            self._nat_history.put(ip, (nat_type, now + self.config.history_ttl))
            self._housekeeping_timer.arm(now)
        session = (
            self._session_of(p.cookie, p.client_index, addr)
            if p.client_index <= 1
            else None
        )
        if (
            session is not None
            and session.targets
            and session.state in (_State.CONNECTING, _State.DONE)
        ):
            # A REPORT is the only word on whether the clients reached each other;
            # it counts only for a session that sent them a peer address, and
            # only from a socket of its own clients.
            a, b = session.clients
            assert a is not None and b is not None
            success = bool(p.neg_result)
            self._conclude(
                session, Outcome.CONNECTED if success else Outcome.FAILED, now
            )
            if not success and a.public_ip != b.public_ip:
                self._failed_pairs.put(
                    _pair(a.public_ip, b.public_ip),
                    now + self.config.history_ttl,
                )
                self._housekeeping_timer.arm(now)
        self._events.append(
            ReportReceived(
                p.cookie, p.client_index, bool(p.neg_result), nat_type, p.game_name
            )
        )

    def _on_address_check(
        self, p: AddressCheck, addr: Address, endpoint: NatNegSocket
    ) -> None:
        # The client indexes nat->mappings[cookie] with the reply's cookie: anything
        # but 0-3 would make it write out of bounds (ref §3.2), so never echo it.
        if p.cookie > 3:
            self._drop("bad-cookie")
            return
        reply = AddressReply(
            p.version, p.cookie, p.port_type, p.client_index, 0, addr[0], addr[1]
        )
        self._send(reply, addr, endpoint)

    def _on_natify(
        self, p: NatifyRequest, addr: Address, endpoint: NatNegSocket
    ) -> None:
        """Reachability test (ref §5): echo the request as ERT_TEST (what GameSpy did).

        pt1 is answered from where it arrived (solicited). pt2 must come from an IP
        the client's ERT socket never contacted (it sent to natneg1 and natneg2) to
        show whether its NAT filters by IP; pt3 from a contacted IP but another port.
        Without a spare IP, pt2 is sent from the spare port too: then an
        address-restricted cone NAT is reported as full cone (documented limit), but
        the client completes at once instead of waiting 10 s for a reply that never
        comes (ref §8).
        """
        if p.cookie != NATIFY_COOKIE:
            # The SDK's only NATify cookie is 777 (ref §3.5); this is not NATify.
            self._drop("bad-cookie")
            return
        config = self.config
        source: NatNegSocket | None
        if p.port_type <= PortType.NN1:
            source = endpoint
        elif p.port_type == PortType.NN2:
            source = (
                config.unsolicited_ip
                if config.unsolicited_ip is not None
                else config.unsolicited_port
            )
        elif p.port_type == PortType.NN3:
            source = config.unsolicited_port
        else:
            self._drop("bad-port-type")
            return
        if source is None:
            self._drop("no-probe-endpoint")
            return
        ert = p.echo_as(ErtTest)
        self._send(ert, addr, source)

    def _on_backup_test(
        self, p: BackupTest, addr: Address, endpoint: NatNegSocket
    ) -> None:
        # No client sends BACKUP_TEST; answer with the echo the DWC emulator uses
        # (same size as the request, so no amplification).
        ack = p.echo_as(BackupAck)
        self._send(ack, addr, endpoint)

    def _on_preinit(
        self, p: Preinit, addr: Address, endpoint: NatNegSocket, now: float
    ) -> None:
        """v4 PREINIT (ref §3.6): WAITING_FOR_CLIENT until the partner's PREINIT for
        the same cookie has arrived, then READY to both (the DWC emulator's
        pairing; OpenSpy answers READY at once). PREINIT_ACK carries clientID 0, as
        in the captured replies."""
        if p.client_index > 1:
            self._drop("bad-client-index")
            return
        entry = self._preinits.get(p.cookie)
        if entry is None:
            if len(self._preinits) >= self.config.max_sessions:
                self._drop("session-limit")
                return
            entry = _PreinitEntry(now + self.config.session_timeout)
            self._preinits[p.cookie] = entry
            self._housekeeping_timer.arm(now)
        entry.slots[p.client_index] = (addr, endpoint, p.version)
        partner = entry.slots[1 - p.client_index]
        if partner is None:
            state = PreinitState.WAITING_FOR_CLIENT
        else:
            state = PreinitState.READY
            p_addr, p_endpoint, p_version = partner
            self._send(
                PreinitAck(p_version, p.cookie, 1 - p.client_index, state, 0),
                p_addr,
                p_endpoint,
            )
        self._send(
            PreinitAck(p.version, p.cookie, p.client_index, state, 0), addr, endpoint
        )


def _echoes(
    session: _Session, p: Init, ip: str
) -> list[tuple[Init, Address, NatNegSocket]]:
    """The GP INITs of ``session`` to count in the session ``p`` starts.

    A game socket kept across attempts repeats its known mapping, and comes first
    (ref §3.1); the client will not send it again once ACKed. Not replayed: the
    echo of ``p``'s own slot when ``p`` is itself a GP INIT (it shows the game
    socket changed) or is from another client (a new pair on the cookie).
    """
    replayed = []
    for index, client in enumerate(session.clients):
        if client is None or client.gp_echo is None:
            continue
        if index == p.client_index and (
            p.port_type == PortType.GP or not client.is_same(p, ip)
        ):
            continue
        replayed.append(client.gp_echo)
    return replayed


def _ports(client: _Client) -> str:
    """``client 1 NN1/NN2/NN3 :p1/:p2/:p3``, the mappings that show its NAT."""
    ports = "/".join(
        f":{client.mappings[pt][0][1]}"
        for pt in _NEGOTIATE_SOCKET_PORTS
        if pt in client.mappings
    )
    return f"client {client.index} NN {ports}"


def _pair(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a < b else (b, a)
