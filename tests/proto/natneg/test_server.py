"""natneg server core, driven in memory with a fake clock."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from crossroads.proto.natneg.packets import (
    MAGIC,
    AddressCheck,
    AddressReply,
    BackupAck,
    BackupTest,
    Connect,
    ConnectAck,
    ErtTest,
    Finished,
    Init,
    InitAck,
    NatifyRequest,
    NatType,
    PreinitAck,
    PreinitState,
    Report,
    ReportAck,
    decode,
)
from crossroads.proto.natneg.server import (
    NatNegServer,
    NatNegSocket,
    NegotiationFinished,
    Outcome,
    RelayMode,
    RelayNeeded,
    ReportReceived,
    ServerConfig,
    SessionClosed,
    SessionId,
)
from crossroads.types import Address

COOKIE = 0x1234
#: The first session of a fresh core.
FIRST = SessionId(COOKIE, 1)

Sent = list[tuple[bytes, Address, NatNegSocket]]


class Client:
    """Addresses one SDK client would use, as the server sees them."""

    def __init__(
        self,
        index: int,
        public_ip: str,
        *,
        version: int = 3,
        local_ip: str = "192.168.1.10",
        game_port: int | None = 6500,
        nego_port: int = 40000,
        symmetric: bool = False,
        cookie: int = COOKIE,
        gp_port: int | None = None,
    ) -> None:
        self.index = index
        self.ip = public_ip
        self.version = version
        self.local_ip = local_ip
        self.game_port = game_port
        self.nego_port = nego_port
        self.symmetric = symmetric
        self.cookie = cookie
        #: Public port of the game socket (default: 50000 + index).
        self.gp_port = gp_port

    def port_types(self) -> list[int]:
        types = [1, 2] if self.version <= 2 else [1, 2, 3]
        return ([0] if self.game_port else []) + types

    def source(self, port_type: int) -> Address:
        if port_type == 0:
            assert self.game_port is not None
            # The game socket's mapping.
            return (self.ip, self.gp_port or 50000 + self.index)
        # One negotiate socket; a symmetric NAT maps it anew per destination.
        return (self.ip, self.nego_port + (port_type if self.symmetric else 0))

    def endpoint(self, port_type: int) -> NatNegSocket:
        return {
            0: NatNegSocket.PRIMARY,
            1: NatNegSocket.PRIMARY,
            2: NatNegSocket.NATNEG2,
        }.get(port_type, NatNegSocket.NATNEG3)

    def init(self, port_type: int) -> bytes:
        use_game = 1 if self.game_port else 0
        local_port = 0
        if port_type >= 2:
            local_port = self.game_port if self.game_port else 33333
        return Init(
            self.version,
            self.cookie,
            port_type,
            self.index,
            use_game,
            self.local_ip,
            local_port,
            "gmtest",
        ).encode()

    def send_inits(
        self, core: NatNegServer, now: float, types: list[int] | None = None
    ) -> None:
        for pt in self.port_types() if types is None else types:
            core.receive_datagram(
                self.init(pt), self.source(pt), now, self.endpoint(pt)
            )


def sent(core: NatNegServer, now: float = 0.0) -> Sent:
    return core.datagrams_to_send(now)


def connects(out: Sent) -> list[tuple[Connect, Address, NatNegSocket]]:
    result = []
    for wire, addr, endpoint in out:
        packet = decode(wire)
        if isinstance(packet, Connect):
            assert len(wire) == 20
            result.append((packet, addr, endpoint))
    return result


def ack(core: NatNegServer, client: Client, now: float) -> None:
    # CONNECT_ACK as the SDK sends it: garbage in bytes 12 and 14-20 (ref §3.2).
    wire = bytearray(
        ConnectAck(client.version, client.cookie, 0, client.index).encode()
    )
    wire[12] = 0xFC
    wire[14:21] = bytes.fromhex("0000b04b69e0fc")
    core.receive_datagram(bytes(wire), client.source(1), now)


def tight(**overrides: object) -> ServerConfig:
    base = ServerConfig(
        session_timeout=5.0,
        connect_interval=1.0,
        connect_attempts=3,
        error_attempts=2,
        linger=4.0,
    )
    return replace(base, **overrides)  # type: ignore[arg-type]


def run_until(core: NatNegServer, until: float) -> Sent:
    """Fire every timer up to ``until``; return everything sent."""
    out: Sent = []
    while (deadline := core.get_timer()) is not None and deadline <= until:
        core.handle_timer(deadline)
        out += core.datagrams_to_send(deadline)
    return out


# ------------------------------------------------------------------ INIT / ACK


def test_every_init_gets_a_21_byte_ack_from_the_endpoint_it_reached() -> None:
    core = NatNegServer(tight())
    a = Client(0, "198.51.100.1")
    a.send_inits(core, 0.0)
    out = sent(core)
    assert len(out) == 5
    # Complete: one ERT_TEST to its negotiate socket times its round trip.
    wire, addr, endpoint = out.pop()
    assert decode(wire) == ErtTest(3, COOKIE, 1, 0)
    assert (addr, endpoint) == (a.source(1), a.endpoint(1))
    for (wire, addr, endpoint), pt in zip(out, a.port_types(), strict=True):
        assert len(wire) == 21
        reply = decode(wire)
        assert isinstance(reply, InitAck)
        assert (reply.port_type, reply.client_index, reply.cookie) == (pt, 0, COOKIE)
        assert reply.version == 3
        assert (reply.ip, reply.port) == a.source(pt)
        assert addr == a.source(pt)
        assert endpoint == a.endpoint(pt)


def answer_erts(core: NatNegServer, out: Sent, now: float) -> Sent:
    """Answer every ERT_TEST in ``out`` at ``now`` as the SDK does (ERT_ACK = its
    first 21 bytes, type 3, from the socket it reached); return ``out`` plus what
    the server sends then."""
    for wire, addr, endpoint in out:
        if isinstance(decode(wire), ErtTest):
            ert_ack = wire[:7] + b"\x03" + wire[8:21]
            core.receive_datagram(ert_ack, addr, now, endpoint)
    return out + core.datagrams_to_send(now)


def connected(core: NatNegServer, a: Client, b: Client) -> None:
    """Both clients negotiate at 0 and ACK their CONNECTs at 0.1."""
    negotiate(core, a, b)
    ack(core, a, 0.1)
    ack(core, b, 0.1)


def replies(
    core: NatNegServer, now: float
) -> list[tuple[Connect, Address, NatNegSocket]]:
    """The CONNECTs the server sends at ``now``, with ERTs answered at once."""
    return connects(answer_erts(core, sent(core, now), now))


def negotiate(
    core: NatNegServer, a: Client, b: Client, now: float = 0.0
) -> list[tuple[Connect, Address, NatNegSocket]]:
    """Both clients' INITs at ``now``, ERTs answered at once (zero round trip)."""
    a.send_inits(core, now)
    b.send_inits(core, now)
    return connects(answer_erts(core, sent(core, now), now))


