"""The natneg core admits sessions through an injected admission (the
service's table of the resource budget): refusals by reason, one release per
session, whatever ends it."""

from __future__ import annotations

from crossroads.proto.admission import LocalTable
from crossroads.proto.natneg.packets import Init
from crossroads.proto.natneg.server import NatNegServer, ServerConfig
from crossroads.transport.admission import Pool, ResourceBudget


def test_sessions_are_admitted_and_released_through_the_budget_table() -> None:
    budget = ResourceBudget(fd_limit=1024, memory=1 << 30)
    table = budget.table(
        "natneg-sessions", max_items=16, max_per_source=64, pool=Pool.NONE
    )
    core = NatNegServer(
        ServerConfig(session_timeout=2.0, linger=1.0, rate_limit=0), admission=table
    )
    # One source: stopped at the table's per-source cap (an eighth of 16).
    for cookie in range(10):
        core.receive_datagram(
            Init(3, cookie, 0, 0, 0).encode(), ("198.51.100.1", 1), 0.0
        )
    assert core.session_count == table.live == table.max_per_source == 2
    assert core.stats.dropped["source-limit"] == 8
    # Many sources: stopped at the global cap.
    for i in range(20):
        init = Init(3, 100 + i, 0, 0, 0).encode()
        core.receive_datagram(init, (f"198.51.100.{10 + i}", 1), 0.0)
    assert core.session_count == table.live == 16
    assert core.stats.dropped["session-limit"] == 6
    # Every session fails, lingers and ends: the table is empty again.
    now = 0.0
    while (deadline := core.get_timer()) is not None:
        now = deadline
        core.handle_timer(now)
        core.datagrams_to_send(now)
    assert core.session_count == table.live == 0
    assert table.per_source == {}


def test_a_core_without_a_budget_keeps_its_configured_caps() -> None:
    core = NatNegServer(
        ServerConfig(max_sessions=3, max_sessions_per_ip=2, rate_limit=0)
    )
    assert isinstance(core.admission, LocalTable)
    for cookie in range(3):
        core.receive_datagram(
            Init(3, cookie, 0, 0, 0).encode(), ("198.51.100.1", 1), 0.0
        )
    assert core.session_count == 2
    core.receive_datagram(Init(3, 9, 0, 0, 0).encode(), ("198.51.100.2", 1), 0.0)
    core.receive_datagram(Init(3, 10, 0, 0, 0).encode(), ("198.51.100.3", 1), 0.0)
    assert core.session_count == 3
    assert core.stats.dropped == {"source-limit": 1, "session-limit": 1}
