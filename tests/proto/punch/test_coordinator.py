"""The signalling core with a fake clock: punch timing, limits, mesh sessions."""

from __future__ import annotations

import base64
import itertools
import json
from typing import Any

import pytest

from crossroads.insight import InsightRecorder
from crossroads.proto.punch import signalling as sig
from crossroads.proto.punch.coordinator import (
    FRAME_BURST,
    MAX_STRIKES,
    PHASE_TIMEOUT,
    CodeClaim,
    CodeLookup,
    CodeReleased,
    Coordinator,
    CoordinatorConfig,
    FrameRejected,
    LadderConcluded,
)
from crossroads.proto.punch.rendezvous import Observed, Probe
from crossroads.services.p2p import ladder_record

UDP = (
    sig.TransportAddress("192.0.2.1", 3480),
    sig.TransportAddress("192.0.2.1", 3481),
    sig.TransportAddress("192.0.2.1", 3482),
)


class Rng:
    def __init__(self) -> None:
        self.counter = itertools.count(1)

    def __call__(self, n: int) -> bytes:
        return next(self.counter).to_bytes(n, "big")


class Harness:
    def __init__(self, *, directory: bool = False, **config: Any) -> None:
        self.core = Coordinator(
            CoordinatorConfig(udp=UDP, **config), Rng(), directory=directory
        )
        self.now = 1000.0
        self.conns = itertools.count(1)
        self.inbox: dict[int, list[dict[str, Any]]] = {}
        self.closed: dict[int, int] = {}
        self.auto_pong = False

    def pump(self) -> None:
        for conn, text in self.core.data_to_send():
            frame = json.loads(text)
            if self.auto_pong and frame["type"] == "ping":
                self.core.receive_data(
                    conn, sig.encode(sig.Pong(frame["id"])), self.now
                )
                continue
            self.inbox.setdefault(conn, []).append(frame)
        for conn, code, _ in self.core.connections_to_close():
            self.closed[conn] = code

    def connect(self, ip: str = "198.51.100.7") -> int:
        conn = next(self.conns)
        self.core.connection_made(conn, ip, self.now)
        self.pump()
        return conn

    def send(self, conn: int, message: sig.Message | str) -> None:
        text = message if isinstance(message, str) else sig.encode(message)
        self.core.receive_data(conn, text, self.now)
        self.pump()

    def take(self, conn: int, kind: str | None = None) -> list[dict[str, Any]]:
        frames = self.inbox.pop(conn, [])
        return [f for f in frames if kind is None or f["type"] == kind]

    def advance(self, seconds: float) -> None:
        self.now += seconds
        timer = self.core.get_timer()
        while timer is not None and timer <= self.now:
            self.core.handle_timer(timer)
            self.pump()
            timer = self.core.get_timer()
            if (
                timer is not None
                and timer <= self.now
                and timer == self.core.get_timer()
            ):
                self.core.handle_timer(self.now)
                self.pump()
                break

    def peer(
        self,
        ip: str = "198.51.100.7",
        rtt: float | None = 0.05,
        ports: tuple[int, ...] = (40000, 40000, 40000),
    ) -> tuple[int, str, bytes]:
        conn = self.connect(ip)
        key = bytes([conn]) * 32
        self.send(conn, sig.Hello(1, key, f"p{conn}"))
        frames = self.take(conn)
        welcome = next(f for f in frames if f["type"] == "welcome")
        ping = next(f for f in frames if f["type"] == "ping")
        if rtt is not None:
            self.now += rtt
            self.send(conn, sig.Pong(ping["id"]))
        token = bytes.fromhex(welcome["token"])
        for index, port in enumerate(ports):
            reply = self.core.receive_rendezvous(
                Probe(token, 0, index).encode(), (ip, port), index, self.now
            )
            assert reply is not None
            assert Observed.decode(reply).port == port
        return conn, welcome["peer"], token


def session_of_two(h: Harness, **kw: Any) -> tuple[int, str, int, str, str]:
    a, pa, _ = h.peer("198.51.100.7", **kw)
    b, pb, _ = h.peer("203.0.113.9", **({"rtt": 0.05} | kw))
    h.send(a, sig.Host())
    hosted = h.take(a, "hosted")[0]
    h.send(b, sig.Join(hosted["code"]))
    assert h.take(b, "join_start")
    return a, pa, b, pb, hosted["session"]