def test_connect_goes_to_every_mapping_with_the_peer_public_address() -> None:
    core = NatNegServer(tight())
    a = Client(0, "198.51.100.1")
    b = Client(1, "203.0.113.7", game_port=None)
    out = negotiate(core, a, b)
    to_a = [(c, addr, ep) for c, addr, ep in out if addr[0] == a.ip]
    to_b = [(c, addr, ep) for c, addr, ep in out if addr[0] == b.ip]
    # Every address each client used, each from the endpoint that received it.
    assert sorted((addr, ep) for _, addr, ep in to_a) == sorted(
        (a.source(pt), a.endpoint(pt)) for pt in a.port_types()
    )
    assert len(to_b) == 3
    for connect, _, _ in to_a:
        # b lent no game socket: its negotiate socket's NN1 mapping.
        assert (connect.remote_ip, connect.remote_port) == b.source(1)
        assert connect.finished == Finished.NOERROR
        assert connect.got_your_data == 0x42
    for connect, _, _ in to_b:
        # a pings from its game socket: the GP mapping.
        assert (connect.remote_ip, connect.remote_port) == a.source(0)


def test_connect_resent_until_acked_then_session_finishes() -> None:
    core = NatNegServer(tight())
    a = Client(0, "198.51.100.1")
    b = Client(1, "203.0.113.7")
    assert len(negotiate(core, a, b)) == 8
    ack(core, a, 0.1)
    resent = connects(run_until(core, 1.0))
    assert resent and all(addr[0] == b.ip for _, addr, _ in resent)
    ack(core, b, 1.1)
    # ACKs say the CONNECTs arrived, not that the clients reached each other.
    assert core.pop_events() == []
    assert connects(run_until(core, 3.0)) == []
    # Lingers, then goes away: no REPORT came (a v1/v2 client never sends one).
    assert core.session_count == 1
    run_until(core, 10.0)
    assert core.session_count == 0
    assert core.pop_events() == [
        NegotiationFinished(FIRST, Outcome.UNREPORTED, False, 5.1, True),
        SessionClosed(FIRST, replaced=False),
    ]


def finished(core: NatNegServer) -> list[NegotiationFinished]:
    return [e for e in core.pop_events() if isinstance(e, NegotiationFinished)]


def test_outcome_is_the_report_first_attempt_and_retry() -> None:
    core = NatNegServer(tight())
    a, b = Client(0, "198.51.100.1", cookie=1), Client(1, "203.0.113.7", cookie=1)
    connected(core, a, b)
    report(core, a, success=False, nat_type=NatType.UNKNOWN, now=6.0)
    report(core, b, success=False, nat_type=NatType.UNKNOWN, now=6.1)
    # One outcome per session, from the first REPORT: the pings failed.
    assert finished(core) == [
        NegotiationFinished(SessionId(1, 1), Outcome.FAILED, False, 6.0, True)
    ]
    # The game retries (new cookie): relayed, a retry, and it works.
    a2 = Client(0, a.ip, cookie=2, nego_port=41000)
    b2 = Client(1, b.ip, cookie=2, nego_port=42000)
    negotiate(core, a2, b2, now=7.0)
    core.relay_allocated(SessionId(2, 2), ("192.0.2.1", 1), ("192.0.2.1", 2), 7.0)
    ack(core, a2, 7.1)
    ack(core, b2, 7.1)
    report(core, b2, success=True, nat_type=NatType.UNKNOWN, now=7.5)
    assert finished(core) == [
        NegotiationFinished(SessionId(2, 2), Outcome.CONNECTED, True, 0.5, False)
    ]
    # A REPORT before any CONNECT of its session (a stale one) decides nothing.
    a3 = Client(0, a.ip, cookie=3)
    a3.send_inits(core, 8.0)
    report(core, a3, success=True, nat_type=NatType.UNKNOWN, now=8.1)
    assert finished(core) == []


def test_connect_resends_run_out() -> None:
    core = NatNegServer(tight(connect_attempts=3))
    a = Client(0, "198.51.100.1")
    b = Client(1, "203.0.113.7")
    negotiate(core, a, b)
    out = connects(run_until(core, 10.0))
    assert len(out) == 2 * 8  # two more rounds to both clients' 4 mappings
    assert core.pop_events() == [
        NegotiationFinished(FIRST, Outcome.UNACKED, False, 3.0, True),
        SessionClosed(FIRST, replaced=False),
    ]


def test_same_public_ip_gets_private_addresses() -> None:
    core = NatNegServer(tight())
    a = Client(0, "198.51.100.1", local_ip="192.168.1.10", game_port=6500)
    b = Client(
        1, "198.51.100.1", local_ip="192.168.1.20", game_port=None, nego_port=41000
    )
    out = negotiate(core, a, b)
    targets = {addr[1]: (c.remote_ip, c.remote_port) for c, addr, _ in out}
    assert targets[a.source(1)[1]] == ("192.168.1.20", 33333)
    assert targets[b.source(1)[1]] == ("192.168.1.10", 6500)


