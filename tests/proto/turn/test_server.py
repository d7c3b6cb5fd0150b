"""The TURN server core, driven in memory with a fake clock."""

from __future__ import annotations

import ipaddress
import os

import pytest

from crossroads.proto.policy import AddressPolicy, Scope
from crossroads.proto.reflection import (
    DROP_REFLECTION,
    ReflectionBudget,
    ReflectionSettings,
)
from crossroads.proto.stun import (
    AdditionalAddressFamily,
    AddressErrorCode,
    AlternateServer,
    ChannelNumber,
    Class,
    ConnectionId,
    Data,
    DontFragment,
    EvenPort,
    Lifetime,
    Message,
    MessageIntegrity,
    MessageIntegritySha256,
    Method,
    Nonce,
    PasswordAlgorithms,
    Realm,
    RequestedAddressFamily,
    ReservationToken,
    UnknownAttribute,
    UnknownAttributes,
    Username,
    XorMappedAddress,
    XorPeerAddress,
    XorRelayedAddress,
    decode,
    encode,
)
from crossroads.proto.turn.allocation import FiveTuple
from crossroads.proto.turn.auth import rest_password
from crossroads.proto.turn.constants import Family, Transport
from crossroads.proto.turn.credentials import LongTermSession
from crossroads.proto.turn.server import (
    AllocationCreated,
    AllocationDeleted,
    BindConnection,
    CloseConnection,
    ConnectPeer,
    TurnServer,
    error_code_of,
)
from crossroads.types import Address
from tests.proto.turn.conftest import EPOCH, SERVER, Harness, tcp, udp

PEER = ("198.51.100.20", 5000)


def alice(**kwargs: object) -> LongTermSession:
    return LongTermSession("alice", "secret", **kwargs)  # type: ignore[arg-type]


def code(message: Message | None) -> int | None:
    assert message is not None
    return error_code_of(message)


# ------------------------------------------------------------------ auth


def test_unauthenticated_allocate_gets_small_401(harness: Harness) -> None:
    request = encode(
        Message(Class.REQUEST, Method.ALLOCATE, os.urandom(12), ()), fingerprint=True
    )
    answer_bytes = harness.send(request, udp())
    assert answer_bytes is not None
    answer = decode(answer_bytes)
    assert error_code_of(answer) == 401
    assert answer.get(Realm) == Realm("example.org")
    nonce = answer.get(Nonce)
    assert nonce is not None and nonce.value.startswith("obMatJos2")
    assert answer.get(PasswordAlgorithms) is not None
    assert answer.get(MessageIntegrity) is None
    # No amplification: a 401 is a small, bounded answer.
    assert len(answer_bytes) <= 140
    assert harness.server.allocations == {}


def test_allocate_md5_success(harness: Harness) -> None:
    session = alice(prefer_sha256=False)
    answer = harness.allocate(udp(), session)
    assert answer.msg_class == Class.SUCCESS
    relayed = answer.get(XorRelayedAddress)
    assert relayed is not None and relayed.host == "203.0.113.5"
    assert 49152 <= relayed.port <= 49251
    assert answer.get(Lifetime) == Lifetime(600)
    assert answer.get(XorMappedAddress) == XorMappedAddress("198.51.100.7", 40000)
    assert answer.get(MessageIntegrity) is not None
    assert len(harness.server.allocations) == 1
    events = harness.server.pop_events()
    assert [type(e) for e in events] == [AllocationCreated]


def test_allocate_sha256_password_algorithms(harness: Harness) -> None:
    session = alice()
    five = udp()
    answer = harness.allocate(five, session)
    assert session.sha256
    assert answer.msg_class == Class.SUCCESS
    assert answer.get(MessageIntegritySha256) is not None
    assert answer.get(MessageIntegrity) is None


def test_password_algorithms_downgrade_is_400(harness: Harness) -> None:
    session = alice()
    harness.allocate(udp(), session)  # learn realm, nonce, offered list
    assert session.offered is not None
    session.offered = PasswordAlgorithms(((1, b""),))  # pretend MD5 only was offered
    answer = harness.request(Method.REFRESH, [], udp(), session)
    assert code(answer) == 400


@pytest.mark.parametrize(
    ("username", "password"),
    [("alice", "wrong"), ("mallory", "secret"), ("alice", "")],
)
def test_wrong_credentials_401(harness: Harness, username: str, password: str) -> None:
    answer = harness.allocate(udp(), LongTermSession(username, password))
    assert code(answer) == 401
    assert answer.get(Nonce) is not None
    assert harness.server.allocations == {}
    assert harness.binder.open_count == 0


