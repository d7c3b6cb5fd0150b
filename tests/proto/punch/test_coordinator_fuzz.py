"""Random conversations with the coordinator: it never raises, and when every
connection is gone nothing is left behind (no leaked peer, session or attempt)."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crossroads.proto.punch import signalling as sig
from crossroads.proto.punch.coordinator import (
    CodeClaim,
    CodeLookup,
    CodeReleased,
    Coordinator,
    CoordinatorConfig,
)
from crossroads.proto.punch.rendezvous import Probe

KEYS = [bytes([i + 1]) * 32 for i in range(4)]

# A step: (connection index 0..3, action, argument index 0..3, flag)
ACTIONS = st.sampled_from(
    [
        "hello",
        "host",
        "join",
        "connect",
        "ready",
        "result",
        "join_result",
        "answer",
        "leave",
        "signal",
        "ping",
        "pong",
        "garbage",
        "probe",
        "time",
        "lose",
        "relay",
    ]
)
STEPS = st.lists(
    st.tuples(st.integers(0, 3), ACTIONS, st.integers(0, 3), st.booleans()),
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@pytest.mark.parametrize("directory", [False, True], ids=["local", "directory"])
@given(steps=STEPS)
def test_random_conversations(
    directory: bool, steps: list[tuple[int, str, int, bool]]
) -> None:
    counter = itertools.count(1)
    core = Coordinator(
        CoordinatorConfig(),
        lambda n: next(counter).to_bytes(n, "big"),
        directory=directory,
    )
    # The directory's view: claims granted and not yet released. The first
    # claim of each session is refused (another instance holds that code).
    held: set[str] = set()
    refused: set[str] = set()
    now = 1000.0
    conns = {i: i + 1 for i in range(4)}
    for conn in conns.values():
        core.connection_made(conn, f"192.0.2.{conn}", now)
    peers: dict[int, str] = {}
    tokens: dict[int, bytes] = {}
    sessions: list[str] = []
    codes: list[str] = []
    attempts: list[int] = [1]
    pings: dict[int, int] = {}

    def pump() -> None:
        # Until quiet: answering the directory's events queues more frames.
        while True:
            frames, events = core.data_to_send(), core.pop_events()
            if not frames and not events:
                break
            for conn, text in frames:
                frame = json.loads(text)
                index = conn - 1
                match frame["type"]:
                    case "welcome":
                        peers[index] = frame["peer"]
                        tokens[index] = bytes.fromhex(frame["token"])
                    case "hosted":
                        sessions.append(frame["session"])
                        codes.append(frame["code"])
                    case "punch_prepare":
                        attempts.append(frame["attempt"])
                    case "ping":
                        pings[index] = frame["id"]
            core.connections_to_close()
            for event in events:
                match event:
                    case CodeClaim(session=claim_session, code=code):
                        ok = claim_session in refused
                        refused.add(claim_session)
                        if ok:
                            held.add(code)
                        core.code_claimed(claim_session, ok)
                    case CodeReleased(code=code):
                        held.discard(code)
                    case CodeLookup(peer=peer, code=code):
                        url = "ws://x/p2p/v1/ws" if held else None
                        core.code_located(peer, code, url)

    for index, action, arg, flag in steps:
        conn = conns[index]
        other = peers.get(arg, "nobody")
        session = sessions[arg % len(sessions)] if sessions else "none"
        message: sig.Message | str | None = None
        match action:
            case "hello":
                message = sig.Hello(1 if flag else 2, KEYS[index])
            case "host":
                message = sig.Host()
            case "join":
                message = sig.Join(codes[arg % len(codes)] if codes else "AAAA-AAAA")
            case "connect":
                message = sig.Connect(other)
            case "ready":
                message = sig.PunchReady(
                    attempts[-1 - arg % len(attempts)], sig.Candidates()
                )
            case "result":
                message = sig.PunchResult(
                    attempts[-1 - arg % len(attempts)], flag, "punch"
                )
            case "join_result":
                message = sig.JoinResult(session, tuple(peers.values()) if flag else ())
            case "answer":
                message = sig.JoinAnswer(session, other, flag)
            case "leave":
                message = sig.Leave(session)
            case "signal":
                message = sig.Signal(other, {"n": arg})
            case "ping":
                message = sig.Ping(arg)
            case "pong":
                message = sig.Pong(pings.get(index, 0))
            case "garbage":
                message = '{"type": "join", "code": 5}' if flag else "\x00{"
            case "probe":
                token = tokens.get(index, bytes(16))
                core.receive_rendezvous(
                    Probe(token, attempts[-1], arg).encode(),
                    (f"192.0.2.{conn}", 40000 + arg),
                    arg % 3,
                    now,
                )
            case "time":
                now += 3.0 if flag else 11.0
                core.handle_timer(now)
            case "lose":
                core.connection_lost(conn, now)
                peers.pop(index, None)
                conns[index] = max(conns.values()) + 1
                core.connection_made(conns[index], f"192.0.2.{index}", now)
            case "relay":
                core.relay_route(
                    conn,
                    b"\x01"
                    + bytes.fromhex(other if len(other) == 16 else "00" * 8)
                    + b"x",
                    now,
                )
        if message is not None:
            text = message if isinstance(message, str) else sig.encode(message)
            core.receive_data(conn, text, now)
        pump()
    for conn in list(conns.values()):
        core.connection_lost(conn, now)
    pump()
    core.handle_timer(now + 1000)
    assert core.peer_count == 0
    assert core.session_count == 0
    assert core.attempt_count == 0
    assert not core._conns and not core._per_ip and not core._tokens and not core._codes
    assert not held  # every claim granted was released
