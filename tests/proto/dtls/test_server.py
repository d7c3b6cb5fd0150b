"""The DTLS server and client cores against each other, in memory."""

from __future__ import annotations

import pytest

from crossroads.proto.dtls import wire as w
from crossroads.proto.dtls.client import ClientState
from crossroads.proto.dtls.crypto import SUITES
from crossroads.proto.dtls.handshake import (
    ApplicationData,
    Closed,
    Established,
    HandshakeFailed,
    HelloReceived,
)
from crossroads.proto.dtls.server import PskDtlsServerConfig
from tests.proto.dtls.support import (
    CLIENT,
    IDENTITY,
    PSK,
    SERVER,
    Wire,
    make_client,
    make_server,
)


def established_pair(**client_options: object) -> Wire:
    wire = Wire(make_client(**client_options), make_server())
    wire.handshake()
    assert wire.client.state == ClientState.ESTABLISHED
    return wire


def record_types(datagram: bytes) -> list[tuple[int, int]]:
    records, bad = w.split_records(datagram)
    assert bad is None
    return [(r.content_type, r.epoch) for r in records]


@pytest.mark.parametrize("suite", sorted(SUITES))
@pytest.mark.parametrize("ems", [True, False])
def test_handshake_and_data_for_every_suite(suite: int, ems: bool) -> None:
    wire = established_pair(cipher_suites=(suite,), offer_extended_master_secret=ems)
    server_events = wire.server.pop_events()
    (established,) = [e for e in server_events if isinstance(e, Established)]
    assert established == Established(CLIENT, IDENTITY, suite, ems)
    assert wire.client.pop_events() == [Established(SERVER, IDENTITY, suite, ems)]
    assert wire.client.send(b"ping", wire.now)
    wire.settle()
    assert wire.server.pop_events() == [ApplicationData(CLIENT, b"ping")]
    assert wire.server.send(CLIENT, b"pong", wire.now)
    wire.settle()
    assert wire.client.pop_events() == [ApplicationData(SERVER, b"pong")]


def test_binary_identity_reaches_the_psk_lookup_whole() -> None:
    asked: list[bytes] = []
    wire = Wire(make_client(), make_server())
    lookup = wire.server.psk_for

    def recording(identity: bytes) -> tuple[bytes, ...]:
        asked.append(identity)
        return tuple(lookup(identity))

    wire.server.psk_for = recording
    wire.handshake()
    assert asked == [IDENTITY]
    assert IDENTITY[0] == 0  # a C-string stack would have seen an empty identity


def test_server_prefers_aes128_gcm_and_reports_the_offer() -> None:
    offered = (0xC0A8, 0x00A9, 0x00A8)
    wire = established_pair(cipher_suites=offered)
    (hello,) = [e for e in wire.server.pop_events() if isinstance(e, HelloReceived)]
    assert hello.chosen == 0x00A8
    assert hello.cipher_suites[:3] == offered
    assert w.ExtensionType.EXTENDED_MASTER_SECRET in hello.extensions


def test_first_hello_is_answered_statelessly_with_a_smaller_verify_request() -> None:
    client, server = make_client(), make_server()
    client.start(0.0)
    ((hello, _),) = client.datagrams_to_send(0.0)
    server.receive_datagram(hello, CLIENT, 0.0)
    ((answer, addr),) = server.datagrams_to_send(0.0)
    assert addr == CLIENT
    assert len(answer) == 48 < len(hello)
    assert answer[1:3] == b"\xfe\xff"  # RFC 6347 §4.2.1: a DTLS 1.0 record
    (record,), _ = w.split_records(answer)
    (fragment,) = w.decode_fragments(record.fragment)
    assert fragment.msg_type == w.HandshakeType.HELLO_VERIFY_REQUEST
    assert record.sequence == 0
    assert not server.handshakes and not server.sessions
    assert server.hello_verify_sent == 1