def test_force_lan_mode_and_invalid_private_address() -> None:
    core = NatNegServer(tight(force_lan_mode=True))
    a = Client(0, "198.51.100.1", local_ip="10.0.0.5")
    b = Client(1, "203.0.113.7", local_ip="0.0.0.0")
    out = negotiate(core, a, b)
    to_b = {(c.remote_ip, c.remote_port) for c, addr, _ in out if addr[0] == b.ip}
    to_a = {(c.remote_ip, c.remote_port) for c, addr, _ in out if addr[0] == a.ip}
    assert to_b == {("10.0.0.5", 6500)}
    # b reported 0.0.0.0 (ref §3.1): fall back to its public game-socket mapping.
    assert to_a == {b.source(0)}


def test_v2_client_is_complete_without_nn3_and_v4_needs_it() -> None:
    core = NatNegServer(tight())
    a = Client(0, "198.51.100.1", version=2)
    b = Client(1, "203.0.113.7", version=2, game_port=None)
    out = negotiate(core, a, b)
    assert len(out) == 3 + 2
    assert {c.version for c, _, _ in out} == {2}

    core = NatNegServer(tight())
    a = Client(0, "198.51.100.1", version=4)
    b = Client(1, "203.0.113.7", version=4)
    a.send_inits(core, 0.0)
    b.send_inits(core, 0.0, [0, 1, 2])
    assert replies(core, 0.0) == []
    b.send_inits(core, 0.1, [3])
    assert {c.version for c, _, _ in replies(core, 0.1)} == {4}


def test_game_port_client_needs_its_gp_init() -> None:
    core = NatNegServer(tight())
    a = Client(0, "198.51.100.1")
    b = Client(1, "203.0.113.7")
    a.send_inits(core, 0.0)
    b.send_inits(core, 0.0, [1, 2, 3])
    assert replies(core, 0.0) == []
    b.send_inits(core, 0.5, [0])
    assert len(replies(core, 0.5)) == 8


# ------------------------------------------------------------------ failures


def test_deadbeat_partner() -> None:
    core = NatNegServer(tight())
    a = Client(0, "198.51.100.1")
    a.send_inits(core, 0.0)
    sent(core)
    out = connects(run_until(core, 20.0))
    # error_attempts=2 rounds to all 4 mappings, finished=1, no address.
    assert len(out) == 8
    assert {(c.finished, c.remote_ip, c.remote_port) for c, _, _ in out} == {
        (1, "0.0.0.0", 0)
    }
    assert {addr for _, addr, _ in out} == {a.source(pt) for pt in a.port_types()}
    assert core.pop_events() == [
        NegotiationFinished(FIRST, Outcome.DEADBEAT, False, 5.0, True),
        SessionClosed(FIRST, replaced=False),
    ]
    assert core.session_count == 0


def test_partner_with_missing_inits_is_init_timeout() -> None:
    core = NatNegServer(tight())
    a = Client(0, "198.51.100.1")
    b = Client(1, "203.0.113.7")
    a.send_inits(core, 0.0)
    b.send_inits(core, 0.0, [0, 1])  # NN2 and NN3 never arrive
    sent(core)
    out = connects(run_until(core, 5.5))
    codes = {addr[0]: c.finished for c, addr, _ in out}
    assert codes == {
        a.ip: Finished.INIT_PACKETS_TIMEDOUT,
        b.ip: Finished.INIT_PACKETS_TIMEDOUT,
    }
    assert core.pop_events()[0].outcome is Outcome.INIT_TIMEOUT  # type: ignore[union-attr]


# ------------------------------------------------------------------ stateless


def test_report_gets_gamespy_style_report_ack() -> None:
    core = NatNegServer(tight())
    report = Report.build(
        version=4,
        cookie=666,
        port_type=0x7F,
        client_index=0,
        success=True,
        nat_type=2,
        mapping_scheme=1,
        game_name="gmtest",
    )
    core.receive_datagram(report.encode(), ("198.51.100.1", 4000), 0.0)
    ((wire, addr, endpoint),) = sent(core)
    expected = bytearray(report.encode()[:21])
    expected[7] = 0x0E
    expected[14] = 0
    assert wire == bytes(expected)
    assert isinstance(decode(wire), ReportAck)
    assert addr == ("198.51.100.1", 4000) and endpoint is NatNegSocket.PRIMARY
    assert core.pop_events() == [ReportReceived(666, 0, True, 2, "gmtest")]


def test_address_check_reply_and_bad_cookie() -> None:
    core = NatNegServer(tight())
    for cookie in (0, 3, 1, 2):
        check = AddressCheck(3, cookie, 1, extra=bytes(52))
        core.receive_datagram(
            check.encode(), ("198.51.100.1", 4000 + cookie), 0.0, NatNegSocket.NATNEG2
        )
    replies = sent(core)
    assert len(replies) == 4
    for wire, addr, endpoint in replies:
        reply = decode(wire)
        assert isinstance(reply, AddressReply) and len(wire) == 21
        assert (reply.ip, reply.port) == addr
        assert reply.cookie == addr[1] - 4000
        assert endpoint is NatNegSocket.NATNEG2
    # A cookie the client would use as an out-of-bounds index is never echoed.
    core.receive_datagram(
        AddressCheck(3, 4, 1, extra=bytes(52)).encode(), ("198.51.100.1", 1), 0.0
    )
    assert sent(core) == []
    assert core.stats.dropped == {"bad-cookie": 1}


