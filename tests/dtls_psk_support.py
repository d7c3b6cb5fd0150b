"""A DTLS-PSK client (the relay's DTLS) on a real UDP socket for tests: crossroads' sans-I/O
:class:`PskDtlsClient` driven by a small asyncio pump (no background task)."""

from __future__ import annotations

import asyncio
import os
import socket

from crossroads.proto.dtls.client import ClientState, PskDtlsClient
from crossroads.proto.dtls.handshake import (
    ApplicationData,
    Closed,
    Established,
    Event,
    HandshakeFailed,
)


class DtlsPeer:
    """One DTLS client socket on 127.0.0.1."""

    def __init__(
        self,
        server: tuple[str, int],
        identity: bytes,
        psk: bytes,
        cipher_suites: tuple[int, ...] | None = None,
    ) -> None:
        self.server = server
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.setblocking(False)
        extra = {} if cipher_suites is None else {"cipher_suites": cipher_suites}
        self.core = PskDtlsClient(server, identity, psk, os.urandom, **extra)
        self.events: list[Event] = []
        self.received: list[bytes] = []
        #: Every datagram the peer received (sizes are checked by tests).
        self.datagrams: list[bytes] = []

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.sock.getsockname()
        return host, port

    def close(self) -> None:
        self.sock.close()

    def flush(self) -> None:
        """Send what the client core queued."""
        self._flush()

    def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        for data, addr in self.core.datagrams_to_send(loop.time()):
            self.sock.sendto(data, addr)

    async def pump(self, seconds: float) -> None:
        """Run the client for up to ``seconds`` (less once something arrived)."""
        loop = asyncio.get_running_loop()
        self._flush()
        deadline = loop.time() + seconds
        timer = self.core.get_timer()
        wait = deadline - loop.time()
        if timer is not None:
            wait = min(wait, max(0.0, timer - loop.time()))
        try:
            data, addr = await asyncio.wait_for(
                loop.sock_recvfrom(self.sock, 65535), max(0.0, wait)
            )
        except TimeoutError:
            self.core.handle_timer(loop.time())
        else:
            self.datagrams.append(data)
            self.core.receive_datagram(data, (addr[0], addr[1]), loop.time())
        self._flush()
        for event in self.core.pop_events():
            self.events.append(event)
            if isinstance(event, ApplicationData):
                self.received.append(event.data)

    async def handshake(self, timeout: float = 10.0) -> Established | HandshakeFailed:
        loop = asyncio.get_running_loop()
        self.core.start(loop.time())
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            await self.pump(deadline - loop.time())
            for event in self.events:
                if isinstance(event, Established | HandshakeFailed):
                    return event
        raise AssertionError(f"no handshake result within {timeout} s")

    @property
    def established(self) -> bool:
        return self.core.state == ClientState.ESTABLISHED

    def send(self, data: bytes) -> None:
        loop = asyncio.get_running_loop()
        assert self.core.send(data, loop.time())
        self._flush()

    async def recv(self, timeout: float = 5.0) -> bytes:
        """The next application message."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.received:
            if loop.time() >= deadline:
                raise TimeoutError("no DTLS application data")
            await self.pump(deadline - loop.time())
        return self.received.pop(0)

    async def sock_silent(self, timeout: float = 0.3) -> bool:
        """True when no datagram at all arrives within ``timeout``."""
        loop = asyncio.get_running_loop()
        try:
            data = await asyncio.wait_for(loop.sock_recv(self.sock, 65535), timeout)
        except TimeoutError:
            return True
        self.datagrams.append(data)
        return False

    async def closed(self, timeout: float = 5.0) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            if any(isinstance(e, Closed | HandshakeFailed) for e in self.events):
                return True
            await self.pump(deadline - loop.time())
        return False