def test_a_cookie_is_bound_to_the_address() -> None:
    wire = Wire(make_client(), make_server())
    wire.client.start(0.0)
    wire.settle()  # through the cookie exchange and the whole handshake
    other = Wire(make_client(), wire.server, addr=("198.51.100.99", 1))
    other.client.start(0.0)
    ((hello, _),) = other.client.datagrams_to_send(0.0)
    wire.server.receive_datagram(hello, other.addr, 0.0)
    ((verify, _),) = wire.server.datagrams_to_send(0.0)
    other.client.receive_datagram(verify, SERVER, 0.0)
    ((second_hello, _),) = other.client.datagrams_to_send(0.0)
    # The second hello (with the cookie) replayed from another address is
    # challenged again, not answered with a ServerHello.
    before = wire.server.hello_verify_sent
    wire.server.receive_datagram(second_hello, ("198.51.100.98", 2), 0.0)
    assert wire.server.hello_verify_sent == before + 1
    assert ("198.51.100.98", 2) not in wire.server.handshakes


def hello_with_cookie(
    server_at: float, answer_at: float, rotations: list[float]
) -> bool:
    """Whether a cookie issued at ``server_at`` is still accepted at
    ``answer_at`` after the server saw hellos (rotating) at ``rotations``."""
    server = make_server(cookie_rotation=30.0)
    client = make_client()
    client.start(server_at)
    ((hello, _),) = client.datagrams_to_send(server_at)
    server.receive_datagram(hello, CLIENT, server_at)
    ((verify, _),) = server.datagrams_to_send(server_at)
    client.receive_datagram(verify, SERVER, server_at)
    ((second_hello, _),) = client.datagrams_to_send(server_at)
    for at in rotations:
        stranger = make_client()
        stranger.start(at)
        ((other, _),) = stranger.datagrams_to_send(at)
        server.receive_datagram(other, ("203.0.113.1", 1), at)
    server.receive_datagram(second_hello, CLIENT, answer_at)
    return CLIENT in server.handshakes


def test_cookie_secret_rotation_keeps_one_previous_secret() -> None:
    assert hello_with_cookie(0.0, 1.0, [])
    assert hello_with_cookie(0.0, 35.0, [])  # one rotation: the previous secret
    assert not hello_with_cookie(0.0, 70.0, [35.0])  # two rotations: forgotten


def test_wrong_psk_fails_with_bad_record_mac() -> None:
    wire = Wire(make_client(psk=bytes(64)), make_server())
    wire.handshake()
    assert wire.client.state == ClientState.FAILED
    assert wire.client.pop_events() == [HandshakeFailed(SERVER, "alert-20")]
    assert wire.server.failures == {"bad-psk": 1}
    assert not wire.server.handshakes and not wire.server.sessions


def test_unknown_identity_gets_unknown_psk_identity() -> None:
    wire = Wire(make_client(identity=b"nobody"), make_server())
    wire.handshake()
    assert wire.client.pop_events() == [HandshakeFailed(SERVER, "alert-115")]


def test_no_shared_suite_fails_with_handshake_failure() -> None:
    wire = Wire(make_client(cipher_suites=(0x00AE,)), make_server())
    wire.handshake()
    assert wire.client.pop_events() == [HandshakeFailed(SERVER, "alert-40")]
    assert wire.server.failures == {"no-shared-suite": 1}


def test_lost_server_hello_flight_is_retransmitted() -> None:
    wire = Wire(make_client(), make_server())
    lost = {"count": 0}

    def lose_first_server_hello(data: bytes) -> bool:
        records, _ = w.split_records(data)
        first = records[0]
        if (first.content_type, first.epoch) == (w.ContentType.HANDSHAKE, 0) and (
            w.decode_fragments(first.fragment)[0].msg_type
            == w.HandshakeType.SERVER_HELLO
        ):
            lost["count"] += 1
            return lost["count"] > 1
        return True

    wire.to_client = lose_first_server_hello
    wire.handshake()
    assert wire.client.state == ClientState.WAIT_SERVER_HELLO
    wire.advance(1.5)  # the 1 s retransmission timers (RFC 6347 §4.2.4.1)
    assert wire.client.state == ClientState.ESTABLISHED
    assert lost["count"] >= 2