def test_natify_erts_come_from_the_probe_endpoints() -> None:
    core = NatNegServer(
        tight(
            unsolicited_ip=NatNegSocket.PROBE_IP,
            unsolicited_port=NatNegSocket.PROBE_PORT,
        )
    )
    src = ("198.51.100.1", 5555)
    for pt, endpoint in (
        (1, NatNegSocket.PRIMARY),
        (2, NatNegSocket.PRIMARY),
        (3, NatNegSocket.NATNEG2),
    ):
        request = NatifyRequest(3, 777, pt, extra=bytes(52))
        core.receive_datagram(request.encode(), src, 0.0, endpoint)
    out = sent(core)
    assert [ep for _, _, ep in out] == [
        NatNegSocket.PRIMARY,
        NatNegSocket.PROBE_IP,
        NatNegSocket.PROBE_PORT,
    ]
    for wire, addr, _ in out:
        assert addr == src and len(wire) == 73
        assert isinstance(decode(wire), ErtTest)

    # Single IP: pt2 falls back to the spare port; without any probe endpoint,
    # pt2/pt3 go unanswered rather than from the solicited endpoint.
    core = NatNegServer(tight(unsolicited_port=NatNegSocket.PROBE_PORT))
    core.receive_datagram(NatifyRequest(3, 777, 2, extra=bytes(52)).encode(), src, 0.0)
    assert [ep for _, _, ep in sent(core)] == [NatNegSocket.PROBE_PORT]
    core = NatNegServer(tight())
    core.receive_datagram(NatifyRequest(3, 777, 3, extra=bytes(52)).encode(), src, 0.0)
    assert sent(core) == []
    assert core.stats.dropped == {"no-probe-endpoint": 1}


def test_preinit_waits_for_partner_then_ready_to_both() -> None:
    core = NatNegServer(tight())
    pre0 = bytes.fromhex("fdfc1e666ab2040fb5e0952a002438b2b35e")
    core.receive_datagram(pre0, ("198.51.100.1", 1000), 0.0)
    ((wire, _, _),) = sent(core)
    assert wire == bytes.fromhex("fdfc1e666ab20410b5e0952a000000000000")
    pre1 = bytes.fromhex("fdfc1e666ab2040fb5e0952a0100aabbccdd")
    core.receive_datagram(pre1, ("203.0.113.7", 2000), 0.5)
    out = sent(core)
    acks = {addr: decode(wire) for wire, addr, _ in out}
    assert acks == {
        ("198.51.100.1", 1000): PreinitAck(4, 0xB5E0952A, 0, PreinitState.READY, 0),
        ("203.0.113.7", 2000): PreinitAck(4, 0xB5E0952A, 1, PreinitState.READY, 0),
    }
    assert all(len(wire) == 18 for wire, _, _ in out)


def test_backup_test_is_echoed() -> None:
    core = NatNegServer(tight())
    test = BackupTest(3, 9, 1, 0, 0, "1.2.3.4", 5)
    core.receive_datagram(test.encode(), ("198.51.100.1", 1), 0.0)
    ((wire, _, _),) = sent(core)
    assert decode(wire) == BackupAck(3, 9, 1, 0, 0, "1.2.3.4", 5)


# ------------------------------------------------------------------ relay


def test_both_symmetric_needs_relay() -> None:
    core = NatNegServer(tight())
    a = Client(0, "198.51.100.1", symmetric=True)
    b = Client(1, "203.0.113.7", symmetric=True, game_port=None)
    assert negotiate(core, a, b) == []
    (event,) = core.pop_events()
    assert event == RelayNeeded(FIRST, (a.ip, b.ip), "both-symmetric")
    # An answer for another session on the cookie changes nothing.
    stale = SessionId(COOKIE, 99)
    assert not core.relay_allocated(stale, ("192.0.2.1", 1), ("192.0.2.1", 2), 0.1)
    assert sent(core) == []
    assert core.relay_allocated(FIRST, ("192.0.2.1", 50001), ("192.0.2.1", 50002), 0.1)
    out = connects(sent(core))
    assert {(addr[0], (c.remote_ip, c.remote_port)) for c, addr, _ in out} == {
        (a.ip, ("192.0.2.1", 50001)),
        (b.ip, ("192.0.2.1", 50002)),
    }
    ack(core, a, 0.2)
    ack(core, b, 0.2)
    report(core, a, success=True, nat_type=NatType.SYMMETRIC, now=0.3)
    (outcome,) = finished(core)
    assert outcome.relayed and outcome.outcome is Outcome.CONNECTED


def test_relay_unavailable_falls_back_to_direct() -> None:
    core = NatNegServer(tight())
    a = Client(0, "198.51.100.1", symmetric=True)
    b = Client(1, "203.0.113.7", symmetric=True)
    negotiate(core, a, b)
    core.pop_events()
    # The transport never answers: after connect_interval, direct addresses.
    out = connects(run_until(core, 1.0))
    assert {(c.remote_ip, c.remote_port) for c, addr, _ in out if addr[0] == a.ip} == {
        b.source(0)
    }


def test_one_symmetric_side_alone_is_direct_and_modes() -> None:
    core = NatNegServer(tight())
    a = Client(0, "198.51.100.1", symmetric=True)
    b = Client(1, "203.0.113.7")
    assert len(negotiate(core, a, b)) == 8
    assert core.pop_events() == []

    core = NatNegServer(tight(relay_mode=RelayMode.ALWAYS))
    negotiate(core, Client(0, "198.51.100.1"), Client(1, "203.0.113.7"))
    assert [e.reason for e in core.pop_events() if isinstance(e, RelayNeeded)] == [
        "forced"
    ]

    core = NatNegServer(tight(relay_mode=RelayMode.NEVER))
    out = negotiate(
        core,
        Client(0, "198.51.100.1", symmetric=True),
        Client(1, "203.0.113.7", symmetric=True),
    )
    assert len(out) == 8


