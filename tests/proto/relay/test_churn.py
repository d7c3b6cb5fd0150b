"""The relay core under churn: 2,000 sessions (a host and a joiner bind,
connect, close) leave live-object counts where they started (a
guard: the core never leaked)."""

from __future__ import annotations

from crossroads.proto.relay.messages import Close
from crossroads.proto.relay.token import Role
from tests.adversarial.turn_quota_support import grown, live_objects
from tests.proto.relay.test_server import HOST_ADDR, J1_ADDR, Harness, connect, player

SESSIONS = 2_000


def test_unity_relay_sessions_leave_object_counts_where_they_started() -> None:
    # The ended allocations' replay records go after their bind deadline.
    harness = Harness()

    def session() -> None:
        host = player(Role.HOST, deadline=harness.now + 10)
        assert harness.send(host.bind(), HOST_ADDR)
        joiner = player(Role.JOINER, host, deadline=harness.now + 10)
        assert harness.send(joiner.bind(), J1_ADDR)
        assert harness.send(connect(joiner, host), J1_ADDR)
        harness.send(Close(joiner.allocation_id).encode(), J1_ADDR)
        harness.send(Close(host.allocation_id).encode(), HOST_ADDR)
        harness.server.pop_events()
        harness.advance(1)

    for _ in range(100):
        session()
    harness.advance(60)
    before = live_objects()
    for _ in range(SESSIONS):
        session()
    harness.advance(60)
    assert harness.server.allocations == {}
    assert grown(before, live_objects()) == {}