def test_lost_final_flight_is_sent_again_when_the_client_repeats_its_own() -> None:
    wire = Wire(make_client(), make_server())
    finals = {"count": 0}

    def lose_first_final(data: bytes) -> bool:
        if (w.ContentType.CHANGE_CIPHER_SPEC, 0) in record_types(data):
            finals["count"] += 1
            return finals["count"] > 1
        return True

    wire.to_client = lose_first_final
    wire.handshake()
    assert CLIENT in wire.server.sessions
    assert wire.client.state == ClientState.WAIT_SERVER_FINISHED
    wire.advance(1.5)
    assert wire.client.state == ClientState.ESTABLISHED
    assert finals["count"] == 2


def test_fresh_hello_on_a_live_address_starts_a_new_handshake_not_an_alert() -> None:
    wire = established_pair()
    wire.server.pop_events()
    # Unity's reconnection probe: a second client on the same socket.
    probe = Wire(make_client(), wire.server)
    probe.now = wire.now
    probe.client.start(probe.now)
    ((hello, _),) = probe.client.datagrams_to_send(probe.now)
    wire.server.receive_datagram(hello, CLIENT, probe.now)
    ((answer, _),) = wire.server.datagrams_to_send(probe.now)
    assert record_types(answer) == [(w.ContentType.HANDSHAKE, 0)]
    (record,), _ = w.split_records(answer)
    assert w.decode_fragments(record.fragment)[0].msg_type == (
        w.HandshakeType.HELLO_VERIFY_REQUEST
    )
    # The old session lives on until the new handshake completes ...
    assert CLIENT in wire.server.sessions
    probe.client.receive_datagram(answer, SERVER, probe.now)
    probe.settle()
    assert probe.client.state == ClientState.ESTABLISHED
    events = wire.server.pop_events()
    assert Closed(CLIENT, "replaced") in events
    # ... then the new one carries the data and the old one is gone.
    assert probe.client.send(b"new", probe.now)
    probe.settle()
    assert wire.server.pop_events() == [ApplicationData(CLIENT, b"new")]
    assert wire.client.send(b"old", wire.now)
    wire.settle()
    assert wire.server.pop_events() == []


def test_renegotiation_is_refused_with_a_warning_and_the_session_goes_on() -> None:
    wire = established_pair()
    client = wire.client
    hello = w.handshake_message(
        w.HandshakeType.CLIENT_HELLO, 5, b"\xfe\xfd" + bytes(40)
    )
    assert client._write is not None  # test reaches in: no public API sends this
    wire.server.receive_datagram(
        client._write.seal(w.ContentType.HANDSHAKE, 50, hello), CLIENT, wire.now
    )
    ((answer, _),) = wire.server.datagrams_to_send(wire.now)
    assert record_types(answer) == [(w.ContentType.ALERT, 1)]
    assert wire.server.drops["renegotiation"] == 1
    assert CLIENT in wire.server.sessions
    assert client.send(b"still here", wire.now)
    wire.settle()
    assert ApplicationData(CLIENT, b"still here") in wire.server.pop_events()


def test_replayed_records_are_dropped() -> None:
    wire = established_pair()
    wire.server.pop_events()
    wire.client.send(b"once", wire.now)
    ((record, _),) = wire.client.datagrams_to_send(wire.now)
    wire.server.receive_datagram(record, CLIENT, wire.now)
    wire.server.receive_datagram(record, CLIENT, wire.now)
    assert wire.server.pop_events() == [ApplicationData(CLIENT, b"once")]
    assert wire.server.drops["replayed"] == 1