def test_time_limited_credentials(harness: Harness) -> None:
    username = f"{int(EPOCH) + 3600}:carl"
    ok = harness.allocate(
        udp(), LongTermSession(username, rest_password("s3cr3t", username))
    )
    assert ok.msg_class == Class.SUCCESS
    allocation = next(iter(harness.server.allocations.values()))
    assert allocation.quota_user == "carl"

    expired = f"{int(EPOCH) - 1}:carl"
    answer = harness.allocate(
        udp(40001), LongTermSession(expired, rest_password("s3cr3t", expired))
    )
    assert code(answer) == 401
    forged = harness.allocate(udp(40002), LongTermSession(username, "not-the-hmac"))
    assert code(forged) == 401
    assert len(harness.server.allocations) == 1


def test_stale_nonce_438_then_retry(harness: Harness) -> None:
    session = alice()
    harness.allocate(udp(), session, [Lifetime(3600)])
    old_nonce = session.nonce
    harness.advance(601)  # nonce lifetime is 600 s
    answer = harness.request(Method.REFRESH, [], udp(), session, retry_stale=False)
    assert code(answer) == 438
    assert answer is not None
    session.learn(answer)
    assert session.nonce != old_nonce
    retry = harness.request(Method.REFRESH, [], udp(), session)
    assert retry is not None and retry.msg_class == Class.SUCCESS


def test_replay_from_another_port_is_stale(harness: Harness) -> None:
    """Even behind the same NAT (same IP), a replay from another port is stale."""
    session = alice()
    challenge = harness.request(Method.ALLOCATE, [], udp(1))
    assert challenge is not None
    session.learn(challenge)
    from crossroads.proto.stun import RequestedTransport

    captured = session.sign(
        Message(
            Class.REQUEST, Method.ALLOCATE, os.urandom(12), (RequestedTransport(17),)
        )
    )
    assert code(harness.raw(captured, udp(2))) == 438
    assert code(harness.raw(captured, tcp(1))) == 438
    assert harness.server.allocations == {}


def test_replay_from_another_address_is_stale(harness: Harness) -> None:
    session = alice()
    five = udp()
    challenge = harness.request(Method.ALLOCATE, [], five)
    assert challenge is not None
    session.learn(challenge)
    from crossroads.proto.stun import RequestedTransport

    captured = session.sign(
        Message(
            Class.REQUEST, Method.ALLOCATE, os.urandom(12), (RequestedTransport(17),)
        )
    )
    first = harness.raw(captured, five)
    assert first is not None and first.msg_class == Class.SUCCESS
    # Retransmission on the same 5-tuple: the same answer, no second allocation.
    again = harness.raw(captured, five)
    assert again == first
    # The same bytes from an attacker's address: the nonce is bound to the IP.
    replay = harness.raw(captured, udp(40000, host="203.0.113.66"))
    assert code(replay) == 438
    # Same client address, new transaction: 437 (the 5-tuple is taken).
    other = harness.allocate(five, session)
    assert code(other) == 437
    assert len(harness.server.allocations) == 1


def test_unauthenticated_answers_are_rate_limited() -> None:
    harness = Harness(unauthenticated_rate=1.0, unauthenticated_burst=3)
    answers = [harness.request(Method.ALLOCATE, [], udp()) for _ in range(10)]
    assert sum(a is not None for a in answers) == 3
    assert harness.server.counters.drops["unauthenticated-rate-limit"] == 7
    harness.advance(1.0)
    assert harness.request(Method.ALLOCATE, [], udp()) is not None


def test_unsigned_answers_over_udp_stay_within_the_reflection_budget() -> None:
    """A 401 is ~4x its Allocate: once a source has been sent its allowance,
    further unsigned answers over UDP are dropped and counted; signed answers
    (the source proved it holds a key) and TCP are not limited."""
    harness = Harness()
    harness.server.reflection = ReflectionBudget(ReflectionSettings(allowance=100))
    five = udp()
    session = alice()
    # The allowance pays for one 401 beyond its request: the client gets in.
    assert harness.allocate(five, session).msg_class == Class.SUCCESS
    # What the source sent (its signed Allocate too) pays for a few more; then
    # the 401s stop.
    answers = [harness.request(Method.ALLOCATE, [], five) for _ in range(20)]
    assert answers[-1] is None
    refused = harness.server.counters.drops[DROP_REFLECTION]
    assert refused == sum(a is None for a in answers) > 10
    # Signed answers are not the budget's business (here a 437: taken 5-tuple).
    assert code(harness.allocate(five, session)) == 437
    assert code(harness.request(Method.ALLOCATE, [], tcp())) == 401


