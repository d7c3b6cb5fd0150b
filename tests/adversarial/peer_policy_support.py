"""Helpers of the peer-policy and reply-address adversarial tests:
relayed traffic to forbidden peers, and replies from the address a request came to."""

from __future__ import annotations

import asyncio
import inspect
import os
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx

from crossroads.client.turn import TurnClient
from crossroads.config import default_config
from crossroads.proto.stun import Class, Message, Method, encode
from crossroads.runtime import Runtime, start
from crossroads.services.turn import TurnService
from tests.conftest import loopback_config
from tests.e2e.relay_support import API_KEY

USER, PASSWORD = "alice", "secret123"


@asynccontextmanager
async def turn_runtime(**extra: Any) -> AsyncIterator[Runtime]:
    """STUN + TURN on 127.0.0.1 with OS-chosen ports and one static user."""
    values: dict[str, Any] = {
        "core__only": ["stun", "turn"],
        "turn__user": [f"{USER}:{PASSWORD}"],
        **extra,
    }
    runtime = await start(default_config(loopback_config(**values)))
    try:
        yield runtime
    finally:
        await runtime.close()


async def relay_allocation(runtime: Runtime) -> dict[str, Any]:
    """A host allocation from the relay's allocations API (over loopback)."""
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{runtime.http_address[1]}",
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=10,
    ) as http:
        reply = await http.post("/v1/allocate", json={"maxConnections": 1})
    allocation: dict[str, Any] = reply.json()["data"]["allocation"]
    return allocation


def turn_of(runtime: Runtime) -> TurnService:
    service = runtime.services["turn"]
    assert isinstance(service, TurnService)
    return service


def binding_request() -> bytes:
    """A STUN Binding request: what a relay must never carry to our own port."""
    return encode(Message(Class.REQUEST, Method.BINDING, os.urandom(12), ()))


class AliasClient:
    """A UDP client on 127.0.0.1 that talks to a wildcard-bound server at
    127.0.0.2: both reach the same socket, and a reply that does not come from
    127.0.0.2 would be dropped by the client's NAT (the kernel, without
    IP_PKTINFO, picks 127.0.0.1 by route)."""

    SERVER_IP = "127.0.0.2"

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.setblocking(False)

    async def exchange(
        self, data: bytes, port: int, attempts: int = 5
    ) -> tuple[bytes, tuple[str, int]]:
        """Send to 127.0.0.2:``port``; the first reply and where it came from
        (resent on loss: UDP, even on loopback)."""
        loop = asyncio.get_running_loop()
        for attempt in range(attempts):
            self.sock.sendto(data, (self.SERVER_IP, port))
            try:
                reply, source = await asyncio.wait_for(
                    loop.sock_recvfrom(self.sock, 65535), 1.0
                )
                return reply, (source[0], source[1])
            except TimeoutError:
                if attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.sock.close()


async def resend_until_received(
    send: Callable[[], object],
    client: TurnClient,
    what: str,
    attempts: int = 20,
) -> tuple[bytes, tuple[str, int]]:
    """Call ``send`` until ``client`` receives a datagram (UDP, even on
    loopback, may lose one); the first one received, as ``(data, peer)``."""
    for _ in range(attempts):
        sent = send()
        if inspect.isawaitable(sent):
            await sent
        try:
            return await client.receive(timeout=0.5)
        except TimeoutError:
            continue
    raise AssertionError(f"nothing received after {attempts} sends: {what}")