def test_forged_and_short_records_are_bad_mac_and_leave_the_window_alone() -> None:
    wire = established_pair()
    wire.server.pop_events()
    wire.client.send(b"real", wire.now)
    ((record, _),) = wire.client.datagrams_to_send(wire.now)
    forged = record[:-1] + bytes([record[-1] ^ 1])
    short = record[: w.RECORD_HEADER_SIZE] + b"\0"
    short = short[:11] + (1).to_bytes(2, "big") + short[13:]
    for bad in (forged, short):
        wire.server.receive_datagram(bad, CLIENT, wire.now)
        wire.client.receive_datagram(bad, SERVER, wire.now)
    assert wire.server.drops["bad-mac"] == 2
    assert wire.client.drops["bad-mac"] == 2
    # A forged copy did not mark the sequence number seen: the real one passes.
    wire.server.receive_datagram(record, CLIENT, wire.now)
    assert wire.server.pop_events() == [ApplicationData(CLIENT, b"real")]


def test_idle_sessions_end() -> None:
    wire = Wire(make_client(), make_server(idle_timeout=30.0))
    wire.handshake()
    wire.server.pop_events()
    wire.advance(29.0)
    assert CLIENT in wire.server.sessions
    wire.client.send(b"alive", wire.now)
    wire.advance(29.0)
    assert CLIENT in wire.server.sessions
    wire.advance(2.0)
    assert CLIENT not in wire.server.sessions
    assert Closed(CLIENT, "idle") in wire.server.pop_events()


def test_close_notify_ends_the_session_but_a_forged_plaintext_alert_does_not() -> None:
    wire = established_pair()
    forged = w.Record(w.ContentType.ALERT, w.DTLS1_2, 0, 99, b"\x02\x14").encode()
    wire.server.receive_datagram(forged, CLIENT, wire.now)
    assert CLIENT in wire.server.sessions
    wire.client.close(wire.now)
    wire.settle()
    assert CLIENT not in wire.server.sessions


def test_every_datagram_fits_unitys_mtu_and_oversize_sends_are_refused() -> None:
    wire = established_pair()
    suite = SUITES[0x00A8]
    biggest = 1400 - suite.overhead
    assert wire.server.send(CLIENT, bytes(biggest), wire.now)
    assert not wire.server.send(CLIENT, bytes(biggest + 1), wire.now)
    assert wire.server.drops["oversize"] == 1
    wire.settle()
    assert max(len(d) for d in wire.sent_to_client) <= 1400


def test_send_without_a_session_is_refused() -> None:
    server = make_server()
    assert not server.send(CLIENT, b"x", 0.0)
    assert server.datagrams_to_send(0.0) == []


def test_the_client_finished_picks_the_psk_among_candidates() -> None:
    server = make_server()
    older = bytes(range(64))
    server.psk_for = lambda identity: (PSK, older)  # a secret adopted since
    wire = Wire(make_client(psk=older), server)
    wire.handshake()
    assert wire.client.state == ClientState.ESTABLISHED
    assert wire.client.send(b"old key", wire.now)
    wire.settle()
    assert ApplicationData(CLIENT, b"old key") in server.pop_events()


def fragment_handshakes(datagram: bytes, piece: int) -> bytes:
    """Re-send every epoch-0 handshake message of ``datagram`` as fragments of
    ``piece`` bytes, each in its own record, last fragment first."""
    records, _ = w.split_records(datagram)
    out = b""
    sequence = 1000
    for record in records:
        if (record.content_type, record.epoch) != (w.ContentType.HANDSHAKE, 0):
            out += record.encode()
            continue
        for fragment in w.decode_fragments(record.fragment):
            pieces = [
                w.HandshakeFragment(
                    fragment.msg_type,
                    fragment.length,
                    fragment.message_seq,
                    offset,
                    fragment.body[offset : offset + piece],
                )
                for offset in range(0, fragment.length, piece)
            ]
            for part in reversed(pieces):
                sequence += 1
                out += w.Record(
                    w.ContentType.HANDSHAKE, record.version, 0, sequence, part.encode()
                ).encode()
    return out


