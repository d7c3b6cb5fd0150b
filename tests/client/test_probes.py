"""The doctor's UDP probes against the real protocol cores (in memory): each
core answers the probe, the probe's parser reads that answer, and the answer is
no larger than the probe (the relay and natneg cores run with a reflection
budget of zero allowance: a reply larger than its request would be refused).
Against real processes and ports: tests/test_admincli.py (doctor)."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from crossroads.client import probes
from crossroads.errors import DecodeError
from crossroads.proto.natneg.server import NatNegServer, NatNegSocket
from crossroads.proto.raknet.node import RakNetNode
from crossroads.proto.reflection import ReflectionBudget, ReflectionSettings
from crossroads.proto.relay import messages as relay
from crossroads.proto.relay.server import RelayServer, RelayServerConfig
from crossroads.proto.relay.token import TokenSealer
from tests.conftest import free_port

CLIENT = ("198.51.100.7", 40000)


def no_allowance() -> ReflectionBudget:
    return ReflectionBudget(ReflectionSettings(allowance=0, global_allowance=0))


def test_the_relay_answers_the_ping_with_error_4_no_larger() -> None:
    core = RelayServer(
        RelayServerConfig(node_id="n"),
        TokenSealer(os.urandom(32), os.urandom),
        reflection=no_allowance(),
    )
    probe = probes.relay_probe()
    core.receive_datagram(probe.request, CLIENT, 1.0)
    [(answer, to)] = core.datagrams_to_send(1.0)
    assert to == CLIENT and len(answer) <= len(probe.request)
    assert probe.parse(answer) == relay.ErrorCode.ALLOCATION_ID_NOT_FOUND
    # Another probe's ERROR (another allocation ID) is not this one's answer.
    assert probes.relay_probe().parse(answer) is None


@pytest.mark.parametrize(
    ("role", "endpoint"),
    [
        ("natneg1", NatNegSocket.PRIMARY),
        ("natneg2", NatNegSocket.NATNEG2),
        ("natneg3", NatNegSocket.NATNEG3),
    ],
)
def test_natneg_answers_address_check_with_the_address_seen(
    role: str, endpoint: NatNegSocket
) -> None:
    core = NatNegServer(reflection=no_allowance())
    probe = probes.natneg_probe(role)
    core.receive_datagram(probe.request, CLIENT, 1.0, endpoint)
    [(answer, to, sent_from)] = core.datagrams_to_send(1.0)
    assert to == CLIENT and sent_from == endpoint
    assert len(answer) <= len(probe.request)
    assert probe.parse(answer) == CLIENT


def test_raknet_answers_the_unconnected_ping_with_its_guid() -> None:
    node = RakNetNode(guid=0x1234)
    probe = probes.raknet_probe()
    node.receive_datagram(probe.request, CLIENT, 1.0)
    [(answer, to)] = node.datagrams_to_send(1.0)
    assert to == CLIENT and len(answer) <= len(probe.request)
    assert probe.parse(answer) == 0x1234
    # A pong to another ping (another time) is not this probe's answer.
    assert probes.raknet_probe().parse(answer) is None
    with pytest.raises(DecodeError):
        probe.parse(probe.request)


def test_raknet_answers_the_port_stride_ping_from_its_main_socket() -> None:
    node = RakNetNode(guid=0x1234)
    probe = probes.raknet_stride_probe()
    node.receive_second(probe.request, CLIENT, 1.0)
    # datagrams_to_send is the main socket's queue: the pong leaves from there.
    [(answer, to)] = node.datagrams_to_send(1.0)
    assert to == CLIENT and len(answer) <= len(probe.request)
    assert probe.parse(answer) == CLIENT[1]
    assert probes.raknet_stride_probe().parse(answer) is None


def test_a_port_nobody_listens_on_fails_at_once() -> None:
    """Connected UDP sockets surface the ICMP port unreachable: the probe does
    not wait for its tries (a timing bound would be fragile; the message says
    which way it failed)."""
    port = free_port(socket.SOCK_DGRAM)
    with pytest.raises(probes.ProbeError, match="port unreachable"):
        asyncio.run(probes.raknet_ping(("127.0.0.1", port)))


def test_a_server_that_only_echoes_is_not_taken_for_the_relay() -> None:
    """An echo (a reflector, another protocol's server) returns the PING itself:
    not an answer, so the probe reports no answer after its tries."""

    async def scenario() -> None:
        loop = asyncio.get_running_loop()

        class Echo(asyncio.DatagramProtocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                assert isinstance(transport, asyncio.DatagramTransport)
                self.transport = transport

            def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
                self.transport.sendto(data, addr)

        transport, _ = await loop.create_datagram_endpoint(
            Echo, local_addr=("127.0.0.1", 0)
        )
        try:
            probe = probes.relay_probe()
            with pytest.raises(probes.ProbeError, match="no answer to 2 tries"):
                await probes.exchange(
                    transport.get_extra_info("sockname"),
                    probe.request,
                    probe.parse,
                    tries=2,
                    interval=0.2,
                )
        finally:
            transport.close()

    asyncio.run(scenario())
