"""The relay server core, in memory with a fake clock."""

from __future__ import annotations

import os
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from crossroads.proto.policy import AddressPolicy, Scope, Verdict
from crossroads.proto.relay import messages as m
from crossroads.proto.relay.server import (
    AllocationBound,
    AllocationEnded,
    ClientRefused,
    ConnectRejected,
    PeerConnected,
    PeerDisconnected,
    RelayServer,
    RelayServerConfig,
)
from crossroads.proto.relay.token import AllocationClaims, Role, TokenSealer, bind_hmac
from crossroads.types import Address

NODE = "node-1"
WALL = 1_700_000_000.0  # wall clock = now + WALL
SEALER = TokenSealer(b"k" * 32, os.urandom)

HOST_ADDR: Address = ("198.51.100.1", 4000)
J1_ADDR: Address = ("198.51.100.2", 5000)
J2_ADDR: Address = ("198.51.100.3", 6000)
EVIL: Address = ("203.0.113.66", 6666)


@dataclass
class Player:
    allocation_id: bytes
    token: bytes
    key: bytes
    nonce: int = 0

    def bind(self, nonce: int | None = None, *, key: bytes | None = None) -> bytes:
        if nonce is None:
            nonce = self.nonce
            self.nonce += 1
        unsigned = m.Bind(
            nonce=nonce,
            connection_data=m.pad_connection_data(self.token),
            hmac=bytes(32),
        )
        mac = bind_hmac(key or self.key, unsigned.signed_bytes())
        return m.Bind(
            nonce=nonce, connection_data=unsigned.connection_data, hmac=mac
        ).encode()


def player(
    role: Role,
    host: Player | None = None,
    max_connections: int = 2,
    deadline: float = 10.0,
) -> Player:
    allocation_id = os.urandom(16)
    claims = AllocationClaims(
        allocation_id=allocation_id,
        host_allocation_id=host.allocation_id if host else allocation_id,
        role=role,
        max_connections=max_connections,
        bind_deadline=WALL + deadline,
    )
    return Player(
        allocation_id, SEALER.seal(claims, NODE), SEALER.key_for(allocation_id)
    )


class Harness:
    def __init__(self, **config: object) -> None:
        self.now = 0.0
        cfg = RelayServerConfig(node_id=NODE, **config)  # type: ignore[arg-type]
        self.server = RelayServer(cfg, SEALER, wall_offset=WALL)

    def send(self, data: bytes, addr: Address) -> list[tuple[bytes, Address]]:
        self.server.receive_datagram(data, addr, self.now)
        return self.server.datagrams_to_send(self.now)

    def advance(self, seconds: float) -> list[tuple[bytes, Address]]:
        end = self.now + seconds
        while True:
            timer = self.server.get_timer()
            if timer is None or timer > end:
                break
            self.now = max(self.now, timer)
            self.server.handle_timer(self.now)
        self.now = end
        return self.server.datagrams_to_send(self.now)

    def session(
        self, joiners: int = 1, max_connections: int = 2
    ) -> tuple[Player, list[Player]]:
        host = player(Role.HOST, max_connections=max_connections)
        assert self.send(host.bind(), HOST_ADDR) == [
            (m.BindReceived().encode(), HOST_ADDR)
        ]
        players = []
        for addr in (J1_ADDR, J2_ADDR)[:joiners]:
            joiner = player(Role.JOINER, host)
            assert self.send(joiner.bind(), addr) == [(m.BindReceived().encode(), addr)]
            out = self.send(connect(joiner, host), addr)
            assert out == [
                (m.Accepted(host.allocation_id, joiner.allocation_id).encode(), addr)
            ]
            players.append(joiner)
        return host, players


def connect(joiner: Player, host: Player) -> bytes:
    return m.ConnectRequest(
        joiner.allocation_id, m.pad_connection_data(host.token)
    ).encode()


def error(allocation_id: bytes, code: m.ErrorCode) -> bytes:
    return m.Error(allocation_id, code).encode()


def relay(a: Player, b: Player, payload: bytes) -> bytes:
    return m.Relay(a.allocation_id, b.allocation_id, payload).encode()


# ----------------------------------------------------------------------- binding