def test_hello_gives_welcome_with_rendezvous_ports() -> None:
    h = Harness()
    conn = h.connect()
    h.send(conn, sig.Hello(1, bytes(range(32))))
    frames = h.take(conn)
    assert frames[0]["type"] == "welcome" and frames[0]["ip"] == "198.51.100.7"
    assert frames[0]["udp"] == [e.to_json() for e in UDP]
    assert frames[1]["type"] == "ping"


def test_first_frame_must_be_hello() -> None:
    h = Harness()
    conn = h.connect()
    h.send(conn, sig.Connect("x"))
    assert h.take(conn)[0]["code"] == "hello_required"


def test_unsupported_version_closes() -> None:
    h = Harness()
    conn = h.connect()
    h.send(conn, sig.Hello(2, bytes(range(32))))
    assert h.take(conn)[0]["code"] == "unsupported_version"
    assert h.closed[conn] == 1002


def punch(
    h: Harness, a: int, pa: str, b: int, pb: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    h.send(a, sig.Connect(pb))
    prep_a, prep_b = h.take(a, "punch_prepare"), h.take(b, "punch_prepare")
    assert prep_a[0]["peer"] == pb and prep_b[0]["peer"] == pa
    attempt = prep_a[0]["attempt"]
    h.send(
        a,
        sig.PunchReady(
            attempt, sig.Candidates((sig.TransportAddress("10.0.0.2", 5000),))
        ),
    )
    h.send(b, sig.PunchReady(attempt, sig.Candidates()))
    return h.take(a, "punch_start")[0], h.take(b, "punch_start")[0]


def test_start_time_is_four_times_the_larger_rtt_minus_half_own_rtt() -> None:
    h = Harness()
    a, pa, _ = h.peer("198.51.100.7", rtt=0.2)
    b, pb, _ = h.peer("203.0.113.9", rtt=0.05)
    h.send(a, sig.Host())
    h.send(b, sig.Join(h.take(a, "hosted")[0]["code"]))
    start_a, start_b = punch(h, a, pa, b, pb)
    # RTT 0.2 and 0.05: t_go = now + 4 * 0.2 = 800 ms; each side starts half its
    # own RTT earlier because the frame is that long on the way.
    assert start_a["delay_ms"] == 800 - 100
    assert start_b["delay_ms"] == 800 - 25
    assert start_a["role"] == "initiator" and start_b["role"] == "responder"
    assert start_a["them"]["public"] == ["203.0.113.9", 40000]
    assert start_b["them"]["candidates"]["local"] == [["10.0.0.2", 5000]]
    assert start_a["you"]["mapping"] == "independent"
    assert base64.b64decode(start_a["key"]) == bytes([b]) * 32


def test_start_time_has_a_100_ms_floor() -> None:
    h = Harness()
    a, pa, b, pb, _ = session_of_two(h, rtt=0.001)
    start_a, _ = punch(h, a, pa, b, pb)
    assert 99 <= start_a["delay_ms"] <= 100


def test_unknown_rtt_waits_1500_ms() -> None:
    h = Harness()
    a, pa, b, pb, _ = session_of_two(h, rtt=None)
    start_a, _ = punch(h, a, pa, b, pb)
    assert start_a["delay_ms"] == 1500


def test_sequential_mapping_is_reported_with_stride() -> None:
    h = Harness()
    a, pa, _ = h.peer("198.51.100.7", ports=(50000, 50002, 50004))
    b, pb, _ = h.peer("203.0.113.9")
    h.send(a, sig.Host())
    h.send(b, sig.Join(h.take(a, "hosted")[0]["code"]))
    start_a, start_b = punch(h, a, pa, b, pb)
    assert start_b["them"]["mapping"] == "sequential" and start_b["them"]["stride"] == 2
    assert start_b["them"]["ports"] == [50000, 50002, 50004]


def test_unresponsive_peer_times_out_after_ten_seconds() -> None:
    h = Harness()
    a, pa, b, pb, _ = session_of_two(h)
    h.send(a, sig.Connect(pb))
    attempt = h.take(a, "punch_prepare")[0]["attempt"]
    h.send(a, sig.PunchReady(attempt, sig.Candidates()))
    h.advance(PHASE_TIMEOUT - 0.5)
    assert not h.take(a, "punch_failed")
    h.advance(1.0)
    assert h.take(a, "punch_failed")[0]["reason"] == "target_unresponsive"
    assert h.take(b, "punch_failed")[0]["reason"] == "target_unresponsive"
    assert h.core.attempt_count == 0


def test_repeated_request_is_already_in_progress_either_direction() -> None:
    h = Harness()
    a, pa, b, pb, _ = session_of_two(h)
    h.send(a, sig.Connect(pb))
    h.send(b, sig.Connect(pa))
    assert h.take(b, "punch_failed")[0]["reason"] == "already_in_progress"


def test_unknown_target_and_self_are_not_connected() -> None:
    h = Harness()
    a, pa, _ = h.peer()
    h.send(a, sig.Connect("nobody"))
    h.send(a, sig.Connect(pa))
    reasons = [f["reason"] for f in h.take(a, "punch_failed")]
    assert reasons == ["target_not_connected", "target_not_connected"]


def test_strangers_may_not_punch_or_signal() -> None:
    h = Harness()
    a, _, _ = h.peer()
    b, pb, _ = h.peer()
    h.send(a, sig.Connect(pb))
    h.send(a, sig.Signal(pb, "hi"))
    assert [f["code"] for f in h.take(a, "error")] == ["not_permitted", "not_permitted"]
    assert not h.take(b)


def test_disconnect_during_preparation_is_connection_lost() -> None:
    h = Harness()
    a, pa, b, pb, _ = session_of_two(h)
    h.send(a, sig.Connect(pb))
    h.core.connection_lost(b, h.now)
    h.pump()
    assert h.take(a, "punch_failed")[0]["reason"] == "connection_lost"


def test_attempts_queue_one_per_peer_and_follow_results() -> None:
    h = Harness()
    a, pa, b, pb, session = session_of_two(h)
    h.send(b, sig.JoinResult(session, (pa,)))
    h.send(a, sig.JoinAnswer(session, pb, True))
    c, pc, _ = h.peer("192.0.2.50")
    code = next(iter(h.core._codes))
    h.send(c, sig.Join(code))
    h.take(c)
    h.send(c, sig.Connect(pa))
    h.send(c, sig.Connect(pb))
    prepared = h.take(c, "punch_prepare")
    assert [f["peer"] for f in prepared] == [pa]  # one at a time
    attempt = prepared[0]["attempt"]
    h.send(c, sig.PunchReady(attempt, sig.Candidates()))
    h.send(a, sig.PunchReady(attempt, sig.Candidates()))
    assert h.take(c, "punch_start")
    h.send(c, sig.PunchResult(attempt, True, "punch", 120))
    assert [f["peer"] for f in h.take(c, "punch_prepare")] == [pb]


def test_rendezvous_ignores_unknown_tokens_and_garbage() -> None:
    h = Harness()
    assert h.core.receive_rendezvous(b"junk", ("192.0.2.9", 1), 0, h.now) is None
    assert (
        h.core.receive_rendezvous(
            Probe(bytes(16), 0, 0).encode(), ("192.0.2.9", 1), 0, h.now
        )
        is None
    )
    reasons = {e.reason for e in h.core.pop_events() if hasattr(e, "reason")}
    assert reasons == {"size", "unknown-token"}


def test_rendezvous_is_rate_limited_per_peer() -> None:
    h = Harness()
    _, _, token = h.peer()
    answers = [
        h.core.receive_rendezvous(
            Probe(token, 0, i).encode(), ("198.51.100.7", 1), 0, h.now
        )
        for i in range(100)
    ]
    assert 20 <= sum(a is not None for a in answers) <= 40


def test_bad_frames_get_errors_then_the_connection_is_closed() -> None:
    h = Harness()
    conn, _, _ = h.peer()
    for _ in range(MAX_STRIKES):
        h.now += 1
        h.send(conn, "{nonsense")
    errors = h.take(conn, "error")
    assert errors[0]["code"] == "bad_json" and len(errors) == MAX_STRIKES
    assert h.closed[conn] == 1008


def test_flood_is_rate_limited_with_one_error_per_second() -> None:
    h = Harness()
    conn, _, _ = h.peer()
    h.take(conn)
    for i in range(int(FRAME_BURST) + 40):
        h.send(conn, sig.Ping(i))
    frames = h.take(conn)
    assert sum(f["type"] == "pong" for f in frames) <= FRAME_BURST + 1
    assert sum(f.get("code") == "rate_limited" for f in frames) == 1
    assert FrameRejected("rate-limited") in h.core.pop_events()


def test_connection_limits() -> None:
    h = Harness(max_connections_per_ip=2, max_connections=3)
    h.connect("192.0.2.1")
    h.connect("192.0.2.1")
    third = h.connect("192.0.2.1")
    assert h.closed[third] == 1013
    h.connect("192.0.2.2")
    fifth = h.connect("192.0.2.3")
    assert h.closed[fifth] == 1013


def test_verified_join_then_accept_then_host_migration() -> None:
    h = Harness()
    a, pa, b, pb, session = session_of_two(h)
    h.send(b, sig.JoinResult(session, (pa,)))
    capable = h.take(a, "join_capable")[0]
    assert capable["peer"] == pb
    h.send(a, sig.JoinAnswer(session, pb, True))
    accepted = h.take(b, "join_accepted")[0]
    assert accepted["seniority"] == 1 and accepted["host"] == pa
    assert h.take(a, "member_joined")[0]["member"]["peer"] == pb
    c, pc, _ = h.peer("192.0.2.77")
    h.send(c, sig.Join(next(iter(h.core._codes)).lower().replace("-", "")))
    members = h.take(c, "join_start")[0]["members"]
    assert [m["peer"] for m in members] == [pa, pb]
    h.send(c, sig.JoinResult(session, (pa, pb)))
    h.send(a, sig.JoinAnswer(session, pc, True))
    assert h.take(c, "join_accepted")[0]["seniority"] == 2
    # the host leaves: the next by seniority is host, everyone is told
    h.core.connection_lost(a, h.now)
    h.pump()
    for conn in (b, c):
        left = [f for f in h.take(conn) if f["type"] == "member_left"]
        assert left == [
            {"type": "member_left", "session": session, "peer": pa, "host": pb}
        ]
    assert h.core.session_members(session) == [pb, pc]


def test_join_result_with_missing_member_repeats_join_start() -> None:
    h = Harness()
    a, pa, b, pb, session = session_of_two(h)
    h.send(b, sig.JoinResult(session, ()))
    assert h.take(b, "join_start")
    assert not h.take(a, "join_capable")


def test_failed_join_and_rejection() -> None:
    h = Harness()
    a, pa, b, pb, session = session_of_two(h)
    h.send(b, sig.JoinResult(session, (), (pa,)))
    assert "could not reach" in h.take(b, "join_rejected")[0]["reason"]
    h.send(b, sig.Join(next(iter(h.core._codes))))
    h.take(b)
    h.send(b, sig.JoinResult(session, (pa,)))
    h.send(b, sig.JoinAnswer(session, pb, True))  # not the host
    assert h.take(b, "error")[0]["code"] == "not_host"
    h.send(a, sig.JoinAnswer(session, pb, False, "game is locked"))
    assert h.take(b, "join_rejected")[0]["reason"] == "game is locked"


def test_capable_join_moves_to_the_new_host() -> None:
    h = Harness()
    a, pa, b, pb, session = session_of_two(h)
    h.send(b, sig.JoinResult(session, (pa,)))
    h.send(a, sig.JoinAnswer(session, pb, True))
    c, pc, _ = h.peer("192.0.2.77")
    h.send(c, sig.Join(next(iter(h.core._codes))))
    h.send(c, sig.JoinResult(session, (pa, pb)))
    assert h.take(a, "join_capable")
    h.core.connection_lost(a, h.now)
    h.pump()
    assert h.take(b, "join_capable")[0]["peer"] == pc


def test_join_errors() -> None:
    h = Harness()
    a, pa, _ = h.peer()
    h.send(a, sig.Join("ZZZZ-ZZZZ"))
    assert h.take(a, "error")[0]["code"] == "unknown_code"
    h.send(a, sig.Host(max_members=2))
    code = h.take(a, "hosted")[0]["code"]
    h.send(a, sig.Join(code))
    b, _, _ = h.peer()
    c, _, _ = h.peer()
    h.send(b, sig.Join(code))
    h.send(c, sig.Join(code))
    assert [f["code"] for f in h.take(a, "error")] == ["already_member"]
    assert h.take(c, "error")[0]["code"] == "session_full"


def test_join_times_out() -> None:
    h = Harness()
    _, _, b, _, _ = session_of_two(h)
    h.auto_pong = True
    for _ in range(40):
        h.advance(5)
    assert h.take(b, "join_rejected")[0]["reason"] == "join timed out"


def test_signal_between_members() -> None:
    h = Harness()
    a, pa, b, pb, _ = session_of_two(h)
    h.send(b, sig.Signal(pa, {"chat": "hi"}))
    assert h.take(a, "signal") == [
        {"type": "signal", "from": pb, "data": {"chat": "hi"}}
    ]


def test_dead_connection_is_closed_after_missed_pings() -> None:
    h = Harness()
    conn, _, _ = h.peer(rtt=None)
    h.advance(35)
    assert h.closed.get(conn) == 1008
    assert h.core.peer_count == 0


def test_last_member_leaving_frees_the_code() -> None:
    h = Harness()
    a, _, _ = h.peer()
    h.send(a, sig.Host())
    session = h.take(a, "hosted")[0]["session"]
    h.send(a, sig.Leave(session))
    assert h.core.session_count == 0 and not h.core._codes


def test_relay_route_only_between_related_peers() -> None:
    h = Harness()
    a, pa, b, pb, _ = session_of_two(h)
    c, pc, _ = h.peer()
    frame = b"\x01" + bytes.fromhex(pb) + b"sealed"
    target, out = h.core.relay_route(a, frame, h.now) or (0, b"")
    assert target == b and out == b"\x01" + bytes.fromhex(pa) + b"sealed"
    assert h.core.relay_route(c, b"\x01" + bytes.fromhex(pb) + b"x", h.now) is None
    assert h.core.relay_route(a, b"\x01short", h.now) is None
    big = b"\x01" + bytes.fromhex(pb) + bytes(1400)
    sent = sum(h.core.relay_route(a, big, h.now) is not None for _ in range(200))
    assert 40 <= sent <= 50  # 64 KiB burst


def test_mapped_candidate_must_be_on_the_public_address() -> None:
    h = Harness()
    a, pa, b, pb, _ = session_of_two(h)
    h.send(a, sig.Connect(pb))
    attempt = h.take(a, "punch_prepare")[0]["attempt"]
    h.take(b)
    good = sig.Candidates(mapped=sig.TransportAddress("198.51.100.7", 5000))
    bad = sig.Candidates(mapped=sig.TransportAddress("192.0.2.200", 53))
    h.send(a, sig.PunchReady(attempt, good))
    h.send(b, sig.PunchReady(attempt, bad))
    start_a = h.take(a, "punch_start")[0]
    start_b = h.take(b, "punch_start")[0]
    assert start_b["them"]["candidates"]["mapped"] == ["198.51.100.7", 5000]
    assert start_a["them"]["candidates"]["mapped"] is None


# ------------------------------------------------- directory mode (scale-out)


def directory_events(h: Harness) -> list[object]:
    return [
        e
        for e in h.core.pop_events()
        if isinstance(e, CodeClaim | CodeLookup | CodeReleased)
    ]


def test_directory_claims_the_code_before_hosted() -> None:
    h = Harness(directory=True)
    a, pa, _ = h.peer()
    h.send(a, sig.Host())
    assert h.take(a, "hosted") == []
    [claim] = directory_events(h)
    assert isinstance(claim, CodeClaim)
    # Another instance holds that code: the session draws another one.
    h.core.code_claimed(claim.session, ok=False)
    [again] = directory_events(h)
    assert isinstance(again, CodeClaim) and again.session == claim.session
    assert again.code != claim.code
    assert h.core.live_codes() == []
    h.core.code_claimed(claim.session, ok=True)
    h.pump()
    [hosted] = h.take(a, "hosted")
    assert hosted["code"] == again.code and hosted["session"] == claim.session
    assert h.core.live_codes() == [again.code]
    # A late or repeated answer changes nothing.
    h.core.code_claimed(claim.session, ok=False)
    h.core.code_claimed("no-such-session", ok=True)
    h.pump()
    assert h.take(a) == [] and h.core.live_codes() == [again.code]
    # The last member leaving releases the claim.
    h.send(a, sig.Leave(claim.session))
    assert directory_events(h) == [CodeReleased(again.code)]
    assert h.core.live_codes() == []


def test_directory_host_leaving_before_the_claim_answer() -> None:
    h = Harness(directory=True)
    a, _, _ = h.peer()
    h.send(a, sig.Host())
    [claim] = directory_events(h)
    h.core.connection_lost(a, h.now)
    assert directory_events(h) == [CodeReleased(claim.code)]  # type: ignore[attr-defined]
    h.core.code_claimed(claim.session, ok=True)  # type: ignore[attr-defined]
    h.pump()
    assert h.core.session_count == 0 and h.core.live_codes() == []


def test_directory_redirects_joins_for_codes_held_elsewhere() -> None:
    h = Harness(directory=True)
    b, pb, _ = h.peer()
    h.send(b, sig.Join("k7qm3xzp"))
    assert h.take(b) == []
    assert directory_events(h) == [CodeLookup(pb, "K7QM-3XZP")]
    h.core.code_located(pb, "K7QM-3XZP", "ws://192.0.2.8:8080/p2p/v1/ws")
    h.pump()
    assert h.take(b) == [
        {
            "type": "redirect",
            "code": "K7QM-3XZP",
            "url": "ws://192.0.2.8:8080/p2p/v1/ws",
        }
    ]
    # Held nowhere: the usual error.
    h.send(b, sig.Join("K7QM-3XZQ"))
    [lookup] = directory_events(h)
    h.core.code_located(pb, lookup.code, None)  # type: ignore[attr-defined]
    h.pump()
    [error] = h.take(b, "error")
    assert error["code"] == "unknown_code" and error["ref"] == "join"
    # Not code-shaped: no directory lookup at all.
    h.send(b, sig.Join("hello there"))
    assert directory_events(h) == []
    assert h.take(b, "error")[0]["code"] == "unknown_code"
    # The peer left before the answer: nothing to send.
    h.send(b, sig.Join("K7QM-3XZR"))
    h.core.connection_lost(b, h.now)
    h.core.code_located(pb, "K7QM-3XZR", "ws://x/p2p/v1/ws")
    h.pump()
    assert h.take(b) == []


def test_directory_local_codes_join_without_a_lookup() -> None:
    h = Harness(directory=True)
    a, _, _ = h.peer()
    b, _, _ = h.peer("203.0.113.9")
    h.send(a, sig.Host())
    [claim] = directory_events(h)
    # Not yet claimed: a join for it is not served from this instance either.
    h.send(b, sig.Join(claim.code))  # type: ignore[attr-defined]
    assert h.take(b, "error")[0]["code"] == "unknown_code"
    h.core.code_claimed(claim.session, ok=True)  # type: ignore[attr-defined]
    h.pump()
    h.send(b, sig.Join(claim.code))  # type: ignore[attr-defined]
    assert h.take(b, "join_start")
    assert directory_events(h) == []


def concluded(h: Harness) -> list[LadderConcluded]:
    return [e for e in h.core.pop_events() if isinstance(e, LadderConcluded)]


def test_a_concluded_attempt_carries_both_results_and_what_the_server_saw() -> None:
    h = Harness()
    a, pa, b, pb, _ = session_of_two(h, rtt=0.2)
    start_a, _ = punch(h, a, pa, b, pb)
    h.now += 1.0
    h.send(a, sig.PunchResult(start_a["attempt"], True, "relay", 900))
    assert concluded(h) == []  # one side has not reported yet
    h.send(b, sig.PunchResult(start_a["attempt"], True, "relay", 950))
    [event] = concluded(h)
    assert event.reason == ""
    assert (event.initiator.host, event.initiator.mapping) == (
        "198.51.100.7",
        "independent",
    )
    assert event.initiator.result == (True, "relay", 900)
    assert event.responder.result == (True, "relay", 950)
    assert event.initiator.rtt == pytest.approx(0.2)
    # The insight record: the relay won, and why it took the relay.
    record = ladder_record(InsightRecorder(), event)
    assert (record.family, record.winner, record.outcome) == ("p2p", "relay", "relayed")
    assert record.cause == "punch failed (mappings independent/independent)"
    assert [(s.name, s.outcome) for s in record.steps] == [
        ("prepare", "ok"),
        ("initiator:relay", "ok"),
        ("responder:relay", "ok"),
    ]
    assert [s.nat for s in record.sides] == ["independent", "independent"]


def test_a_side_leaving_concludes_the_attempt_as_connection_lost() -> None:
    h = Harness()
    a, pa, b, pb, _ = session_of_two(h)
    start_a, _ = punch(h, a, pa, b, pb)
    h.send(a, sig.PunchResult(start_a["attempt"], True, "punch", 300))
    h.core.connection_lost(b, h.now)
    h.pump()
    [event] = concluded(h)
    assert event.reason == "connection_lost"
    record = ladder_record(InsightRecorder(), event)
    assert (record.outcome, record.winner) == ("failed", "")
    assert record.cause.startswith("connection_lost")
    assert [(s.name, s.outcome) for s in record.steps][1:] == [
        ("initiator:punch", "ok"),
        ("responder", "unreported"),
    ]