def report(
    core: NatNegServer, client: Client, *, success: bool, nat_type: int, now: float
) -> None:
    packet = Report.build(
        version=client.version,
        cookie=client.cookie,
        client_index=client.index,
        success=success,
        nat_type=nat_type,
        mapping_scheme=0,
        game_name="gmtest",
    )
    core.receive_datagram(packet.encode(), client.source(1), now)


def test_history_symmetric_vs_port_restricted_and_failed_pair() -> None:
    core = NatNegServer(tight())
    # b reported a port-restricted cone earlier; a is symmetric now.
    b_old = Client(1, "203.0.113.7", cookie=1)
    report(core, b_old, success=True, nat_type=NatType.PORT_RESTRICTED_CONE, now=0.0)
    negotiate(
        core,
        Client(0, "198.51.100.1", symmetric=True, cookie=2),
        Client(1, "203.0.113.7", cookie=2),
    )
    assert [e.reason for e in core.pop_events() if isinstance(e, RelayNeeded)] == [
        "symmetric-vs-restricted"
    ]

    # A direct negotiation that failed: the retry with a new cookie is relayed.
    core = NatNegServer(tight())
    a, b = Client(0, "198.51.100.1", cookie=3), Client(1, "203.0.113.7", cookie=3)
    connected(core, a, b)
    report(core, a, success=False, nat_type=NatType.UNKNOWN, now=3.0)
    core.pop_events()
    a2, b2 = (
        Client(0, a.ip, cookie=4, nego_port=1),
        Client(1, b.ip, cookie=4, nego_port=2),
    )
    negotiate(core, a2, b2, now=4.0)
    assert [e.reason for e in core.pop_events() if isinstance(e, RelayNeeded)] == [
        "failed-before"
    ]


# ------------------------------------------------------------------ bad input


def test_bad_packets_dropped_and_counted_sessions_unaffected() -> None:
    core = NatNegServer(tight())
    a = Client(0, "198.51.100.1")
    a.send_inits(core, 0.0)
    answer_erts(core, sent(core), 0.0)
    src = ("192.0.2.99", 1)
    garbage = [
        b"\x00" * 30,  # wrong magic
        MAGIC + b"\x07\x00" + bytes(20),  # unknown version
        MAGIC + b"\x03\x42" + bytes(20),  # unknown type
        MAGIC + b"\x03\x00" + bytes(5),  # truncated INIT
        MAGIC + b"\x03\x0d" + bytes(30),  # truncated REPORT
        Init(3, COOKIE, 7, 0, 0, "1.2.3.4", 1, "x").encode(),  # bad port type
        Init(3, COOKIE, 1, 2, 0, "1.2.3.4", 1, "x").encode(),  # bad client index
        Connect(3, COOKIE, "1.2.3.4", 1).encode(),  # server-to-client type
        ConnectAck(3, 999, 0, 0).encode(),  # unknown cookie
    ]
    for data in garbage:
        core.receive_datagram(data, src, 0.1)
    core.receive_datagram(a.init(1), ("2001:db8::1", 5), 0.1)
    assert sent(core) == []
    assert core.stats.dropped == {
        "bad-magic": 1,
        "bad-version": 1,
        "bad-type": 1,
        "short": 2,
        "bad-port-type": 1,
        "bad-client-index": 1,
        "unexpected-type": 1,
        "unknown-cookie": 1,
        "not-ipv4": 1,
    }
    b = Client(1, "203.0.113.7")
    b.send_inits(core, 0.2)
    assert len(replies(core, 0.2)) == 8


def test_third_client_on_a_cookie_is_dropped() -> None:
    core = NatNegServer(tight())
    a, b = Client(0, "198.51.100.1"), Client(1, "203.0.113.7")
    a.send_inits(core, 0.0)
    intruder = Client(0, "192.0.2.50")
    intruder.send_inits(core, 0.0)
    # Same public IP, other host (other private address), same index: dropped too.
    neighbour = Client(0, "198.51.100.1", local_ip="192.168.1.99", nego_port=45000)
    neighbour.send_inits(core, 0.0, [1])
    assert len(answer_erts(core, sent(core), 0.0)) == 5  # a's INIT_ACKs and ERT
    assert core.stats.dropped == {"third-client": 5}
    b.send_inits(core, 0.1)
    out = replies(core, 0.1)
    assert {addr[0] for _, addr, _ in out} == {a.ip, b.ip}
    assert {(c.remote_ip, c.remote_port) for c, addr, _ in out if addr[0] == b.ip} == {
        a.source(0)
    }


def test_cookie_flood_hits_the_per_source_limit() -> None:
    core = NatNegServer(tight(max_sessions_per_ip=10, rate_limit=0))
    for cookie in range(100):
        flood = Client(0, "192.0.2.66", cookie=cookie)
        flood.send_inits(core, 0.0, [1])
    assert core.session_count == 10
    assert core.stats.dropped == {"source-limit": 90}
    a, b = Client(0, "198.51.100.1"), Client(1, "203.0.113.7")
    sent(core)
    assert len(negotiate(core, a, b)) == 8
    # Flood sessions expire (deadbeat), the limit frees up.
    run_until(core, 30.0)
    assert core.session_count == 0


def test_global_session_limit_and_rate_limit() -> None:
    core = NatNegServer(tight(max_sessions=5, rate_limit=0))
    for cookie in range(8):
        Client(0, f"192.0.2.{cookie + 1}", cookie=cookie).send_inits(core, 0.0, [1])
    assert core.session_count == 5
    assert core.stats.dropped == {"session-limit": 3}

    core = NatNegServer(tight(rate_limit=10, rate_burst=20))
    a = Client(0, "192.0.2.1")
    for _ in range(50):
        a.send_inits(core, 0.0, [1])
    assert core.stats.dropped == {"rate-limit": 30}
    # Tokens come back with time.
    a.send_inits(core, 1.0, [1])
    assert core.stats.dropped == {"rate-limit": 30}


