"""Shared helpers of the h12-turn adversarial tests (TURN quotas, credentials,
churn): a fixture that starts the turn service on loopback, and a client that
drives it in-process."""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from crossroads.config import default_config
from crossroads.proto.stun import (
    Attribute,
    Class,
    Lifetime,
    Message,
    Method,
    RequestedTransport,
    decode,
    encode,
)
from crossroads.proto.turn.credentials import LongTermSession
from crossroads.proto.turn.server import error_code_of
from crossroads.runtime import Runtime, start
from crossroads.services.turn import TurnService
from tests.conftest import loopback_config

USER, PASSWORD, SECRET = "alice", "secret123", "s3cr3t"

TurnFactory = Callable[..., Awaitable[TurnService]]


@pytest.fixture(name="turn_service")
async def turn_service_fixture() -> AsyncIterator[TurnFactory]:
    """``await turn_service(**overrides)``: a running turn service (with STUN)."""
    runtimes: list[Runtime] = []

    async def make(**overrides: Any) -> TurnService:
        values: dict[str, Any] = {
            "core__only": ["stun", "turn"],
            "turn__user": [f"{USER}:{PASSWORD}"],
            "turn__secret": [SECRET],
            "turn__allow_loopback_peers": True,
            "turn__relay_ports": (44000, 44999),
        }
        values.update(overrides)
        runtime = await start(default_config(loopback_config(**values)))
        runtimes.append(runtime)
        service = runtime.services["turn"]
        assert isinstance(service, TurnService)
        return service

    try:
        yield make
    finally:
        for runtime in runtimes:
            await runtime.close()


class DirectClient:
    """A TURN client that hands its requests straight to the service's STUN hook
    (:meth:`TurnService.handle_stun`, what the STUN listener calls for every
    datagram) and reads the answers from a real UDP socket the service sends
    them to: the real service and real relay sockets, without a network round
    trip per request, so tens of thousands of cycles take seconds."""

    def __init__(self, service: TurnService, username: str, password: str) -> None:
        self.service = service
        self.endpoint = service.stun.udp_endpoints[0]
        self.sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sink.bind(("127.0.0.1", 0))
        self.sink.setblocking(False)
        self.address: tuple[str, int] = self.sink.getsockname()
        self.session = LongTermSession(username, password)

    def ask(self, data: bytes) -> Message:
        self.service.handle_stun(data, self.address, self.endpoint)
        return decode(self.sink.recv(4096))

    def request(self, method: int, attributes: tuple[Attribute, ...]) -> Message:
        message = Message(Class.REQUEST, method, os.urandom(12), attributes)
        if not self.session.ready:
            self.session.learn(self.ask(encode(message)))
        answer = self.ask(self.session.sign(message))
        if error_code_of(answer) == 438:
            self.session.learn(answer)
            answer = self.ask(self.session.sign(message))
        return answer

    def allocate(self) -> int | None:
        """Allocate (UDP); the error code, or None on success."""
        return error_code_of(self.request(Method.ALLOCATE, (RequestedTransport(17),)))

    def release(self) -> int | None:
        """Refresh with LIFETIME 0; the error code, or None on success."""
        return error_code_of(self.request(Method.REFRESH, (Lifetime(0),)))

    def close(self) -> None:
        self.sink.close()
