"""The turn service on real loopback sockets: bad input, abuse, leaks, metrics,
configuration.

Each bad-input case checks the protocol's answer (or the counted drop) and that
nothing leaks: allocations, relay sockets and file descriptors go back to where
they were.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest

from crossroads.client.turn import TurnClient, TurnClientError, rest_credentials
from crossroads.config import build_config, default_config
from crossroads.errors import ConfigError
from crossroads.proto.stun import (
    ChannelNumber,
    Class,
    Data,
    Message,
    Method,
    RequestedTransport,
    XorPeerAddress,
    decode,
    encode,
)
from crossroads.proto.turn.credentials import LongTermSession
from crossroads.proto.turn.server import error_code_of
from crossroads.runtime import Runtime, start
from crossroads.services.turn import ACCELERATED, TurnService
from tests.conftest import loopback_config

pytestmark = pytest.mark.timeout(60)

USER, PASSWORD, SECRET = "alice", "secret123", "s3cr3t"


def service_of(runtime: Runtime) -> TurnService:
    service = runtime.services["turn"]
    assert isinstance(service, TurnService)
    return service


@pytest.fixture(name="turn")
async def turn_fixture() -> AsyncIterator[Callable[..., Awaitable[TurnService]]]:
    runtimes: list[Runtime] = []

    async def make(**overrides: Any) -> TurnService:
        values: dict[str, Any] = {
            "core__only": ["stun", "turn"],
            "turn__user": [f"{USER}:{PASSWORD}"],
            "turn__secret": [SECRET],
            "turn__allow_loopback_peers": True,
            "turn__relay_ports": (43000, 43999),
        }
        values.update(overrides)
        runtime = await start(default_config(loopback_config(**values)))
        runtimes.append(runtime)
        return service_of(runtime)

    try:
        yield make
    finally:
        for runtime in runtimes:
            await runtime.close()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def eventually(condition: Callable[[], bool]) -> bool:
    """Poll (bounded): asyncio closes transports on the next loop iteration."""
    for _ in range(200):
        if condition():
            return True
        await asyncio.sleep(0.01)
    return condition()


class Peer:
    """A UDP socket playing a peer, with a receive helper."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.setblocking(False)
        self.address: tuple[str, int] = self.sock.getsockname()

    async def recv(self, timeout: float = 1.0) -> bytes | None:
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.sock_recv(self.sock, 4096), timeout)
        except TimeoutError:
            return None

    def close(self) -> None:
        self.sock.close()


class RawClient:
    """A bare UDP client socket, for hand-made STUN/ChannelData."""

    def __init__(self, server: tuple[str, int]) -> None:
        self.server = server
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.setblocking(False)

    def send(self, data: bytes) -> None:
        self.sock.sendto(data, self.server)

    async def request(self, data: bytes, timeout: float = 2.0) -> Message | None:
        loop = asyncio.get_running_loop()
        self.send(data)
        try:
            reply = await asyncio.wait_for(loop.sock_recv(self.sock, 4096), timeout)
        except TimeoutError:
            return None
        return decode(reply)

    def close(self) -> None:
        self.sock.close()


def allocate_request(session: LongTermSession | None = None) -> bytes:
    message = Message(
        Class.REQUEST, Method.ALLOCATE, os.urandom(12), (RequestedTransport(17),)
    )
    return session.sign(message) if session else encode(message)


async def signed_allocate(client: RawClient) -> tuple[LongTermSession, Message]:
    session = LongTermSession(USER, PASSWORD)
    challenge = await client.request(allocate_request())
    assert challenge is not None and error_code_of(challenge) == 401
    session.learn(challenge)
    answer = await client.request(allocate_request(session))
    assert answer is not None and answer.msg_class == Class.SUCCESS
    return session, answer


async def signed_request(
    client: RawClient, session: LongTermSession, method: Method, *attributes: Any
) -> Message:
    """A signed request of ``method``; it must succeed."""
    request = Message(Class.REQUEST, method, os.urandom(12), attributes)
    answer = await client.request(session.sign(request))
    assert answer is not None and answer.msg_class == Class.SUCCESS
    return answer