def test_duplicate_init_after_done_is_acked_and_restart_starts_over() -> None:
    core = NatNegServer(tight())
    a, b = Client(0, "198.51.100.1"), Client(1, "203.0.113.7")
    connected(core, a, b)
    a.send_inits(core, 0.5, [2])
    out = sent(core)
    assert [type(decode(w)) for w, _, _ in out] == [InitAck]
    # The game starts over with the same cookie from a new socket.
    a2 = Client(0, a.ip, nego_port=46000)
    a2.send_inits(core, 1.0)
    sent(core)
    run_until(core, 6.5)
    assert [
        e.outcome for e in core.pop_events() if isinstance(e, NegotiationFinished)
    ] == [
        Outcome.UNREPORTED,
        Outcome.DEADBEAT,
    ]


# ------------------------------------------------------------------ cookie reuse


def test_old_session_deadlines_never_fire_on_a_new_one_with_the_cookie() -> None:
    """Cookie reuse: the deadline queue keyed sessions by (cookie, generation)
    and every session counted generations from 0, so the first session's session
    timeout fired on the second one (a deadbeat CONNECT 1 s after its INIT)."""
    core = NatNegServer(tight())  # session_timeout 5, connect_interval 1, linger 4
    a, b = Client(0, "198.51.100.1"), Client(1, "203.0.113.7")
    negotiate(core, a, b)  # deadlines of session 1: 1.0 (resend), 5.0 (timeout)
    ack(core, a, 0.1)
    ack(core, b, 0.1)  # 4.1 (linger)
    report(core, a, success=True, nat_type=NatType.UNKNOWN, now=0.2)
    # The same game plays again with the same cookie, from new sockets.
    a2 = Client(0, a.ip, nego_port=41000, game_port=None)
    b2 = Client(1, b.ip, nego_port=42000, game_port=None)
    a2.send_inits(core, 4.0)
    sent(core)
    # Session 1's 5.0 s timeout must not make session 2 give up at 5.0.
    out = run_until(core, 8.9)
    assert [c for c, _, _ in connects(out)] == []
    b2.send_inits(core, 8.9)
    out = replies(core, 8.9)
    assert {addr for _, addr, _ in out} == {
        a2.source(1),
        a2.source(2),
        a2.source(3),
        b2.source(1),
        b2.source(2),
        b2.source(3),
    }
    assert {c.finished for c, _, _ in out} == {Finished.NOERROR}
    second = SessionId(COOKIE, 2)
    assert [e for e in core.pop_events() if not isinstance(e, ReportReceived)] == [
        NegotiationFinished(FIRST, Outcome.CONNECTED, False, 0.2, True),
        SessionClosed(FIRST, replaced=True),
    ]
    ack(core, a2, 9.0)
    ack(core, b2, 9.0)
    report(core, b2, success=True, nat_type=NatType.UNKNOWN, now=9.1)
    assert finished(core) == [
        NegotiationFinished(second, Outcome.CONNECTED, False, 5.1, True)
    ]


# ------------------------------------------------------------------ properties


datagrams = st.one_of(
    st.binary(max_size=100),
    st.builds(
        lambda v, t, c, rest: MAGIC + bytes((v, t)) + c.to_bytes(4, "big") + rest,
        st.integers(1, 4),
        st.integers(0, 0x10),
        st.integers(0, 3),
        st.binary(min_size=0, max_size=70),
    ),
)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            datagrams,
            st.sampled_from(["198.51.100.1", "203.0.113.7", "::1"]),
            st.floats(0, 2),
        ),
        max_size=40,
    )
)
def test_random_traffic_never_raises(steps: list[tuple[bytes, str, float]]) -> None:
    core = NatNegServer(tight(max_sessions=8))
    now = 0.0
    for data, ip, dt in steps:
        now += dt
        core.receive_datagram(data, (ip, 1000), now, NatNegSocket.PRIMARY)
        for wire, _, _ in core.datagrams_to_send(now):
            # Never amplify: no reply is larger than the biggest request.
            assert len(wire) <= 100
        core.pop_events()
        if (deadline := core.get_timer()) is not None and deadline <= now:
            core.handle_timer(now)
    run_until(core, now + 100.0)
    assert core.session_count == 0


def test_history_expires() -> None:
    core = NatNegServer(tight(history_ttl=60.0))
    a, b = Client(0, "198.51.100.1", cookie=5), Client(1, "203.0.113.7", cookie=5)
    connected(core, a, b)
    report(core, a, success=False, nat_type=NatType.PORT_RESTRICTED_CONE, now=1.0)
    core.pop_events()
    run_until(core, 200.0)  # housekeeping forgets the failure and the NAT type
    assert core.get_timer() is None  # nothing left to wake up for
    a2, b2 = Client(0, a.ip, cookie=6), Client(1, b.ip, cookie=6, symmetric=True)
    assert len(negotiate(core, a2, b2, now=201.0)) == 8
    assert not [e for e in core.pop_events() if isinstance(e, RelayNeeded)]


def test_old_linger_never_deletes_a_new_session_before_its_report() -> None:
    """Cookie reuse, second face: session 1's linger deleted session 2 early,
    so session 2's failed REPORT found no session and the retry was not relayed."""
    core = NatNegServer(tight())  # linger 4
    a, b = Client(0, "198.51.100.1"), Client(1, "203.0.113.7")
    negotiate(core, a, b)
    ack(core, a, 0.1)
    ack(core, b, 0.1)  # session 1 lingers until 4.1
    a2 = Client(0, a.ip, nego_port=41000)
    b2 = Client(1, b.ip, nego_port=42000)
    assert len(negotiate(core, a2, b2, now=1.0)) == 8
    ack(core, a2, 1.1)
    ack(core, b2, 1.1)  # session 2 lingers until 5.1
    run_until(core, 4.5)
    assert core.session_count == 1
    report(core, a2, success=False, nat_type=NatType.UNKNOWN, now=4.5)
    assert finished(core) == [
        # Replaced at 1.0, it lingered for a late REPORT until 4.1.
        NegotiationFinished(FIRST, Outcome.UNREPORTED, False, 4.1, True),
        NegotiationFinished(SessionId(COOKIE, 2), Outcome.FAILED, False, 3.5, True),
    ]
    # The game retries with the same cookie: relayed, because session 2 failed.
    a3 = Client(0, a.ip, nego_port=43000)
    b3 = Client(1, b.ip, nego_port=44000)
    assert negotiate(core, a3, b3, now=5.0) == []
    assert [e for e in core.pop_events() if isinstance(e, RelayNeeded)] == [
        RelayNeeded(SessionId(COOKIE, 3), (a.ip, b.ip), "failed-before")
    ]


