"""The relay core admits every allocation through an injected table (the
service's ``relay-allocations`` table of the resource budget): one source
holds at most its share, a rebind moves the count, and the table drains when
the allocations end, whatever ends them."""

from __future__ import annotations

from crossroads.proto.admission import Admitter, LocalTable
from crossroads.proto.relay import messages as m
from crossroads.proto.relay.server import RelayServer, RelayServerConfig
from crossroads.proto.relay.token import Role
from crossroads.transport.admission import Pool, ResourceBudget
from crossroads.types import Address
from tests.proto.relay.test_server import NODE, SEALER, WALL, Player, player

BOUND = m.BindReceived().encode()


def core(table: Admitter | None = None, **config: object) -> RelayServer:
    cfg = RelayServerConfig(node_id=NODE, **config)  # type: ignore[arg-type]
    return RelayServer(cfg, SEALER, wall_offset=WALL, admission=table)


def bind(server: RelayServer, p: Player, addr: Address, now: float = 0.0) -> bool:
    """Whether ``p``'s next BIND from ``addr`` was answered BIND_RECEIVED."""
    server.receive_datagram(p.bind(), addr, now)
    return server.datagrams_to_send(now) == [(BOUND, addr)]


def test_one_source_holds_at_most_its_share_and_the_table_drains() -> None:
    budget = ResourceBudget(fd_limit=1024, memory=1 << 30)
    table = budget.table(
        "relay-allocations", max_items=16, max_per_source=16, pool=Pool.NONE
    )
    server = core(table)
    # One source with many valid tokens: stopped at an eighth of the table.
    hosts = [player(Role.HOST) for _ in range(6)]
    bound = [bind(server, h, ("198.51.100.1", 4000 + i)) for i, h in enumerate(hosts)]
    assert bound == [True, True, False, False, False, False]
    assert len(server.allocations) == table.live == table.max_per_source == 2
    assert server.drops["source-capacity"] == 4
    assert table.refused == {"over-ip-limit": 4}
    # Many sources: stopped at the table's total.
    for i in range(20):
        bind(server, player(Role.HOST), (f"198.51.100.{10 + i}", 4000))
    assert len(server.allocations) == table.live == 16
    assert server.drops["capacity"] == 6
    # Every allocation ends (idle, host-alone): the table is empty again.
    now = 0.0
    while (deadline := server.get_timer()) is not None:
        now = deadline
        server.handle_timer(now)
    assert not server.allocations
    assert table.live == 0 and table.per_source == {}
    assert table.closes == {"host-alone": 16}


def test_a_close_a_kick_and_a_host_leaving_release_their_allocations() -> None:
    table = LocalTable(16, 16)
    server = core(table)
    host = player(Role.HOST, max_connections=2)
    joiner = player(Role.JOINER, host)
    other = player(Role.HOST)
    assert bind(server, host, ("198.51.100.1", 4000))
    assert bind(server, joiner, ("198.51.100.2", 5000))
    assert bind(server, other, ("198.51.100.3", 6000))
    assert table.live == 3
    server.receive_datagram(
        m.ConnectRequest(
            joiner.allocation_id, m.pad_connection_data(host.token)
        ).encode(),
        ("198.51.100.2", 5000),
        0.0,
    )
    # CLOSE from the host takes its joiner with it.
    server.receive_datagram(
        m.Close(host.allocation_id).encode(), ("198.51.100.1", 4000), 1.0
    )
    assert table.live == 1 and table.per_source == {"198.51.100.3": 1}
    assert server.kick(other.allocation_id, 2.0)
    assert table.live == 0 and table.per_source == {}
    assert table.closes == {"host-ended": 1, "revoked": 1}


def test_a_rebind_moves_the_count_to_the_new_source() -> None:
    table = LocalTable(16, 2)
    server = core(table)
    a, b, c = (player(Role.HOST) for _ in range(3))
    assert bind(server, a, ("198.51.100.1", 4000))
    assert bind(server, b, ("198.51.100.2", 4000))
    assert bind(server, c, ("198.51.100.2", 4001))
    # The same source on another port: nothing to move.
    assert bind(server, a, ("198.51.100.1", 4999))
    assert table.per_source == {"198.51.100.1": 1, "198.51.100.2": 2}
    # Into a source that holds its share: refused, the allocation stays.
    assert not bind(server, a, ("198.51.100.2", 4002))
    assert server.allocations[a.allocation_id].address == ("198.51.100.1", 4999)
    assert server.drops["source-capacity"] == 1
    assert table.per_source == {"198.51.100.1": 1, "198.51.100.2": 2}
    # Out of it: the count follows the allocation, so a source cannot hold
    # more than its share by binding elsewhere and moving in.
    assert bind(server, b, ("198.51.100.3", 4000))
    assert table.per_source == {"198.51.100.1": 1, "198.51.100.2": 1, "198.51.100.3": 1}
    server.receive_datagram(
        m.Close(b.allocation_id).encode(), ("198.51.100.3", 4000), 1.0
    )
    assert table.per_source == {"198.51.100.1": 1, "198.51.100.2": 1}
    assert table.live == 2


def test_without_a_table_the_configured_cap_holds() -> None:
    server = core(max_allocations=2)
    assert isinstance(server.admission, LocalTable)
    results = [
        bind(server, player(Role.HOST), (f"198.51.100.{i + 1}", 4000)) for i in range(3)
    ]
    assert results == [True, True, False]
    assert server.drops["capacity"] == 1