async def bind_channel(
    client: RawClient, session: LongTermSession, peer: tuple[str, int]
) -> None:
    """ChannelBind 0x4001 to ``peer``; it must succeed."""
    await signed_request(
        client,
        session,
        Method.CHANNEL_BIND,
        ChannelNumber(0x4001),
        XorPeerAddress(*peer),
    )


async def create_permission(
    client: RawClient, session: LongTermSession, peer: tuple[str, int]
) -> None:
    """CreatePermission for ``peer``'s IP; it must succeed."""
    await signed_request(
        client, session, Method.CREATE_PERMISSION, XorPeerAddress(*peer)
    )


# ------------------------------------------------------------------ credentials


async def test_wrong_credentials_401_nothing_allocated(turn: Any) -> None:
    service: TurnService = await turn()
    fds = open_fds()
    for username, password in [(USER, "wrong"), ("mallory", PASSWORD)]:
        async with await TurnClient.connect(
            service.stun.primary, username, password, timeout=3
        ) as client:
            with pytest.raises(TurnClientError) as excinfo:
                await client.allocate()
            assert excinfo.value.code == 401
    assert service.core.allocations == {} and service.relays == set()
    assert await eventually(lambda: open_fds() <= fds)


async def test_expired_time_limited_credentials_401(turn: Any) -> None:
    service: TurnService = await turn()
    username, password = rest_credentials(SECRET, "carl", ttl=-10)
    async with await TurnClient.connect(
        service.stun.primary, username, password, timeout=3
    ) as client:
        with pytest.raises(TurnClientError) as excinfo:
            await client.allocate()
        assert excinfo.value.code == 401
    assert service.core.counters.drops["auth-expired"] >= 1
    username, password = rest_credentials(SECRET, "carl", ttl=60)
    async with await TurnClient.connect(
        service.stun.primary, username, password, timeout=3
    ) as client:
        await client.allocate()
        assert service.core.user_allocations == {"carl": 1}
    assert await eventually(lambda: service.core.allocations == {})


async def test_stale_nonce_438_and_client_recovers(turn: Any) -> None:
    service: TurnService = await turn()
    raw = RawClient(service.stun.primary)
    try:
        session, _ = await signed_allocate(raw)
        # Move the service's wall clock 11 minutes on: the nonce (600 s) is stale.
        service.core.wall_offset += 660
        refresh = session.sign(Message(Class.REQUEST, Method.REFRESH, os.urandom(12)))
        answer = await raw.request(refresh)
        assert answer is not None and error_code_of(answer) == 438
        assert session.learn(answer)
        retry = await raw.request(
            session.sign(Message(Class.REQUEST, Method.REFRESH, os.urandom(12)))
        )
        assert retry is not None and retry.msg_class == Class.SUCCESS
    finally:
        raw.close()


async def test_replayed_request_from_elsewhere_438(turn: Any) -> None:
    service: TurnService = await turn()
    victim = RawClient(service.stun.primary)
    attacker = RawClient(service.stun.primary)
    try:
        session = LongTermSession(USER, PASSWORD)
        challenge = await victim.request(allocate_request())
        assert challenge is not None
        session.learn(challenge)
        captured = allocate_request(session)
        first = await victim.request(captured)
        assert first is not None and first.msg_class == Class.SUCCESS
        # The same bytes again from the victim: the same answer (retransmission).
        again = await victim.request(captured)
        assert again == first
        # From another address (attacker): the nonce is bound to the client.
        replay = await attacker.request(captured)
        assert replay is not None and error_code_of(replay) == 438
        assert len(service.core.allocations) == 1
    finally:
        victim.close()
        attacker.close()


# ------------------------------------------------------------------ data path