def test_missing_realm_or_nonce_400(harness: Harness) -> None:
    message = Message(
        Class.REQUEST, Method.ALLOCATE, os.urandom(12), (Username("alice"),)
    )
    data = encode(message, integrity_key=b"k" * 16)
    assert code(harness.raw(data, udp())) == 400


def test_unknown_comprehension_required_attribute_420(harness: Harness) -> None:
    answer = harness.allocate(udp(), alice(), extra=[UnknownAttribute(0x0031, b"x")])
    assert code(answer) == 420
    assert answer.get(UnknownAttributes) == UnknownAttributes((0x0031,))


def test_unknown_method_400(harness: Harness) -> None:
    assert code(harness.request(0x0FF, [], udp())) == 400


# ------------------------------------------------------------------ Allocate


def test_allocate_errors(harness: Harness) -> None:
    session = alice()
    harness.allocate(udp(1), session)  # learn nonce
    assert code(harness.request(Method.ALLOCATE, [], udp(2), session)) == 400
    assert code(harness.allocate(udp(3), session, transport=99)) == 442
    # TCP relay over a UDP control connection: 400 (RFC 6062 §5.1).
    assert code(harness.allocate(udp(4), session, transport=6)) == 400
    assert (
        code(
            harness.allocate(
                udp(5), session, [ReservationToken(b"12345678"), EvenPort(False)]
            )
        )
        == 400
    )
    assert (
        code(
            harness.allocate(
                udp(6),
                session,
                [RequestedAddressFamily(1), AdditionalAddressFamily(2)],
            )
        )
        == 400
    )
    assert code(harness.allocate(udp(7), session, [AdditionalAddressFamily(1)])) == 400
    assert code(harness.allocate(udp(8), session, [RequestedAddressFamily(3)])) == 440
    assert (
        code(harness.allocate(udp(9), session, [ReservationToken(b"unknown!")])) == 508
    )
    assert len(harness.server.allocations) == 1
    assert harness.binder.open_count == 1


def test_lifetime_rules(harness: Harness) -> None:
    session = alice()
    short = harness.allocate(udp(1), session, [Lifetime(30)])
    assert short.get(Lifetime) == Lifetime(600)  # below default -> default
    long = harness.allocate(udp(2), session, [Lifetime(86400)])
    assert long.get(Lifetime) == Lifetime(3600)  # capped
    refreshed = harness.request(Method.REFRESH, [Lifetime(1200)], udp(1), session)
    assert refreshed is not None and refreshed.get(Lifetime) == Lifetime(1200)


def test_allocation_expires_and_releases_everything(harness: Harness) -> None:
    session = alice()
    harness.allocate(udp(), session)
    harness.server.pop_events()
    harness.advance(599)
    assert len(harness.server.allocations) == 1
    harness.advance(2)
    assert harness.server.allocations == {}
    assert harness.binder.open_count == 0
    assert harness.server.ports.in_use == set()
    assert harness.server.user_allocations == {}
    events = harness.server.pop_events()
    assert [type(e) for e in events] == [AllocationDeleted]
    assert isinstance(events[0], AllocationDeleted) and events[0].reason == "expired"
    assert harness.server.get_timer() is None or harness.server.get_timer() > 600


def test_refresh_zero_deletes_now(harness: Harness) -> None:
    session = alice()
    harness.allocate(udp(), session)
    answer = harness.request(Method.REFRESH, [Lifetime(0)], udp(), session)
    assert answer is not None and answer.msg_class == Class.SUCCESS
    assert harness.server.allocations == {}
    assert harness.binder.open_count == 0
    # A retransmitted Refresh(0) finds nothing: 437.
    assert code(harness.request(Method.REFRESH, [Lifetime(0)], udp(), session)) == 437


def test_other_user_on_same_five_tuple_441(harness: Harness) -> None:
    harness.allocate(udp(), alice())
    bob = LongTermSession("bob", "hunter2")
    assert code(harness.request(Method.REFRESH, [], udp(), bob)) == 441
    assert code(harness.request(Method.REFRESH, [], udp(9), bob)) == 437


