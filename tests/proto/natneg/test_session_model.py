"""natneg session model under cookie reuse and restarts,
driven in memory with a fake clock: a client that starts over on its cookie
replaces its own record; a finished session does not lock its cookie; a third
client is refused while a pair negotiates."""

from __future__ import annotations

from crossroads.proto.natneg.packets import (
    ErtTest,
    Finished,
    InitAck,
    NatType,
    decode,
)
from crossroads.proto.natneg.server import (
    NatNegServer,
    NegotiationFinished,
    Outcome,
    SessionClosed,
    SessionId,
)
from crossroads.types import Address
from tests.proto.natneg.test_server import (
    Client,
    Sent,
    ack,
    answer_erts,
    connected,
    connects,
    negotiate,
    replies,
    report,
    run_until,
    sent,
    tight,
)

#: The SDK test program's cookie (ref §3.1).
COOKIE = 666
HOST_IP = "198.51.100.10"


def targets_for(out: list[tuple[object, Address, object]], ip: str) -> set[Address]:
    return {
        (c.remote_ip, c.remote_port)  # type: ignore[attr-defined]
        for c, addr, _ in out
        if addr[0] == ip
    }


def sent_to(out: list[tuple[object, Address, object]], ip: str) -> set[Address]:
    return {addr for _, addr, _ in out if addr[0] == ip}


def init_acks(out: Sent) -> list[Address]:
    return [addr for wire, addr, _ in out if isinstance(decode(wire), InitAck)]


# ------------------------------------------------------------------ restarts


def test_a_client_restarting_while_waiting_gets_its_connect_on_its_live_ports() -> None:
    """The real SDK client's capture: the host's first process (GP :56031, NN
    :44466) waits for a partner who never comes; its restart INITs from new
    sockets (GP :33250, NN :35895). The server merged the new INITs into the old
    record and sent the CONNECT to the dead ports; it must go to the live ones,
    and the guest must be told the live game socket."""
    core = NatNegServer(tight())
    old = Client(1, HOST_IP, version=4, gp_port=56031, nego_port=44466, cookie=COOKIE)
    old.send_inits(core, 0.0)
    answer_erts(core, sent(core, 0.0), 0.0)  # complete, waiting for its partner
    live = Client(1, HOST_IP, version=4, gp_port=33250, nego_port=35895, cookie=COOKIE)
    live.send_inits(core, 0.5)
    out = answer_erts(core, sent(core, 0.5), 0.5)
    assert init_acks(out) == [live.source(pt) for pt in live.port_types()]
    guest = Client(0, "203.0.113.20", version=4, cookie=COOKIE)
    guest.send_inits(core, 0.6)
    out = replies(core, 0.6)
    assert {c.finished for c, _, _ in out} == {Finished.NOERROR}
    assert sent_to(out, HOST_IP) == {live.source(pt) for pt in live.port_types()}
    assert targets_for(out, guest.ip) == {live.source(0)}
    assert targets_for(out, HOST_IP) == {guest.source(0)}
    # The old process's session ended as restarted; the live one negotiates.
    events = core.pop_events()
    assert (
        NegotiationFinished(SessionId(COOKIE, 1), Outcome.RESTARTED, False, 0.5, True)
        in events
    )
    assert SessionClosed(SessionId(COOKIE, 1), replaced=True) in events


def test_a_restart_keeping_its_game_socket_or_reordered_counts_its_gp_init() -> None:
    """A game that retries in-process keeps its game socket: the new attempt's GP
    INIT repeats the known mapping and only the NN INITs show the restart; the
    client never resends an ACKed INIT, so the GP INIT must count for the new
    record. And a new process's NN INITs may overtake its GP INIT."""
    for order in ([0, 1, 2, 3], [1, 2, 3, 0]):
        core = NatNegServer(tight())
        old = Client(
            1, HOST_IP, version=4, gp_port=56031, nego_port=44466, cookie=COOKIE
        )
        old.send_inits(core, 0.0)
        sent(core)
        kept_gp = order[0] == 0
        live = Client(
            1,
            HOST_IP,
            version=4,
            gp_port=56031 if kept_gp else 33250,
            nego_port=35895,
            cookie=COOKIE,
        )
        live.send_inits(core, 1.0, order)
        answer_erts(core, sent(core, 1.0), 1.0)
        guest = Client(0, "203.0.113.20", version=4, cookie=COOKIE)
        guest.send_inits(core, 1.1)
        out = replies(core, 1.1)
        assert sent_to(out, HOST_IP) == {live.source(pt) for pt in live.port_types()}
        assert targets_for(out, guest.ip) == {live.source(0)}


