"""In-memory DTLS client/server pairs with a fake clock (no sockets)."""

from __future__ import annotations

import os
from collections.abc import Callable

from crossroads.proto.dtls.client import PskDtlsClient
from crossroads.proto.dtls.server import PskDtlsServer, PskDtlsServerConfig
from crossroads.types import Address

SERVER: Address = ("192.0.2.10", 7781)
CLIENT: Address = ("198.51.100.20", 40000)
#: A Unity-like identity: 16 raw bytes, zero bytes included.
IDENTITY = bytes(range(16))
PSK = bytes(range(100, 164))

Filter = Callable[[bytes], bool]


def keys(table: dict[bytes, bytes]) -> Callable[[bytes], tuple[bytes, ...]]:
    def lookup(identity: bytes) -> tuple[bytes, ...]:
        psk = table.get(identity)
        return () if psk is None else (psk,)

    return lookup


def make_server(**config: object) -> PskDtlsServer:
    return PskDtlsServer(
        PskDtlsServerConfig(**config),  # type: ignore[arg-type]
        keys({IDENTITY: PSK}),
        os.urandom,
    )


def make_client(
    identity: bytes = IDENTITY, psk: bytes = PSK, **options: object
) -> PskDtlsClient:
    return PskDtlsClient(SERVER, identity, psk, os.urandom, **options)  # type: ignore[arg-type]


class Wire:
    """Carries datagrams between one client and a server, with a fake clock.

    ``to_server`` / ``to_client`` filters return False to lose a datagram;
    every datagram that crossed is recorded.
    """

    def __init__(
        self, client: PskDtlsClient, server: PskDtlsServer, addr: Address = CLIENT
    ):
        self.client = client
        self.server = server
        self.addr = addr
        self.now = 0.0
        self.to_server: Filter = lambda data: True
        self.to_client: Filter = lambda data: True
        self.sent_to_server: list[bytes] = []
        self.sent_to_client: list[bytes] = []

    def step(self) -> bool:
        """Deliver what is queued; True when something moved."""
        moved = False
        for data, _ in self.client.datagrams_to_send(self.now):
            moved = True
            self.sent_to_server.append(data)
            if self.to_server(data):
                self.server.receive_datagram(data, self.addr, self.now)
        for data, addr in self.server.datagrams_to_send(self.now):
            moved = True
            if addr != self.addr:
                continue
            self.sent_to_client.append(data)
            if self.to_client(data):
                self.client.receive_datagram(data, SERVER, self.now)
        return moved

    def settle(self) -> None:
        while self.step():
            pass

    def advance(self, seconds: float) -> None:
        """Let time pass, firing both timers as they come due."""
        end = self.now + seconds
        while True:
            self.settle()
            due = [
                t
                for t in (self.client.get_timer(), self.server.get_timer())
                if t is not None and t <= end
            ]
            if not due:
                break
            self.now = max(self.now, min(due))
            self.client.handle_timer(self.now)
            self.server.handle_timer(self.now)
        self.now = end
        self.settle()

    def handshake(self) -> None:
        self.client.start(self.now)
        self.settle()