def test_quotas_and_release() -> None:
    harness = Harness(user_quota=2, total_quota=3)
    session = alice()
    assert harness.allocate(udp(1), session).msg_class == Class.SUCCESS
    assert harness.allocate(udp(2), session).msg_class == Class.SUCCESS
    assert code(harness.allocate(udp(3), session)) == 486
    bob = LongTermSession("bob", "hunter2")
    assert harness.allocate(udp(4), bob).msg_class == Class.SUCCESS
    assert code(harness.allocate(udp(5), bob)) == 486  # total quota
    # Freed at once by Refresh(0), not after a delay (coturn lags here).
    harness.request(Method.REFRESH, [Lifetime(0)], udp(1), session)
    assert harness.allocate(udp(3), session).msg_class == Class.SUCCESS
    assert harness.binder.open_count == 3


def test_over_capacity_redirects_to_alternate() -> None:
    harness = Harness(total_quota=1, alternate_servers=(("192.0.2.77", 3478),))
    session = alice()
    harness.allocate(udp(1), session)
    answer = harness.allocate(udp(2), session)
    assert code(answer) == 300
    assert answer.get(AlternateServer) == AlternateServer("192.0.2.77", 3478)
    assert answer.get(MessageIntegritySha256) is not None


def test_draining_redirects_new_allocations_and_keeps_live_ones(
    harness: Harness,
) -> None:
    session = allocated(harness)
    harness.server.drain([("2001:db8::5", 3478), ("192.0.2.78", 3478)])
    # A new Allocate: 300 naming the peer of the client's family (RFC 8489
    # §14.15), signed like every authenticated answer.
    answer = harness.allocate(udp(2), alice())
    assert code(answer) == 300
    assert answer.get(AlternateServer) == AlternateServer("192.0.2.78", 3478)
    assert answer.get(MessageIntegritySha256) is not None
    # The live allocation: refresh, permission, channel all still work.
    refreshed = harness.request(Method.REFRESH, [Lifetime(600)], udp(), session)
    assert refreshed is not None and refreshed.msg_class == Class.SUCCESS
    permitted = harness.request(
        Method.CREATE_PERMISSION, [XorPeerAddress(*PEER)], udp(), session
    )
    assert permitted is not None and permitted.msg_class == Class.SUCCESS
    bound = bind(harness, session, 0x4000, PEER)
    assert bound is not None and bound.msg_class == Class.SUCCESS
    assert len(harness.server.allocations) == 1


def test_draining_without_a_peer_of_the_family_is_486(harness: Harness) -> None:
    harness.server.drain([("2001:db8::5", 3478)])
    assert code(harness.allocate(udp(2), alice())) == 486
    harness.server.drain([])
    assert code(harness.allocate(udp(3), alice())) == 486
    assert harness.server.counters.drops["draining-refused"] == 2


def test_even_port_and_reservation_token(harness: Harness) -> None:
    session = alice()
    first = harness.allocate(udp(1), session, [EvenPort(True)])
    relayed = first.get(XorRelayedAddress)
    token = first.get(ReservationToken)
    assert relayed is not None and relayed.port % 2 == 0 and token is not None
    assert relayed.port + 1 in harness.server.ports.in_use
    second = harness.allocate(udp(2), session, [token])
    second_relayed = second.get(XorRelayedAddress)
    assert second_relayed is not None and second_relayed.port == relayed.port + 1
    # Tokens are single use.
    assert code(harness.allocate(udp(3), session, [token])) == 508


def test_unclaimed_reservation_expires(harness: Harness) -> None:
    session = alice()
    first = harness.allocate(udp(1), session, [EvenPort(True)])
    token = first.get(ReservationToken)
    relayed = first.get(XorRelayedAddress)
    assert token is not None and relayed is not None
    harness.advance(31)
    assert relayed.port + 1 not in harness.server.ports.in_use
    assert code(harness.allocate(udp(2), session, [token])) == 508


def test_dual_allocation(harness: Harness) -> None:
    answer = harness.allocate(udp(), alice(), [AdditionalAddressFamily(2)])
    relayed = answer.get_all(XorRelayedAddress)
    assert [r.host for r in relayed] == ["203.0.113.5", "2001:db8::5"]


def test_dual_allocation_without_ipv6_reports_address_error() -> None:
    harness = Harness(families=(Family.IPV4,))
    answer = harness.allocate(udp(), alice(), [AdditionalAddressFamily(2)])
    assert answer.msg_class == Class.SUCCESS
    assert len(answer.get_all(XorRelayedAddress)) == 1
    error = answer.get(AddressErrorCode)
    assert error is not None and (error.family, error.code) == (2, 440)
    assert code(harness.allocate(udp(2), alice(), [RequestedAddressFamily(2)])) == 440


