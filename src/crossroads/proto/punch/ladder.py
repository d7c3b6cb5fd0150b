"""The connection ladder's schedule: who sends which probe where, and when.

Theory of operation
-------------------
Both peers receive ``punch_start`` with the same two :class:`PeerInfo` records and
start at the same instant (``t_go``). Each runs :func:`plan` on the same inputs
and gets the *same* schedule for both sides; it executes its own half. Because
the schedule is shared, each side can predict the NAT ports the other side's
sends will create — which is what port prediction needs.

Steps, in order (names as the NAT lab reports them):

``lan``      both send to the other's host candidates, when both have the same
             public IP (they are behind the same NAT) — RakNet's
             TESTING_INTERNAL_IPS: 2 sends per address, 15 ms apart (§2.1).
             When both have IPv6 host candidates, they send to those in any
             case: IPv6 has no NAT to traverse, only stateful firewalls, which
             simultaneous sends open (ICE's preference for IPv6 host pairs).
``direct``   only the initiator sends, to the responder's server-observed public
             endpoint: succeeds when the responder has no NAT. Skipped when the
             responder is known to be behind a NAT (none of its host candidates
             carries its public address): a one-sided send then reaches the
             responder's router before the responder has sent anything towards
             the initiator, and a router that accepts unsolicited input keeps a
             conntrack entry for it that makes it *remap* the responder's port
             when the responder punches later -- the knock that fails first
             attempts (docs/natneg.md "CONNECT timing"). A NAT that
             filters nothing is opened by the ``punch`` step's first slot at the
             same moment, with both sides sending.
``mapping``  each side sends to the other's port-mapped (UPnP / NAT-PMP / PCP)
             endpoint, if it holds one: an open port needs no punching.
``punch``    simultaneous open: both send to the other's public endpoint at the
             same time, in three slots for port offsets 0..2 (RakNet's
             MAX_PREDICTIVE_PORT_RANGE = 2); 8 sends 50 ms apart per slot
             (UDP_SENDS_PER_PORT_EXTERNAL, TIME_BETWEEN_PUNCH_ATTEMPTS_EXTERNAL).
             A side whose NAT maps *sequentially* is predicted: each new
             destination it contacts gets ``last + stride x n`` (the server saw
             ``last`` and ``stride`` on its three rendezvous ports; the shared
             schedule gives ``n``). When both map sequentially, slot k of each side
             targets the port the other side's k-th new destination gets, so the
             two new mappings meet.
             A *random* mapping against an endpoint-independent one adds the
             birthday technique (reference §3.4): the hard side opens 256 sockets
             that each send to the easy side; the easy side probes random ports
             of the hard side's IP (the hard side's sends leave with a TTL of
             2: they open its own NAT and die before the easy side's router,
             which must see the easy side's probe first). With 256 holes among
             65 535 ports, k probes
             succeed with P = 1 - (1 - 256/65535)^k: 98 % at 1024, 99.97 % at
             2048. We probe 2048 at 500/s (about 4 s; Tailscale's figure is 100/s).

             A *random* mapping against a *sequential* one cannot use the
             birthday technique: neither side has a fixed port. It uses the
             *prediction spray* instead. The sequential side opens
             ``SPRAY_PORTS`` new mappings, each aimed at a random port of the
             random side's IP; its NAT numbers them ``last + stride x n``, so the
             random side knows every one of their ports without knowing what
             they aim at. The random side then sends from ``SPRAY_SOCKETS``
             sockets to each of those ports. Each of its new mappings gets a
             random port r towards one sequential-side port b; it is a hit when
             b's mapping was aimed at r, P = 1/64 512 per mapping. So
             P(hit) = 1 - exp(-n / 64 512) after n mappings: the mean cost is
             64 512 datagrams (about 1 s at the lab's 60 000/s), and the budget
             of 2048 x 256 = 524 288 fails 3 times in 10 000. There is no
             cheaper way: each random-side mapping can match exactly one
             sequential-side mapping, so the expected hits are n / 64 512
             whatever the arrangement. It needs a NAT that holds that many
             flows at once (the lab's kernel NAT does; a home router that caps a
             host at a few thousand sessions will not, and the relay step takes
             over).

What the schedule cannot do — a random mapping against another random mapping
(both holes unknown and both change with every destination: about 65 536 probes
per side for 64 %), or UDP that never reached the server — is left to the
``relay`` step, which the client runs when the schedule ends without a path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from crossroads.proto.punch.signalling import PeerInfo
from crossroads.types import Address, frozen

#: RakNet internal-address schedule (§2.1): 2 sends per address, 15 ms apart; at
#: most 5 addresses (MAXIMUM_NUMBER_OF_INTERNAL_IDS_TO_CHECK).
LAN_SENDS = 2
LAN_INTERVAL = 0.015
LAN_MAX_ADDRESSES = 5
LAN_DURATION = 0.25
#: External sends per target, and the gap between them (§2.1 defaults 8 / 50 ms).
EXTERNAL_SENDS = 8
EXTERNAL_INTERVAL = 0.05
#: Direct and mapping steps: 8 sends + 100 ms for the answer to come back.
DIRECT_DURATION = EXTERNAL_SENDS * EXTERNAL_INTERVAL + 0.1
#: Port offsets 0..2: RakNet's MAX_PREDICTIVE_PORT_RANGE = 2.
PREDICTION_SLOTS = 3
SLOT_DURATION = EXTERNAL_SENDS * EXTERNAL_INTERVAL + 0.1
#: Birthday technique (reference §3.4, Tailscale / danderson): 256 sockets on the
#: hard side, 2048 random probes from the easy side (99.97 %).
BIRTHDAY_SOCKETS = 256
BIRTHDAY_PROBES = 2048
BIRTHDAY_RATE = 500.0
#: Hard-side sockets re-send every second so their mappings stay alive and each
#: new probe from the easy side finds the hole open.
BIRTHDAY_RESEND = 1.0
#: IP TTL of the hard side's hole-opening sends: enough to leave its own NAT (one
#: router), too little to reach the easy side's router, as RakNet's
#: NatPunchthroughClient sends a TTL-2 datagram before punching
#: (shared/reference/raknet-wire.md §3). The easy side's probes are what must
#: arrive; a hard-side datagram that reached the easy router first would be a
#: knock, and a router that accepts unsolicited input would remap the easy
#: side's port for exactly that hard port -- the one a hit needs (docs/natneg.md).
BIRTHDAY_TTL = 2
#: Ports a random NAT allocates from (Linux' default NAT range is 1024-65535).
BIRTHDAY_LOW_PORT = 1024
NAT_PORT_SPAN = 65536 - BIRTHDAY_LOW_PORT
#: Prediction spray (random against sequential mapping, see above): the
#: sequential side's new mappings, and the random side's sockets that each send to
#: all of them. 2048 x 256 = 524 288 random-side mappings: P(hit) = 99.97 %.
SPRAY_PORTS = 2048
SPRAY_SOCKETS = 256
#: Random side: datagrams per second at most. Each one makes a new conntrack
#: entry on its NAT; the lab's kernel path sustains ~67 000/s from one core, so
#: the whole budget takes ~9 s and the mean hit ~1 s.
SPRAY_RATE = 60_000.0
#: Sequential side: its 2048 mappings in ~0.1 s, before the random side starts
#: (a datagram that reaches a NAT before the mapping it needs is lost).
SPRAY_SEQUENTIAL_RATE = 20_000.0
SPRAY_HEAD_START = 0.15
#: After the last send, how long to wait for a late answer before giving up.
FINAL_WAIT = 0.3


@frozen
class Send:
    """One probe: at ``at`` seconds after t_go, from socket ``socket`` (0 is the
    peer socket, 1.. are birthday sockets) to ``dest``."""

    at: float
    step: str
    dest: Address
    socket: int = 0
    #: IP TTL of this datagram; 0: the socket's default.
    ttl: int = 0


@frozen
class Spray:
    """Many probes in one run, sent by one paced task rather than a timer each.

    From ``at`` seconds after t_go: with ``sockets`` = 0 the peer socket sends
    one probe to each of ``ports`` on ``host``; with ``sockets`` = n, each of the
    extra sockets 1..n sends one to every port, socket after socket. At most
    ``rate`` datagrams per second; it stops as soon as a path is found.
    """

    at: float
    step: str
    host: str
    ports: tuple[int, ...]
    sockets: int
    rate: float

    @property
    def count(self) -> int:
        return len(self.ports) * max(1, self.sockets)

    @property
    def duration(self) -> float:
        return self.count / self.rate


@frozen
class Step:
    name: str
    start: float
    end: float


@dataclass(slots=True)
class Plan:
    """Both sides' schedules; ``mine``/``theirs`` select by role."""

    steps: list[Step] = field(default_factory=list)
    initiator: list[Send] = field(default_factory=list)
    responder: list[Send] = field(default_factory=list)
    #: Bulk sends (the prediction spray), per side.
    initiator_sprays: list[Spray] = field(default_factory=list)
    responder_sprays: list[Spray] = field(default_factory=list)
    #: Extra sockets (birthday, spray) each side must open.
    initiator_sockets: int = 0
    responder_sockets: int = 0

    @property
    def duration(self) -> float:
        return (self.steps[-1].end if self.steps else 0.0) + FINAL_WAIT

    def sends(self, role: str) -> list[Send]:
        return self.initiator if role == "initiator" else self.responder

    def sprays(self, role: str) -> list[Spray]:
        return self.initiator_sprays if role == "initiator" else self.responder_sprays

    def sockets(self, role: str) -> int:
        return self.initiator_sockets if role == "initiator" else self.responder_sockets

    def set_sockets(self, role: str, count: int) -> None:
        """``role`` must open ``count`` extra sockets."""
        if role == "initiator":
            self.initiator_sockets = count
        else:
            self.responder_sockets = count