def test_bind_then_duplicate_then_replay() -> None:
    h = Harness()
    host = player(Role.HOST)
    first = host.bind()
    assert h.send(first, HOST_ADDR) == [(m.BindReceived().encode(), HOST_ADDR)]
    events = h.server.pop_events()
    assert isinstance(events[0], AllocationBound) and events[0].is_host
    # The identical BIND again from the bound address: the reply was lost.
    assert h.send(first, HOST_ADDR) == [(m.BindReceived().encode(), HOST_ADDR)]
    # The identical BIND from elsewhere is a replay: dropped, nothing moves.
    assert h.send(first, EVIL) == []
    assert h.server.drops["replayed-nonce"] == 1
    assert h.server.allocations[host.allocation_id].address == HOST_ADDR


def test_nonce_must_strictly_increase() -> None:
    h = Harness()
    host = player(Role.HOST)
    assert h.send(host.bind(5), HOST_ADDR)
    assert h.send(host.bind(4), HOST_ADDR) == []
    assert h.send(host.bind(6), HOST_ADDR) == [(m.BindReceived().encode(), HOST_ADDR)]
    assert h.server.drops == {"replayed-nonce": 1}


def test_nonce_is_little_endian_on_the_wire() -> None:
    h = Harness()
    host = player(Role.HOST)
    assert h.send(host.bind(0x0100), HOST_ADDR)  # bytes 00 01
    assert h.send(host.bind(0x00FF), HOST_ADDR) == []  # bytes ff 00: smaller


def test_wrong_hmac_is_dropped_silently() -> None:
    h = Harness()
    host = player(Role.HOST)
    assert h.send(host.bind(0, key=bytes(64)), HOST_ADDR) == []
    assert h.server.drops == {"bad-hmac": 1}
    assert not h.server.allocations
    # A later honest BIND with the same nonce works: the bad one consumed nothing.
    assert h.send(host.bind(0), HOST_ADDR)


def test_forged_token_is_dropped_silently() -> None:
    h = Harness()
    other = TokenSealer(b"x" * 32, os.urandom)
    aid = os.urandom(16)
    claims = AllocationClaims(aid, aid, Role.HOST, 2, WALL + 10)
    forged = Player(aid, other.seal(claims, NODE), other.key_for(aid))
    assert h.send(forged.bind(), HOST_ADDR) == []
    assert h.server.drops == {"bad-token": 1}


def test_bind_after_deadline_gets_error_4() -> None:
    h = Harness()
    host = player(Role.HOST, deadline=10.0)
    h.now = 10.5
    out = h.send(host.bind(), HOST_ADDR)
    assert out == [
        (error(host.allocation_id, m.ErrorCode.ALLOCATION_ID_NOT_FOUND), HOST_ADDR)
    ]
    assert h.server.drops == {"bind-deadline": 1}


def test_private_addresses_refused_by_default() -> None:
    h = Harness()
    host = player(Role.HOST)
    assert h.send(host.bind(), ("127.0.0.1", 4000)) == []
    assert h.send(host.bind(), ("10.1.2.3", 4000)) == []
    assert h.send(host.bind(), ("::ffff:192.168.1.1", 4000)) == []
    assert h.server.drops == {"client-loopback": 1, "client-private": 2}
    refused = [e for e in h.server.pop_events() if isinstance(e, ClientRefused)]
    assert [e.verdict for e in refused] == [
        Verdict.LOOPBACK,
        Verdict.PRIVATE,
        Verdict.PRIVATE,
    ]
    h2 = Harness(policy=AddressPolicy(admitted=frozenset({Scope.LOOPBACK})))
    assert h2.send(host.bind(), ("127.0.0.1", 4000))


# -------------------------------------------------------------------- connecting


def test_connect_relay_both_ways() -> None:
    h = Harness()
    host, (j1, j2) = h.session(joiners=2)
    assert h.send(relay(j1, host, b"hello"), J1_ADDR) == [
        (relay(j1, host, b"hello"), HOST_ADDR)
    ]
    assert h.send(relay(host, j2, b"hi"), HOST_ADDR) == [
        (relay(host, j2, b"hi"), J2_ADDR)
    ]
    assert len(h.server.routes) == 4
    events = h.server.pop_events()
    connected = [e for e in events if isinstance(e, PeerConnected)]
    assert [e.connections for e in connected] == [1, 2]