def test_ports_exhausted_508() -> None:
    harness = Harness()
    harness.binder.busy = set(range(49152, 49252))
    assert code(harness.allocate(udp(), alice())) == 508
    assert harness.server.allocations == {}


# ------------------------------------------------------------------ permissions


def allocated(
    harness: Harness, session: LongTermSession | None = None
) -> LongTermSession:
    session = session or alice()
    answer = harness.allocate(udp(), session, [Lifetime(3600)])
    assert answer.msg_class == Class.SUCCESS
    return session


def test_create_permission_policy_and_family(harness: Harness) -> None:
    session = allocated(harness)
    ok = harness.request(
        Method.CREATE_PERMISSION, [XorPeerAddress(*PEER)], udp(), session
    )
    assert ok is not None and ok.msg_class == Class.SUCCESS
    allocation = harness.server.allocations[udp()]
    assert set(allocation.permissions) == {PEER[0]}
    denied = harness.request(
        Method.CREATE_PERMISSION,
        [XorPeerAddress("198.51.100.21", 1), XorPeerAddress("10.0.0.1", 1)],
        udp(),
        session,
    )
    assert code(denied) == 403
    assert "198.51.100.21" not in allocation.permissions  # all or nothing
    assert (
        code(
            harness.request(
                Method.CREATE_PERMISSION,
                [XorPeerAddress("2001:db8::9", 1)],
                udp(),
                session,
            )
        )
        == 443
    )
    assert code(harness.request(Method.CREATE_PERMISSION, [], udp(), session)) == 400
    assert (
        code(
            harness.request(
                Method.CREATE_PERMISSION, [XorPeerAddress(*PEER)], udp(9), session
            )
        )
        == 437
    )


def test_loopback_peer_needs_opt_in() -> None:
    strict = Harness()
    session = allocated(strict)
    loop = [XorPeerAddress("127.0.0.1", 3480)]
    assert code(strict.request(Method.CREATE_PERMISSION, loop, udp(), session)) == 403
    relaxed = Harness(policy=AddressPolicy(admitted=frozenset({Scope.LOOPBACK})))
    session = allocated(relaxed)
    answer = relaxed.request(Method.CREATE_PERMISSION, loop, udp(), session)
    assert answer is not None and answer.msg_class == Class.SUCCESS


def test_permission_lifetime_300s(harness: Harness) -> None:
    session = allocated(harness)
    harness.request(Method.CREATE_PERMISSION, [XorPeerAddress(*PEER)], udp(), session)
    allocation = harness.server.allocations[udp()]
    harness.advance(200)
    harness.request(Method.CREATE_PERMISSION, [XorPeerAddress(*PEER)], udp(), session)
    harness.advance(200)  # 400 s after creation, 200 after refresh
    assert PEER[0] in allocation.permissions
    harness.advance(101)
    assert PEER[0] not in allocation.permissions


def test_permission_limit_508() -> None:
    harness = Harness(max_permissions=2)
    session = allocated(harness)
    peers = [XorPeerAddress(f"198.51.100.{n}", 1) for n in (1, 2, 3)]
    assert code(harness.request(Method.CREATE_PERMISSION, peers, udp(), session)) == 508
    answer = harness.request(Method.CREATE_PERMISSION, peers[:2], udp(), session)
    assert answer is not None and answer.msg_class == Class.SUCCESS


def test_own_relayed_addresses_are_peers_other_own_ports_are_not() -> None:
    """Two clients both forced to relay reach each other through their relayed
    addresses even though those are the server's own (private, here: own)
    addresses; any other port of the server stays out of reach."""
    own = ipaddress.IPv4Address("203.0.113.5")  # FakeBinder's relayed address
    harness = Harness(policy=AddressPolicy(self_addresses=frozenset({own})))
    server = harness.server
    first = allocated(harness)
    answer = harness.allocate(udp(40001), alice(), [Lifetime(3600)])
    second_relay = answer.get(XorRelayedAddress)
    assert second_relay is not None
    their = (second_relay.host, second_relay.port)
    # CreatePermission's port means nothing: the host of a relayed address is enough.
    ok = harness.request(
        Method.CREATE_PERMISSION, [XorPeerAddress(their[0], 0)], udp(), first
    )
    assert ok is not None and ok.msg_class == Class.SUCCESS
    assert bind(harness, first, 0x4000, their) is not None
    assert code(bind(harness, first, 0x4001, (their[0], 8080))) == 403
    assert server.counters.drops["peer-self"] == 1
    # Send indications to the relayed host are checked port by port.
    route = slow_send(server, send_indication(their, b"x"), udp())
    assert route is not None and route[1] == their
    assert slow_send(server, send_indication((their[0], 3478), b"x"), udp()) is None
    assert server.counters.drops["peer-self"] == 2
    assert server.self_peer_refused((their[0], 3478))
    assert not server.self_peer_refused(their)
    # Once the allocation is gone, its address is the server's again.
    harness.request(Method.REFRESH, [Lifetime(0)], udp(40001), alice())
    assert their not in server.relayed
    assert server.self_peer_refused(their)