async def test_send_without_permission_is_dropped(turn: Any) -> None:
    service: TurnService = await turn()
    peer = Peer()
    try:
        async with await TurnClient.connect(service.stun.primary, USER, PASSWORD) as c:
            await c.allocate()
            await c.send(b"no permission yet", peer.address)
            assert await peer.recv(0.5) is None
            assert service.stats.drops["send-no-permission"] == 1
            # Data from the peer without a permission: dropped too.
            assert c.relayed is not None
            peer.sock.sendto(b"unsolicited", c.relayed)
            with pytest.raises(TimeoutError):
                await c.receive(timeout=0.5)
            assert await eventually(
                lambda: service.stats.drops.get("peer-no-permission") == 1
            )
            await c.create_permission(peer.address[0])
            await c.send(b"now allowed", peer.address)
            assert await peer.recv() == b"now allowed"
    finally:
        peer.close()


async def test_unknown_channel_and_bad_channeldata_dropped(turn: Any) -> None:
    service: TurnService = await turn()
    peer = Peer()
    raw = RawClient(service.stun.primary)
    try:
        session, _ = await signed_allocate(raw)
        await bind_channel(raw, session, peer.address)
        _, _, _, _, errors_before = service.counters()
        raw.send(b"\x40\x02\x00\x04ping")  # unbound channel
        raw.send(b"\x40\x01\x00\x10ping")  # truncated: claims 16 bytes, has 4
        raw.send(b"\x40\x01\x00\x04ping" + b"\x00" * 8)  # oversized: 8 extra bytes
        raw.send(b"\x40\x01\xff\xff" + b"x" * 100)  # length far beyond the datagram
        raw.send(b"\x40\x01")  # not even a header
        assert await peer.recv(0.5) is None
        raw.send(b"\x40\x01\x00\x04ping\x00\x00\x00")  # legal UDP padding
        assert await peer.recv() == b"ping"

        async def dropped() -> int:
            _, _, _, _, errors = service.counters()
            return (
                errors - errors_before + service.stats.drops.get("channel-unbound", 0)
            )

        for _ in range(100):
            if await dropped() >= 5:
                break
            await asyncio.sleep(0.01)
        assert service.stats.drops.get("channel-unbound", 0) >= 1
        assert await dropped() >= 4
    finally:
        raw.close()
        peer.close()


async def test_unknown_attribute_420_and_garbage(turn: Any) -> None:
    service: TurnService = await turn()
    raw = RawClient(service.stun.primary)
    try:
        await signed_allocate(raw)
        for junk in (b"\x00\x03\x00\x01" + bytes(16), b"\xff" * 40, b"\x00\x16\x00"):
            raw.send(junk)
        # Still serving.
        assert await raw.request(
            encode(Message(Class.REQUEST, Method.BINDING, os.urandom(12)))
        )
    finally:
        raw.close()


# ------------------------------------------------------------------ quotas, leaks


async def test_allocation_flood_beyond_quota_486_and_release(turn: Any) -> None:
    # 32 in total: an eighth, 4, per IP (the budget's per-source fraction).
    service: TurnService = await turn(turn__user_quota=3, turn__total_quota=32)
    fds = open_fds()
    clients: list[TurnClient] = []
    codes: list[int] = []
    try:
        for _ in range(6):
            client = await TurnClient.connect(service.stun.primary, USER, PASSWORD)
            clients.append(client)
            try:
                await client.allocate()
                codes.append(0)
            except TurnClientError as exc:
                codes.append(exc.code)
        assert codes == [0, 0, 0, 486, 486, 486]
        assert len(service.core.allocations) == 3
        assert len(service.relays) == 3
        # Another user still fits under the per-IP cap, then this IP is full.
        username, password = rest_credentials(SECRET, "dave")
        other = await TurnClient.connect(service.stun.primary, username, password)
        clients.append(other)
        await other.allocate()
        extra = await TurnClient.connect(service.stun.primary, username, password)
        clients.append(extra)
        with pytest.raises(TurnClientError) as excinfo:
            await extra.allocate()
        assert excinfo.value.code == 486
    finally:
        for client in clients:
            await client.close()
    # Refresh(0) frees allocations at once; relay sockets and fds are released.
    assert service.core.allocations == {}
    assert service.core.user_allocations == {}
    assert service.core.ports.in_use == set()
    assert service.relays == set()
    assert await eventually(lambda: open_fds() <= fds)


