from __future__ import annotations

import pytest

from crossroads.proto.openttd.coordinator import (
    GcConnectFailed,
    GcConnecting,
    GcDirectConnect,
    GcStunConnect,
    GcStunRequest,
    GcTurnConnect,
)
from crossroads.proto.openttd.ladder import (
    CONNECT_TIMEOUT,
    MAX_STUN_LEAD,
    Command,
    ConnectAttempt,
    Finished,
    IssueTicket,
    LadderStep,
    SendToClient,
    SendToServer,
    Side,
)
from tests.proto.openttd.timers import fire

KEY = "0a1b2c3d" + "00" * 12
TICKET = "0123456789abcdef:0123456789abcdef"
C, S = "C" + KEY, "S" + KEY


def attempt(
    direct: list[tuple[str, int]] | None = None,
    client_version: int = 6,
    server_version: int = 6,
    turn: str | None = "relay.example:3974",
) -> tuple[ConnectAttempt, list[Command]]:
    a = ConnectAttempt(
        attempt_key=KEY,
        invite_code="+abcdefg",
        client_version=client_version,
        server_version=server_version,
        direct=direct if direct is not None else [("203.0.113.5", 3979)],
        turn_address=turn,
        ticket=TICKET,
        now=0.0,
    )
    return a, a.start(0.0)


def stun_both(
    a: ConnectAttempt,
    client_family: int = 10,
    server_family: int = 10,
    client_at: float = 1.0,
    server_at: float = 1.0,
) -> list[Command]:
    """Both sides report IPv4 ok (family 2), at ``client_at`` / ``server_at``,
    and IPv6 with their own byte."""
    out: list[Command] = []
    out += a.stun_observed(Side.CLIENT, 2, "198.51.100.7", 40000, client_at)
    out += a.stun_result(Side.CLIENT, client_family, False, client_at)
    out += a.stun_result(Side.CLIENT, 2, True, client_at)
    out += a.stun_result(Side.SERVER, server_family, False, server_at)
    out += a.stun_result(Side.SERVER, 2, True, server_at)
    assert out == []  # the server's IPv4 observation is still missing
    return a.stun_observed(Side.SERVER, 2, "203.0.113.5", 50000, 1.1)


def test_direct_join() -> None:
    a, out = attempt()
    assert out == [
        SendToClient(GcConnecting(C, "+abcdefg")),
        SendToClient(GcDirectConnect(C, 1, "203.0.113.5", 3979)),
    ]
    assert a.connected(0.5) == [Finished(True, "direct-ipv4", "connected")]
    assert a.done and a.get_timer() is None


def test_ipv4_is_tried_before_ipv6() -> None:
    a, out = attempt(direct=[("2001:db8::5", 3979), ("203.0.113.5", 3979)])
    assert out[-1] == SendToClient(GcDirectConnect(C, 1, "203.0.113.5", 3979))
    assert a.connect_failed(Side.CLIENT, 1, 1.0) == [
        SendToClient(GcDirectConnect(C, 2, "2001:db8::5", 3979))
    ]
    assert a.connected(1.5) == [Finished(True, "direct-ipv6", "connected")]


def test_full_ladder_direct_stun_turn() -> None:
    a, _ = attempt()
    assert a.connect_failed(Side.CLIENT, 1, 1.0) == [
        SendToClient(GcStunRequest(C)),
        SendToServer(GcStunRequest(S)),
    ]
    # Each side gets the other's public address and its own family byte back.
    assert stun_both(a, client_family=10, server_family=23) == [
        SendToClient(GcStunConnect(C, 2, 2, "203.0.113.5", 50000)),
        SendToServer(GcStunConnect(S, 2, 2, "198.51.100.7", 40000)),
    ]
    assert a.method == "stun-ipv4"
    # The server fails first; the client's failure for the same number is stale.
    out = a.connect_failed(Side.SERVER, 2, 2.0)
    assert out == [
        IssueTicket(TICKET),
        SendToClient(GcTurnConnect(C, 3, TICKET, "relay.example:3974")),
        SendToServer(GcTurnConnect(S, 3, TICKET, "relay.example:3974")),
    ]
    assert a.connect_failed(Side.CLIENT, 2, 2.1) == []
    assert a.connected(3.0) == [Finished(True, "turn", "connected")]
    # Every rung tried, with when and how it went (the insight record's steps).
    expected = (
        LadderStep("direct-ipv4", 0.0, 1.0, "failed"),
        LadderStep("stun-request", 1.0, 0.1, "ok"),  # the server's result at 1.1
        LadderStep("stun-ipv4", 1.1, 0.9, "failed"),
        LadderStep("turn", 2.0, 1.0, "ok"),
    )
    assert [(s.name, s.outcome) for s in a.history] == [
        (s.name, s.outcome) for s in expected
    ]
    assert [(s.start, s.duration) for s in a.history] == [
        (pytest.approx(s.start), pytest.approx(s.duration)) for s in expected
    ]