def test_own_listening_ports_refused_even_when_loopback_is_allowed() -> None:
    harness = Harness(policy=AddressPolicy(admitted=frozenset({Scope.LOOPBACK})))
    harness.server.own_ports = lambda: frozenset({3478, 8080})
    session = allocated(harness)
    assert code(bind(harness, session, 0x4000, ("127.0.0.1", 8080))) == 403
    assert harness.server.counters.drops["peer-service-port"] == 1
    assert bind(harness, session, 0x4001, ("127.0.0.1", 5000)) is not None
    server = harness.server
    assert slow_send(server, send_indication(("127.0.0.1", 3478), b"x"), udp()) is None
    assert slow_send(server, send_indication(("127.0.0.1", 5000), b"x"), udp())
    assert harness.server.counters.drops["peer-service-port"] == 2


# ------------------------------------------------------------------ channels


def bind(
    harness: Harness, session: LongTermSession, number: int, peer: tuple[str, int]
) -> Message | None:
    return harness.request(
        Method.CHANNEL_BIND,
        [ChannelNumber(number), XorPeerAddress(*peer)],
        udp(),
        session,
    )


def test_channel_bind_tables_and_expiry(harness: Harness) -> None:
    session = allocated(harness)
    answer = bind(harness, session, 0x4000, PEER)
    assert answer is not None and answer.msg_class == Class.SUCCESS
    allocation = harness.server.allocations[udp()]
    relay = allocation.relays[Family.IPV4]
    assert allocation.routes[0x4000] == (relay, PEER)
    assert relay.channel_routes == {0x4000: PEER}
    assert relay.peer_channels == {PEER: 0x4000}
    assert PEER[0] in allocation.permissions  # ChannelBind installs the permission

    # Permission lapses at 300 s: peer data stops, client->peer still routed.
    harness.advance(301)
    assert relay.peer_channels == {}
    assert 0x4000 in allocation.routes and relay.channel_routes == {0x4000: PEER}
    assert relay.lapsed == [PEER[0]]
    harness.request(Method.CREATE_PERMISSION, [XorPeerAddress(*PEER)], udp(), session)
    assert relay.peer_channels == {PEER: 0x4000}

    # Channel lapses at 600 s.
    harness.advance(300)
    assert allocation.routes == {} and relay.peer_channels == {}
    assert relay.channel_routes == {}
    assert harness.server.channel_count == 0


def test_channel_rebind_rules(harness: Harness) -> None:
    session = allocated(harness)
    other = ("198.51.100.30", 6000)
    assert bind(harness, session, 0x4001, PEER) is not None
    assert code(bind(harness, session, 0x4001, other)) == 400  # number taken
    assert code(bind(harness, session, 0x4002, PEER)) == 400  # peer taken
    refreshed = bind(harness, session, 0x4001, PEER)  # same pair: refresh
    assert refreshed is not None and refreshed.msg_class == Class.SUCCESS
    harness.advance(601)  # expired: quarantined for 5 minutes
    assert code(bind(harness, session, 0x4001, other)) == 400
    assert code(bind(harness, session, 0x4002, PEER)) == 400
    revived = bind(harness, session, 0x4001, PEER)
    assert revived is not None and revived.msg_class == Class.SUCCESS
    harness.advance(601 + 301)
    # Now free: the number can go to another peer.
    rebound = bind(harness, session, 0x4001, other)
    assert code(rebound) is None
    assert rebound is not None and rebound.msg_class == Class.SUCCESS


@pytest.mark.parametrize("number", [0x3FFF, 0x8000, 0xFFFF])
def test_channel_number_range(harness: Harness, number: int) -> None:
    session = allocated(harness)
    assert code(bind(harness, session, number, PEER)) == 400


