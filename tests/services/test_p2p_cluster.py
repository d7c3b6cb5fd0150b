"""Two p2p instances sharing a real Redis: invite codes claimed in the Store,
joins that reach the wrong instance redirected to the session's, SDK clients
following the redirect, claims kept alive and freed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from crossroads.client.p2p import MAX_REDIRECTS, JoinRejected, P2PClient
from crossroads.client.signalling import SignallingError
from crossroads.config import default_config
from crossroads.runtime import Runtime, start
from crossroads.services import p2p as p2p_service
from crossroads.services.p2p import CODE_KEY, P2PService
from tests.conftest import RedisServer, eventually, loopback_config, running_service

pytestmark = pytest.mark.timeout(60)


def ws_url(rt: Runtime) -> str:
    host, port = rt.http_address
    return f"ws://{host}:{port}/p2p/v1/ws"


def service(rt: Runtime) -> P2PService:
    return running_service(rt, "p2p", P2PService)


@pytest.fixture
async def pair(redis_url: str) -> AsyncIterator[tuple[Runtime, Runtime]]:
    started: list[Runtime] = []
    try:
        for _ in range(2):
            config = loopback_config(core__only="p2p", core__store=redis_url)
            started.append(await start(default_config(config)))
        yield started[0], started[1]
    finally:
        for rt in started:
            await rt.close()


@pytest.fixture
async def clients() -> AsyncIterator[Callable[[str], Awaitable[P2PClient]]]:
    made: list[P2PClient] = []

    async def make(url: str) -> P2PClient:
        client = P2PClient(url, bind=("127.0.0.1", 0))
        await client.start()
        made.append(client)
        return client

    try:
        yield make
    finally:
        for client in made:
            await client.close()


async def test_a_join_on_the_other_instance_is_redirected_and_connects(
    pair: tuple[Runtime, Runtime], clients: Callable[[str], Awaitable[P2PClient]]
) -> None:
    a, b = pair
    host = await clients(ws_url(a))
    code = await host.host()
    assert await a.store.get(CODE_KEY + code) == ws_url(a).encode()
    assert CODE_KEY + code in [k for k in await b.store.keys(CODE_KEY)]

    guest = await clients(ws_url(b))
    first_id = guest.peer_id
    await guest.join(code.lower().replace("-", ""))
    assert guest.url == ws_url(a)  # moved to the session's instance
    assert guest.peer_id != first_id  # a new peer there
    # The old instance's rendezvous ports were sent to before the new instance
    # first saw the socket: they must not shift a sequential NAT's prediction.
    assert guest.socket.flows(guest._rendezvous) <= 1  # at most the host's link
    assert set(guest.members) == {host.peer_id, guest.peer_id}
    assert service(b).core.peer_count == 0 and service(a).core.peer_count == 2
    guest.send(host.peer_id, b"across instances")
    assert await asyncio.wait_for(host.recv(), 5) == (
        guest.peer_id,
        b"across instances",
    )
    metrics = service(b).redirects._value.get()
    assert metrics == 1

    # The session ends with its last member: the claim goes at once.
    await guest.leave()
    await host.leave()

    async def released() -> bool:
        return await b.store.get(CODE_KEY + code) is None

    await eventually(released, "code released")


async def test_codes_nobody_holds_and_stale_own_claims_are_unknown(
    pair: tuple[Runtime, Runtime], clients: Callable[[str], Awaitable[P2PClient]]
) -> None:
    a, b = pair
    guest = await clients(ws_url(b))
    with pytest.raises(SignallingError) as nobody:
        await guest.join("K7QM-3XZP")
    assert nobody.value.code == "unknown_code"
    # A claim naming this very instance whose session is gone (a restart
    # within the TTL): unknown, not a redirect to itself.
    await b.store.set(CODE_KEY + "K7QM-3XZQ", ws_url(b).encode(), ttl=30)
    with pytest.raises(SignallingError) as stale:
        await guest.join("K7QM-3XZQ")
    assert stale.value.code == "unknown_code"
    assert guest.url == ws_url(b)
    assert service(b).redirects._value.get() == 0


async def test_a_member_is_not_moved_out_of_its_session(
    pair: tuple[Runtime, Runtime], clients: Callable[[str], Awaitable[P2PClient]]
) -> None:
    a, b = pair
    host_a = await clients(ws_url(a))
    code_a = await host_a.host()
    host_b = await clients(ws_url(b))
    await host_b.host()
    with pytest.raises(Exception, match="leave this one first"):
        await host_b.join(code_a)
    assert host_b.url == ws_url(b) and host_b.session


async def test_claims_are_refreshed_restored_and_freed_on_close(
    redis_url: str,
    clients: Callable[[str], Awaitable[P2PClient]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(p2p_service, "CODE_TTL", 1.5)
    config = loopback_config(core__only="p2p", core__store=redis_url)
    rt = await start(default_config(config))
    try:
        host = await clients(ws_url(rt))
        code = await host.host()
        key = CODE_KEY + code
        # Refreshed: alive well past its TTL while the session lives.
        await asyncio.sleep(3.5)
        assert await rt.store.get(key) == ws_url(rt).encode()
        ttl = await rt.store.ttl(key)
        assert ttl is not None and 0 < ttl <= 1.5
        # Lost by the Store (a Redis restart without persistence): re-claimed.
        await rt.store.delete(key)

        async def restored() -> bool:
            return await rt.store.get(key) == ws_url(rt).encode()

        await eventually(restored, "claim restored")
        # Claimed by another instance in a gap: never refreshed nor deleted by us.
        await rt.store.set(key, b"ws://other:8080/p2p/v1/ws", ttl=30)

        async def disowned() -> bool:
            return code not in service(rt).owned_codes

        await eventually(disowned, "claim given up")
        await host.leave()

        async def released() -> bool:
            svc = service(rt)
            return svc.core.session_count == 0 and svc._directory_ops.empty()

        await eventually(released, "session over, release handled")
        await asyncio.sleep(0.2)  # the release op itself, if it were to delete
        assert await rt.store.get(key) == b"ws://other:8080/p2p/v1/ws"
    finally:
        await rt.close()
    # An instance that stops frees its codes without waiting for the TTL.
    rt = await start(default_config(config))
    try:
        host = await clients(ws_url(rt))
        key = CODE_KEY + await host.host()
        assert await rt.store.get(key) is not None
    finally:
        await rt.close()
    check = await start(default_config(config))
    try:
        assert await check.store.get(key) is None
    finally:
        await check.close()


async def test_codes_are_unique_across_instances(
    pair: tuple[Runtime, Runtime], clients: Callable[[str], Awaitable[P2PClient]]
) -> None:
    a, b = pair
    hosts = [await clients(ws_url(rt)) for rt in (a, b, a, b)]
    codes = [await h.host() for h in hosts]
    assert len(set(codes)) == 4
    holders = {code: await a.store.get(CODE_KEY + code) for code in codes}
    assert holders == {
        codes[0]: ws_url(a).encode(),
        codes[1]: ws_url(b).encode(),
        codes[2]: ws_url(a).encode(),
        codes[3]: ws_url(b).encode(),
    }


async def test_hosting_waits_out_a_redis_restart(
    clients: Callable[[str], Awaitable[P2PClient]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Redis restarts empty: a session hosted meanwhile gets its code once Redis
    is back, and the live session's claim is restored by the refresh."""
    monkeypatch.setattr(p2p_service, "CODE_TTL", 1.5)
    redis = RedisServer()
    config = loopback_config(core__only="p2p", core__store=redis.url)
    rt = await start(default_config(config))
    try:
        first = await clients(ws_url(rt))
        code = await first.host()
        redis.stop()
        second = await clients(ws_url(rt))  # signalling needs no Store
        hosting = asyncio.create_task(second.host())
        await asyncio.sleep(1.0)
        assert not hosting.done()  # the claim waits for the Store
        redis = RedisServer(port=redis.port)
        later = await asyncio.wait_for(hosting, 15)
        assert later != code

        async def both_claimed() -> bool:
            held = [await rt.store.get(CODE_KEY + c) for c in (code, later)]
            return held == [ws_url(rt).encode()] * 2

        await eventually(both_claimed, "both codes claimed after the restart")
    finally:
        await rt.close()
        redis.stop()


