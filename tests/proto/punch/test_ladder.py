"""The shared ladder schedule: steps, port prediction, birthday technique."""

from __future__ import annotations

import random

from crossroads.proto.punch import ladder
from crossroads.proto.punch.signalling import Candidates, PeerInfo, TransportAddress


def info(
    ip: str,
    ports: tuple[int, ...],
    mapping: str,
    stride: int = 0,
    local: tuple[TransportAddress, ...] = (),
    mapped: TransportAddress | None = None,
) -> PeerInfo:
    return PeerInfo(
        TransportAddress(ip, ports[0]),
        ports,
        mapping,
        stride,
        Candidates(local, mapped),
    )


def plan(
    a: PeerInfo, b: PeerInfo, role: str = "initiator", **kw: object
) -> ladder.Plan:
    return ladder.plan(a, b, own_role=role, randbelow=random.Random(7).randrange, **kw)  # type: ignore[arg-type]


def dests(sends: list[ladder.Send], step: str) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    for s in sends:
        if s.step == step and s.dest not in out:
            out.append(s.dest)
    return out


CONE_A = info(
    "198.51.100.1",
    (4000, 4000, 4000),
    "independent",
    local=(TransportAddress("10.0.1.2", 4000),),
)
CONE_B = info(
    "203.0.113.1",
    (5000, 5000, 5000),
    "independent",
    local=(TransportAddress("10.0.2.2", 5000),),
)


def test_cone_pair_steps_and_targets() -> None:
    p = plan(CONE_A, CONE_B)
    # B is behind a NAT (its host candidate is private): no one-sided direct
    # step, whose probes would knock on B's router before B sent (docs/natneg.md).
    assert [s.name for s in p.steps] == ["punch"]
    assert p.steps[0].start == 0.0
    assert dests(p.initiator, "punch") == [("203.0.113.1", 5000)]
    assert dests(p.responder, "punch") == [("198.51.100.1", 4000)]
    # RakNet: 8 sends per port, 50 ms apart, three port offsets
    assert sum(s.step == "punch" for s in p.initiator) == 8 * 3
    assert p.sockets("initiator") == p.sockets("responder") == 0


def test_direct_step_only_to_a_responder_without_nat() -> None:
    open_b = info(
        "203.0.113.1",
        (5000, 5000, 5000),
        "independent",
        local=(TransportAddress("203.0.113.1", 5000),),
    )
    p = plan(CONE_A, open_b)
    assert [s.name for s in p.steps] == ["direct", "punch"]
    assert dests(p.initiator, "direct") == [("203.0.113.1", 5000)]
    assert dests(p.responder, "direct") == []  # direct is one-sided
    # Without host candidates nothing is known: direct is tried.
    unknown_b = info("203.0.113.1", (5000, 5000, 5000), "independent")
    assert [s.name for s in plan(CONE_A, unknown_b).steps] == ["direct", "punch"]


def test_no_probe_reaches_a_nated_responder_before_it_sends() -> None:
    """The knock a remapping router punishes: every probe the initiator sends to the responder's
    public address leaves no earlier than the responder's first send towards the
    initiator, so a router that accepts unsolicited input never sees one first."""
    for a, b in ((CONE_A, CONE_B), (CONE_B, CONE_A)):
        p = plan(a, b)
        assert b.public is not None and a.public is not None
        to_responder = [s.at for s in p.initiator if s.dest[0] == b.public.host]
        to_initiator = [s.at for s in p.responder if s.dest[0] == a.public.host]
        assert to_responder and to_initiator
        assert min(to_responder) >= min(to_initiator)


def test_lan_only_behind_the_same_public_address() -> None:
    same_b = info(
        "198.51.100.1",
        (5000, 5000, 5000),
        "independent",
        local=(TransportAddress("10.0.1.3", 5000),),
    )
    p = plan(CONE_A, same_b)
    assert p.steps[0].name == "lan"
    assert dests(p.initiator, "lan") == [("10.0.1.3", 5000)]
    assert dests(p.responder, "lan") == [("10.0.1.2", 4000)]


def test_mapping_step_uses_port_mappings() -> None:
    mapped_b = info(
        "203.0.113.1",
        (5000, 5000, 5000),
        "random",
        mapped=TransportAddress("203.0.113.1", 6000),
    )
    p = plan(CONE_A, mapped_b)
    assert [s.name for s in p.steps][:2] == ["direct", "mapping"]  # no candidates
    assert dests(p.initiator, "mapping") == [("203.0.113.1", 6000)]
    assert dests(p.responder, "mapping") == []