def test_restart_on_the_same_game_socket_keeps_its_gp_init() -> None:
    """The SDK test program lends its game socket and always uses cookie 666: a
    second negotiation's GP INIT comes from the address the first one saw (it
    looks like a duplicate), and only the NN INITs from a new negotiate socket show
    the restart. The GP INIT must count for the new session (the client will not
    resend an INIT that was ACKed)."""
    core = NatNegServer(tight())
    a, b = Client(0, "198.51.100.1"), Client(1, "203.0.113.7")
    connected(core, a, b)
    report(core, a, success=True, nat_type=NatType.UNKNOWN, now=0.2)
    core.pop_events()
    a2 = Client(0, a.ip, nego_port=41000)  # same game socket, new negotiate socket
    b2 = Client(1, b.ip, nego_port=42000)
    out = negotiate(core, a2, b2, now=1.0)
    assert {addr for _, addr, _ in out} == {
        *(a2.source(pt) for pt in a2.port_types()),
        *(b2.source(pt) for pt in b2.port_types()),
    }
    assert {c.finished for c, _, _ in out} == {Finished.NOERROR}
    closed = [e for e in core.pop_events() if isinstance(e, SessionClosed)]
    assert closed == [SessionClosed(FIRST, replaced=True)]


def test_a_stale_connect_ack_does_not_silence_a_new_session() -> None:
    """A CONNECT_ACK of session 1, late, must not mark the client of session 2 as
    having ACKed CONNECTs it was never sent."""
    core = NatNegServer(tight())
    a, b = Client(0, "198.51.100.1"), Client(1, "203.0.113.7")
    negotiate(core, a, b)
    ack(core, b, 0.1)
    run_until(core, 3.0)  # a never ACKs: resends run out at 3.0, linger to 7.0
    core.pop_events()
    a2 = Client(0, a.ip, nego_port=41000)
    b2 = Client(1, b.ip, nego_port=42000)
    run_until(core, 7.5)
    a2.send_inits(core, 7.5)  # session 1 is gone
    answer_erts(core, sent(core), 7.5)
    ack(core, a, 7.6)  # a's late CONNECT_ACK for session 1
    assert core.stats.dropped == {"stale-connect-ack": 1}
    b2.send_inits(core, 7.7)
    out = replies(core, 7.7)
    assert {addr[0] for _, addr, _ in out} == {a.ip, b.ip}


# ------------------------------------------------------------------ CONNECT timing


def connect_times(core: NatNegServer, until: float) -> dict[str, float]:
    """When the first CONNECT to each client's IP went out, firing timers."""
    first: dict[str, float] = {}
    while (deadline := core.get_timer()) is not None and deadline <= until:
        core.handle_timer(deadline)
        for c, addr, _ in connects(core.datagrams_to_send(deadline)):
            assert c.finished == Finished.NOERROR
            first.setdefault(addr[0], deadline)
    return first


def test_connects_are_timed_so_both_arrive_together() -> None:
    """The farther client's CONNECT leaves first, the nearer one's later by the
    difference of their one-way times (rtt / 2), so both first pings leave at the
    same moment (docs/natneg.md, "CONNECT timing")."""
    core = NatNegServer(tight())
    a, b = Client(0, "198.51.100.1"), Client(1, "203.0.113.7")
    a.send_inits(core, 0.0)
    answer_erts(core, sent(core), 0.2)  # a: rtt 200 ms
    b.send_inits(core, 1.0)
    out = sent(core, 1.0)
    assert connects(out) == []  # TIMING: b's round trip is not known yet
    now = 1.04
    out = answer_erts(core, out, now)  # b: rtt 40 ms
    to_a = {addr for c, addr, _ in connects(out) if addr[0] == a.ip}
    assert to_a == {a.source(pt) for pt in a.port_types()}
    assert not [addr for _, addr, _ in connects(out) if addr[0] == b.ip]
    times = connect_times(core, 3.0)
    lead = times[b.ip] - now
    # a hears its CONNECT at now + 0.1, b at now + lead + 0.02: the same moment
    # but for half a poll interval (a round trip may include one, and the lead
    # must never overshoot: proto/timing.py, "Poll delay").
    poll = core.config.client_poll
    assert abs((now + 0.1) - (times[b.ip] + 0.02) - poll / 2) < 1e-9
    assert abs(lead - (0.08 - poll / 2)) < 1e-9
    # Resends keep each client's own rhythm until it ACKs.
    ack(core, a, 1.2)
    ack(core, b, 1.2)
    assert connect_times(core, 5.0) == {}