async def test_over_capacity_redirects_300(turn: Any) -> None:
    service: TurnService = await turn(
        turn__total_quota=1,
        turn__ip_quota=0,
        turn__alternate_server=["127.0.0.1:3478"],
    )
    async with await TurnClient.connect(service.stun.primary, USER, PASSWORD) as a:
        await a.allocate()
        async with await TurnClient.connect(service.stun.primary, USER, PASSWORD) as b:
            with pytest.raises(TurnClientError) as excinfo:
                await b.allocate()
            assert excinfo.value.code == 300


async def test_tcp_control_connection_close_deletes_allocation(turn: Any) -> None:
    service: TurnService = await turn()
    fds = open_fds()
    client = await TurnClient.connect(
        service.stun.primary, USER, PASSWORD, transport="tcp"
    )
    await client.allocate()
    assert len(service.core.allocations) == 1
    assert client._tcp is not None
    client._tcp.abort()  # no Refresh(0): the server must notice the close
    assert await eventually(lambda: service.core.allocations == {})
    assert service.relays == set()
    assert await eventually(lambda: open_fds() <= fds)


# ------------------------------------------------------------------ metrics, Binding


async def test_metrics_and_binding_on_turn_port(turn: Any) -> None:
    service: TurnService = await turn()
    peer = Peer()
    try:
        async with await TurnClient.connect(service.stun.primary, USER, PASSWORD) as c:
            await c.allocate()
            await c.bind_channel(peer.address)
            await c.send(b"x" * 10, peer.address)
            assert await peer.recv() == b"x" * 10
            assert c.relayed is not None
            peer.sock.sendto(b"y" * 7, c.relayed)
            assert await c.receive(timeout=2) == (b"y" * 7, peer.address)
            text = await asyncio.to_thread(_metrics_text, service)
            assert "crossroads_turn_allocations 1.0" in text
            assert "crossroads_turn_channels 1.0" in text
            assert "crossroads_turn_permissions 1.0" in text
            assert (
                'crossroads_turn_relayed_packets_total{direction="to_peer"} 1.0' in text
            )
            assert (
                'crossroads_turn_relayed_bytes_total{direction="to_client"} 7.0' in text
            )
            assert (
                'crossroads_turn_responses_total{code="0",method="allocate"} 1.0'
                in text
            )
        # TURN servers answer Binding too (same port).
        raw = RawClient(service.stun.primary)
        try:
            answer = await raw.request(
                encode(Message(Class.REQUEST, Method.BINDING, os.urandom(12)))
            )
            assert answer is not None and answer.msg_class == Class.SUCCESS
        finally:
            raw.close()
    finally:
        peer.close()


def _metrics_text(service: TurnService) -> str:
    from prometheus_client import generate_latest

    return generate_latest(service.ctx.metrics).decode()


async def test_send_indication_slow_and_fast_paths_agree(turn: Any) -> None:
    service: TurnService = await turn()
    peer = Peer()
    raw = RawClient(service.stun.primary)
    try:
        session, _ = await signed_allocate(raw)
        await create_permission(raw, session, peer.address)
        indication = Message(
            Class.INDICATION,
            Method.SEND,
            os.urandom(12),
            (XorPeerAddress(*peer.address), Data(b"fast")),
        )
        raw.send(encode(indication, fingerprint=True))  # fast path
        assert await peer.recv() == b"fast"
        # SOFTWARE makes the fast parser give up: the full decoder handles it.
        from crossroads.proto.stun import Software

        slow = Message(
            Class.INDICATION,
            Method.SEND,
            os.urandom(12),
            (XorPeerAddress(*peer.address), Data(b"slow"), Software("test")),
        )
        raw.send(encode(slow))
        assert await peer.recv() == b"slow"
    finally:
        raw.close()
        peer.close()