def test_rfc8656_channel_range_option() -> None:
    harness = Harness(channel_max=0x4FFF)
    session = allocated(harness)
    assert code(bind(harness, session, 0x5000, PEER)) == 400
    answer = bind(harness, session, 0x4FFF, PEER)
    assert answer is not None and answer.msg_class == Class.SUCCESS


def test_channel_bind_missing_attributes(harness: Harness) -> None:
    session = allocated(harness)
    assert (
        code(
            harness.request(
                Method.CHANNEL_BIND, [ChannelNumber(0x4000)], udp(), session
            )
        )
        == 400
    )
    assert code(bind(harness, session, 0x4000, ("10.1.1.1", 5))) == 403


# ------------------------------------------------------------------ Send slow path


#: The server side of udp()'s 5-tuples.
LISTENER = (Transport.UDP, SERVER)


def slow_send(
    server: TurnServer, message: Message, five: FiveTuple
) -> tuple[object, Address, bytes] | None:
    """The Send slow path (send_route) for ``message`` from ``five``'s client."""
    return server.send_route(encode(message), five[1], (five[0], five[2]))


def send_indication(peer: tuple[str, int], payload: bytes, df: bool = False) -> Message:
    attributes = [XorPeerAddress(*peer), Data(payload)]
    if df:
        attributes.append(DontFragment())
    return Message(Class.INDICATION, Method.SEND, os.urandom(12), tuple(attributes))


def test_send_indication_slow_path(harness: Harness) -> None:
    session = allocated(harness)
    server = harness.server
    assert slow_send(server, send_indication(PEER, b"x"), udp()) is None
    assert server.counters.drops["send-no-permission"] == 1
    harness.request(Method.CREATE_PERMISSION, [XorPeerAddress(*PEER)], udp(), session)
    route = slow_send(server, send_indication(PEER, b"x", df=True), udp())
    assert route is not None and route[1:] == (PEER, b"x")
    assert slow_send(server, send_indication(PEER, b"x"), udp(5)) is None
    assert server.counters.drops["send-no-allocation"] == 1
    assert slow_send(server, send_indication(("2001:db8::1", 1), b"x"), udp()) is None
    # Indications are never answered, and the core API drops a Send one (the
    # transport routes it with send_route).
    assert harness.send(encode(send_indication(PEER, b"x")), udp()) is None
    assert server.counters.drops["send-slow-path-unused"] == 1
    # send_route takes Send indications only, and counts what does not decode.
    refresh = encode(Message(Class.REQUEST, Method.REFRESH, os.urandom(12)))
    assert server.send_route(refresh, udp()[1], LISTENER) is None
    assert server.counters.drops["send-not-a-send-indication"] == 1
    assert server.send_route(b"\x00\x16\x00\x01", udp()[1], LISTENER) is None
    assert sum(n for r, n in server.counters.drops.items() if r.startswith("decode-"))


# ------------------------------------------------------------------ RFC 6062


def tcp_allocation(harness: Harness) -> LongTermSession:
    session = alice()
    answer = harness.allocate(tcp(), session, transport=6)
    assert answer.msg_class == Class.SUCCESS
    harness.server.pop_events()
    return session


def test_connect_connectionbind_flow(harness: Harness) -> None:
    session = tcp_allocation(harness)
    server = harness.server
    assert (
        harness.request(Method.CONNECT, [XorPeerAddress(*PEER)], tcp(), session) is None
    )
    (event,) = server.pop_events()
    assert isinstance(event, ConnectPeer) and event.peer == PEER
    # Same peer again while connecting: 446.
    again = harness.request(Method.CONNECT, [XorPeerAddress(*PEER)], tcp(), session)
    assert code(again) == 446
    server.peer_connected(event.connection_id, harness.now)
    assert server.pop_events() == []
    ((sent, five),) = harness.sent()
    assert five == tcp()
    response = decode(sent)
    assert response.msg_class == Class.SUCCESS
    assert response.get(ConnectionId) == ConnectionId(event.connection_id)
    assert session.verify(sent, response)

    data_five = tcp(40001)
    bound = harness.request(
        Method.CONNECTION_BIND, [ConnectionId(event.connection_id)], data_five, session
    )
    assert bound is not None and bound.msg_class == Class.SUCCESS
    (bind_event,) = server.pop_events()
    assert bind_event == BindConnection(event.connection_id, data_five)
    # Binding twice: 400.
    assert (
        code(
            harness.request(
                Method.CONNECTION_BIND,
                [ConnectionId(event.connection_id)],
                tcp(40002),
                session,
            )
        )
        == 400
    )
    # Closing the control connection deletes the allocation and the connection.
    server.client_disconnected(tcp())
    kinds = [type(e) for e in server.pop_events()]
    assert CloseConnection in kinds and AllocationDeleted in kinds
    assert server.connections == {} and server.allocations == {}


