"""RakNet UDPProxy forwarders under the one resource budget.

A real ``crossroads serve --only raknet,stun,turn`` under ``ulimit -n 1024``;
48 RakNet clients from 3 loopback addresses (16 each, the per-IP connection
cap) connect to its UDPProxyCoordinator and ask for a forwarder to every
other client, with RakNet's largest timeout (10 min, what RakNet's own
NATCompleteClient sample asks for). Before, every pair got a forwarder (one
UDP socket each) until the process ran out of descriptors: TURN answered
``Errno 24`` and the forwarders stayed after the clients left. Now they stop
at the ``raknet-forwarders`` table's caps (answered ALL_SERVERS_BUSY and
counted), TURN and HTTP keep working, and when the clients leave their
unused forwarders and sockets are gone. docs/security.md, "RakNet UDPProxy
forwarders".
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from typing import Any

import httpx
import pytest

from crossroads.client.turn import TurnClient
from crossroads.proto.admission import LocalTable
from crossroads.proto.raknet import messages as m
from crossroads.proto.raknet.bitstream import BitWriter
from crossroads.proto.raknet.reliability import (
    Reliability,
    ReliabilityLayer,
)
from crossroads.proto.raknet.udpproxy import Sub
from crossroads.types import Address
from tests.adversarial.connection_flood_support import serve_with_fd_limit
from tests.conftest import eventually, free_port

pytestmark = pytest.mark.timeout(120)

ADMIN_TOKEN = "rkp-admin-token"
SOURCES = ("127.0.0.11", "127.0.0.12", "127.0.0.13")
PER_SOURCE = 16  # --raknet-max-connections-per-ip's default
#: RakNet's UDP_FORWARDER_MAXIMUM_TIMEOUT (UDPProxyCommon.h).
TIMEOUT_MS = 600_000
#: UDPProxyClient's answers to a request (the notification goes to the target).
ANSWERS = {
    Sub.FORWARDING_SUCCEEDED,
    Sub.ALL_SERVERS_BUSY,
    Sub.IN_PROGRESS,
    Sub.NO_SERVERS_ONLINE,
    Sub.RECIPIENT_GUID_NOT_CONNECTED_TO_COORDINATOR,
}


class ProxyClient:
    """A RakNet client (the project's reliability layer on a plain
    non-blocking UDP socket) that asks the coordinator for forwarders, as
    UDPProxyClient::RequestForwarding does."""

    def __init__(self, server: Address, host: str, guid: int) -> None:
        self.server = server
        self.guid = guid
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((host, 0))
        self.sock.setblocking(False)
        self.layer = ReliabilityLayer(1492, LocalTable(max_bytes=10**9))
        self.offline: list[bytes] = []
        self.accepted = False
        self.answers: list[int] = []

    @staticmethod
    def now_ms() -> int:
        return int(time.monotonic() * 1000)

    def pump(self) -> None:
        now = self.now_ms()
        while True:
            try:
                data = self.sock.recv(2048)
            except (BlockingIOError, InterruptedError):
                break
            if data and data[0] & 0x80 and not m.is_offline(data):
                for message in self.layer.receive(data, now):
                    self._message(message)
            else:
                self.offline.append(data)
        for data in self.layer.datagrams(now):
            self.sock.sendto(data, self.server)

    def _message(self, message: bytes) -> None:
        if message[0] == m.MessageId.CONNECTION_REQUEST_ACCEPTED:
            self.accepted = True
            writer = BitWriter()
            writer.write_u8(m.MessageId.NEW_INCOMING_CONNECTION)
            for _ in range(11):
                writer.write_address(("0.0.0.0", 0))
            writer.write_u64(1)
            writer.write_u64(2)
            self.send(writer.data())
        elif message[0] == m.MessageId.UDP_PROXY_GENERAL and len(message) > 1:
            self.answers.append(message[1])

    def send(self, payload: bytes) -> None:
        self.layer.send(payload, Reliability.RELIABLE_ORDERED, 0, self.now_ms())

    def open(self) -> None:
        """The offline handshake and CONNECTION_REQUEST (answers via pump)."""
        self.sock.sendto(m.OpenConnectionRequest1(6, 1492).encode(), self.server)

    def on_offline(self) -> None:
        for data in self.offline:
            if data[0] == m.MessageId.OPEN_CONNECTION_REPLY_1:
                request2 = m.OpenConnectionRequest2(self.server, 1492, self.guid)
                self.sock.sendto(request2.encode(), self.server)
            elif data[0] == m.MessageId.OPEN_CONNECTION_REPLY_2:
                writer = BitWriter()
                writer.write_u8(m.MessageId.CONNECTION_REQUEST)
                writer.write_u64(self.guid)
                writer.write_u64(1)
                writer.write_bool(False)
                self.send(writer.data())
        self.offline.clear()

    def request_forwarding(self, target_guid: int, timeout_ms: int) -> None:
        writer = BitWriter()
        writer.write_u8(m.MessageId.UDP_PROXY_GENERAL)
        writer.write_u8(Sub.FORWARDING_REQUEST_FROM_CLIENT_TO_COORDINATOR)
        writer.write_address(("0.0.0.0", 0))  # "as you see me"
        writer.write_bool(False)  # target by GUID
        writer.write_u64(target_guid)
        writer.write_u32(timeout_ms)
        writer.write_bool(False)
        self.send(writer.data())

    def answered(self) -> int:
        return sum(1 for sub in self.answers if sub in ANSWERS)

    def leave(self) -> None:
        self.send(bytes([m.MessageId.DISCONNECTION_NOTIFICATION]))

    def close(self) -> None:
        self.sock.close()


async def pump_until(clients: list[ProxyClient], done: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError("the RakNet clients did not get their answers")
        for client in clients:
            client.pump()
            client.on_offline()
        await asyncio.sleep(0.005)


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def resources(http_port: int) -> dict[str, Any]:
    answer = httpx.get(
        f"http://127.0.0.1:{http_port}/console/api/admin/resources",
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        timeout=10,
    )
    assert answer.status_code == 200, answer.text
    snapshot: dict[str, Any] = answer.json()
    return snapshot


def forwarder_row(snapshot: dict[str, Any]) -> dict[str, Any]:
    rows = [t for t in snapshot["tables"] if t["table"] == "raknet-forwarders"]
    assert rows, "the forwarders are not a table of the resource budget"
    return rows[0]


async def test_forwarders_stay_in_their_share_under_ulimit_and_end_with_their_clients() -> (
    None
):
    raknet_port = free_port(socket.SOCK_DGRAM)
    with serve_with_fd_limit(
        1024,
        "--only",
        "raknet,stun,turn,openttd",
        "--turn-user",
        "alice:secret",
        "--admin-token",
        ADMIN_TOKEN,
        "--raknet-port",
        str(raknet_port),
    ) as server:
        pid = server.process.pid
        coordinator = ("127.0.0.1", raknet_port)
        clients = [
            ProxyClient(coordinator, host, 0x5100 + i * PER_SOURCE + j)
            for i, host in enumerate(SOURCES)
            for j in range(PER_SOURCE)
        ]
        try:
            for client in clients:
                client.open()
            await pump_until(clients, lambda: all(c.accepted for c in clients), 30)
            # Let NEW_INCOMING_CONNECTION arrive before the requests.
            for _ in range(20):
                for client in clients:
                    client.pump()
                await asyncio.sleep(0.01)
            before = descriptors(pid)
            for client in clients:
                for other in clients:
                    if other is not client:
                        client.request_forwarding(other.guid, TIMEOUT_MS)
            wanted = len(clients) - 1
            await pump_until(
                clients, lambda: all(c.answered() >= wanted for c in clients), 60
            )
            answers = [sub for c in clients for sub in c.answers]
            during = descriptors(pid)

            # The forwarders took no more descriptors than the pool of
            # per-client sockets (the budget's rest after the TCP listeners'
            # half and the reserve)...
            snapshot = await asyncio.to_thread(resources, server.http_port)
            assert during - before <= snapshot["relay_pool"] < 1024 // 2
            # ... so another service still works: a TURN allocation (one more
            # descriptor) and HTTP.
            async with await TurnClient.connect(
                ("127.0.0.1", server.stun_port), "alice", "secret", timeout=10
            ) as turn:
                relayed = await turn.allocate()
                assert relayed[0] == "127.0.0.1"
            health = await asyncio.to_thread(
                httpx.get, f"http://127.0.0.1:{server.http_port}/healthz", timeout=10
            )
            assert health.status_code == 200

            # ... they stopped at the caps of their table, within its share,
            # and the refusals were answered and counted.
            row = forwarder_row(snapshot)
            assert row["pool"] == "relay" and row["descriptors_per_item"] == 1
            assert row["max"] <= snapshot["relay_pool"]
            assert row["max_per_source"] <= max(1, row["max"] // 8)
            opened = answers.count(Sub.FORWARDING_SUCCEEDED)
            assert opened == row["live"] > 0
            assert row["live"] <= len(SOURCES) * row["max_per_source"]
            assert during - before <= row["max"]
            assert answers.count(Sub.ALL_SERVERS_BUSY) > 0
            assert row["refused"].get("over-ip-limit", 0) > 0
            metrics = await asyncio.to_thread(server.metrics)
            assert (
                'crossroads_raknet_proxy_requests_total{answer="all_servers_busy"}'
                in metrics
            )

            # The clients leave: their forwarders (nothing was forwarded)
            # and the forwarders' sockets are gone at once, not in 10 min.
            for client in clients:
                client.leave()
            for _ in range(20):
                for client in clients:
                    client.pump()
                await asyncio.sleep(0.01)

            async def gone() -> bool:
                for client in clients:
                    client.pump()
                row = forwarder_row(
                    await asyncio.to_thread(resources, server.http_port)
                )
                # (a few descriptors of slack: the TURN allocation's socket
                # until its client's refresh to 0 is handled, HTTP keep-alive)
                return row["live"] == 0 and descriptors(pid) <= before + 8

            await eventually(gone, "the forwarders end with their clients")
            assert "Too many open files" not in server.output()
        finally:
            for client in clients:
                client.close()