async def test_data_indications_move_to_the_data_plane_after_the_first(
    turn: Any,
) -> None:
    """A permitted peer without a channel: the first datagram is answered by
    the Python path, which installs a Data indication route; the next ones
    leave by that route, identical indications on the wire."""
    service: TurnService = await turn()
    peer = Peer()
    raw = RawClient(service.stun.primary)
    try:
        session, _ = await signed_allocate(raw)
        await create_permission(raw, session, peer.address)
        (relay,) = service.relays
        loop = asyncio.get_running_loop()
        got = []
        for n in range(3):
            peer.sock.sendto(b"data %d" % n, relay.sock.getsockname())
            wire = await asyncio.wait_for(loop.sock_recv(raw.sock, 4096), 2)
            message = decode(wire)
            assert (message.msg_class, message.method) == (
                Class.INDICATION,
                Method.DATA,
            )
            got.append((message.get(XorPeerAddress), message.get(Data)))
        assert [(p.host, p.port) for p, _ in got] == [peer.address] * 3
        assert [d.value for _, d in got] == [b"data 0", b"data 1", b"data 2"]
        assert peer.address in relay.peer_routes
        assert relay.tap.forwarded == 2
        to_peer, _, to_client, to_client_bytes, _ = service.counters()
        assert (to_client, to_client_bytes) == (3, 18)
        # A channel bound to the peer takes over its route: ChannelData now.
        await bind_channel(raw, session, peer.address)
        assert relay.learned == 0
        peer.sock.sendto(b"chan", relay.sock.getsockname())
        wire = await asyncio.wait_for(loop.sock_recv(raw.sock, 4096), 2)
        assert wire == b"\x40\x01\x00\x04chan"
    finally:
        raw.close()
        peer.close()


async def test_sends_to_this_host_take_the_data_plane_once_judged(turn: Any) -> None:
    """A loopback peer is one of the server's own hosts: the control plane
    judges each port. An approved port's Send indications then take the data
    plane (for a second at a time); a service port is refused every time."""
    service: TurnService = await turn()
    peer = Peer()
    raw = RawClient(service.stun.primary)
    try:
        session, _ = await signed_allocate(raw)
        await create_permission(raw, session, peer.address)
        taps = [t for e, t in service.taps.items() if e.local == service.stun.primary]
        tap = taps[0] if ACCELERATED else None
        for n in range(5):
            indication = Message(
                Class.INDICATION,
                Method.SEND,
                os.urandom(12),
                (XorPeerAddress(*peer.address), Data(b"%d" % n)),
            )
            raw.send(encode(indication))
            assert await peer.recv() == b"%d" % n
        if tap is not None:
            assert tap.forwarded >= 3  # the first went through Python
        stun_port = service.stun.primary
        for _ in range(3):
            raw.send(
                encode(
                    Message(
                        Class.INDICATION,
                        Method.SEND,
                        os.urandom(12),
                        (XorPeerAddress(*stun_port), Data(b"binding?")),
                    )
                )
            )
        refused = service.core.counters.drops

        assert await eventually(lambda: refused.get("peer-service-port", 0) == 3)
    finally:
        raw.close()
        peer.close()


# ------------------------------------------------------------------ configuration


def test_config_flags_env_and_toml() -> None:
    from crossroads.services import load_service_modules
    from crossroads.services.turn import Config

    load_service_modules()
    config = build_config(
        flags={"turn.user": ["a:1", "b:2"], "turn.relay_ports": "50000-50100"},
        env={"CROSSROADS_ALLOW_LOOPBACK_PEERS": "true", "CROSSROADS_TURN_SECRET": "s"},
        file_data={"turn": {"realm": "example.org", "user_quota": 5}},
    )
    section = config.section("turn", Config)
    assert section.user == ("a:1", "b:2")
    assert section.relay_ports == (50000, 50100)
    assert section.allow_loopback_peers is True
    assert section.secret == ("s",)
    assert section.realm == "example.org" and section.user_quota == 5
    for bad in (
        {"turn.user": ["nocolon"]},
        {"turn.relay_ports": "10-5"},
        {"turn.denied_peers": ["not-a-net"]},
        {"turn.max_lifetime": "10"},
        {"turn.alternate_server": ["nowhere"]},
    ):
        with pytest.raises(ConfigError, match="turn"):
            build_config(flags=bad, env={})


