"""Where a peer's report goes and what it does (proto/openttd/routing.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crossroads.proto.openttd.bus import (
    ConnectedReport,
    ConnectFailedReport,
    DropSession,
    ForwardToServer,
    PeerReport,
    StunReport,
    StunSeen,
)
from crossroads.proto.openttd.codes import parse_token
from crossroads.proto.openttd.coordinator import (
    ClientConnected,
    ConnectFailed,
    GcDirectConnect,
    StunResult,
)
from crossroads.proto.openttd.ladder import Finished, SendToClient, Side
from crossroads.proto.openttd.routing import (
    Forward,
    Ignore,
    Local,
    attempt_commands,
    check_commands,
    peer_report,
    report_side,
    route_end_session,
    route_forwarded_report,
    route_peer_report,
    route_stun_request,
    route_stun_seen,
    route_to_server,
)
from tests.proto.openttd.test_ladder import attempt
from tests.proto.openttd.test_verify import check

HERE, THERE = "0a1b2c3d", "99887766"
RANDOM = "00" * 12


def token(side: str, instance: str = HERE) -> str:
    return side + instance + RANDOM


def test_our_own_tokens_are_handled_here() -> None:
    for side in "CSV":
        route = route_peer_report(token(side), ConnectedReport(), HERE, None)
        assert route == Local(parse_token(token(side)))  # type: ignore[arg-type]


def test_a_servers_report_on_another_instances_attempt_is_forwarded() -> None:
    report = ConnectFailedReport(1)
    assert route_peer_report(token("S", THERE), report, HERE, "+abc") == Forward(
        THERE, PeerReport(token("S", THERE), "+abc", report)
    )


@pytest.mark.parametrize(
    ("reported", "server_code", "reason"),
    [
        (token("S", THERE), None, "foreign-token"),  # not a registered server
        (token("C", THERE), "+abc", "foreign-token"),  # clients report at home
        (token("V", THERE), "+abc", "foreign-token"),
        ("garbage", "+abc", "unknown-token"),
    ],
)
def test_other_reports_are_ignored_with_a_reason(
    reported: str, server_code: str | None, reason: str
) -> None:
    route = route_peer_report(reported, ConnectedReport(), HERE, server_code)
    assert route == Ignore(reason)


def test_only_server_tokens_of_ours_come_over_the_bus() -> None:
    ours = PeerReport(token("S"), "+abc", ConnectedReport())
    assert route_forwarded_report(ours, HERE) == Local(parse_token(token("S")))  # type: ignore[arg-type]
    for other in (token("C"), token("S", THERE), "x"):
        message = PeerReport(other, "+abc", ConnectedReport())
        assert route_forwarded_report(message, HERE) == Ignore("bad-bus-event")


def test_stun_observations_count_only_for_our_tokens() -> None:
    assert isinstance(route_stun_seen(token("C"), HERE), Local)
    assert route_stun_seen(token("C", THERE), HERE) == Ignore("unknown-token")


def test_a_report_must_come_from_the_peer_the_token_was_given_to() -> None:
    client, server = parse_token(token("C")), parse_token(token("S"))
    assert client is not None and server is not None
    assert report_side(client, True, None, "+abc") is Side.CLIENT
    assert report_side(client, False, "+abc", "+abc") == Ignore("wrong-sender")
    assert report_side(server, False, "+abc", "+abc") is Side.SERVER
    assert report_side(server, True, "+xyz", "+abc") == Ignore("wrong-sender")


def test_reports_drive_the_attempt() -> None:
    a, _ = attempt(direct=[("203.0.113.5", 3979), ("2001:db8::5", 3979)])
    failed = attempt_commands(a, Side.CLIENT, ConnectFailedReport(1), 1.0)
    assert failed == [
        SendToClient(GcDirectConnect(a.client_token, 2, "2001:db8::5", 3979))
    ]
    # Only the client can say it is connected.
    assert attempt_commands(a, Side.SERVER, ConnectedReport(), 1.0) == Ignore(
        "bad-report"
    )
    done = attempt_commands(a, Side.CLIENT, ConnectedReport(), 1.0)
    assert done == [Finished(True, "direct-ipv6", "connected")]


def test_only_a_stun_result_reaches_a_registration_check() -> None:
    routed, direct = check(), check()
    routed.start(0.0)
    direct.start(0.0)
    assert check_commands(routed, ConnectFailedReport(0), 0.1) == []
    assert check_commands(routed, ConnectedReport(), 0.1) == []
    for c in (routed, direct):
        assert c.stun_observed(2, "198.51.100.9", 0.1) == []
    for family, ok in ((10, False), (2, True)):
        expected = direct.stun_result(family, ok, 0.1)
        assert check_commands(routed, StunReport(family, ok), 0.1) == expected
    expected = direct.probe_result("198.51.100.9", True, 0.2)
    assert expected and routed.probe_result("198.51.100.9", True, 0.2) == expected


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40), st.text(max_size=10) | st.none())
def test_any_token_is_routed_somewhere(reported: str, server_code: str | None) -> None:
    route = route_peer_report(reported, ConnectedReport(), HERE, server_code)
    assert isinstance(route, Local | Forward | Ignore)


def test_a_packet_for_a_server_seated_elsewhere_goes_to_its_owner() -> None:
    assert route_to_server("+abc", THERE, True, b"pkt") is None
    assert route_to_server("+abc", THERE, False, b"pkt") == Forward(
        THERE, ForwardToServer("+abc", b"pkt")
    )


def test_a_superseded_session_is_closed_where_it_is_seated() -> None:
    assert route_end_session(HERE, "+abc", "s1", HERE) is None
    assert route_end_session(THERE, "+abc", "s1", HERE) == Forward(
        THERE, DropSession("+abc", "s1")
    )


def test_what_the_stun_listener_saw_goes_to_the_tokens_instance() -> None:
    seen = route_stun_request(token("C", THERE), 1, "198.51.100.2", 40000)
    assert seen == Forward(THERE, StunSeen(token("C", THERE), 1, "198.51.100.2", 40000))
    assert route_stun_request("junk", 1, "198.51.100.2", 1) == Ignore("unknown-token")


@given(st.text(max_size=40))
def test_any_stun_token_is_routed_or_ignored(raw: str) -> None:
    route = route_stun_request(raw, 2, "2001:db8::1", 3975)
    parsed = parse_token(raw)
    if parsed is None:
        assert route == Ignore("unknown-token")
    else:
        assert isinstance(route, Forward) and route.instance == parsed.instance


def test_each_reporting_packet_carries_its_report() -> None:
    assert peer_report(ConnectFailed(6, token("C"), 3)) == ConnectFailedReport(3)
    assert peer_report(ClientConnected(6, token("C"))) == ConnectedReport()
    assert peer_report(StunResult(6, token("S"), 2, True)) == StunReport(2, True)
