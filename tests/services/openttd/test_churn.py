"""The OpenTTD coordinator under churn: 2,000 game servers
register, update, are joined or looked up, and leave, through the real service
over loopback TCP; afterwards the live objects of every crossroads class and
every socket are back where they started (counted by type after a full
collection; not timings, not RSS).

Object counts miss a dict or list that keeps growing by atomic entries (strings,
numbers, bytes: the collector does not track them), so the test also sums the
lengths of the containers every crossroads object holds. The one thing that
grows is deliberate: the store keeps each invite code it issued reserved for 30
days (``registry.CODE_RESERVATION``), so a returning server gets its code back
and nobody else does; one reservation per new code, none per reconnect.
"""

from __future__ import annotations

import asyncio
import collections
import gc as collector
from collections.abc import AsyncIterator

import pytest

from crossroads.client.openttd import GameInfoResponder, PacketStream
from crossroads.config import default_config
from crossroads.proto.openttd.coordinator import (
    ClientConnect,
    ClientConnected,
    ClientListing,
    ConnectFailed,
    ErrorType,
    GcConnectFailed,
    GcConnecting,
    GcDirectConnect,
    GcError,
    GcListing,
    GcStunConnect,
    GcStunRequest,
    GcTurnConnect,
)
from crossroads.proto.openttd.gameinfo import GameInfo, NewGRF
from crossroads.runtime import Runtime, start
from crossroads.services.openttd.registry import PREFIX, SERVERS_KEY
from tests.adversarial.turn_quota_support import grown, live_objects
from tests.conftest import eventually, loopback_config
from tests.services.openttd.helpers import (
    Registered,
    answer_stun_request,
    gc,
    recv_until,
    register,
    service,
    turn_connect,
    turn_connected,
    update,
)

pytestmark = pytest.mark.timeout(120)

SERVERS = 2_000
WARM_UP = 200
#: Servers alive at once (each holds a coordinator connection, a STUN
#: connection and, while joined, a client's and two relay connections).
PARALLEL = 32

#: Store keys of invite-code reservations (services/openttd/registry.py).
CODE_PREFIX = PREFIX + "code:"

INFO = GameInfo(
    server_name="Churn",
    server_revision="13.0",
    clients_max=8,
    map_width=256,
    map_height=256,
    newgrfs=(NewGRF(0x4D560102, bytes(range(16)), "One NewGRF"),),
)


@pytest.fixture
async def ottd() -> AsyncIterator[Runtime]:
    # One source address plays 2,000 servers and their clients: lift the
    # per-address limits that would (rightly) stop it, and the guessing budget
    # that would refuse its lookups of unknown codes.
    values = loopback_config(
        core__only="openttd",
        core__guess_per_source=0,
        core__guess_global=0,
        openttd__secret="churn-secret",
        openttd__registrations_per_minute=1_000_000,
        openttd__max_servers_per_address=10_000,
        # Each join leaves an insight record in a bounded ring and stream: keep
        # them small enough for the warm-up to fill, so the measured churn
        # shows what grows without bound, not what fills to its cap.
        insight__ring=WARM_UP // 4,
        insight__stream_max=WARM_UP // 4,
        openttd__max_connections_per_address=10_000,
    )
    rt = await start(default_config(values))
    try:
        yield rt
    finally:
        await rt.close()


async def direct_join(rt: Runtime, server: Registered) -> None:
    """A client joins a directly reachable server and reports success."""
    client = await gc(rt)
    try:
        await client.send_message(ClientConnect(6, server.code))
        connecting = await recv_until(client, GcConnecting)
        await recv_until(client, GcDirectConnect)
        await client.send_message(ClientConnected(6, connecting.token))
    finally:
        await client.close()


async def stun_then_turn_join(rt: Runtime, server: Registered) -> None:
    """A client joins a server behind NAT: STUN fails, the pair meets on TURN
    and relays a few bytes; the client reports success."""
    client = await gc(rt)
    streams: list[PacketStream] = []
    try:
        await client.send_message(ClientConnect(6, server.code))
        await recv_until(client, GcConnecting)
        client_request = await recv_until(client, GcStunRequest)
        server_request = await recv_until(server.client, GcStunRequest)
        streams += await answer_stun_request(rt, client, client_request.token)
        streams += await answer_stun_request(rt, server.client, server_request.token)
        client_stun = await recv_until(client, GcStunConnect)
        await recv_until(server.client, GcStunConnect)
        await client.send_message(ConnectFailed(6, client_stun.token, 1))
        client_turn = await recv_until(client, GcTurnConnect)
        server_turn = await recv_until(server.client, GcTurnConnect)
        for side in (client_turn, server_turn):
            stream, _ = await turn_connect(side.connection_string, side.ticket)
            streams.append(stream)
        for stream in streams[-2:]:
            await turn_connected(stream)
        await streams[-2].send(b"\x03\x00\x07")
        assert await streams[-1].reader.readexactly(3) == b"\x03\x00\x07"
        await client.send_message(ClientConnected(6, client_turn.token))
    finally:
        for stream in streams:
            await stream.close()
        await client.close()


async def client_gives_up(rt: Runtime, server: Registered) -> None:
    """A client starts a join and gives up (tracking number 0)."""
    client = await gc(rt)
    try:
        await client.send_message(ClientConnect(6, server.code))
        connecting = await recv_until(client, GcConnecting)
        await client.send_message(ConnectFailed(6, connecting.token, 0))
        await recv_until(server.client, GcConnectFailed)
    finally:
        await client.close()


