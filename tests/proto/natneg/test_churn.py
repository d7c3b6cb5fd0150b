"""The natneg core under churn: 2,000 negotiations (two clients, INIT on every
port, CONNECT_ACK, session ends) leave live-object counts where they started
(a guard: the core never leaked)."""

from __future__ import annotations

from crossroads.proto.natneg.server import NatNegServer
from tests.adversarial.turn_quota_support import grown, live_objects
from tests.proto.natneg.test_server import Client, ack, negotiate, run_until, tight

NEGOTIATIONS = 2_000


def test_negotiations_leave_object_counts_where_they_started() -> None:
    core = NatNegServer(tight())
    clock = [0.0]

    def negotiation(cookie: int) -> None:
        a = Client(0, "198.51.100.1", cookie=cookie)
        b = Client(1, "203.0.113.7", game_port=None, cookie=cookie)
        negotiate(core, a, b, clock[0])
        ack(core, a, clock[0])
        ack(core, b, clock[0])
        clock[0] += 1
        core.datagrams_to_send(clock[0])
        run_until(core, clock[0])
        core.pop_events()

    def settle() -> None:
        clock[0] += 100
        run_until(core, clock[0])
        core.pop_events()

    for cookie in range(100):
        negotiation(cookie)
    settle()
    before = live_objects()
    for cookie in range(100, 100 + NEGOTIATIONS):
        negotiation(cookie)
    settle()
    assert core.session_count == 0
    assert grown(before, live_objects()) == {}
