"""The SDK on loopback: a real server, several SDK instances, real UDP."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from crossroads.client.p2p import (
    HostChanged,
    JoinRejected,
    LinkUp,
    MemberLeft,
    P2PClient,
)
from crossroads.config import default_config
from crossroads.proto.punch import signalling as sig
from crossroads.runtime import Runtime, start
from tests.conftest import loopback_config

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
async def url() -> AsyncIterator[str]:
    rt: Runtime = await start(default_config(loopback_config(core__only="p2p")))
    host, port = rt.http_address
    try:
        yield f"ws://{host}:{port}/p2p/v1/ws"
    finally:
        await rt.close()


@pytest.fixture
async def make(url: str) -> AsyncIterator[Callable[..., Awaitable[P2PClient]]]:
    clients: list[P2PClient] = []

    async def factory(**kw: Any) -> P2PClient:
        client = P2PClient(url, bind=("127.0.0.1", 0), **kw)
        await client.start()
        clients.append(client)
        return client

    try:
        yield factory
    finally:
        for client in clients:
            await client.close()


async def next_event(client: P2PClient, kind: type, timeout: float = 10) -> Any:
    while True:
        event = await asyncio.wait_for(client.events.get(), timeout)
        if isinstance(event, kind):
            return event


async def test_start_learns_public_endpoint_and_mapping(make: Any) -> None:
    client = await make()
    assert client.public == client.socket.local
    assert client.mapping == "independent"


async def test_host_join_and_exchange_encrypted_datagrams(make: Any) -> None:
    host = await make()
    guest = await make()
    code = await host.host()
    await guest.join(code)
    link = guest.links[host.peer_id]
    assert link.step in ("lan", "direct", "punch")
    assert link.seconds >= 0
    assert set(guest.members) == {host.peer_id, guest.peer_id}
    assert guest.host_peer == host.peer_id and not guest.is_host
    guest.send(host.peer_id, b"hello host")
    assert await asyncio.wait_for(host.recv(), 5) == (guest.peer_id, b"hello host")
    up = await next_event(host, LinkUp)
    assert up.peer == guest.peer_id


async def test_four_peer_mesh_host_leaves_and_nobody_drops(make: Any) -> None:
    peers = [await make() for _ in range(4)]
    code = await peers[0].host()
    for peer in peers[1:]:
        await peer.join(code)
    # full mesh: every member has a link to every other
    for peer in peers:
        assert set(peer.links) == {p.peer_id for p in peers} - {peer.peer_id}
        assert peer.host_peer == peers[0].peer_id
    await peers[0].close()
    for peer in peers[1:]:
        changed = await next_event(peer, HostChanged)
        assert changed.old == peers[0].peer_id and changed.new == peers[1].peer_id
    survivors = peers[1:]
    for peer in survivors:
        assert peer.host_peer == peers[1].peer_id
        assert set(peer.links) == {p.peer_id for p in survivors} - {peer.peer_id}
    # and the remaining links still carry data both ways
    for sender in survivors:
        sender.broadcast(f"from {sender.peer_id}".encode())
    for receiver in survivors:
        got = {(await asyncio.wait_for(receiver.recv(), 5))[0] for _ in range(2)}
        assert got == {p.peer_id for p in survivors} - {receiver.peer_id}
    # a new member can still join through the same code (via the new host)
    late = await make()
    await late.join(code)
    assert set(late.links) == {p.peer_id for p in survivors}


async def test_forced_relay_carries_only_sealed_data(make: Any) -> None:
    host = await make()
    guest = await make(relay="force")
    seen: list[sig.Message] = []
    handler = host.signalling._handler
    host.signalling._handler = lambda m: (seen.append(m), handler(m))[1]
    code = await host.host()
    await guest.join(code)
    # The host learned no address of the guest: no public endpoint (the guest
    # sent no rendezvous probes), no host candidates, no port mapping.
    [start] = [m for m in seen if isinstance(m, sig.PunchStart)]
    assert start.them.public is None and start.them.ports == ()
    assert start.them.candidates.local == () and start.them.candidates.mapped is None
    assert guest.public is None
    assert guest.links[host.peer_id].step == "relay"
    assert guest.links[host.peer_id].addr[0].startswith("relay:")
    guest.send(host.peer_id, b"through the relay")
    assert await asyncio.wait_for(host.recv(), 5) == (
        guest.peer_id,
        b"through the relay",
    )
    host.send(guest.peer_id, b"and back")
    assert await asyncio.wait_for(guest.recv(), 5) == (host.peer_id, b"and back")


async def test_host_may_reject(make: Any) -> None:
    host = await make(accept_join=lambda peer: False)
    guest = await make()
    code = await host.host()
    with pytest.raises(JoinRejected):
        await guest.join(code)


async def test_leave_is_seen_by_members(make: Any) -> None:
    host = await make()
    guest = await make()
    await guest.join(await host.host())
    await guest.leave()
    left = await next_event(host, MemberLeft)
    assert left.peer == guest.peer_id
    assert set(host.members) == {host.peer_id}


async def test_unknown_code(make: Any) -> None:
    guest = await make()
    from crossroads.client.signalling import SignallingError

    with pytest.raises(SignallingError) as info:
        await guest.join("ZZZZ-ZZZZ")
    assert info.value.code == "unknown_code"


async def test_links_survive_the_server_going_away() -> None:
    rt = await start(default_config(loopback_config(core__only="p2p")))
    host, port = rt.http_address
    url = f"ws://{host}:{port}/p2p/v1/ws"
    a = P2PClient(url, bind=("127.0.0.1", 0))
    b = P2PClient(url, bind=("127.0.0.1", 0))
    try:
        await a.start()
        await b.start()
        await b.join(await a.host())
        await rt.close()
        await asyncio.wait_for(a.signalling.closed.wait(), 5)
        # The peers talk to each other, not through the server.
        for _ in range(3):
            b.send(a.peer_id, b"still here")
            assert await asyncio.wait_for(a.recv(), 5) == (b.peer_id, b"still here")
            a.send(b.peer_id, b"me too")
            assert await asyncio.wait_for(b.recv(), 5) == (a.peer_id, b"me too")
            await asyncio.sleep(1)
        assert a.peer_id in b.links and b.peer_id in a.links
    finally:
        await a.close()
        await b.close()
        await rt.close()


async def test_ipv6_host_candidates_connect_peers_behind_different_ipv4s(
    url: str,
) -> None:
    """The server sees two public IPv4 addresses (127.0.0.1 and 127.0.0.2: no
    LAN step over IPv4), both peers have an IPv6 host address (::1): the ladder
    tries IPv6 first and the link runs over it."""
    host = P2PClient(url, bind=("127.0.0.1", 0), bind6=("::1", 0))
    guest = P2PClient(url, bind=("127.0.0.2", 0), bind6=("::1", 0))
    try:
        await host.start()
        await guest.start()
        assert host.public is not None and guest.public is not None
        assert host.public[0] != guest.public[0]
        code = await host.host()
        await guest.join(code)
        link = guest.links[host.peer_id]
        assert link.step == "lan"
        assert link.addr == ("::1", host.socket.v6.local[1])  # type: ignore[union-attr]
        guest.send(host.peer_id, b"over IPv6")
        assert await asyncio.wait_for(host.recv(), 5) == (guest.peer_id, b"over IPv6")
        host.send(guest.peer_id, b"and back")
        assert await asyncio.wait_for(guest.recv(), 5) == (host.peer_id, b"and back")
    finally:
        await host.close()
        await guest.close()


async def test_without_ipv6_on_one_side_the_ladder_stays_on_ipv4(url: str) -> None:
    host = P2PClient(url, bind=("127.0.0.1", 0), bind6=("::1", 0))
    guest = P2PClient(url, bind=("127.0.0.2", 0), bind6=None)
    try:
        await host.start()
        await guest.start()
        assert guest.socket.v6 is None
        await guest.join(await host.host())
        link = guest.links[host.peer_id]
        assert link.step == "direct" and link.addr[0] == "127.0.0.1"
    finally:
        await host.close()
        await guest.close()