def test_joiners_cannot_talk_to_each_other() -> None:
    h = Harness()
    host, (j1, j2) = h.session(joiners=2)
    out = h.send(relay(j1, j2, b"psst"), J1_ADDR)
    assert out == [(error(j1.allocation_id, m.ErrorCode.NOT_CONNECTED), J1_ADDR)]


def test_relay_to_unknown_peer_gets_not_connected() -> None:
    h = Harness()
    host, (j1,) = h.session()
    stranger = os.urandom(16)
    out = h.send(m.Relay(host.allocation_id, stranger, b"x").encode(), HOST_ADDR)
    assert out == [(error(host.allocation_id, m.ErrorCode.NOT_CONNECTED), HOST_ADDR)]


def test_relay_with_wrong_length_is_dropped_not_forwarded() -> None:
    h = Harness()
    host, (j1,) = h.session()
    frame = relay(j1, host, b"hello")
    assert h.send(frame + b"!", J1_ADDR) == []
    assert h.send(frame[:-1], J1_ADDR) == []
    assert h.server.drops == {"bad-length": 2}


def test_max_connections_rejects() -> None:
    h = Harness()
    host, (j1,) = h.session(joiners=1, max_connections=1)
    j2 = player(Role.JOINER, host)
    assert h.send(j2.bind(), J2_ADDR)
    out = h.send(connect(j2, host), J2_ADDR)
    assert out == [(m.Rejected(host.allocation_id, j2.allocation_id).encode(), J2_ADDR)]
    assert any(isinstance(e, ConnectRejected) for e in h.server.pop_events())


def test_connect_is_idempotent() -> None:
    h = Harness()
    host, (j1,) = h.session(max_connections=1)
    out = h.send(connect(j1, host), J1_ADDR)
    assert out == [(m.Accepted(host.allocation_id, j1.allocation_id).encode(), J1_ADDR)]
    assert h.server.connections == 1


def test_connect_to_the_wrong_host_is_unauthorized() -> None:
    h = Harness()
    host, _ = h.session(joiners=0)
    other_host = player(Role.HOST)
    assert h.send(other_host.bind(), ("198.51.100.9", 1))
    joiner = player(Role.JOINER, host)
    assert h.send(joiner.bind(), J1_ADDR)
    out = h.send(connect(joiner, other_host), J1_ADDR)
    assert out == [(error(joiner.allocation_id, m.ErrorCode.UNAUTHORIZED), J1_ADDR)]
    garbage = m.ConnectRequest(joiner.allocation_id, b"\x01" * 100).encode()
    out = h.send(garbage, J1_ADDR)
    assert out == [(error(joiner.allocation_id, m.ErrorCode.UNAUTHORIZED), J1_ADDR)]


def test_host_connecting_to_itself_is_self_connect() -> None:
    h = Harness()
    host, _ = h.session(joiners=0)
    out = h.send(connect(host, host), HOST_ADDR)
    assert out == [
        (error(host.allocation_id, m.ErrorCode.SELF_CONNECT_NOT_ALLOWED), HOST_ADDR)
    ]


def test_connect_before_host_binds_waits_then_works() -> None:
    h = Harness()
    host = player(Role.HOST)
    joiner = player(Role.JOINER, host)
    assert h.send(joiner.bind(), J1_ADDR)
    assert h.send(connect(joiner, host), J1_ADDR) == []
    assert h.server.drops == {"host-not-bound": 1}
    assert h.send(host.bind(), HOST_ADDR)
    out = h.send(connect(joiner, host), J1_ADDR)
    assert out == [
        (m.Accepted(host.allocation_id, joiner.allocation_id).encode(), J1_ADDR)
    ]


# ----------------------------------------------------------- addresses and errors


def test_unknown_allocation_gets_error_4() -> None:
    h = Harness()
    stranger = os.urandom(16)
    out = h.send(m.Ping(stranger).encode(), EVIL)
    assert out == [(error(stranger, m.ErrorCode.ALLOCATION_ID_NOT_FOUND), EVIL)]


