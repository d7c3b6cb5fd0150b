"""The relay's UDP endpoint: fast path, slow path and timers on real sockets."""

from __future__ import annotations

import asyncio
import os
import socket
import time

import pytest

from crossroads.proto.policy import AddressPolicy, Scope
from crossroads.proto.relay import messages as m
from crossroads.proto.relay.server import (
    AllocationBound,
    Event,
    RelayServer,
    RelayServerConfig,
)
from crossroads.proto.relay.token import AllocationClaims, Role, TokenSealer, bind_hmac
from crossroads.transport.relay import RelayEndpoint
from crossroads.transport.sockets import make_udp_socket

pytestmark = pytest.mark.timeout(30)

SEALER = TokenSealer(b"t" * 32, os.urandom)
LOOPBACK_CLIENTS = AddressPolicy(admitted=frozenset({Scope.LOOPBACK}))


def bind_message(allocation_id: bytes, token: bytes, nonce: int) -> bytes:
    unsigned = m.Bind(
        nonce=nonce, connection_data=m.pad_connection_data(token), hmac=bytes(32)
    )
    mac = bind_hmac(SEALER.key_for(allocation_id), unsigned.signed_bytes())
    return unsigned.signed_bytes() + mac


def allocation(role: Role, host_id: bytes | None = None) -> tuple[bytes, bytes]:
    aid = os.urandom(16)
    claims = AllocationClaims(aid, host_id or aid, role, 4, time.time() + 30)
    return aid, SEALER.seal(claims, "node")


class Peer:
    def __init__(self, family: int, host: str, server: tuple[str, int]) -> None:
        self.sock = socket.socket(family, socket.SOCK_DGRAM)
        self.sock.bind((host, 0))
        self.sock.setblocking(False)
        self.server = server

    async def request(self, data: bytes) -> bytes:
        loop = asyncio.get_running_loop()
        for _ in range(5):
            self.sock.sendto(data, self.server)
            try:
                reply, _ = await asyncio.wait_for(
                    loop.sock_recvfrom(self.sock, 70000), 0.5
                )
                return reply
            except TimeoutError:
                continue
        raise TimeoutError

    async def recv(self) -> bytes:
        loop = asyncio.get_running_loop()
        reply, source = await asyncio.wait_for(loop.sock_recvfrom(self.sock, 70000), 2)
        # Relayed frames leave from the address the client sends to.
        assert source[:2] == self.server
        return reply


async def run_session(
    bind_host: str, family: int, client_host: str, server_host: str
) -> None:
    core = RelayServer(
        RelayServerConfig(node_id="node", policy=LOOPBACK_CLIENTS),
        SEALER,
        wall_offset=time.time() - asyncio.get_running_loop().time(),
    )
    events: list[Event] = []
    endpoint = RelayEndpoint(core, make_udp_socket(bind_host, 0), events.extend)
    endpoint.start()
    port = endpoint.sock.getsockname()[1]
    host = Peer(family, client_host, (server_host, port))
    joiner = Peer(family, client_host, (server_host, port))
    try:
        hid, htoken = allocation(Role.HOST)
        jid, jtoken = allocation(Role.JOINER, hid)
        assert (
            await host.request(bind_message(hid, htoken, 0))
            == m.BindReceived().encode()
        )
        assert (
            await joiner.request(bind_message(jid, jtoken, 0))
            == m.BindReceived().encode()
        )
        connect = m.ConnectRequest(jid, m.pad_connection_data(htoken)).encode()
        assert await joiner.request(connect) == m.Accepted(hid, jid).encode()
        assert any(isinstance(e, AllocationBound) for e in events)
        for n in range(50):
            joiner.sock.sendto(m.Relay(jid, hid, bytes([n])).encode(), joiner.server)
        got = {await host.recv() for _ in range(50)}
        assert got == {m.Relay(jid, hid, bytes([n])).encode() for n in range(50)}
        host.sock.sendto(m.Relay(hid, jid, b"back").encode(), host.server)
        assert await joiner.recv() == m.Relay(hid, jid, b"back").encode()
        # Forwarded frames went through the fast path: the core only counts them.
        assert core.relayed()[0] == 51
        assert core.drops == {}
    finally:
        endpoint.close()
        host.sock.close()
        joiner.sock.close()


async def test_ipv4_socket() -> None:
    await run_session("127.0.0.1", socket.AF_INET, "127.0.0.1", "127.0.0.1")


async def test_ipv6_socket() -> None:
    await run_session("::1", socket.AF_INET6, "::1", "::1")


async def test_dual_stack_socket_serves_ipv4_clients() -> None:
    await run_session("::", socket.AF_INET, "127.0.0.1", "127.0.0.1")


async def test_wildcard_socket_relays_from_the_address_each_client_sent_to() -> None:
    # 127.0.0.3 is not the address the kernel would pick to reach 127.0.0.1.
    await run_session("0.0.0.0", socket.AF_INET, "127.0.0.1", "127.0.0.3")


async def test_timers_fire_without_traffic() -> None:
    core = RelayServer(
        RelayServerConfig(
            node_id="node",
            policy=LOOPBACK_CLIENTS,
            idle_timeout=0.2,
            host_alone_timeout=0.2,
        ),
        SEALER,
        wall_offset=time.time() - asyncio.get_running_loop().time(),
    )
    endpoint = RelayEndpoint(core, make_udp_socket("127.0.0.1", 0))
    endpoint.start()
    peer = Peer(socket.AF_INET, "127.0.0.1", endpoint.sock.getsockname())
    try:
        hid, htoken = allocation(Role.HOST)
        assert (
            await peer.request(bind_message(hid, htoken, 0))
            == m.BindReceived().encode()
        )
        # Nothing more is sent: the relay's own timer ends the allocation.
        assert await peer.recv() == m.Error(hid, m.ErrorCode.PLAYER_TIMED_OUT).encode()
        assert not core.allocations
    finally:
        endpoint.close()
        peer.sock.close()