def test_a_waiting_partner_is_kept_when_the_other_client_restarts() -> None:
    """The guest is complete and waits; the host's first process sent only part of
    its INITs (the rest were lost) and is replaced by a new one: the guest's
    record stands (it will not send its INITs again) and the pair connects."""
    core = NatNegServer(tight())
    guest = Client(0, "203.0.113.20", version=4, cookie=COOKIE)
    guest.send_inits(core, 0.0)
    answer_erts(core, sent(core, 0.0), 0.0)
    old = Client(1, HOST_IP, version=4, gp_port=56031, nego_port=44466, cookie=COOKIE)
    old.send_inits(core, 0.1, [0, 1])
    sent(core)
    live = Client(1, HOST_IP, version=4, gp_port=33250, nego_port=35895, cookie=COOKIE)
    live.send_inits(core, 2.0)
    out = replies(core, 2.0)
    assert sent_to(out, HOST_IP) == {live.source(pt) for pt in live.port_types()}
    assert sent_to(out, guest.ip) == {guest.source(pt) for pt in guest.port_types()}
    assert targets_for(out, guest.ip) == {live.source(0)}
    assert core.stats.dropped == {}


def test_a_late_init_of_the_replaced_process_does_not_take_its_record_back() -> None:
    core = NatNegServer(tight())
    old = Client(1, HOST_IP, version=4, gp_port=56031, nego_port=44466, cookie=COOKIE)
    old.send_inits(core, 0.0)
    sent(core)
    live = Client(1, HOST_IP, version=4, gp_port=33250, nego_port=35895, cookie=COOKIE)
    live.send_inits(core, 0.5)
    answer_erts(core, sent(core, 0.5), 0.5)
    old.send_inits(core, 0.6, [3])  # a resend of the dead process, reordered
    assert init_acks(sent(core, 0.6)) == [old.source(3)]
    guest = Client(0, "203.0.113.20", version=4, cookie=COOKIE)
    guest.send_inits(core, 0.7)
    out = replies(core, 0.7)
    assert sent_to(out, HOST_IP) == {live.source(pt) for pt in live.port_types()}


# ------------------------------------------------------------------ linger


def test_a_new_pair_on_a_finished_sessions_cookie_negotiates_at_once() -> None:
    """For the linger of a DONE session, another pair's INITs on
    the cookie were dropped as third-client and that pair ran into the SDK's INIT
    timeout. They start a new session at once; the old pair's late duplicates
    (INITs, CONNECT_ACKs, REPORT) are still the old session's."""
    core = NatNegServer(tight())  # linger 4
    a = Client(0, "198.51.100.1", cookie=COOKIE)
    b = Client(1, "203.0.113.7", cookie=COOKIE)
    connected(core, a, b)  # DONE at 0.1, lingers until 4.1
    c = Client(0, "192.0.2.30", cookie=COOKIE)
    d = Client(1, "192.0.2.40", cookie=COOKIE, nego_port=41000)
    out = negotiate(core, c, d, now=0.5)
    assert core.stats.dropped == {}
    assert sent_to(out, c.ip) == {c.source(pt) for pt in c.port_types()}
    assert sent_to(out, d.ip) == {d.source(pt) for pt in d.port_types()}
    assert targets_for(out, c.ip) == {d.source(0)}
    # The old pair's late duplicates: answered, and counted for the old session.
    a.send_inits(core, 0.6, [2])
    assert init_acks(sent(core, 0.6)) == [a.source(2)]
    ack(core, b, 0.6)
    report(core, a, success=True, nat_type=NatType.UNKNOWN, now=0.7)
    assert core.stats.dropped == {}
    ack(core, c, 0.8)
    ack(core, d, 0.8)
    report(core, d, success=True, nat_type=NatType.UNKNOWN, now=0.9)
    run_until(core, 10.0)
    second = SessionId(COOKIE, 2)
    assert [e for e in core.pop_events() if not hasattr(e, "client_index")] == [
        NegotiationFinished(SessionId(COOKIE, 1), Outcome.CONNECTED, False, 0.7, True),
        NegotiationFinished(second, Outcome.CONNECTED, False, 0.4, True),
        # The old pair may be playing through its relay: an ordinary end.
        SessionClosed(SessionId(COOKIE, 1), replaced=False),
        SessionClosed(second, replaced=False),
    ]
    assert core.session_count == 0