def test_ping_is_echoed() -> None:
    h = Harness()
    host, _ = h.session(joiners=0)
    ping = m.Ping(host.allocation_id, 7).encode()
    assert h.send(ping, HOST_ADDR) == [(ping, HOST_ADDR)]


def test_spoofed_source_gets_error_3_and_nothing_is_forwarded() -> None:
    h = Harness()
    host, (j1,) = h.session()
    out = h.send(relay(j1, host, b"evil"), EVIL)
    assert out == [
        (error(j1.allocation_id, m.ErrorCode.ALLOCATION_ID_CLIENT_MISMATCH), EVIL)
    ]
    out = h.send(m.Disconnect(j1.allocation_id, host.allocation_id).encode(), EVIL)
    assert out == [
        (error(j1.allocation_id, m.ErrorCode.ALLOCATION_ID_CLIENT_MISMATCH), EVIL)
    ]
    out = h.send(m.Close(host.allocation_id).encode(), EVIL)
    assert out == [
        (error(host.allocation_id, m.ErrorCode.ALLOCATION_ID_CLIENT_MISMATCH), EVIL)
    ]
    assert h.server.connections == 1 and len(h.server.allocations) == 2


def test_address_change_rebind_moves_routes() -> None:
    h = Harness()
    host, (j1,) = h.session()
    moved: Address = ("198.51.100.2", 5999)
    # The NAT gave the joiner a new port: its RELAY now gets ERROR 3 ...
    out = h.send(relay(j1, host, b"a"), moved)
    assert out == [
        (error(j1.allocation_id, m.ErrorCode.ALLOCATION_ID_CLIENT_MISMATCH), moved)
    ]
    # ... it bumps its nonce and re-BINDs from the new address ...
    assert h.send(j1.bind(), moved) == [(m.BindReceived().encode(), moved)]
    bound = [e for e in h.server.pop_events() if isinstance(e, AllocationBound)]
    assert bound[-1].rebind
    # ... and traffic flows both ways on the new address; the old one is dead.
    assert h.send(relay(j1, host, b"b"), moved) == [(relay(j1, host, b"b"), HOST_ADDR)]
    assert h.send(relay(host, j1, b"c"), HOST_ADDR) == [(relay(host, j1, b"c"), moved)]
    out = h.send(relay(j1, host, b"d"), J1_ADDR)
    assert out == [
        (error(j1.allocation_id, m.ErrorCode.ALLOCATION_ID_CLIENT_MISMATCH), J1_ADDR)
    ]


def test_wrong_sizes_are_dropped() -> None:
    h = Harness()
    host, (j1,) = h.session()
    for data in (
        m.Ping(host.allocation_id).encode() + b"x",
        host.bind()[:-1],
        connect(j1, host)[:-1],
        m.Close(host.allocation_id).encode() + b"x",
        m.Disconnect(j1.allocation_id, host.allocation_id).encode()[:-1],
        b"\xda\x72\x00\x0a" + bytes(10),
    ):
        assert h.send(data, J1_ADDR) == []
    assert h.server.drops == {"bad-size": 6}
    assert h.server.connections == 1


def test_bad_version_gets_error_0_and_junk_is_dropped() -> None:
    h = Harness()
    out = h.send(b"\xda\x72\x01\x02" + bytes(18), EVIL)
    assert out == [(error(bytes(16), m.ErrorCode.INVALID_PROTOCOL_VERSION), EVIL)]
    assert h.send(b"GET / HTTP/1.1\r\n", EVIL) == []
    assert h.send(m.BindReceived().encode(), EVIL) == []
    assert h.server.drops == {
        "bad-version": 1,
        "bad-signature": 1,
        "unexpected-type": 1,
    }


def test_error_replies_are_rate_limited_per_source() -> None:
    h = Harness(error_rate=1.0, error_burst=3.0)
    stranger = os.urandom(16)
    replies = sum(len(h.send(m.Ping(stranger).encode(), EVIL)) for _ in range(50))
    assert replies == 3
    assert h.server.drops["error-rate-limited"] == 47


