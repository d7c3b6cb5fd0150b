"""Item 2 of the hardening issue: no relay reaches into the server itself, one
policy for every relay, and a relay serves the scope it advertises.

Each test fails on the code before the shared policy (crossroads.proto.policy):
the TURN Connect fetched /metrics, the Send reached the STUN port, the two
relay-only clients got 403, the loopback BIND was dropped without a word.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import pytest

from crossroads.client.turn import TurnClient, TurnClientError
from crossroads.proto.stun import Method, RequestedTransport, XorPeerAddress
from tests.adversarial.peer_policy_support import (
    PASSWORD,
    USER,
    binding_request,
    relay_allocation,
    resend_until_received,
    turn_of,
    turn_runtime,
)
from tests.conftest import eventually
from tests.e2e.relay_support import (
    BIND_RECEIVED,
    RawPeer,
    raw_bind,
    relay_runtime,
)

pytestmark = pytest.mark.timeout(60)


async def test_turn_connect_to_own_http_port_is_403(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """RFC 6062 Connect to the server's own HTTP port: 403, not /metrics.
    Loopback peers are allowed here on purpose (--allow-loopback-peers): the
    server's own listening ports stay out of reach even then."""
    async with turn_runtime(turn__allow_loopback_peers=True) as runtime:
        service = turn_of(runtime)
        async with await TurnClient.connect(
            service.stun.primary, USER, PASSWORD, transport="tcp", timeout=5
        ) as client:
            await client.request(Method.ALLOCATE, [RequestedTransport(6)])
            with pytest.raises(TurnClientError) as refused:
                await client.request(
                    Method.CONNECT, [XorPeerAddress(*runtime.http_address)]
                )
            assert refused.value.code == 403
        assert service.core.counters.drops.get("peer-service-port") == 1
        assert any(
            "peer 127.0.0.1 refused: service-port" in r.getMessage()
            for r in caplog.records
        )


async def test_turn_send_to_own_stun_and_relay_ports_is_not_relayed() -> None:
    async with turn_runtime(
        core__only=["stun", "turn", "relay"], turn__allow_loopback_peers=True
    ) as runtime:
        service = turn_of(runtime)
        stun_port = service.stun.primary
        relay: Any = runtime.services["relay"]
        unity_relay = ("127.0.0.1", relay.bound[1])
        async with await TurnClient.connect(
            stun_port, USER, PASSWORD, timeout=5
        ) as client:
            await client.allocate()
            await client.create_permission("127.0.0.1")
            await client.send(binding_request(), stun_port)
            await client.send(b"\xda\x72\x00\x02" + bytes(18), unity_relay)

            async def counted() -> bool:
                return service.core.counters.drops.get("peer-service-port", 0) >= 2

            await eventually(counted, "the Sends to our own STUN and relay ports")
            # An ordinary loopback peer is still reached, and its answer is the
            # first thing back: the STUN port's answer, had the Send been
            # relayed, would have come before it.
            peer = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            peer.bind(("127.0.0.1", 0))
            peer.setblocking(False)
            try:
                await client.send(b"ping", peer.getsockname())
                loop = asyncio.get_running_loop()
                data, relayed = await asyncio.wait_for(
                    loop.sock_recvfrom(peer, 2048), 5
                )
                assert data == b"ping"
                peer.sendto(b"pong", relayed)
                assert await client.receive(timeout=5) == (
                    b"pong",
                    peer.getsockname(),
                )
            finally:
                peer.close()


async def test_two_relay_only_clients_meet_through_relayed_addresses() -> None:
    """Both clients forced to relay, server on a non-public (here loopback)
    address, no --allow-loopback-peers / --turn-allowed-peers: each client's
    peer is the other's relayed address, which is ours and must be allowed."""
    async with turn_runtime() as runtime:
        server = turn_of(runtime).stun.primary
        async with (
            await TurnClient.connect(server, USER, PASSWORD, timeout=5) as alice,
            await TurnClient.connect(server, USER, PASSWORD, timeout=5) as bob,
        ):
            alice_relayed = await alice.allocate()
            bob_relayed = await bob.allocate()
            await alice.create_permission(bob_relayed)
            await bob.create_permission(alice_relayed)
            await alice.bind_channel(bob_relayed)

            async def both_ways() -> None:
                await alice.send(b"hello over two relays", bob_relayed)
                await bob.send(b"hello back", alice_relayed)

            data, source = await resend_until_received(
                both_ways, bob, "nothing crossed the two relays"
            )
            assert data == b"hello over two relays"
            assert source == alice_relayed
            data, source = await alice.receive(timeout=5)
            assert (data, source) == (b"hello back", bob_relayed)
            # Only the relayed addresses: another port of the same host is not.
            with pytest.raises(TurnClientError) as refused:
                await alice.bind_channel((bob_relayed[0], server[1]))
            assert refused.value.code == 403


async def test_relay_on_loopback_serves_loopback_clients() -> None:
    """`crossroads serve --only relay` on one machine advertises 127.0.0.1; its
    loopback clients used to be dropped silently, failing a new user's first try."""
    async with relay_runtime(relay__allow_private_peers=False) as runtime:
        allocation = await relay_allocation(runtime)
        endpoint = allocation["relayServer"]
        assert endpoint["ipV4"] == "127.0.0.1"
        peer = RawPeer((endpoint["ipV4"], endpoint["port"]))
        try:
            answer = await peer.request(raw_bind(allocation, 1))
            assert answer[:4] == BIND_RECEIVED
        finally:
            peer.close()


async def test_refused_relay_client_is_logged_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A node advertised at a public address does not serve loopback clients;
    the refusal is a metric and a (rate-limited) log line, not silence."""
    caplog.set_level(logging.WARNING, logger="crossroads")
    async with relay_runtime(
        relay__allow_private_peers=False, relay__public_host="203.0.113.9"
    ) as runtime:
        allocation = await relay_allocation(runtime)
        peer = RawPeer(("127.0.0.1", allocation["relayServer"]["port"]))
        try:
            for nonce in range(1, 4):
                peer.send(raw_bind(allocation, nonce))

            async def refused() -> bool:
                value = runtime.metrics.get_sample_value(
                    "crossroads_relay_dropped_datagrams_total",
                    {"reason": "client-loopback"},
                )
                return (value or 0) >= 3

            await eventually(refused, "three loopback BINDs refused and counted")
        finally:
            peer.close()

        async def logged() -> bool:
            return any("refused: loopback" in r.getMessage() for r in caplog.records)

        await eventually(logged, "a log line about the refused client")
        lines = [r for r in caplog.records if "refused: loopback" in r.getMessage()]
        assert len(lines) == 1  # rate-limited: one line for three refusals