def test_sequential_against_cone_is_predicted() -> None:
    # The server saw 7000, 7001, 7002; the initiator's first send to B (punch) is its
    # next new destination and gets 7003; B aims at 7003, 7004, 7005.
    seq = info("198.51.100.1", (7000, 7001, 7002), "sequential", 1)
    p = plan(seq, CONE_B)
    assert dests(p.responder, "punch") == [
        ("198.51.100.1", 7003),
        ("198.51.100.1", 7004),
        ("198.51.100.1", 7005),
    ]
    assert dests(p.initiator, "punch") == [("203.0.113.1", 5000)]


def test_cone_against_sequential_responder() -> None:
    seq = info("203.0.113.1", (7000, 7002, 7004), "sequential", 2)
    p = plan(CONE_A, seq)
    # B contacts nothing before the punch, so its first new mapping is 7006.
    assert dests(p.initiator, "punch")[0] == ("203.0.113.1", 7006)
    assert dests(p.responder, "punch") == [("198.51.100.1", 4000)]


def test_two_sequential_sides_meet_slot_by_slot() -> None:
    a = info("198.51.100.1", (7000, 7001, 7002), "sequential", 1)
    b = info("203.0.113.1", (9000, 9001, 9002), "sequential", 1)
    p = plan(a, b)
    # A's direct send used 7003; slot k: A's next new port is 7004+k, B's 9003+k.
    assert dests(p.initiator, "punch") == [
        ("203.0.113.1", 9003),
        ("203.0.113.1", 9004),
        ("203.0.113.1", 9005),
    ]
    assert dests(p.responder, "punch") == [
        ("198.51.100.1", 7004),
        ("198.51.100.1", 7005),
        ("198.51.100.1", 7006),
    ]
    # slot k of each side is sent at the same time
    for k in range(3):
        at_a = [
            s.at for s in p.initiator if s.step == "punch" and s.dest[1] == 9003 + k
        ]
        at_b = [
            s.at for s in p.responder if s.step == "punch" and s.dest[1] == 7004 + k
        ]
        assert at_a == at_b


def test_birthday_for_random_against_cone() -> None:
    hard = info("203.0.113.1", (31000, 12000, 55000), "random")
    p = plan(CONE_A, hard, role="initiator", birthday_probes=1024, birthday_sockets=256)
    assert p.sockets("responder") == 256 and p.sockets("initiator") == 0
    easy_targets = dests(p.initiator, "punch")
    assert len([d for d in easy_targets if d[0] == "203.0.113.1"]) >= 1024
    assert all(1024 <= port <= 65535 for _, port in easy_targets)
    hard_sends = [s for s in p.responder if s.socket > 0]
    assert {s.socket for s in hard_sends} == set(range(1, 257))
    assert {s.dest for s in hard_sends} == {("198.51.100.1", 4000)}
    # the hard side only opens its own NAT: TTL 2 (RakNet's), so its datagrams
    # never knock on the easy side's router before the easy side's probe
    assert {s.ttl for s in hard_sends} == {2}
    assert all(s.ttl == 0 for s in p.initiator)
    # the birthday probes are paced, not sent at once
    probes = [s.at for s in p.initiator if s.step == "punch"]
    assert max(probes) - min(probes) >= 1024 / ladder.BIRTHDAY_RATE


def test_birthday_probability_figures() -> None:
    # reference §3.4: P = 1 - (1 - 256/65535)^k
    def p(k: int) -> float:
        return 1 - (1 - 256 / 65535) ** k

    assert round(p(256), 2) == 0.63
    assert round(p(1024), 2) == 0.98
    assert p(2048) > 0.9995


def test_random_against_random_has_no_birthday() -> None:
    a = info("198.51.100.1", (1, 2000, 30000), "random")
    b = info("203.0.113.1", (4000, 100, 9000), "random")
    p = plan(a, b)
    assert p.sockets("initiator") == p.sockets("responder") == 0
    assert p.duration < 3


def test_unknown_public_address_only_tries_lan() -> None:
    blocked = PeerInfo(
        None, (), "unknown", 0, Candidates((TransportAddress("10.0.2.2", 5000),))
    )
    p = plan(CONE_A, blocked)
    assert [s.name for s in p.steps] == ["lan"]


SEQ = info("198.51.100.1", (20000, 20001, 20002), "sequential", stride=1)
RANDOM = info("203.0.113.1", (31000, 12000, 55000), "random")


