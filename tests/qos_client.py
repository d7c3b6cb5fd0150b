"""A QoS client written from the public protocol tables (docs/qos.md), not
from crossroads' server code: its own struct packing, and the behaviour of
Unity's services runner (WebTransportQosRunner): 5 requests per server sent
back to back, one random identifier per server, an 8-byte little-endian
millisecond timestamp; latency = now - echoed timestamp; responses with a
wrong identifier, a sequence >= 5, a version other than 0, a duplicate
sequence or a latency outside 0..60000 ms are ignored; loss = missing / 5.

Run as ``python -m tests.qos_client HOST:PORT ...`` it prints one JSON line
per server (for lab tests that run it inside a namespace).
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import socket
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

REQUESTS_PER_ENDPOINT = 5
TITLE = b"QoS request"
#: magic 0x59, version|flow 0, title length counting itself.
_HEAD = struct.Struct("<BBB")
#: sequence u8, identifier u16 LE, timestamp u64 LE.
_TAIL = struct.Struct("<BHQ")
#: magic 0x95, version|flow, sequence, identifier u16 LE, timestamp u64 LE.
_RESPONSE = struct.Struct("<BBBHQ")


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def request(
    sequence: int, identifier: int, timestamp: int, title: bytes = TITLE
) -> bytes:
    return (
        _HEAD.pack(0x59, 0, len(title) + 1)
        + title
        + _TAIL.pack(sequence, identifier, timestamp)
    )


@dataclass
class Result:
    endpoint: str
    identifier: int
    latencies: list[float] = field(default_factory=list)
    flows: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    seen: set[int] = field(default_factory=set)

    @property
    def latency_ms(self) -> float:
        """Average latency, or int.MaxValue when nothing came back."""
        if not self.latencies:
            return float(2**31 - 1)
        return sum(self.latencies) / len(self.latencies)

    @property
    def min_latency_ms(self) -> float:
        return min(self.latencies) if self.latencies else float(2**31 - 1)

    @property
    def packet_loss(self) -> float:
        return (REQUESTS_PER_ENDPOINT - len(self.latencies)) / REQUESTS_PER_ENDPOINT

    def accept(self, data: bytes, arrived_ms: int) -> bool:
        if len(data) < _RESPONSE.size:
            return False
        magic, verflow, sequence, identifier, timestamp = _RESPONSE.unpack_from(data)
        latency = arrived_ms - timestamp
        if (
            magic != 0x95
            or verflow >> 4 != 0
            or identifier != self.identifier
            or sequence >= REQUESTS_PER_ENDPOINT
            or sequence in self.seen
            or not 0 <= latency <= 60_000
        ):
            return False
        self.seen.add(sequence)
        self.latencies.append(float(latency))
        self.flows.append(verflow & 0xF)
        self.sizes.append(len(data))
        return True


def measure(
    endpoints: list[tuple[str, int]], timeout: float = 2.0, source: str = ""
) -> list[Result]:
    """Measure every endpoint concurrently, as the services runner does."""
    results = []
    socks: dict[socket.socket, Result] = {}
    try:
        for host, port in endpoints:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_DGRAM)
            if source:
                sock.bind((source, 0))
            sock.setblocking(False)
            identifier = int.from_bytes(os.urandom(2), "little")
            result = Result(f"{host}:{port}", identifier)
            results.append(result)
            socks[sock] = result
            for sequence in range(REQUESTS_PER_ENDPOINT):
                sock.sendto(request(sequence, identifier, now_ms()), (host, port))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(
            len(r.latencies) < REQUESTS_PER_ENDPOINT for r in socks.values()
        ):
            ready, _, _ = select.select(list(socks), [], [], 0.05)
            for sock in ready:
                try:
                    data = sock.recv(2048)
                except OSError:
                    continue
                socks[sock].accept(data, now_ms())
    finally:
        for sock in socks:
            sock.close()
    return results


class UdpDelay(asyncio.DatagramProtocol):
    """A UDP forwarder on loopback that holds every datagram ``delay``
    seconds each way, to ``target`` and back to the last client (one client
    at a time is enough for the tests that use it)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.target: tuple[str, int] | None = None
        self.client: tuple[str, int] | None = None
        self.transport: asyncio.DatagramTransport | None = None

    @classmethod
    def factory(cls, delay: float) -> Callable[[], UdpDelay]:
        return lambda: cls(delay)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[Any, ...]) -> None:
        loop = asyncio.get_running_loop()
        assert self.transport is not None and self.target is not None
        if addr[:2] == self.target:
            if self.client is not None:
                loop.call_later(self.delay, self.transport.sendto, data, self.client)
        else:
            self.client = (addr[0], addr[1])
            loop.call_later(self.delay, self.transport.sendto, data, self.target)


def main(argv: list[str]) -> None:
    endpoints = []
    for text in argv:
        host, _, port = text.rpartition(":")
        endpoints.append((host.strip("[]"), int(port)))
    for r in measure(endpoints):
        print(
            json.dumps(
                {
                    "endpoint": r.endpoint,
                    "latency": r.latency_ms,
                    "min": r.min_latency_ms,
                    "loss": r.packet_loss,
                }
            )
        )


if __name__ == "__main__":
    main(sys.argv[1:])