def test_a_fragmented_key_exchange_is_reassembled() -> None:
    client, server = make_client(identity=bytes(40)), make_server()
    server.psk_for = lambda identity: (PSK,)
    wire = Wire(client, server)
    hellos = {"count": 0}

    def fragmenting(data: bytes) -> bool:
        records, _ = w.split_records(data)
        if records[0].fragment[:1] == b"\x10":  # ClientKeyExchange flight
            server.receive_datagram(fragment_handshakes(data, 7), CLIENT, wire.now)
            return False
        hellos["count"] += 1
        return True

    wire.to_server = fragmenting
    wire.handshake()
    assert client.state == ClientState.ESTABLISHED
    assert hellos["count"] == 2


def test_a_fragmented_client_hello_is_dropped_without_state() -> None:
    client, server = make_client(), make_server()
    client.start(0.0)
    ((hello, _),) = client.datagrams_to_send(0.0)
    server.receive_datagram(fragment_handshakes(hello, 20), CLIENT, 0.0)
    assert server.datagrams_to_send(0.0) == []
    assert server.drops["fragmented-hello"] >= 1
    assert not server.handshakes


def test_defaults_are_the_ones_the_readme_states() -> None:
    config = PskDtlsServerConfig()
    assert config.cipher_suites == (0x00A8, 0x00A9, 0xC0A4, 0xC0A8)
    assert (config.max_handshakes_per_ip, config.max_handshakes) == (8, 1024)
    assert config.handshake_timeout == 15.0
    assert config.max_sessions_per_ip == 256
    assert config.idle_timeout == 30.0
    assert config.cookie_rotation == 30.0
    assert config.max_datagram == 1400
    assert (config.hello_rate, config.hello_burst) == (50.0, 200.0)


def test_one_ipv6_64_holds_at_most_its_handshake_cap() -> None:
    """Handshakes are counted per source, an IPv6 /64 (one site's LAN): 40
    addresses of one /64 get 8 handshakes between them, not 8 each; another
    /64 still gets its own."""
    server = make_server()
    for host in [f"2001:db8:1::{n:x}" for n in range(1, 41)] + ["2001:db8:2::1"]:
        client = make_client()
        wire = Wire(client, server, addr=(host, 40000))
        client.start(wire.now)
        # ClientHello, HelloVerifyRequest, ClientHello with the cookie,
        # the server's flight (not answered: the handshake stays open).
        for _ in range(2):
            for data, _ in client.datagrams_to_send(wire.now):
                server.receive_datagram(data, wire.addr, wire.now)
            for data, addr in server.datagrams_to_send(wire.now):
                if addr == wire.addr:
                    client.receive_datagram(data, SERVER, wire.now)
    per_64: dict[str, int] = {}
    for host, _ in server.handshakes:
        prefix = host.rsplit(":", 2)[0]
        per_64[prefix] = per_64.get(prefix, 0) + 1
    assert per_64 == {"2001:db8:1": 8, "2001:db8:2": 1}
    assert server.drops["handshake-cap"] == 32


def test_a_session_not_confirmed_in_time_ends_and_a_confirmed_one_stays() -> None:
    """With a first-message deadline (the relay's: a BIND it accepted), a
    session nobody confirmed ends with a close_notify after it; one its owner
    confirmed lives on until the idle timeout."""
    silent = Wire(make_client(), make_server(first_message_timeout=10.0))
    silent.handshake()
    silent.server.pop_events()
    silent.advance(9.0)
    assert CLIENT in silent.server.sessions
    silent.advance(2.0)
    assert CLIENT not in silent.server.sessions
    assert Closed(CLIENT, "no-first-message") in silent.server.pop_events()
    assert silent.client.state == ClientState.CLOSED

    bound = Wire(make_client(), make_server(first_message_timeout=10.0))
    bound.handshake()
    bound.server.confirm(CLIENT)
    bound.advance(20.0)
    assert CLIENT in bound.server.sessions
