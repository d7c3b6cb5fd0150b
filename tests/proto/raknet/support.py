"""In-memory RakNet clients for core tests, built on the same reliability layer.

A :class:`Network` delivers everything the core sends to the clients it
addresses (and what no client owns to :attr:`Network.stray`).
"""

from __future__ import annotations

from typing import Protocol

from crossroads.proto.admission import LocalTable
from crossroads.proto.raknet import messages as m
from crossroads.proto.raknet.bitstream import BitWriter
from crossroads.proto.raknet.reliability import (
    Reliability,
    ReliabilityLayer,
)
from crossroads.proto.raknet.udpproxy import ForwarderResult
from crossroads.types import Address

SERVER: Address = ("203.0.113.1", 61111)
CLIENT: Address = ("198.51.100.7", 50000)


class Core(Protocol):
    def receive_datagram(self, data: bytes, addr: Address, now: float) -> None: ...

    def datagrams_to_send(self, now: float) -> list[tuple[bytes, Address]]: ...


def ocr2(guid: int, mtu: int = 1492) -> bytes:
    return m.OpenConnectionRequest2(SERVER, mtu, guid).encode()


class Network:
    def __init__(self, core: Core) -> None:
        self.core = core
        self.clients: dict[Address, Client] = {}
        self.stray: list[tuple[bytes, Address]] = []
        #: Clients that may have something to send (received or queued).
        self.dirty: set[Address] = set()

    def flush(self, now: float) -> None:
        """Move datagrams both ways until both sides are quiet."""
        now_ms = int(now * 1000)
        for _ in range(50):
            moved = False
            for data, addr in self.core.datagrams_to_send(now):
                moved = True
                client = self.clients.get(addr)
                if client is None:
                    self.stray.append((data, addr))
                elif data[0] & 0x80 and not m.is_offline(data):
                    client.inbox += client.layer.receive(data, now_ms)
                    self.dirty.add(addr)
                else:
                    client.offline.append(data)
            dirty, self.dirty = self.dirty, set()
            for addr in dirty:
                client = self.clients[addr]
                for data in client.layer.datagrams(now_ms):
                    moved = True
                    self.core.receive_datagram(data, client.addr, now)
            if not moved:
                return


class Client:
    """Just enough of a RakNet client to drive the server."""

    def __init__(
        self, net: Network | Core, addr: Address = CLIENT, guid: int = 42
    ) -> None:
        self.net = net if isinstance(net, Network) else Network(net)
        self.net.clients[addr] = self
        self.addr = addr
        self.guid = guid
        self.layer = ReliabilityLayer(1492, LocalTable(max_bytes=10**9))
        self.inbox: list[bytes] = []
        self.offline: list[bytes] = []
        self.accepted = b""

    def raw(self, data: bytes, now: float) -> list[bytes]:
        """Send an offline datagram; returns the offline answers."""
        self.offline = []
        self.net.core.receive_datagram(data, self.addr, now)
        self.net.flush(now)
        return self.offline

    def pump(self, now: float) -> None:
        self.net.dirty.add(self.addr)
        self.net.flush(now)

    def send(self, payload: bytes, now: float) -> None:
        self.layer.send(payload, Reliability.RELIABLE_ORDERED, 0, int(now * 1000))
        self.net.dirty.add(self.addr)
        self.net.flush(now)

    def take(self, kind: int) -> list[bytes]:
        """Remove and return the received messages with this first byte."""
        found = [p for p in self.inbox if p[0] == kind]
        self.inbox = [p for p in self.inbox if p[0] != kind]
        return found

    def connect(self, now: float = 1.0, lan: Address = ("192.168.1.20", 50000)) -> None:
        self.raw(m.OpenConnectionRequest1(6, 1492).encode(), now)
        self.raw(ocr2(self.guid), now)
        writer = BitWriter()
        writer.write_u8(m.MessageId.CONNECTION_REQUEST)
        writer.write_u64(self.guid)
        writer.write_u64(1234)
        writer.write_bool(False)
        self.send(writer.data(), now)
        (self.accepted,) = self.take(m.MessageId.CONNECTION_REQUEST_ACCEPTED)
        writer = BitWriter()
        writer.write_u8(m.MessageId.NEW_INCOMING_CONNECTION)
        writer.write_address(SERVER)
        writer.write_address(lan)
        for _ in range(9):
            writer.write_address(("0.0.0.0", 0))
        writer.write_u64(1)
        writer.write_u64(2)
        self.send(writer.data(), now)


class RecordingForwarders:
    """A built-in forwarder that records what it is asked and answers ``result``."""

    def __init__(self, result: ForwarderResult = ForwarderResult.SUCCESS) -> None:
        self.result = result
        self.started: list[tuple[Address, Address, int]] = []
        #: Addresses whose coordinator connection closed, in order.
        self.ended: list[Address] = []

    def start(
        self,
        source: Address,
        target: Address,
        timeout_ms: int,
        requester: Address | None = None,
    ) -> tuple[ForwarderResult, int]:
        self.started.append((source, target, timeout_ms))
        return self.result, 45000

    def end_client(self, address: Address) -> int:
        self.ended.append(address)
        return 0