def test_a_poll_delay_in_a_round_trip_does_not_let_a_ping_overtake_a_connect() -> None:
    """Both clients 20 ms from the server, 3 ms from each other; a's ERT_ACK
    waited 9 ms for the SDK's next ``NNThink`` (it polls every 10 ms), b's none.
    A lead of half the measured difference (4.5 ms to b) makes b's CONNECT arrive
    after a's first ping reached b's router (issue 25: a 5.7 ms lead cost 0.7 s);
    the lead must be robust to the poll, so b's CONNECT is not held past a's."""
    d, d_ab, poll_a = 0.020, 0.003, 0.009
    core = NatNegServer(tight())
    a, b = Client(0, "198.51.100.1"), Client(1, "203.0.113.7")
    a.send_inits(core, 0.0)
    answer_erts(core, sent(core), 2 * d + poll_a)
    b.send_inits(core, 0.1)
    out = sent(core, 0.1)
    assert connects(out) == []
    now = 0.1 + 2 * d
    out = answer_erts(core, out, now)
    times = {ip: now for ip in {addr[0] for _, addr, _ in connects(out)}}
    times.update(
        {ip: t for ip, t in connect_times(core, 1.0).items() if ip not in times}
    )
    arrives = {ip: t + d for ip, t in times.items()}
    # Each side pings the moment its CONNECT arrives (the earliest it can):
    # the ping reaches the other's router d_ab later.
    assert arrives[b.ip] <= arrives[a.ip] + d_ab
    assert arrives[a.ip] <= arrives[b.ip] + d_ab


def test_no_wait_for_round_trips_where_timing_cannot_change_the_outcome() -> None:
    """The wait for the later client's round trip is paid only where an early
    ping could break the pair or cost it a ping interval: not when one side sits
    on its public address, has a REPORTed full cone, both REPORTed restricted
    cones, or both map per destination (relayed). There the CONNECTs go as soon
    as both are complete, without waiting for the ERT_ACKs."""
    unnated = Client(0, "198.51.100.1", local_ip="198.51.100.1")
    a, b = Client(0, "198.51.100.1"), Client(1, "203.0.113.7")
    cones = {
        "198.51.100.1": NatType.RESTRICTED_CONE,
        "203.0.113.7": NatType.RESTRICTED_CONE,
    }
    cases: list[tuple[str, Client, Client, dict[str, int]]] = [
        ("unnated", unnated, Client(1, "203.0.113.7", symmetric=True), {}),
        ("full cone", a, b, {"198.51.100.1": NatType.FULL_CONE}),
        ("restricted cones", a, b, cones),
        (
            "both symmetric",
            Client(0, "198.51.100.1", symmetric=True),
            Client(1, "203.0.113.7", symmetric=True),
            {},
        ),
    ]
    for name, x, y, history in cases:
        core = NatNegServer(tight(relay_mode=RelayMode.NEVER))
        for serial, (ip, nat_type) in enumerate(history.items()):
            earlier = Client(0, ip, cookie=100 + serial)
            report(core, earlier, success=True, nat_type=nat_type, now=0.0)
        x.send_inits(core, 1.0)
        y.send_inits(core, 1.0)
        out = connects(sent(core, 1.0))  # no ERT_ACK yet
        assert {addr[0] for _, addr, _ in out} == {x.ip, y.ip}, name


def test_timing_still_waits_where_an_early_ping_can_cost() -> None:
    """A restricted cone may remap on a knock, and its partner may filter by
    port; or it drops the first ping of a symmetric partner, whose NAT then
    drops the cone's ping to the port it saw: a ping interval lost. Both pairs
    still wait for the round trips."""
    for b in (Client(1, "203.0.113.7"), Client(1, "203.0.113.7", symmetric=True)):
        core = NatNegServer(tight(relay_mode=RelayMode.NEVER))
        report(
            core,
            Client(0, "198.51.100.1", cookie=7),
            success=True,
            nat_type=NatType.RESTRICTED_CONE,
            now=0.0,
        )
        a = Client(0, "198.51.100.1")
        a.send_inits(core, 1.0)
        b.send_inits(core, 1.0)
        assert connects(sent(core, 1.0)) == []


def test_timing_waits_for_an_ert_ack_at_most_rtt_wait() -> None:
    core = NatNegServer(tight(rtt_wait=0.5))
    a, b = Client(0, "198.51.100.1"), Client(1, "203.0.113.7")
    a.send_inits(core, 0.0)
    answer_erts(core, sent(core), 0.1)
    b.send_inits(core, 0.3)
    assert connects(sent(core)) == []  # b never answers its ERT
    # Given up on at 0.8: both CONNECTs at once (an unknown rtt means no lead).
    assert connect_times(core, 0.9) == {a.ip: 0.8, b.ip: 0.8}


def test_lead_is_capped_and_untimed_mode_sends_together_without_erts() -> None:
    core = NatNegServer(tight(max_connect_lead=0.2))
    a, b = Client(0, "198.51.100.1"), Client(1, "203.0.113.7")
    a.send_inits(core, 0.0)
    answer_erts(core, sent(core), 0.9)  # rtt 900 ms: one-way 450 ms
    b.send_inits(core, 1.0)
    out = answer_erts(core, sent(core), 1.0)  # rtt 0
    assert {addr[0] for _, addr, _ in connects(out)} == {a.ip}
    assert connect_times(core, 1.5) == {b.ip: 1.2}  # not 1.45: capped

    core = NatNegServer(tight(timed_connect=False))
    a.send_inits(core, 0.0)
    b.send_inits(core, 0.0)
    out = sent(core)
    assert not [w for w, _, _ in out if isinstance(decode(w), ErtTest)]
    assert len(connects(out)) == 8


def test_a_forged_ert_ack_is_dropped() -> None:
    core = NatNegServer(tight())
    a = Client(0, "198.51.100.1")
    a.send_inits(core, 0.0)
    ((ert, _, endpoint),) = [x for x in sent(core) if isinstance(decode(x[0]), ErtTest)]
    forged = ert[:7] + b"\x03" + ert[8:21]
    core.receive_datagram(forged, ("192.0.2.66", 40000), 0.1, endpoint)
    core.receive_datagram(
        forged[:8] + b"\x00\x00\x00\x01" + forged[12:], a.source(1), 0.1
    )
    assert core.stats.dropped == {"unsolicited-ert-ack": 2}