def test_a_late_partner_after_a_deadbeat_starts_a_new_session() -> None:
    """The host waited in vain and was told its partner never came (FAILING);
    a client arriving now starts a new negotiation rather than being told the
    same, and the host's retry (new sockets) meets it."""
    core = NatNegServer(tight())  # session_timeout 5
    host = Client(1, HOST_IP, cookie=COOKIE)
    host.send_inits(core, 0.0)
    sent(core)
    run_until(core, 5.5)  # deadbeat CONNECTs from 5.0, one more at 6.0
    guest = Client(0, "203.0.113.20", cookie=COOKIE)
    guest.send_inits(core, 5.5)
    assert connects(answer_erts(core, sent(core, 5.5), 5.5)) == []
    retry = Client(1, HOST_IP, cookie=COOKIE, gp_port=33250, nego_port=35895)
    retry.send_inits(core, 5.8)
    out = replies(core, 5.8)
    assert {c.finished for c, _, _ in out} == {Finished.NOERROR}
    assert sent_to(out, HOST_IP) == {retry.source(pt) for pt in retry.port_types()}
    assert targets_for(out, guest.ip) == {retry.source(0)}


def test_a_third_client_is_refused_while_the_pair_negotiates() -> None:
    core = NatNegServer(tight())
    a = Client(0, "198.51.100.1", cookie=COOKIE)
    b = Client(1, "203.0.113.7", cookie=COOKIE)
    assert len(negotiate(core, a, b)) == 8  # CONNECTING: no ACK yet
    intruder = Client(0, "192.0.2.50", cookie=COOKIE)
    intruder.send_inits(core, 0.2)
    assert sent(core, 0.2) == []
    assert core.stats.dropped == {"third-client": 4}
    ack(core, a, 0.3)
    ack(core, b, 0.3)
    # Done now: the same newcomer starts a session of its own.
    intruder.send_inits(core, 0.4)
    assert init_acks(sent(core, 0.4)) == [
        intruder.source(pt) for pt in intruder.port_types()
    ]
    assert core.stats.dropped == {"third-client": 4}


def test_a_late_init_of_the_same_attempt_after_the_session_gave_up_is_no_restart() -> (
    None
):
    """The guest's NN3 was held up; the session gave up (init timeout). When the
    NN3 INIT arrives at last, from the socket its NN1 INIT came from, it belongs
    to that attempt: ACKed, and the cookie is not taken by a new session."""
    core = NatNegServer(tight())
    host = Client(1, HOST_IP, cookie=COOKIE)
    guest = Client(0, "203.0.113.20", cookie=COOKIE)
    host.send_inits(core, 0.0)
    guest.send_inits(core, 0.0, [0, 1, 2])
    sent(core)
    run_until(core, 5.5)
    core.pop_events()
    guest.send_inits(core, 5.6, [3])
    assert init_acks(sent(core, 5.6)) == [guest.source(3)]
    assert core.session_count == 1
    assert not [e for e in core.pop_events() if isinstance(e, SessionClosed)]


# ------------------------------------------------------------------ a dead waiter


def erts_to(out: Sent, addrs: set[Address], now: float, core: NatNegServer) -> Sent:
    """Answer, at ``now``, the ERT_TESTs in ``out`` sent to ``addrs`` (the live
    sockets; a dead process answers nothing); return what the server sends."""
    for wire, addr, endpoint in out:
        if addr in addrs and isinstance(decode(wire), ErtTest):
            core.receive_datagram(wire[:7] + b"\x03" + wire[8:21], addr, now, endpoint)
    return core.datagrams_to_send(now)


def test_a_partner_nearer_than_the_restart_never_gets_the_dead_hosts_ports() -> None:
    """The back-to-back matrix's last differing cell. The host's first process
    waited alone on cookie 666 (its partner could not reach the server) and was
    stopped: its record stays, complete and silent. In the next game the
    partner, 22 ms from the server, arrives before the new host process, 74 ms
    away: it completed the pair with the dead record, the CONNECTs left after
    its round trip, a few ms before the restart's INITs, and it pinged dead
    ports for 6.4 s. The silent record must be asked first (one ERT), so the
    restart replaces it and the CONNECTs name the live sockets only."""
    core = NatNegServer(tight(session_timeout=30.0))
    old = Client(1, HOST_IP, version=4, gp_port=56031, nego_port=44466, cookie=COOKIE)
    old.send_inits(core, 0.0)
    erts_to(sent(core, 0.0), {old.source(1)}, 0.148, core)  # rtt 148 ms
    # ~6.5 s later the old process is stopped; 0.5 s after that the next game:
    guest = Client(0, "203.0.113.20", version=4, cookie=COOKIE)
    guest.send_inits(core, 7.0)
    out = sent(core, 7.0)
    live = Client(1, HOST_IP, version=4, gp_port=33250, nego_port=35895, cookie=COOKIE)
    live_addrs = {live.source(pt) for pt in live.port_types()}
    out += erts_to(out, {guest.source(1)}, 7.044, core)  # the guest's rtt: 44 ms
    out += run_until(core, 7.052)
    live.send_inits(core, 7.052)  # 52 ms after the guest: 74 - 22 ms
    step = sent(core, 7.052)
    out += step + erts_to(step, {live.source(1)}, 7.2, core)
    out += run_until(core, 9.0)
    dead = {old.source(pt) for pt in old.port_types()}
    connect_list = connects(out)
    assert connect_list
    assert not {addr for _, addr, _ in connect_list} & dead
    assert {addr for _, addr, _ in connect_list if addr[0] == HOST_IP} == live_addrs
    assert targets_for(connect_list, guest.ip) == {live.source(0)}
    assert targets_for(connect_list, HOST_IP) == {guest.source(0)}
    assert {c.finished for c, _, _ in connect_list} == {Finished.NOERROR}
    assert core.stats.liveness == {"asked": 1, "replaced": 1}


