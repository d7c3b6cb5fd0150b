"""crossroads' TURN client (``crossroads.client.turn``) as the SDK's relay.

:class:`TurnClientRelay` wraps one TURN allocation in the small
:class:`crossroads.client.p2p.TurnRelay` shape the ladder's relay step uses:
permissions on demand, fire-and-forget sends (ChannelData once a channel is
bound, Send indications before), and a receive loop that hands every relayed
datagram to the peer socket's router.

:func:`welcome_factory` builds the factory the SDK uses when the server's
``welcome`` carries TURN credentials: UDP to the TURN server first, TCP when UDP
gets no answer (a UDP-blocked host still gets a relayed UDP address).

The TURN client is imported when first used, so the SDK runs in a build without
the TURN area (it then relays through the WebSocket only).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import ipaddress
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from crossroads.proto.punch import signalling as sig
from crossroads.types import Address

log = logging.getLogger("crossroads.client.p2p")

#: Sends queued towards the TURN server before new ones are dropped (a relayed
#: datagram path may drop, as a full socket buffer would).
MAX_PENDING_SENDS = 256


class TurnClientRelay:
    """One allocation of ``crossroads.client.turn.TurnClient``."""

    def __init__(self, client: Any, relayed: Address) -> None:
        self.client = client
        self.relayed = relayed
        self._receiver: Callable[[bytes, Address], None] = lambda data, peer: None
        self._reader = asyncio.create_task(self._read())
        self._sends: asyncio.Queue[tuple[bytes, Address]] = asyncio.Queue(
            MAX_PENDING_SENDS
        )
        self._writer: asyncio.Task[None] | None = None

    @classmethod
    async def open(
        cls,
        server: Address,
        username: str,
        password: str,
        *,
        transport: str = "udp",
        timeout: float = 5.0,
    ) -> TurnClientRelay:
        turn = importlib.import_module("crossroads.client.turn")
        client = await turn.TurnClient.connect(
            server, username, password, transport=transport, timeout=timeout
        )
        return await cls.allocate(client)

    @classmethod
    async def allocate(cls, client: Any) -> TurnClientRelay:
        """Allocate on a connected ``TurnClient`` and wrap the allocation; the
        client is closed when the allocation fails (nothing is left open)."""
        try:
            relayed = await client.allocate()
        except BaseException:
            await client.close()
            raise
        return cls(client, (str(relayed[0]), int(relayed[1])))

    def set_receiver(self, receiver: Callable[[bytes, Address], None]) -> None:
        self._receiver = receiver

    async def permit(self, *hosts: str) -> None:
        if hosts:
            await self.client.create_permission(*hosts)

    def send(self, data: bytes, peer: Address) -> None:
        try:
            self._sends.put_nowait((data, peer))
        except asyncio.QueueFull:
            return
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write())

    async def _write(self) -> None:
        while not self._sends.empty():
            data, peer = self._sends.get_nowait()
            try:
                await self.client.send(data, peer)
            except Exception as exc:  # noqa: BLE001 - like a lost datagram
                log.debug("TURN send failed: %r", exc)

    async def _read(self) -> None:
        while True:
            try:
                data, peer = await self.client.receive()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the allocation is gone
                return
            self._receiver(data, (str(peer[0]), int(peer[1])))

    def renew(self, username: str, password: str) -> None:
        """Use fresh credentials of the same user for this allocation."""
        self.client.renew_credentials(username, password)

    async def close(self) -> None:
        for task in (self._reader, self._writer):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        await self.client.close()


def welcome_factory(
    info: sig.TurnInfo, server_ip: str, *, timeout: float = 5.0
) -> Callable[[], Awaitable[TurnClientRelay]]:
    """A TURN factory from ``welcome.turn``: UDP first, then TCP."""

    async def make() -> TurnClientRelay:
        endpoint = info.servers[0]
        host = endpoint.host
        if ipaddress.ip_address(host).is_unspecified:
            host = server_ip
        server = (host, endpoint.port)
        try:
            return await TurnClientRelay.open(
                server, info.username, info.password, transport="udp", timeout=timeout
            )
        except Exception as exc:  # noqa: BLE001 - try TCP before giving up
            log.info("TURN over UDP failed (%r); trying TCP", exc)
        return await TurnClientRelay.open(
            server, info.username, info.password, transport="tcp", timeout=timeout
        )

    return make
