"""Shared helpers of the TURN adversarial tests (TURN quotas, credentials,
churn): a runtime with p2p and TURN, a TURN client that drives the service
in-process, and object counts. The turn service fixture is
``tests.services.test_turn``'s ``turn``."""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import gc
import json
import os
import socket
from collections.abc import AsyncIterator
from typing import Any

import websockets

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
from crossroads.services.p2p import P2PService
from crossroads.services.turn import TurnService
from tests.conftest import eventually, loopback_config
from tests.services.test_turn import PASSWORD, SECRET, USER


@contextlib.asynccontextmanager
async def p2p_with_turn(**overrides: Any) -> AsyncIterator[Runtime]:
    """p2p, STUN and TURN in one runtime on loopback; the p2p service hands out
    credentials of the TURN service's secret."""
    values: dict[str, Any] = {
        "core__only": ["p2p", "stun", "turn"],
        "turn__user": [f"{USER}:{PASSWORD}"],
        "turn__secret": [SECRET],
        "turn__relay_ports": (47000, 47999),
    }
    values.update(overrides)
    runtime = await start(default_config(loopback_config(**values)))
    try:
        yield runtime
    finally:
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


def live_objects() -> collections.Counter[str]:
    """Live objects by type (after a full collection)."""
    gc.collect()
    return collections.Counter(
        f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.get_objects()
    )


#: Growth in live objects of one type that churn may leave (caches that fill once,
#: such as weak references asyncio and the metrics registry keep); a leak of even
#: one object per cycle is 2,000 or 20,000 here.
CHURN_SLACK = 100


def grown(
    before: collections.Counter[str], after: collections.Counter[str]
) -> dict[str, int]:
    """Types that grew: every crossroads type and socket must be back exactly,
    any other type within :data:`CHURN_SLACK`."""
    out: dict[str, int] = {}
    for name, count in after.items():
        growth = count - before.get(name, 0)
        exact = name.startswith("crossroads.") or name.startswith("socket.")
        if growth > (0 if exact else CHURN_SLACK):
            out[name] = growth
    return out


async def turn_churn(pool: list[DirectClient], cycles: int) -> None:
    """``cycles`` Allocate / Refresh(0) cycles spread over the ``pool``'s client
    ports (the same ports each time: a freed allocation is remembered per
    5-tuple for one nonce lifetime, see docs/security.md)."""
    for index in range(cycles):
        client = pool[index % len(pool)]
        assert client.allocate() is None
        assert client.release() is None
        if index % 256 == 0:
            await asyncio.sleep(0)  # let the loop run the relays' callbacks
    for _ in range(3):
        await asyncio.sleep(0)


async def measure_turn_churn(cycles: int) -> dict[str, int]:
    """Start a turn service, warm it up, churn, return what grew."""
    runtime = await start(
        default_config(
            loopback_config(
                core__only=["stun", "turn"],
                turn__user=[f"{USER}:{PASSWORD}"],
                turn__relay_ports=(46000, 46999),
                # Each allocation leaves an insight record in a bounded ring
                # and stream: small enough for the warm-up (500 cycles) to
                # fill, so the churn shows what grows without bound.
                insight__ring=100,
                insight__stream_max=100,
            )
        )
    )
    service = runtime.services["turn"]
    assert isinstance(service, TurnService)
    pool = [DirectClient(service, USER, PASSWORD) for _ in range(16)]
    try:
        await turn_churn(pool, 500)
        before = live_objects()
        await turn_churn(pool, cycles)
        after = live_objects()
        assert service.core.allocations == {} and service.relays == set()
        return grown(before, after)
    finally:
        for client in pool:
            client.close()
        await runtime.close()


async def p2p_churn(runtime: Runtime, sessions: int, parallel: int = 32) -> None:
    """``sessions`` hosting peers, ``parallel`` at a time: each opens the
    signalling WebSocket, hosts a session, is joined by a second peer (TURN
    credentials come only then, pushed to the host), allocates a TURN relay
    with them, frees it and goes away with its guest."""
    host, port = runtime.http_address
    url = f"ws://{host}:{port}/p2p/v1/ws"
    turn = runtime.services["turn"]
    assert isinstance(turn, TurnService)
    slots = asyncio.Semaphore(parallel)

    async def one() -> None:
        async with (
            slots,
            websockets.connect(url) as ws,
            websockets.connect(url) as guest,
        ):
            for peer in (ws, guest):
                key = base64.b64encode(os.urandom(32)).decode()
                await peer.send(json.dumps({"type": "hello", "v": 1, "key": key}))
                await _frame(peer, "welcome")
            await ws.send(json.dumps({"type": "host"}))
            code = (await _frame(ws, "hosted"))["code"]
            await guest.send(json.dumps({"type": "join", "code": code}))
            await _frame(guest, "join_start")
            credentials = (await _frame(ws, "turn"))["turn"]
            client = DirectClient(
                turn, credentials["username"], credentials["password"]
            )
            try:
                assert client.allocate() is None
                assert client.release() is None
            finally:
                client.close()

    await asyncio.gather(*(one() for _ in range(sessions)))


async def _frame(ws: Any, kind: str) -> dict[str, Any]:
    while True:
        frame = json.loads(await asyncio.wait_for(ws.recv(), 10))
        if frame["type"] == kind:
            return dict(frame)


async def settled(runtime: Runtime) -> None:
    """Wait (bounded) until every WebSocket is gone from the p2p service."""
    p2p = runtime.services["p2p"]
    assert isinstance(p2p, P2PService)

    async def gone() -> bool:
        return p2p.core.peer_count == 0 and p2p.core.session_count == 0

    await eventually(gone, "every p2p peer and session gone", timeout=30)
    for _ in range(10):
        await asyncio.sleep(0)


if __name__ == "__main__":
    # python -m tests.adversarial.turn_quota_support CYCLES: the TURN churn in a
    # process of its own (the data plane is chosen at import time).
    import json
    import sys

    print(json.dumps(asyncio.run(measure_turn_churn(int(sys.argv[1])))))