def test_a_dead_waiter_is_dropped_and_its_partner_waits_for_the_next_one() -> None:
    """No restart comes in time: the unanswered liveness ERT drops the dead
    record (outcome ``gone``) instead of sending its partner to dead ports; the
    partner waits in a new session with a fresh timeout, and a host arriving
    later pairs with it."""
    core = NatNegServer(tight())  # session_timeout 5
    old = Client(1, HOST_IP, version=4, gp_port=56031, nego_port=44466, cookie=COOKIE)
    old.send_inits(core, 0.0)
    erts_to(sent(core, 0.0), {old.source(1)}, 0.1, core)
    guest = Client(0, "203.0.113.20", version=4, cookie=COOKIE)
    guest.send_inits(core, 3.0)
    out = sent(core, 3.0)
    assert [addr for wire, addr, _ in out if isinstance(decode(wire), ErtTest)] == [
        guest.source(1),
        old.source(1),  # the liveness ERT to the silent record's negotiate socket
    ]
    out += erts_to(out, {guest.source(1)}, 3.02, core)
    out += run_until(core, 3.5)  # the old rtt (0.1) + probe_grace (0.1) passed
    assert connects(out) == []
    events = core.pop_events()
    assert (
        NegotiationFinished(SessionId(COOKIE, 1), Outcome.GONE, False, 3.2, True)
        in events
    )
    assert core.stats.liveness == {"asked": 1, "gone": 1}
    # The old session's timeout (at 5.0) no longer ends the partner's wait.
    assert connects(run_until(core, 7.0)) == []
    late = Client(1, HOST_IP, version=4, gp_port=33250, nego_port=35895, cookie=COOKIE)
    late.send_inits(core, 7.5)
    out = connects(answer_erts(core, sent(core, 7.5), 7.5) + run_until(core, 8.5))
    assert targets_for(out, guest.ip) == {late.source(0)}
    assert sent_to(out, HOST_IP) == {late.source(pt) for pt in late.port_types()}


def test_a_live_waiter_answers_and_the_pair_is_made() -> None:
    """A host that really waited (3 s) answers the liveness ERT: the pair is
    made with its record, no later than its answer. A host heard within
    ``stale_after`` is not asked (no datagram more, no wait), nor is one that
    never answered an ERT (no answer would prove nothing: as before)."""
    core = NatNegServer(tight())
    host = Client(1, HOST_IP, version=4, cookie=COOKIE)
    host.send_inits(core, 0.0)
    answer_erts(core, sent(core, 0.0), 0.1)
    guest = Client(0, "203.0.113.20", version=4, cookie=COOKIE)
    guest.send_inits(core, 3.0)
    out = connects(answer_erts(core, sent(core, 3.0), 3.1))
    out += connects(run_until(core, 3.5))
    assert targets_for(out, guest.ip) == {host.source(0)}
    assert targets_for(out, HOST_IP) == {guest.source(0)}
    assert core.stats.liveness == {"asked": 1, "alive": 1}

    for silent_ert, late in ((False, 0.45), (True, 3.0)):
        core = NatNegServer(tight())
        host.send_inits(core, 0.0)
        first = sent(core, 0.0)
        if not silent_ert:
            answer_erts(core, first, 0.1)
        guest.send_inits(core, late)
        out = sent(core, late)
        erts = [addr for wire, addr, _ in out if isinstance(decode(wire), ErtTest)]
        assert erts == [guest.source(1)]
        out += answer_erts(core, out, late + 0.05)
        out += run_until(core, late + 1.0)
        assert targets_for(connects(out), guest.ip) == {host.source(0)}
        assert core.stats.liveness == {}