def test_history_names_the_reason_a_join_ended_on() -> None:
    a, _ = attempt(turn=None)
    a.connect_failed(Side.CLIENT, 1, 0.5)
    a.handle_timer(0.5 + 5.0)  # STUN's wait passes with nothing reported
    fire(a, CONNECT_TIMEOUT)
    assert [(s.name, s.outcome) for s in a.history] == [
        ("direct-ipv4", "failed"),
        ("stun-request", "no-pair"),
    ]


def test_stun_connect_to_the_nearer_side_is_held_so_both_syns_cross() -> None:
    """Each side sends its SYN when GC_STUN_CONNECT arrives (rtt / 2 after it
    left): the message to the nearer side waits the difference of the one-way
    times, so both SYNs leave at once (docs/natneg.md, "CONNECT timing")."""
    a, _ = attempt(direct=[])
    a.round_trip(Side.CLIENT, 0.180)
    a.round_trip(Side.SERVER, 0.020)
    # STUN answered after two round trips each (GC_STUN_REQUEST at 0): no
    # reaction time on either side.
    client, server = stun_both(
        a, client_family=10, server_family=23, client_at=0.360, server_at=0.040
    )
    assert client == SendToClient(GcStunConnect(C, 1, 2, "203.0.113.5", 50000), 0.0)
    assert isinstance(server, SendToServer) and abs(server.delay - 0.080) < 1e-9
    # Arrival: client at 0 + 0.090, server at 0.080 + 0.010.
    assert abs((0.0 + 0.180 / 2) - (server.delay + 0.020 / 2)) < 1e-9

    # The server is the farther one; the lead is capped at MAX_STUN_LEAD.
    a, _ = attempt(direct=[])
    a.round_trip(Side.CLIENT, 0.010)
    a.round_trip(Side.SERVER, 3.0)
    client, server = stun_both(a)
    assert isinstance(client, SendToClient) and client.delay == MAX_STUN_LEAD
    assert isinstance(server, SendToServer) and server.delay == 0.0

    # An unknown round trip (the server's connection on another instance): both
    # at once, as before.
    a, _ = attempt(direct=[])
    a.round_trip(Side.CLIENT, 0.2)
    assert [c.delay for c in stun_both(a)] == [0.0, 0.0]  # type: ignore[union-attr]


def test_stun_connect_allows_for_a_slow_reacting_side() -> None:
    """Equal round trips, but the server (a dedicated server reading its socket
    on 30 ms game ticks) answered GC_STUN_REQUEST 60 ms later than two round
    trips, the client at once: the server reacts ~30 ms late each time, so the
    client's GC_STUN_CONNECT is held 30 ms and both SYNs still leave together.
    On round trips alone both would go at once and the client's SYN would lead
    by the server's reaction time (what the NAT lab showed: 27-29 ms)."""
    a, _ = attempt(direct=[])
    a.round_trip(Side.CLIENT, 0.040)
    a.round_trip(Side.SERVER, 0.040)
    client, server = stun_both(a, client_at=0.080, server_at=0.140)
    assert isinstance(client, SendToClient) and abs(client.delay - 0.030) < 1e-9
    assert isinstance(server, SendToServer) and server.delay == 0.0
    # SYNs: client at 0.030 + 0.020, server at 0 + 0.020 + 0.030 (reaction).
    assert abs((client.delay + 0.020) - (server.delay + 0.020 + 0.030)) < 1e-9
    # An answer faster than two round trips cannot lower a side below its
    # round trip: a client cannot buy its partner a hold by answering early.
    a, _ = attempt(direct=[])
    a.round_trip(Side.CLIENT, 0.040)
    a.round_trip(Side.SERVER, 0.040)
    assert [c.delay for c in stun_both(a, client_at=0.0, server_at=0.080)] == [
        0.0,
        0.0,
    ]  # type: ignore[union-attr]


def test_stun_pairs_every_shared_family_ipv4_first() -> None:
    a, _ = attempt(direct=[])
    for side, addr6, addr4 in (
        (Side.CLIENT, ("2001:db8::c", 1), ("198.51.100.7", 2)),
        (Side.SERVER, ("2001:db8::5", 3), ("203.0.113.5", 4)),
    ):
        a.stun_observed(side, 10, *addr6, 0.5)
        a.stun_observed(side, 2, *addr4, 0.5)
        a.stun_result(side, 10, True, 0.5)
    out = a.stun_result(Side.CLIENT, 2, True, 0.6) + a.stun_result(
        Side.SERVER, 2, True, 0.6
    )
    assert out[0] == SendToClient(GcStunConnect(C, 1, 2, "203.0.113.5", 4))
    out = a.connect_failed(Side.CLIENT, 1, 1.0)
    assert out[0] == SendToClient(GcStunConnect(C, 2, 10, "2001:db8::5", 3))
    assert a.connected(1.2)[-1] == Finished(True, "stun-ipv6", "connected")


