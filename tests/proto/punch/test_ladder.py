"""The shared ladder schedule: steps, port prediction, birthday technique."""

from __future__ import annotations

import random

from crossroads.proto.punch import ladder
from crossroads.proto.punch.signalling import Candidates, Endpoint, PeerInfo


def info(
    ip: str,
    ports: tuple[int, ...],
    mapping: str,
    stride: int = 0,
    local: tuple[Endpoint, ...] = (),
    mapped: Endpoint | None = None,
) -> PeerInfo:
    return PeerInfo(
        Endpoint(ip, ports[0]), ports, mapping, stride, Candidates(local, mapped)
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
    local=(Endpoint("10.0.1.2", 4000),),
)
CONE_B = info(
    "203.0.113.1",
    (5000, 5000, 5000),
    "independent",
    local=(Endpoint("10.0.2.2", 5000),),
)


def test_cone_pair_steps_and_targets() -> None:
    p = plan(CONE_A, CONE_B)
    assert [s.name for s in p.steps] == ["direct", "punch"]
    assert dests(p.initiator, "direct") == [("203.0.113.1", 5000)]
    assert dests(p.responder, "direct") == []  # direct is one-sided
    assert dests(p.initiator, "punch") == [("203.0.113.1", 5000)]
    assert dests(p.responder, "punch") == [("198.51.100.1", 4000)]
    # RakNet: 8 sends per port, 50 ms apart, three port offsets
    assert sum(s.step == "punch" for s in p.initiator) == 8 * 3
    assert p.sockets("initiator") == p.sockets("responder") == 0


def test_lan_only_behind_the_same_public_address() -> None:
    same_b = info(
        "198.51.100.1",
        (5000, 5000, 5000),
        "independent",
        local=(Endpoint("10.0.1.3", 5000),),
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
        mapped=Endpoint("203.0.113.1", 6000),
    )
    p = plan(CONE_A, mapped_b)
    assert [s.name for s in p.steps][:2] == ["direct", "mapping"]
    assert dests(p.initiator, "mapping") == [("203.0.113.1", 6000)]
    assert dests(p.responder, "mapping") == []


def test_sequential_against_cone_is_predicted() -> None:
    # The server saw 7000, 7001, 7002; the initiator's direct send to B is its
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
        None, (), "unknown", 0, Candidates((Endpoint("10.0.2.2", 5000),))
    )
    p = plan(CONE_A, blocked)
    assert [s.name for s in p.steps] == ["lan"]