async def test_users_file_errors_are_config_errors(tmp_path: Any) -> None:
    broken = tmp_path / "users"
    broken.write_text("ok:1\nbroken line\n")
    with pytest.raises(ConfigError, match="line 2"):
        await start(
            default_config(
                loopback_config(turn__users_file=str(broken), core__only=["turn"])
            )
        )
    with pytest.raises(ConfigError, match="users_file"):
        await start(
            default_config(
                loopback_config(
                    turn__users_file=str(tmp_path / "missing"), core__only=["turn"]
                )
            )
        )


async def test_only_turn_starts_its_own_stun_listener() -> None:
    runtime = await start(
        default_config(loopback_config(core__only=["turn"], turn__user=["a:b"]))
    )
    try:
        assert list(runtime.services) == ["turn"]
        service = service_of(runtime)
        assert service.owns_stun
        raw = RawClient(service.stun.primary)
        try:
            answer = await raw.request(
                encode(Message(Class.REQUEST, Method.BINDING, os.urandom(12)))
            )
            assert answer is not None and answer.msg_class == Class.SUCCESS
        finally:
            raw.close()
        host, port = runtime.http_address
        async with httpx.AsyncClient() as http:
            text = (await http.get(f"http://{host}:{port}/metrics")).text
        assert "crossroads_turn_allocations" in text
        assert "crossroads_stun_requests_total" in text
    finally:
        await runtime.close()


async def test_bandwidth_limit_per_allocation(turn: Any) -> None:
    service: TurnService = await turn(turn__max_bps=1000)
    peer = Peer()
    try:
        async with await TurnClient.connect(service.stun.primary, USER, PASSWORD) as c:
            await c.allocate()
            await c.bind_channel(peer.address)
            for _ in range(10):
                await c.send(b"x" * 400, peer.address)  # 4000 bytes at once
            received = 0
            while await peer.recv(0.3) is not None:
                received += 1
            # One second's worth (1000 bytes) passes: two or three datagrams.
            assert 1 <= received <= 3
            assert sum(r.budget.throttled for r in service.relays) >= 7
            text = await asyncio.to_thread(_metrics_text, service)
            assert 'crossroads_turn_dropped_total{reason="bandwidth-limit"}' in text
    finally:
        peer.close()


@pytest.mark.parametrize("batch_io", [True, False], ids=["recvmmsg", "asyncio"])
async def test_port_taps_either_socket_kind_from_bind_time(
    turn: Any, batch_io: bool
) -> None:
    """The STUN/TURN port puts TURN's listener tap in front of its socket when
    it binds (recvmmsg endpoint with the C plane, or asyncio endpoint): the tap
    relays ChannelData itself and hands the rest (Allocate, ChannelBind,
    Binding) to the port's per-datagram dispatch. Nothing is rewired when TURN
    stops: the port answers Binding on through the same tap."""
    service: TurnService = await turn(stun__batch_io=batch_io)
    endpoint = service.stun.udp_endpoints[0]
    assert (endpoint in service.taps) == (ACCELERATED or not batch_io)
    peer = Peer()
    raw = RawClient(service.stun.primary)
    try:
        session, _ = await signed_allocate(raw)
        await bind_channel(raw, session, peer.address)
        raw.send(b"\x40\x01\x00\x04ping")
        assert await peer.recv() == b"ping"
        binding = Message(Class.REQUEST, Method.BINDING, os.urandom(12))
        reply = await raw.request(encode(binding))
        assert reply is not None and reply.msg_class == Class.SUCCESS
    finally:
        raw.close()
        peer.close()
    await service.close()
    assert (endpoint in service.port.routes.taps) == (ACCELERATED or not batch_io)
    # STUN alone answers on its socket.
    raw = RawClient(service.stun.primary)
    try:
        binding = Message(Class.REQUEST, Method.BINDING, os.urandom(12))
        reply = await raw.request(encode(binding))
        assert reply is not None and reply.msg_class == Class.SUCCESS
    finally:
        raw.close()