async def lookups_then_server_leaves(rt: Runtime, server: Registered) -> None:
    """A client looks up an unknown code and lists the servers; then it starts
    a join and the server leaves in the middle of it."""
    client = await gc(rt)
    try:
        await client.send_message(ClientConnect(6, "+" + server.code[1:][::-1]))
        error = await recv_until(client, GcError)
        assert error.error is ErrorType.INVALID_INVITE_CODE
        await client.send_message(ClientListing(6, 6, "13.0", 0))
        await recv_until(client, GcListing)
        await client.send_message(ClientConnect(6, server.code))
        await recv_until(client, GcConnecting)
        await server.close()
        await recv_until(client, GcConnectFailed)
    finally:
        await client.close()


async def reconnect_with_code(rt: Runtime, server: Registered, port: int) -> None:
    """The server drops its connection and registers again with its invite
    code and secret, as OpenTTD does after a network hiccup."""
    await server.close()
    again = await register(
        rt, port, code=server.code, secret=server.ack.invite_code_secret
    )
    try:
        assert again.code == server.code
    finally:
        await again.close()


async def one_server(rt: Runtime, index: int, responder: GameInfoResponder) -> None:
    """One server's life; ``index`` picks what happens to it."""
    kind = index % 5
    direct = kind in (0, 3, 4)  # the probe reaches the responder; else STUN
    port = responder.port if direct else 1
    server = await register(rt, port)
    try:
        await update(server, INFO)
        match kind:
            case 0:
                await direct_join(rt, server)
            case 1:
                await stun_then_turn_join(rt, server)
            case 2:
                await client_gives_up(rt, server)
            case 3:
                await lookups_then_server_leaves(rt, server)
            case 4:
                await reconnect_with_code(rt, server, port)
    finally:
        await server.close()


async def churn(rt: Runtime, servers: int, responder: GameInfoResponder) -> None:
    slots = asyncio.Semaphore(PARALLEL)

    async def one(index: int) -> None:
        async with slots:
            await one_server(rt, index, responder)

    await asyncio.gather(*(one(index) for index in range(servers)))


async def settled(rt: Runtime) -> None:
    """Wait (bounded) until the service holds nothing of the churn: no
    connection on any listener, no server, join or check, no stored record;
    then let the listing drop what it cached."""
    svc = service(rt)
    coordinator = svc.coordinator
    assert coordinator is not None

    async def idle() -> bool:
        return (
            all(not listener.connections for listener in svc.listeners.values())
            and not coordinator.local_servers
            and not coordinator.attempts
            and not coordinator.checks
            and await rt.store.hgetall(SERVERS_KEY) == {}
        )

    await eventually(idle, "every connection, server and join gone", timeout=30)
    coordinator.listing.invalidate()
    await eventually(
        lambda: _listing_empty(rt), "the listing refreshed to empty", timeout=10
    )
    for _ in range(10):
        await asyncio.sleep(0)


def container_sizes() -> collections.Counter[str]:
    """Summed ``len()`` of the containers held in the attributes of every live
    crossroads object, by ``module.Class.attribute``; deques with a ``maxlen``
    are left out (bounded by construction, and they fill with time)."""
    collector.collect()
    sizes: collections.Counter[str] = collections.Counter()
    for obj in collector.get_objects():
        kind = type(obj)
        # Some extension types (loaded by other tests) have no __module__ string.
        module = kind.__dict__.get("__module__")
        if not isinstance(module, str) or not module.startswith("crossroads."):
            continue
        attributes = dict(getattr(obj, "__dict__", {}))
        for klass in kind.__mro__:
            for name in getattr(klass, "__slots__", ()):
                if hasattr(obj, name):
                    attributes[name] = getattr(obj, name)
        for name, value in attributes.items():
            if isinstance(value, collections.deque) and value.maxlen is not None:
                continue
            if isinstance(value, (dict, list, set, frozenset, collections.deque)):
                sizes[f"{module}.{kind.__qualname__}.{name}"] += len(value)
    return sizes


async def _listing_empty(rt: Runtime) -> bool:
    coordinator = service(rt).coordinator
    assert coordinator is not None
    loop = asyncio.get_running_loop()
    return await coordinator.listing.all(loop.time()) == []


async def test_server_churn_leaves_object_counts_where_they_started(
    ottd: Runtime,
) -> None:
    responder = GameInfoResponder()
    await responder.start()
    try:
        await churn(ottd, WARM_UP, responder)
        await settled(ottd)
        codes_before = len(await ottd.store.keys(CODE_PREFIX))
        sizes_before = container_sizes()
        before = live_objects()
        await churn(ottd, SERVERS, responder)
        await settled(ottd)
        after = live_objects()
        sizes_after = container_sizes()
        new_codes = len(await ottd.store.keys(CODE_PREFIX)) - codes_before
    finally:
        await responder.close()
    assert grown(before, after) == {}
    # Every server drew one new code (its reconnect took the same one back) ...
    assert new_codes == SERVERS
    # ... and its reservation is all the store kept; nothing else grew.
    assert {
        name: sizes_after[name] - sizes_before[name]
        for name in sizes_after
        if sizes_after[name] != sizes_before[name]
    } == {
        "crossroads.store.memory.MemoryStore._values": new_codes,
        "crossroads.store.memory.MemoryStore._deadlines": new_codes,
    }
