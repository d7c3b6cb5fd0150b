"""The real RakNet 4.081 C++ peer (PyPI ``raknet==0.3.0``) as a test client.

The wheel runs RakNet's own update thread; ``receive()`` never blocks, so an
asyncio test polls it. Packets not yet asked for wait in :attr:`backlog`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import raknet

RELIABLE_ORDERED = raknet.PacketReliability.RELIABLE_ORDERED
HIGH = raknet.PacketPriority.HIGH_PRIORITY
ID = raknet.MessageIdentifiers  # read-only class properties, ints


class RakNetPeer:
    """One stock RakNet peer on ``host`` (127.0.0.1), any free port."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        protocol_version: int = 6,
        max_connections: int = 8,
    ) -> None:
        self.peer = raknet.RakPeer()
        self.peer.startup(
            host=host,
            port=0,
            max_connections=max_connections,
            protocol_version=protocol_version,
        )
        self.backlog: list[tuple[bytes, Any]] = []
        #: The server's SystemAddress object (the wheel's send() wants one).
        self.server: Any = None

    @property
    def port(self) -> int:
        return int(self.peer.get_bound_address().port)

    def _drain(self) -> None:
        while True:
            packet = self.peer.receive()
            if packet is None:
                return
            self.backlog.append((bytes(packet.data), packet.system_address))

    async def expect_packet(
        self, match: int | Callable[[bytes], bool], timeout: float = 10.0
    ) -> tuple[bytes, Any]:
        """The first packet whose id is ``match`` (or that ``match`` accepts)."""
        accept = (
            (lambda d: d[:1] == bytes([match])) if isinstance(match, int) else match
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            self._drain()
            for i, (data, addr) in enumerate(self.backlog):
                if accept(data):
                    del self.backlog[i]
                    return data, addr
            if loop.time() > deadline:
                ids = [d[0] for d, _ in self.backlog]
                raise AssertionError(
                    f"no packet {match!r} in {timeout} s; got ids {ids}"
                )
            await asyncio.sleep(0.005)

    async def expect(
        self, match: int | Callable[[bytes], bool], timeout: float = 10.0
    ) -> bytes:
        return (await self.expect_packet(match, timeout))[0]

    async def connect(self, host: str, port: int) -> bytes:
        """Connect; returns ID_CONNECTION_REQUEST_ACCEPTED as delivered."""
        self.peer.connect(host, port)
        data, self.server = await self.expect_packet(ID.ID_CONNECTION_REQUEST_ACCEPTED)
        return data

    def send(
        self,
        data: bytes,
        reliability: Any = RELIABLE_ORDERED,
        channel: int = 0,
    ) -> None:
        assert self.server is not None, "connect() first"
        self.peer.send(data, HIGH, reliability, channel, self.server)

    def close(self) -> None:
        self.peer.shutdown(0.3)