def test_slow_path_flood_is_rate_limited_and_other_sessions_unaffected() -> None:
    h = Harness(slow_path_rate=10.0, slow_path_burst=20.0)
    host, (j1,) = h.session()
    for _ in range(1000):
        h.send(os.urandom(40), EVIL)
    assert h.server.drops["rate-limited"] >= 980
    assert h.send(relay(j1, host, b"still here"), J1_ADDR) == [
        (relay(j1, host, b"still here"), HOST_ADDR)
    ]


def test_tracked_sources_are_bounded() -> None:
    h = Harness(max_tracked_sources=100)
    for i in range(1000):
        h.send(b"junk", (f"203.0.113.{i % 250}", 1000 + i))
    assert len(h.server._slow_buckets) <= 100


def test_route_over_its_rate_is_suspended_then_restored() -> None:
    h = Harness(max_route_pps=10.0, sweep_interval=1.0, idle_timeout=100.0)
    host, (j1,) = h.session()
    for _ in range(50):
        h.send(relay(j1, host, b"x"), J1_ADDR)
    h.advance(1.0)
    assert h.send(relay(j1, host, b"x"), J1_ADDR) == []
    assert h.server.drops["rate-limited"] == 1
    # The other direction is untouched.
    assert h.send(relay(host, j1, b"y"), HOST_ADDR) == [
        (relay(host, j1, b"y"), J1_ADDR)
    ]
    h.advance(2.0)
    assert h.send(relay(j1, host, b"x"), J1_ADDR) == [
        (relay(j1, host, b"x"), HOST_ADDR)
    ]


# ---------------------------------------------------------------------- endings


def test_disconnect_is_forwarded_and_frees_the_slot() -> None:
    h = Harness()
    host, (j1,) = h.session(max_connections=1)
    out = h.send(m.Disconnect(j1.allocation_id, host.allocation_id).encode(), J1_ADDR)
    assert out == [
        (m.Disconnect(j1.allocation_id, host.allocation_id).encode(), HOST_ADDR)
    ]
    assert h.server.connections == 0 and not h.server.routes
    assert [e for e in h.server.pop_events() if isinstance(e, PeerDisconnected)]
    j2 = player(Role.JOINER, host)
    assert h.send(j2.bind(), J2_ADDR)
    out = h.send(connect(j2, host), J2_ADDR)
    assert out == [(m.Accepted(host.allocation_id, j2.allocation_id).encode(), J2_ADDR)]


def test_idle_joiner_times_out_and_frees_the_slot() -> None:
    h = Harness(idle_timeout=10.0, host_alone_timeout=60.0)
    host, (j1,) = h.session(max_connections=1)
    for _ in range(4):  # the host keeps pinging, the joiner says nothing
        h.advance(3.0)
        assert h.send(m.Ping(host.allocation_id).encode(), HOST_ADDR)
    out = h.advance(0.0)
    assert j1.allocation_id not in h.server.allocations
    ended = [e for e in h.server.pop_events() if isinstance(e, AllocationEnded)]
    assert [(e.allocation_id, e.reason) for e in ended] == [(j1.allocation_id, "idle")]
    assert h.server.connections == 0
    later = h.send(relay(j1, host, b"late"), J1_ADDR)
    assert later == [
        (error(j1.allocation_id, m.ErrorCode.ALLOCATION_ID_NOT_FOUND), J1_ADDR)
    ]
    del out


def test_timeout_sends_error_1_to_client_and_disconnect_to_host() -> None:
    h = Harness(idle_timeout=10.0, host_alone_timeout=60.0, sweep_interval=1.0)
    host, (j1,) = h.session()
    out = []
    for _ in range(11):
        out += h.advance(1.0)
        if j1.allocation_id in h.server.allocations:
            h.send(m.Ping(host.allocation_id).encode(), HOST_ADDR)
    assert (error(j1.allocation_id, m.ErrorCode.PLAYER_TIMED_OUT), J1_ADDR) in out
    assert (
        m.Disconnect(j1.allocation_id, host.allocation_id).encode(),
        HOST_ADDR,
    ) in out


def test_kick_sends_error_to_client_and_disconnect_to_host() -> None:
    h = Harness()
    host, (j1,) = h.session()
    assert h.server.kick(j1.allocation_id, h.now)
    assert h.server.datagrams_to_send(h.now) == [
        (error(j1.allocation_id, m.ErrorCode.PLAYER_TIMED_OUT), J1_ADDR),
        (m.Disconnect(j1.allocation_id, host.allocation_id).encode(), HOST_ADDR),
    ]


