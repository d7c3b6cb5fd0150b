"""The ladder runner on loopback: real UDP sockets, a hand-made plan."""

from __future__ import annotations

import asyncio
import socket

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from crossroads.client.peer import LadderRun, PeerSocket
from crossroads.proto.punch.ladder import Plan, Spray, Step
from crossroads.proto.punch.secure import SecureChannel, derive_keys

pytestmark = pytest.mark.timeout(30)


def closed_udp_ports(count: int) -> list[int]:
    """Loopback ports nothing listens on (bound, read, closed)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(count)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


async def test_spray_finds_the_one_open_port_and_stops() -> None:
    a_key, b_key = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    a_keys = derive_keys(a_key, b_key.public_key().public_bytes_raw(), b"\0")
    b_keys = derive_keys(b_key, a_key.public_key().public_bytes_raw(), b"\0")
    a_side, b_side = PeerSocket(), PeerSocket()
    await a_side.open("127.0.0.1")
    await b_side.open("127.0.0.1")
    try:
        # The random side's plan: 8 sockets, each to 64 ports of which one is
        # the other side's socket (the hole), sent at 2000/s.
        ports = closed_udp_ports(63)
        ports.insert(40, b_side.local[1])
        spray = Spray(0.0, "punch", "127.0.0.1", tuple(ports), 8, 2000.0)
        plan = Plan(
            steps=[Step("punch", 0.0, spray.duration)],
            initiator_sprays=[spray],
            initiator_sockets=8,
        )
        extra = await a_side.open_extra(8)
        a_run = LadderRun(a_side, SecureChannel(a_keys), plan, "initiator", extra)
        b_run = LadderRun(b_side, SecureChannel(b_keys), Plan(), "responder", [])
        a_side.route(a_keys.recv_id, a_run.receive)
        b_side.route(b_keys.recv_id, b_run.receive)
        t_go = asyncio.get_running_loop().time() + 0.05
        a_run.start(t_go)
        b_run.start(t_go, extra_delay=5)
        result = await asyncio.wait_for(a_run.result, 10)
        assert result.ok and result.step == "punch"
        # the answer came back on the first extra socket, from the hole
        assert result.via is extra[0]
        assert result.addr == b_side.local
        # the spray stopped once the path was found: far fewer than 8 x 64 sent
        await asyncio.sleep(0.2)
        assert 64 <= a_run.sprayed < 8 * 64
        a_run.stop()
        b_run.stop()
    finally:
        for transport in extra:
            transport.close()
        a_side.close()
        b_side.close()


async def test_sequential_side_spray_sends_one_probe_per_port_and_counts_flows() -> (
    None
):
    key = X25519PrivateKey.generate()
    keys = derive_keys(
        key, X25519PrivateKey.generate().public_key().public_bytes_raw(), b"\0"
    )
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sink.bind(("127.0.0.1", 0))
    sink.setblocking(False)
    side = PeerSocket()
    await side.open("127.0.0.1")
    try:
        ports = [sink.getsockname()[1], *closed_udp_ports(99)]
        spray = Spray(0.0, "punch", "127.0.0.1", tuple(ports), 0, 5000.0)
        plan = Plan(steps=[Step("punch", 0.0, 0.1)], initiator_sprays=[spray])
        run = LadderRun(side, SecureChannel(keys), plan, "initiator", [])
        run.start(asyncio.get_running_loop().time())
        await asyncio.wait_for(run.result, 5)
        assert run.sprayed == 100
        # every aim is a new destination of the peer socket: the flow count the
        # next punch attempt reports includes them
        assert side.flows([]) == 100
        data = sink.recv(2048)
        assert data  # a sealed probe
        run.stop()
    finally:
        sink.close()
        side.close()
