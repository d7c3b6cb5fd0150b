"""Item 7 of the hardening issue: every UDP service answers from the address
the client sent to.

Each server is bound to the wildcard 0.0.0.0 (the default ``--host``), and the
client sends to 127.0.0.2: the same socket receives it, and without
IP_PKTINFO the kernel answers from 127.0.0.1, the route's choice -- what a
client behind NAT drops on a host with several addresses. Each test fails on
the code before crossroads.transport.pktinfo.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
from typing import Any

import pytest
import websockets

from crossroads.client.turn import TurnClient
from crossroads.config import default_config
from crossroads.proto.natneg.packets import Init, PacketType, PortType
from crossroads.proto.punch.rendezvous import Observed, Probe
from crossroads.runtime import start
from tests.adversarial.peer_policy_support import (
    PASSWORD,
    USER,
    AliasClient,
    relay_allocation,
    resend_until_received,
    turn_of,
    turn_runtime,
)
from tests.conftest import loopback_config
from tests.e2e.relay_support import BIND_RECEIVED, raw_bind, relay_runtime

pytestmark = pytest.mark.timeout(60)

WILDCARD = "0.0.0.0"


@pytest.mark.parametrize("batch_io", [True, False])
async def test_turn_answers_and_relays_from_the_address_it_was_sent_to(
    batch_io: bool,
) -> None:
    async with turn_runtime(
        core__host=WILDCARD,
        turn__allow_loopback_peers=True,
        stun__batch_io=batch_io,
    ) as runtime:
        port = turn_of(runtime).stun.primary[1]
        # A connected socket only accepts datagrams from 127.0.0.2:port: the
        # 401, the Allocate answer and the Data indication all must come from it.
        async with await TurnClient.connect(
            (AliasClient.SERVER_IP, port), USER, PASSWORD, timeout=5
        ) as client:
            relayed = await client.allocate()
            await client.create_permission("127.0.0.1")
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as peer:
                peer.bind(("127.0.0.1", 0))
                to_relay = ("127.0.0.1", relayed[1])
                received = await resend_until_received(
                    lambda: peer.sendto(b"to the client", to_relay),
                    client,
                    "no Data indication from 127.0.0.2",
                )
                assert received == (b"to the client", peer.getsockname())
                # With a channel (ChannelData, the C data plane's path otherwise).
                await client.bind_channel(peer.getsockname())
                received = await resend_until_received(
                    lambda: peer.sendto(b"on a channel", to_relay),
                    client,
                    "no ChannelData from 127.0.0.2",
                )
                assert received == (b"on a channel", peer.getsockname())


async def test_unity_relay_answers_from_the_address_it_was_sent_to() -> None:
    async with relay_runtime(core__host=WILDCARD) as runtime:
        allocation = await relay_allocation(runtime)
        client = AliasClient()
        try:
            answer, source = await client.exchange(
                raw_bind(allocation, 1), allocation["relayServer"]["port"]
            )
        finally:
            client.close()
        assert answer[:4] == BIND_RECEIVED
        assert source[0] == AliasClient.SERVER_IP


async def test_natneg_answers_from_the_address_it_was_sent_to() -> None:
    runtime = await start(
        default_config(
            loopback_config(
                core__only="natneg", core__host=WILDCARD, natneg__relay_mode="never"
            )
        )
    )
    try:
        service: Any = runtime.services["natneg"]
        port = service.addresses[next(iter(service.addresses))][1]
        init = Init(
            version=3,
            cookie=0x1234,
            port_type=PortType.GP,
            client_index=0,
            use_game_port=0,
            local_ip="127.0.0.1",
            local_port=4000,
            game_name="gmtest",
        )
        client = AliasClient()
        try:
            answer, source = await client.exchange(init.encode(), port)
        finally:
            client.close()
        assert answer[7] == PacketType.INIT_ACK
        assert source == (AliasClient.SERVER_IP, port)
    finally:
        await runtime.close()


async def test_p2p_rendezvous_answers_from_the_address_it_was_sent_to() -> None:
    runtime = await start(
        default_config(loopback_config(core__only="p2p", core__host=WILDCARD))
    )
    try:
        http_port = runtime.http_address[1]
        url = f"ws://127.0.0.1:{http_port}/p2p/v1/ws"
        async with websockets.connect(url) as ws:
            key = base64.b64encode(os.urandom(32)).decode()
            await ws.send(json.dumps({"type": "hello", "v": 1, "key": key}))
            while True:
                welcome = json.loads(await asyncio.wait_for(ws.recv(), 5))
                if welcome["type"] == "welcome":
                    break
            token = bytes.fromhex(welcome["token"])
            client = AliasClient()
            try:
                for index, (_host, port) in enumerate(welcome["udp"]):
                    answer, source = await client.exchange(
                        Probe(token, 0, index).encode(), port
                    )
                    assert Observed.decode(answer).index == index
                    assert source == (AliasClient.SERVER_IP, port)
            finally:
                client.close()
    finally:
        await runtime.close()