class _NatModel:
    """Predicts the public port one side's NAT gives each new destination."""

    def __init__(self, info: PeerInfo) -> None:
        self.info = info
        self.mapping = info.mapping if info.public is not None else "unknown"
        last = info.ports[-1] if info.ports else 0
        # Flows the client opened since the server saw ``last`` moved a
        # sequential NAT's counter on by that many ports.
        self.last = last + info.stride * info.candidates.flows
        self.contacted: dict[Address, int] = {}
        #: New destinations whose addresses only this side knows (spray probes).
        self.unnamed = 0

    @property
    def ip(self) -> str | None:
        return self.info.public.host if self.info.public else None

    @property
    def public_port(self) -> int:
        return self.info.public.port if self.info.public else 0

    def next_port(self) -> int:
        """The port the next *new* destination will get (sequential mapping)."""
        port = self.last + self.info.stride * (len(self.contacted) + self.unnamed + 1)
        return (port - 1) % 65535 + 1

    def open_unnamed(self, count: int) -> list[int]:
        """The ports of ``count`` new destinations, in the order they are opened."""
        ports = []
        for _ in range(count):
            ports.append(self.next_port())
            self.unnamed += 1
        return ports

    def contact(self, dest: Address) -> int | None:
        """Record that this side sends to ``dest``; the public port it uses."""
        if self.mapping == "sequential":
            if dest not in self.contacted:
                self.contacted[dest] = self.next_port()
            return self.contacted[dest]
        if self.mapping in ("independent", "unknown"):
            return self.public_port
        return None