def test_stun_wait_pairs_what_arrived() -> None:
    a, out = attempt(direct=[])
    assert out[-1] == SendToServer(GcStunRequest(S))
    assert a.get_timer() == 5.0
    a.stun_observed(Side.CLIENT, 2, "198.51.100.7", 1, 0.1)
    a.stun_result(Side.CLIENT, 2, True, 0.1)
    a.stun_observed(Side.SERVER, 2, "203.0.113.5", 2, 0.1)
    a.stun_result(Side.SERVER, 2, True, 0.1)
    # Neither side reported its second family: wait for the STUN deadline.
    assert fire(a, 4.9) == []
    out = fire(a, 5.0)
    assert out[0] == SendToClient(GcStunConnect(C, 1, 2, "203.0.113.5", 2))


def test_no_shared_family_goes_to_turn() -> None:
    a, _ = attempt(direct=[])
    a.stun_observed(Side.CLIENT, 10, "2001:db8::c", 1, 0.1)
    a.stun_result(Side.CLIENT, 10, True, 0.1)
    a.stun_result(Side.CLIENT, 2, False, 0.1)
    a.stun_result(Side.SERVER, 10, False, 0.1)
    out = a.stun_observed(Side.SERVER, 2, "203.0.113.5", 2, 0.1) + a.stun_result(
        Side.SERVER, 2, True, 0.1
    )
    assert out[0] == IssueTicket(TICKET)


def test_old_peers_get_no_stun_or_turn() -> None:
    a, _ = attempt(client_version=2)
    assert a.connect_failed(Side.CLIENT, 1, 1.0) == [
        SendToClient(GcConnectFailed(C)),
        Finished(False, "direct-ipv4", "no method left"),
    ]
    a, _ = attempt(server_version=4, direct=[])
    stun_out = stun_both(a)
    assert a.connect_failed(Side.CLIENT, 1, 2.0)[-1] == Finished(
        False, "stun-ipv4", "no method left"
    )
    assert stun_out[0] == SendToClient(GcStunConnect(C, 1, 2, "203.0.113.5", 50000))


def test_no_turn_without_a_relay() -> None:
    a, _ = attempt(direct=[], turn=None)
    stun_both(a)
    out = a.connect_failed(Side.CLIENT, 1, 2.0)
    assert out == [
        SendToClient(GcConnectFailed(C)),
        SendToServer(GcConnectFailed(S)),
        Finished(False, "stun-ipv4", "no method left"),
    ]


def test_stale_and_unknown_tracking_numbers_are_ignored() -> None:
    a, _ = attempt(direct=[("203.0.113.5", 1), ("203.0.113.6", 1)])
    assert a.connect_failed(Side.CLIENT, 5, 1.0) == []
    assert a.connect_failed(Side.CLIENT, 1, 1.0) != []
    assert a.connect_failed(Side.CLIENT, 1, 1.0) == []
    assert a.tracking_number == 2


def test_tracking_zero_means_the_client_gave_up() -> None:
    a, _ = attempt(direct=[])
    assert a.connect_failed(Side.CLIENT, 0, 1.0) == [
        SendToClient(GcConnectFailed(C)),
        SendToServer(GcConnectFailed(S)),
        Finished(False, "none", "client gave up"),
    ]
    assert a.connected(2.0) == []


def test_overall_timeout() -> None:
    a, _ = attempt()
    assert a.get_timer() == CONNECT_TIMEOUT
    assert fire(a, CONNECT_TIMEOUT - 0.1) == []
    assert fire(a, CONNECT_TIMEOUT) == [
        SendToClient(GcConnectFailed(C)),
        Finished(False, "direct-ipv4", "timeout"),
    ]


def test_peer_gone() -> None:
    a, _ = attempt(direct=[])
    assert a.peer_gone(Side.SERVER, 1.0) == [
        SendToClient(GcConnectFailed(C)),
        Finished(False, "none", "server left"),
    ]
    a, _ = attempt(direct=[])
    assert a.peer_gone(Side.CLIENT, 1.0) == [
        SendToServer(GcConnectFailed(S)),
        Finished(False, "none", "client left"),
    ]


def test_made_up_families_cannot_grow_the_tables() -> None:
    a, _ = attempt(direct=[])
    for family in range(200):
        a.stun_result(Side.CLIENT, family, False, 0.1)
        a.stun_observed(Side.CLIENT, family, "198.51.100.1", family, 0.1)
    assert a.done is False