def test_connect_failure_and_timeout_447(harness: Harness) -> None:
    session = tcp_allocation(harness)
    server = harness.server
    harness.request(Method.CONNECT, [XorPeerAddress(*PEER)], tcp(), session)
    (event,) = server.pop_events()
    assert isinstance(event, ConnectPeer)
    server.peer_connect_failed(event.connection_id)
    assert CloseConnection(event.connection_id) in server.pop_events()
    ((sent, five),) = harness.sent()
    assert code(decode(sent)) == 447 and five == tcp()
    harness.request(Method.CONNECT, [XorPeerAddress(*PEER)], tcp(), session)
    server.pop_events()
    harness.advance(31)
    ((sent, five),) = harness.sent()
    assert code(decode(sent)) == 447 and five == tcp()
    assert server.connections == {}


def test_connect_rules(harness: Harness) -> None:
    session = tcp_allocation(harness)
    assert code(harness.request(Method.CONNECT, [], tcp(), session)) == 400
    assert (
        code(
            harness.request(
                Method.CONNECT, [XorPeerAddress("10.0.0.1", 80)], tcp(), session
            )
        )
        == 403
    )
    # Channels make no sense on a TCP allocation.
    assert (
        code(
            harness.request(
                Method.CHANNEL_BIND,
                [ChannelNumber(0x4000), XorPeerAddress(*PEER)],
                tcp(),
                session,
            )
        )
        == 400
    )
    udp_session = alice()
    harness.allocate(udp(), udp_session)
    assert (
        code(
            harness.request(Method.CONNECT, [XorPeerAddress(*PEER)], udp(), udp_session)
        )
        == 400
    )
    # ConnectionBind with an unknown id: 400.
    assert (
        code(
            harness.request(
                Method.CONNECTION_BIND, [ConnectionId(12345)], tcp(7), session
            )
        )
        == 400
    )


def test_incoming_peer_connection(harness: Harness) -> None:
    session = tcp_allocation(harness)
    server = harness.server
    allocation = server.allocations[tcp()]
    assert server.peer_accepted(allocation, PEER, harness.now) is None  # no permission
    harness.request(Method.CREATE_PERMISSION, [XorPeerAddress(*PEER)], tcp(), session)
    connection_id = server.peer_accepted(allocation, PEER, harness.now)
    assert connection_id is not None
    assert server.pop_events() == []
    ((sent, five),) = harness.sent()
    assert five == tcp()
    attempt = decode(sent)
    assert (attempt.msg_class, attempt.method) == (
        Class.INDICATION,
        Method.CONNECTION_ATTEMPT,
    )
    assert attempt.get(ConnectionId) == ConnectionId(connection_id)
    assert attempt.get(XorPeerAddress) == XorPeerAddress(*PEER)
    harness.advance(31)  # no ConnectionBind within 30 s: closed
    assert server.pop_events() == [CloseConnection(connection_id)]
    assert server.connections == {}


def test_same_host_loopback_peers_only_for_loopback_clients() -> None:
    """Development mode (crossroads.firstrun): a client on loopback may relay to
    loopback peers (it reaches them directly anyway); a remote client may not,
    and nobody reaches the server's own listening ports."""
    harness = Harness(
        same_host_loopback_peers=True,
        policy=AddressPolicy(
            self_addresses=frozenset({ipaddress.ip_address("127.0.0.1")})
        ),
    )
    harness.server.own_ports = lambda: frozenset({3478, 8080})
    local = udp(40010, host="127.0.0.1")
    remote = udp(40011)
    session = alice()
    for five in (local, remote):
        assert (
            harness.allocate(five, session, [Lifetime(600)]).msg_class == Class.SUCCESS
        )
    peer = [XorPeerAddress("127.0.0.1", 6379)]
    ok = harness.request(Method.CREATE_PERMISSION, peer, local, session)
    assert ok is not None and ok.msg_class == Class.SUCCESS
    refused = harness.request(Method.CREATE_PERMISSION, peer, remote, session)
    assert code(refused) == 403
    server = harness.server
    assert slow_send(server, send_indication(("127.0.0.1", 6379), b"x"), local)
    assert slow_send(server, send_indication(("127.0.0.1", 8080), b"x"), local) is None
    assert server.counters.drops["peer-service-port"] == 1
