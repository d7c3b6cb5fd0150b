"""Hostile traffic against ``serve --only raknet`` over real UDP, while a real
RakNet 4.081 peer stays connected: handshake floods, connection-slot
exhaustion, a connected attacker sending huge split counts, forged ACK
ranges and ordering gaps, and out-of-band garbage. Everything is dropped and
counted; the attacker's connection is closed; the honest peer is unaffected."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator

import pytest

from crossroads.config import default_config
from crossroads.proto.raknet import messages as m
from crossroads.proto.raknet.bitstream import BitWriter
from crossroads.proto.raknet.reliability import (
    Frame,
    Reliability,
    ReliabilityLayer,
    SplitBudget,
)
from crossroads.runtime import Runtime, start
from crossroads.services.raknet import RakNetService
from crossroads.types import Address
from tests.conftest import eventually, loopback_config, running_service
from tests.interop.raknet_support import RakNetPeer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def rt() -> AsyncIterator[Runtime]:
    runtime = await start(
        default_config(
            loopback_config(
                core__only="raknet",
                raknet__max_connections_per_ip=6,
                raknet__handshakes_per_second=200.0,
            )
        )
    )
    try:
        yield runtime
    finally:
        await runtime.close()


def service_of(rt: Runtime) -> RakNetService:
    return running_service(rt, "raknet", RakNetService)


async def honest_peer_still_served(peer: RakNetPeer) -> None:
    peer.send(bytes([m.MessageId.NAT_REQUEST_BOUND_ADDRESSES]))
    await peer.expect(m.MessageId.NAT_RESPOND_BOUND_ADDRESSES)


class Attacker:
    """A RakNet client built from the project's own reliability layer, on a
    plain UDP socket: it completes the handshake, then misbehaves."""

    def __init__(self, server: Address) -> None:
        self.server = server
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(2)
        self.layer = ReliabilityLayer(1492, SplitBudget(10**9))
        self.guid = int.from_bytes(os.urandom(8), "big")
        self.inbox: list[bytes] = []

    def exchange(self, data: bytes, wait: bool = True) -> bytes | None:
        self.sock.sendto(data, self.server)
        if not wait:
            return None
        return self.sock.recvfrom(2048)[0]

    def pump(self, now_ms: int, rounds: int = 5) -> None:
        for data in self.layer.datagrams(now_ms):
            self.sock.sendto(data, self.server)
        self.sock.settimeout(0.2)
        for _ in range(rounds):
            try:
                data = self.sock.recvfrom(2048)[0]
            except TimeoutError:
                break
            if data[0] & 0x80:
                self.inbox += self.layer.receive(data, now_ms)
        for data in self.layer.datagrams(now_ms):
            self.sock.sendto(data, self.server)

    def connect(self) -> None:
        assert self.exchange(m.OpenConnectionRequest1(6, 1492).encode())
        assert self.exchange(
            m.OpenConnectionRequest2(self.server, 1492, self.guid).encode()
        )
        writer = BitWriter()
        writer.write_u8(m.MessageId.CONNECTION_REQUEST)
        writer.write_u64(self.guid)
        writer.write_u64(1)
        writer.write_bool(False)
        self.layer.send(writer.data(), Reliability.RELIABLE_ORDERED, 0, 1)
        self.pump(1)
        assert any(p[0] == m.MessageId.CONNECTION_REQUEST_ACCEPTED for p in self.inbox)
        writer = BitWriter()
        writer.write_u8(m.MessageId.NEW_INCOMING_CONNECTION)
        for _ in range(11):
            writer.write_address(("0.0.0.0", 0))
        writer.write_u64(1)
        writer.write_u64(2)
        self.layer.send(writer.data(), Reliability.RELIABLE_ORDERED, 0, 2)
        self.pump(2)

    def raw(self, data: bytes) -> None:
        self.sock.sendto(data, self.server)

    def close(self) -> None:
        self.sock.close()


def datagram(number: int, *frames: Frame) -> bytes:
    return b"\x84" + number.to_bytes(3, "little") + b"".join(f.encode() for f in frames)


@pytest.mark.parametrize(
    ("attack", "reason"),
    [
        (
            [Frame(Reliability.RELIABLE, b"\x86", 100, split_count=2**31, split_id=1)],
            "split-count",
        ),
        (
            [
                Frame(
                    Reliability.RELIABLE_ORDERED, b"\x86" * 100, 100 + i, 0, 500 + i, 0
                )
                for i in range(1100)
            ],
            "ordering",
        ),
        ([Frame(Reliability.RELIABLE, b"\x86", 2**22)], "window"),
        (
            [
                Frame(
                    Reliability.RELIABLE,
                    bytes(1000),
                    100 + i,
                    split_count=1000,
                    split_id=i,
                )
                for i in range(17)
            ],
            "splits",
        ),
    ],
)
async def test_a_connected_attacker_is_cut_off_and_others_are_unaffected(
    rt: Runtime, attack: list[Frame], reason: str
) -> None:
    service = service_of(rt)
    server = service.addresses[0]
    honest = RakNetPeer()
    attacker = Attacker(server)
    loop = asyncio.get_running_loop()
    try:
        await honest.connect(*server)
        await loop.run_in_executor(None, attacker.connect)
        assert service.node.peer.connected_count == 2
        for i, frame in enumerate(attack):
            attacker.raw(datagram(10 + i, frame))
        dropped = service.node.peer.stats.dropped

        async def cut_off() -> bool:
            return dropped[reason] >= 1 and service.node.peer.connected_count == 1

        await eventually(cut_off, f"the attacker is dropped for {reason}")
        await honest_peer_still_served(honest)
    finally:
        attacker.close()
        honest.close()


async def test_forged_acks_and_naks_cost_nothing_and_break_nothing(rt: Runtime) -> None:
    service = service_of(rt)
    server = service.addresses[0]
    honest = RakNetPeer()
    attacker = Attacker(server)
    loop = asyncio.get_running_loop()
    wide = bytes(3) + b"\xff\xff\x7f"  # one range over 8M datagram numbers
    try:
        await honest.connect(*server)
        await loop.run_in_executor(None, attacker.connect)
        for _ in range(50):
            attacker.raw(b"\xc0\x00\x01\x00\x05\x00\x00\x02\x00\x00")  # max < min
            attacker.raw(b"\xc0\x00\x01\x00" + wide)
            attacker.raw(b"\xa0\x00\x01\x00" + wide)  # the same as a NAK
        attacker.raw(b"\xc0\xff\xff")  # 65535 ranges announced: cut off
        dropped = service.node.peer.stats.dropped

        async def counted() -> bool:
            return dropped["bad-range"] >= 50 and dropped["ack-ranges"] == 1

        await eventually(counted, "forged ranges dropped and counted")
        assert service.node.peer.connected_count == 1
        await honest_peer_still_served(honest)
    finally:
        attacker.close()
        honest.close()


async def test_handshake_floods_and_slot_exhaustion(rt: Runtime) -> None:
    service = service_of(rt)
    server = service.addresses[0]
    honest = RakNetPeer()
    try:
        await honest.connect(*server)
        flooders = []
        for i in range(10):  # 10 half-open handshakes from one IP: 6 records
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind(("127.0.0.1", 0))
            s.sendto(m.OpenConnectionRequest2(server, 1492, 1000 + i).encode(), server)
            flooders.append(s)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            for _ in range(2000):
                sock.sendto(m.OpenConnectionRequest1(6, 1492).encode(), server)
        dropped = service.node.peer.stats.dropped

        async def counted() -> bool:
            return dropped["handshake-ip-rate"] > 0 and dropped["handshake-evicted"] > 0

        await eventually(counted, "the flood is rate limited, the oldest records go")
        for s in flooders:
            s.close()
        assert len(service.node.peer.handshakes) <= 6
        assert len(service.node.peer.connections) <= 6
        await honest_peer_still_served(honest)
    finally:
        honest.close()


async def test_out_of_band_and_offline_garbage_is_dropped_and_counted(
    rt: Runtime,
) -> None:
    service = service_of(rt)
    honest = RakNetPeer()
    garbage = [
        b"",
        b"\x0d",
        b"\x0d" + bytes(8) + m.MAGIC[:8],  # truncated out-of-band header
        b"\x05" + m.MAGIC,  # REQUEST_1 without a protocol byte
        b"\x07" + m.MAGIC + b"\x09",  # REQUEST_2 with a bad address family
        b"\x84\x00\x00\x00\x60\x00",  # a connected datagram from a stranger
        b"\xff" * 700,
    ]
    try:
        await honest.connect(*service.addresses[0])
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            for data in garbage:
                for addr in service.addresses:
                    sock.sendto(data, addr)
        peer = service.node.peer

        async def counted() -> bool:
            return (
                sum(peer.stats.dropped.values()) >= 4
                and service.node.second_dropped >= 5
            )

        await eventually(counted, "the garbage is counted")
        assert peer.stats.dropped["unknown-source"] >= 1
        await honest_peer_still_served(honest)
    finally:
        honest.close()