def _random_ports(
    count: int,
    randbelow: Callable[[int], int],
    exclude: set[int] | frozenset[int] = frozenset(),
) -> tuple[int, ...]:
    """``count`` distinct ports of a random NAT's range, not in ``exclude``, in
    the order drawn (``count`` must leave room for ``exclude``)."""
    distinct: dict[int, None] = {}  # an insertion-ordered set
    while len(distinct) < count:
        port = BIRTHDAY_LOW_PORT + randbelow(NAT_PORT_SPAN)
        if port not in exclude:
            distinct[port] = None
    return tuple(distinct)


def _is_ipv6(host: str) -> bool:
    return ":" in host


def _random_against(a: _NatModel, b: _NatModel, mapping: str) -> tuple[str, str] | None:
    """``(hard role, other role)`` when one side's NAT maps at random and the
    other's maps as ``mapping``; None for any other pair."""
    if a.mapping == "random" and b.mapping == mapping:
        return "initiator", "responder"
    if b.mapping == "random" and a.mapping == mapping:
        return "responder", "initiator"
    return None


def _behind_nat(peer: PeerInfo) -> bool:
    """Known to be behind a NAT: it named host candidates, and none of them is
    the public address the server saw (no candidates: not known)."""
    local = peer.candidates.local
    return (
        peer.public is not None
        and bool(local)
        and all(c.host != peer.public.host for c in local)
    )