def test_kick_without_notify_still_tells_the_peer() -> None:
    """A DTLS client whose session closed: nothing can reach it any more, but
    its host must still hear DISCONNECT."""
    h = Harness()
    host, (j1,) = h.session()
    assert h.server.kick(j1.allocation_id, h.now, notify=False)
    assert h.server.datagrams_to_send(h.now) == [
        (m.Disconnect(j1.allocation_id, host.allocation_id).encode(), HOST_ADDR),
    ]
    assert not h.server.kick(j1.allocation_id, h.now, notify=False)


def test_relayed_traffic_keeps_both_ends_alive() -> None:
    h = Harness(idle_timeout=10.0, sweep_interval=1.0)
    host, (j1,) = h.session()
    for _ in range(30):
        h.advance(1.0)
        h.send(relay(j1, host, b"tick"), J1_ADDR)
    assert len(h.server.allocations) == 2
    assert h.server.relayed() == (30, 30 * 42)
    assert h.server.relayed_packets == 29  # the last one is folded in by the next sweep


def test_host_alone_gets_the_longer_timeout() -> None:
    h = Harness(idle_timeout=10.0, host_alone_timeout=60.0)
    host, _ = h.session(joiners=0)
    h.advance(59.0)
    assert host.allocation_id in h.server.allocations
    h.advance(2.0)
    assert host.allocation_id not in h.server.allocations
    ended = [e for e in h.server.pop_events() if isinstance(e, AllocationEnded)]
    assert ended[0].reason == "host-alone"


def test_host_ending_ends_its_joiners() -> None:
    h = Harness()
    host, (j1, j2) = h.session(joiners=2)
    out = h.send(m.Close(host.allocation_id).encode(), HOST_ADDR)
    assert sorted(out) == sorted(
        [
            (m.Disconnect(host.allocation_id, j1.allocation_id).encode(), J1_ADDR),
            (m.Disconnect(host.allocation_id, j2.allocation_id).encode(), J2_ADDR),
        ]
    )
    assert not h.server.allocations and not h.server.routes and h.server.load == 0
    # The closed allocation cannot be re-bound with its still-valid token.
    out = h.send(host.bind(), HOST_ADDR)
    assert out == [
        (error(host.allocation_id, m.ErrorCode.ALLOCATION_ID_NOT_FOUND), HOST_ADDR)
    ]


def test_load_counts_host_seats() -> None:
    h = Harness()
    h.session(joiners=2, max_connections=5)
    assert h.server.load == 6
    assert h.server.stats() == {
        "allocations": 3,
        "connections": 2,
        "routes": 4,
        "load": 6,
    }


def test_timer_is_idle_without_allocations() -> None:
    h = Harness()
    assert h.server.get_timer() is None
    host, _ = h.session(joiners=0)
    assert h.server.get_timer() is not None
    h.send(m.Close(host.allocation_id).encode(), HOST_ADDR)
    h.advance(20.0)
    assert h.server.get_timer() is None


@settings(max_examples=300)
@given(st.lists(st.binary(max_size=300), max_size=20))
def test_random_datagrams_never_crash_or_disturb_a_session(
    datagrams: list[bytes],
) -> None:
    h = Harness()
    host, (j1,) = h.session()
    for data in datagrams:
        for reply, _ in h.send(data, EVIL):
            assert len(reply) <= max(len(data), 21)
        h.send(data, J1_ADDR)
    assert h.send(relay(host, j1, b"ok"), HOST_ADDR) == [
        (relay(host, j1, b"ok"), J1_ADDR)
    ]


@given(st.binary(min_size=4, max_size=60), st.integers(0, 12))
def test_random_bodies_with_valid_headers(body: bytes, code: int) -> None:
    h = Harness()
    host, (j1,) = h.session()
    h.send(b"\xda\x72\x00" + bytes((code,)) + host.allocation_id + body, EVIL)
    h.send(b"\xda\x72\x00" + bytes((code,)) + j1.allocation_id + body, EVIL)
    assert h.server.connections == 1