async def test_a_release_never_deletes_another_instances_claim(
    pair: tuple[Runtime, Runtime], clients: Callable[[str], Awaitable[P2PClient]]
) -> None:
    """Our claim expired (a stall past the TTL) and another instance claimed the
    code before our refresh noticed: the session's end must leave that claim."""
    a, _ = pair
    host = await clients(ws_url(a))
    code = await host.host()
    key = CODE_KEY + code
    other = b"ws://203.0.113.99:8080/p2p/v1/ws"
    await a.store.set(key, other, ttl=30)
    assert code in service(a).owned_codes  # not noticed yet (refresh every 10 s)
    await host.leave()

    async def released() -> bool:
        return code not in service(a).owned_codes

    await eventually(released, "release handled")
    await asyncio.sleep(0.2)  # the release's store call itself
    assert await a.store.get(key) == other


async def test_redirects_are_bounded(
    pair: tuple[Runtime, Runtime], clients: Callable[[str], Awaitable[P2PClient]]
) -> None:
    """A claim naming this instance under another spelling (a misconfigured
    --p2p-public-url) would redirect forever; the client stops after
    MAX_REDIRECTS with a clear error."""
    a, _ = pair
    port = a.http_address[1]
    await a.store.set(
        CODE_KEY + "K7QM-3XZP", f"ws://localhost:{port}/p2p/v1/ws".encode(), ttl=30
    )
    guest = await clients(ws_url(a))
    with pytest.raises(JoinRejected, match=f"more than {MAX_REDIRECTS} redirects"):
        await guest.join("K7QM-3XZP")
    assert service(a).redirects._value.get() == MAX_REDIRECTS + 1