def plan(
    initiator: PeerInfo,
    responder: PeerInfo,
    *,
    own_role: str,
    randbelow: Callable[[int], int],
    birthday_probes: int = BIRTHDAY_PROBES,
    birthday_sockets: int = BIRTHDAY_SOCKETS,
    birthday_rate: float = BIRTHDAY_RATE,
    spray_ports: int = SPRAY_PORTS,
    spray_sockets: int = SPRAY_SOCKETS,
    spray_rate: float = SPRAY_RATE,
) -> Plan:
    """The ladder schedule for both sides (see module docstring).

    ``randbelow`` is used only for ``own_role``'s random birthday and spray
    ports, which the other side never needs to know.
    """
    result = Plan()
    nat = {"initiator": _NatModel(initiator), "responder": _NatModel(responder)}
    info = {"initiator": initiator, "responder": responder}
    sends = {"initiator": result.initiator, "responder": result.responder}
    t = 0.0

    def other(role: str) -> str:
        return "responder" if role == "initiator" else "initiator"

    def burst(role: str, step: str, dest: Address, start: float) -> None:
        nat[role].contact(dest)
        for i in range(EXTERNAL_SENDS):
            sends[role].append(Send(start + i * EXTERNAL_INTERVAL, step, dest))

    # -- lan
    same_nat = (
        initiator.public is not None
        and responder.public is not None
        and initiator.public.host == responder.public.host
    )
    either_unknown = initiator.public is None or responder.public is None
    both_ipv6 = all(
        any(_is_ipv6(c.host) for c in i.candidates.local)
        for i in (initiator, responder)
    )
    if same_nat or either_unknown or both_ipv6:
        any_lan = False
        for role in ("initiator", "responder"):
            lan_targets = info[other(role)].candidates.local
            if not (same_nat or either_unknown):
                # Behind different NATs only IPv6 host addresses are reachable:
                # no NAT, just a stateful firewall on each side, which these
                # simultaneous sends open (RFC 6092 section 3.2.3).
                lan_targets = tuple(c for c in lan_targets if _is_ipv6(c.host))
            lan_targets = lan_targets[:LAN_MAX_ADDRESSES]
            for n, endpoint in enumerate(lan_targets):
                any_lan = True
                for i in range(LAN_SENDS):
                    at = t + n * LAN_SENDS * LAN_INTERVAL + i * LAN_INTERVAL
                    sends[role].append(Send(at, "lan", endpoint.address()))
        if any_lan:
            result.steps.append(Step("lan", t, t + LAN_DURATION))
            t += LAN_DURATION

    # -- direct: initiator -> responder's public endpoint, unless that would
    # knock on the responder's NAT before the responder sent (see above)
    if responder.public is not None and not _behind_nat(responder):
        burst("initiator", "direct", responder.public.address(), t)
        result.steps.append(Step("direct", t, t + DIRECT_DURATION))
        t += DIRECT_DURATION

    # -- mapping: each side -> the other's port mapping
    any_mapping = False
    for role in ("initiator", "responder"):
        mapped = info[other(role)].candidates.mapped
        if mapped is not None:
            any_mapping = True
            burst(role, "mapping", mapped.address(), t)
    if any_mapping:
        result.steps.append(Step("mapping", t, t + DIRECT_DURATION))
        t += DIRECT_DURATION

    # -- punch: simultaneous open with port prediction
    a, b = nat["initiator"], nat["responder"]
    if a.ip is None or b.ip is None:
        return result
    punch_start = t
    for slot in range(PREDICTION_SLOTS):
        targets: dict[str, Address] = {}
        if a.mapping == "sequential" and b.mapping == "sequential":
            # Both allocate a new port for each new destination: aim slot k of
            # each side at the port the other's k-th new destination gets.
            a_next, b_next = a.next_port(), b.next_port()
            targets["initiator"] = (b.ip, b_next)
            targets["responder"] = (a.ip, a_next)
        else:
            for me, them in ((a, b), (b, a)):
                role = "initiator" if me is a else "responder"
                if them.mapping == "sequential":
                    # Where their mapping towards us will be: the port for our
                    # endpoint, then +stride per slot in case other traffic on
                    # their NAT took a port in between.
                    my_port = me.public_port if me.mapping != "sequential" else 0
                    base = them.contact((me.ip or "", my_port))
                    port = (base or 0) + them.info.stride * slot
                    targets[role] = (them.ip or "", (port - 1) % 65535 + 1)
                else:
                    targets[role] = (them.ip or "", them.public_port)
        start = t + slot * SLOT_DURATION
        for role, dest in targets.items():
            burst(role, "punch", dest, start)
    t += PREDICTION_SLOTS * SLOT_DURATION

    # -- birthday: random mapping against endpoint-independent mapping
    roles = _random_against(a, b, "independent")
    if roles is not None:
        hard, easy = roles
        duration = birthday_probes / birthday_rate + BIRTHDAY_RESEND
        easy_endpoint = (nat[easy].ip or "", nat[easy].public_port)
        result.set_sockets(hard, birthday_sockets)
        rounds = int(duration / BIRTHDAY_RESEND) + 1
        for r in range(rounds):
            for s in range(1, birthday_sockets + 1):
                # Spread each round over 100 ms so 256 sends are not one burst.
                at = t + r * BIRTHDAY_RESEND + (s / birthday_sockets) * 0.1
                sends[hard].append(
                    Send(at, "punch", easy_endpoint, s, ttl=BIRTHDAY_TTL)
                )
        if own_role == easy:
            hard_ip = nat[hard].ip or ""
            chosen = _random_ports(min(birthday_probes, NAT_PORT_SPAN), randbelow)
            for i, port in enumerate(chosen):
                sends[easy].append(
                    Send(t + 0.05 + i / birthday_rate, "punch", (hard_ip, port))
                )
        t += duration

    # -- prediction spray: random mapping against sequential mapping
    roles = _random_against(a, b, "sequential")
    if roles is not None and spray_ports > 0:
        hard, seq = roles
        count = min(spray_ports, NAT_PORT_SPAN // 2)  # leaves room for taken ones
        # Both sides compute the sequential side's ports; only it knows the
        # random ports they aim at (they stay in ``own_role``'s plan).
        predicted = tuple(nat[seq].open_unnamed(count))
        aims: tuple[int, ...] = ()
        if own_role == seq:
            hard_ip = nat[hard].ip or ""
            # Every aim must be a new destination, or the NAT opens fewer
            # mappings than the other side predicted.
            taken = {port for host, port in nat[seq].contacted if host == hard_ip}
            aims = _random_ports(count, randbelow, exclude=taken)
        seq_spray = Spray(
            t, "punch", nat[hard].ip or "", aims, 0, SPRAY_SEQUENTIAL_RATE
        )
        hard_spray = Spray(
            t + SPRAY_HEAD_START,
            "punch",
            nat[seq].ip or "",
            predicted,
            spray_sockets,
            spray_rate,
        )
        result.sprays(seq).append(seq_spray)
        result.sprays(hard).append(hard_spray)
        result.set_sockets(hard, spray_sockets)
        t = hard_spray.at + hard_spray.duration
    result.steps.append(Step("punch", punch_start, t))
    for role in sends:
        sends[role].sort(key=lambda s: s.at)
    return result
