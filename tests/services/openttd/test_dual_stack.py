"""IPv4 and IPv6 together (``--host ::``, dual-stack sockets on loopback)."""

from __future__ import annotations

import pytest

from crossroads.client.openttd import GameInfoResponder, GcClient, PacketStream
from crossroads.config import default_config
from crossroads.proto.openttd.coordinator import (
    ClientConnect,
    ConnectFailed,
    ConnectionType,
    GcConnectFailed,
    GcConnecting,
    GcDirectConnect,
    GcRegisterAck,
    GcStunConnect,
    GcStunRequest,
    ServerRegister,
    StunResult,
)
from crossroads.proto.openttd.stun import StunRequest, encode_stun_packet
from crossroads.runtime import start
from tests.conftest import loopback_config
from tests.services.openttd.helpers import AF_INET, AF_INET6, port_of, recv_until

pytestmark = pytest.mark.timeout(60)


async def both_families(port: int, client: GcClient, token: str) -> list[PacketStream]:
    """What OpenTTD does on a dual-stack host: one STUN connection per family."""
    streams = []
    for host, family in (("::1", AF_INET6), ("127.0.0.1", AF_INET)):
        stream = await PacketStream.open(host, port)
        await stream.send(encode_stun_packet(StunRequest(6, token, family)))
        streams.append(stream)
        await client.send_message(StunResult(6, token, family, True))
    return streams


async def test_dual_stack_registration_and_ipv6_stun_pairing(
    game_server: GameInfoResponder,
) -> None:
    rt = await start(
        default_config(loopback_config(core__only="openttd", core__host="::"))
    )
    streams: list[PacketStream] = []
    try:
        stun_port = port_of(rt, "stun")
        server = await GcClient.connect("::1", port_of(rt, "coordinator"))
        await server.send_message(ServerRegister(6, 2, game_server.port, "", ""))
        request = await server.recv()
        assert isinstance(request, GcStunRequest)
        streams += await both_families(stun_port, server, request.token)
        assert isinstance(await server.recv(), GcConnectFailed)
        ack = await server.recv()
        assert isinstance(ack, GcRegisterAck)
        # The game server answers on 127.0.0.1 only: the IPv6 probe fails, the
        # IPv4 one (of the address STUN saw) succeeds.
        assert ack.connection_type is ConnectionType.DIRECT

        client = await GcClient.connect("127.0.0.1", port_of(rt, "coordinator"))
        await client.send_message(ClientConnect(6, ack.invite_code))
        connecting = await client.recv()
        assert isinstance(connecting, GcConnecting)
        assert await client.recv() == GcDirectConnect(
            connecting.token, 1, "127.0.0.1", game_server.port
        )
        await client.send_message(ConnectFailed(6, connecting.token, 1))
        client_request = await client.recv()
        server_request = await recv_until(server, GcStunRequest)
        streams += await both_families(stun_port, client, client_request.token)
        streams += await both_families(stun_port, server, server_request.token)
        # Both families are paired, IPv4 first, each side getting its own
        # family byte and the other's address of that family.
        first = await client.recv()
        assert isinstance(first, GcStunConnect)
        assert (first.tracking_number, first.family, first.host) == (
            2,
            AF_INET,
            "127.0.0.1",
        )
        await client.send_message(ConnectFailed(6, connecting.token, 2))
        second = await client.recv()
        server_first = await recv_until(server, GcStunConnect)
        server_second = await recv_until(server, GcStunConnect)
        assert (server_first.tracking_number, server_second.tracking_number) == (2, 3)
        assert isinstance(second, GcStunConnect)
        assert (second.tracking_number, second.family, second.host) == (
            3,
            AF_INET6,
            "::1",
        )
        assert (server_second.family, server_second.host) == (AF_INET6, "::1")
        await client.close()
        await server.close()
    finally:
        for stream in streams:
            await stream.close()
        await rt.close()