def test_spray_for_random_against_sequential() -> None:
    for seq_role, hard_role, pair in (
        ("initiator", "responder", (SEQ, RANDOM)),
        ("responder", "initiator", (RANDOM, SEQ)),
    ):
        mine = plan(*pair, role=seq_role)
        theirs = plan(*pair, role=hard_role)
        assert [s.name for s in mine.steps][-1] == "punch"
        assert mine.sockets(hard_role) == ladder.SPRAY_SOCKETS
        assert mine.sockets(seq_role) == 0
        # the sequential side aims its new mappings at distinct random ports of
        # the random side's IP, from its own socket
        (aim,) = mine.sprays(seq_role)
        assert aim.host == "203.0.113.1" and aim.sockets == 0
        assert len(set(aim.ports)) == len(aim.ports) == ladder.SPRAY_PORTS
        assert all(1024 <= port <= 65535 for port in aim.ports)
        # ... which the random side's plan does not know
        assert theirs.sprays(seq_role)[0].ports == ()
        # both sides predict the same sequential ports: after the punch slots'
        # one new destination (port 20003), the next 2048 in order
        (hard,) = theirs.sprays(hard_role)
        assert hard == mine.sprays(hard_role)[0]
        assert hard.host == "198.51.100.1" and hard.sockets == ladder.SPRAY_SOCKETS
        assert hard.ports == tuple(range(20004, 20004 + ladder.SPRAY_PORTS))
        # the sequential side's mappings are made before the random side sends
        assert hard.at >= aim.at + aim.duration
        assert theirs.duration >= hard.at + hard.duration


def test_spray_probability_figures() -> None:
    # each random-side mapping hits with P = 1/64512 (Linux' NAT range 1024-65535)
    def p(n: int) -> float:
        return 1 - (1 - 1 / 64512) ** n

    assert round(p(64512), 2) == 0.63  # the mean cost
    assert p(ladder.SPRAY_PORTS * ladder.SPRAY_SOCKETS) > 0.9996


def test_spray_aims_skip_ports_already_contacted() -> None:
    # the punch step already sent to the random side's public port 31000: an aim
    # at it would open no new mapping and shift every predicted port after it
    for seed in range(20):
        rng = random.Random(seed)
        p = ladder.plan(
            SEQ,
            RANDOM,
            own_role="initiator",
            randbelow=lambda n, rng=rng: 31000 - 1024 + rng.randrange(3),
            spray_ports=2,
        )
        assert 31000 not in p.sprays("initiator")[0].ports


def test_random_against_sequential_without_spray_budget() -> None:
    p = plan(SEQ, RANDOM, spray_ports=0)
    assert p.sprays("initiator") == p.sprays("responder") == []
    assert p.sockets("initiator") == p.sockets("responder") == 0


def test_ipv6_host_candidates_are_tried_across_different_nats() -> None:
    v6_a, v6_b = (
        TransportAddress("2001:db8:a::7", 5000),
        TransportAddress("2001:db8:b::9", 6000),
    )
    lan_a, lan_b = (
        TransportAddress("192.168.1.2", 4000),
        TransportAddress("10.0.0.9", 5000),
    )
    a = info("198.51.100.1", (4000, 4000, 4000), "independent", local=(v6_a, lan_a))
    b = info("203.0.113.9", (5000, 5000, 5000), "independent", local=(v6_b, lan_b))
    p = plan(a, b)
    assert p.steps[0].name == "lan"
    # only the IPv6 addresses: the private IPv4 ones are behind other NATs
    assert dests(p.initiator, "lan") == [v6_b.address()]
    assert dests(p.responder, "lan") == [v6_a.address()]
    assert [s.name for s in p.steps[1:3]] == ["punch"]  # both behind NATs


def test_no_ipv6_step_unless_both_sides_have_ipv6() -> None:
    v6_a = TransportAddress("2001:db8:a::7", 5000)
    a = info("198.51.100.1", (4000, 4000, 4000), "independent", local=(v6_a,))
    b = info("203.0.113.9", (5000, 5000, 5000), "independent")
    assert "lan" not in [s.name for s in plan(a, b).steps]
    assert "lan" not in [s.name for s in plan(b, a).steps]


def test_same_nat_tries_ipv6_and_ipv4_host_candidates() -> None:
    v6_a, lan_a = (
        TransportAddress("2001:db8::7", 5000),
        TransportAddress("192.168.1.2", 4000),
    )
    v6_b, lan_b = (
        TransportAddress("2001:db8::9", 6000),
        TransportAddress("192.168.1.3", 4001),
    )
    a = info("198.51.100.1", (4000, 4000, 4000), "independent", local=(v6_a, lan_a))
    b = info("198.51.100.1", (4001, 4001, 4001), "independent", local=(v6_b, lan_b))
    assert dests(plan(a, b).initiator, "lan") == [v6_b.address(), lan_b.address()]
