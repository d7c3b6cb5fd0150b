"""Real-datagram reflection probes for every UDP service.

Shared by ``tests/adversarial/test_reflection.py`` and ``benchmarks/reflection.py``:
each :class:`Probe` knows one unauthenticated request a spoofer can send, the
runtime settings that expose it, and how to tell that every answer to a burst
has been sent. :func:`reflect` starts nothing itself: it sends a burst from one
loopback address (the "victim" a spoofer would name) and counts the bytes that
come back, on loopback only.

How a test knows every answer has arrived without sleeping: after the burst a
*witness* socket on another loopback address (its own reflection ledger) sends
one more request to the same server socket. A server socket reads its datagrams
in order and loopback delivers a ``sendto`` at once, so when the witness is
answered, every answer to the burst is already in the victim's socket buffer.
natneg's answers also come later, from timers (the error CONNECTs); its probe
waits until the core holds no session any more.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import websockets

from crossroads.config import default_config
from crossroads.proto.natneg.packets import Init
from crossroads.proto.punch.rendezvous import Probe as RendezvousProbe
from crossroads.proto.relay.messages import Close
from crossroads.runtime import Runtime, start
from crossroads.services.natneg import NatNegService
from crossroads.services.relay import RelayService
from crossroads.services.stun import StunService
from crossroads.services.turn import TurnService
from crossroads.types import Address
from tests.conftest import eventually, loopback_config

#: The address a spoofer names as its source (the victim), and the witness's.
VICTIM_IP = "127.0.0.1"
WITNESS_IP = "127.0.0.2"
#: Room for every answer to a burst (each small datagram costs ~1 KiB of
#: buffer in the kernel).
RECEIVE_BUFFER = 4 * 1024 * 1024
#: How long one witness attempt waits before it asks again (a lost datagram on a
#: loaded machine must not fail the test; the overall bound is ``eventually``'s).
WITNESS_RETRY = 1.0


def _stun_request(method: int, i: int) -> bytes:
    """A 20-byte STUN request without attributes (no credentials)."""
    return struct.pack("!HHI", method, 0, 0x2112A442) + i.to_bytes(12, "big")


def _natneg_inits(count: int) -> list[bytes]:
    """``count`` version-1 INITs (15 bytes, the shortest), four port types per
    cookie: each cookie is a session the server later fails with error CONNECTs
    to every mapping."""
    base = int.from_bytes(os.urandom(3), "big") << 8
    return [Init(1, base + i // 4, i % 4, 0, 0).encode() for i in range(count)]


def _stun_target(rt: Runtime) -> Address:
    service = rt.services["stun"]
    assert isinstance(service, StunService)
    return service.primary


def _turn_target(rt: Runtime) -> Address:
    service = rt.services["turn"]
    assert isinstance(service, TurnService)
    return service.stun.primary


def _natneg_service(rt: Runtime) -> NatNegService:
    service = rt.services["natneg"]
    assert isinstance(service, NatNegService)
    return service


def _natneg_target(rt: Runtime) -> Address:
    return next(iter(_natneg_service(rt).addresses.values()))


def _relay_target(rt: Runtime) -> Address:
    service = rt.services["relay"]
    assert isinstance(service, RelayService) and service.bound is not None
    return service.bound


async def _natneg_settled(rt: Runtime, count: int) -> None:
    stats = _natneg_service(rt).core.stats
    core = _natneg_service(rt).core

    async def all_read() -> bool:
        return sum(stats.received) + sum(stats.dropped.values()) >= count

    async def no_sessions() -> bool:
        return core.session_count == 0

    await eventually(all_read, "natneg read the whole burst", 30)
    await eventually(no_sessions, "every natneg session failed and ended", 30)


@dataclass(frozen=True)
class Probe:
    """One unauthenticated request kind of one UDP service."""

    name: str
    #: What the spoofer sends, for tables ("Binding request, 20 B").
    request: str
    #: The first ``n`` datagrams of a burst.
    burst: Callable[[int], list[bytes]]
    target: Callable[[Runtime], Address]
    #: Runtime settings (``loopback_config`` keywords).
    settings: dict[str, Any] = field(default_factory=dict)
    #: Waits until every answer to a burst of the given size has been sent
    #: (None: the witness).
    settled: Callable[[Runtime, int], Awaitable[None]] | None = None
    #: Burst size the adversarial test uses: within the services' own rate
    #: limits' bursts (so the old code answers all of it) and large enough that
    #: the answers then exceed what was sent plus the allowance.
    count: int = 120


PROBES: dict[str, Probe] = {
    probe.name: probe
    for probe in (
        Probe(
            "stun",
            "Binding request",
            lambda n: [_stun_request(0x0001, i) for i in range(n)],
            _stun_target,
            {"core__only": ["stun"]},
            # 100 Binding answers per second per source (--stun-rate-limit).
            count=100,
        ),
        Probe(
            "turn",
            "Allocate without credentials (401)",
            lambda n: [_stun_request(0x0003, i) for i in range(n)],
            _turn_target,
            {"core__only": ["stun", "turn"], "turn__user": ["alice:secret"]},
            # 200 unauthenticated answers in a burst (TurnSettings).
            count=150,
        ),
        Probe(
            "natneg",
            "INIT v1 (ACK + 3 error CONNECTs per mapping later)",
            _natneg_inits,
            _natneg_target,
            {
                "core__only": ["natneg"],
                "natneg__session_timeout": 0.3,
                "natneg__connect_interval": 0.1,
                "natneg__linger": 0.1,
            },
            _natneg_settled,
            # 64 sessions per source IP (--natneg-max-sessions-per-ip), 4 INITs each.
            count=256,
        ),
        Probe(
            "relay",
            "CLOSE for an unknown allocation (ERROR 4)",
            lambda n: [Close(os.urandom(16)).encode() for _ in range(n)],
            _relay_target,
            # Loopback is the test's "internet"; the relay answers nothing to a
            # scope it does not serve.
            {"core__only": ["relay"], "relay__allow_private_peers": True},
            # 40 ERRORs in a burst (RelayServerConfig.error_burst).
            count=40,
        ),
    )
}


@dataclass(frozen=True)
class Exchange:
    """What one source sent and got back."""

    requests: int
    bytes_in: int
    bytes_out: int
    replies: int

    @property
    def ratio(self) -> float:
        return self.bytes_out / self.bytes_in if self.bytes_in else 0.0


def _udp_socket(ip: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
    sock.bind((ip, 0))
    sock.setblocking(False)
    return sock


def _drain(sock: socket.socket) -> list[bytes]:
    out: list[bytes] = []
    while True:
        try:
            out.append(sock.recv(65535))
        except BlockingIOError:
            return out


async def _witness(probe: Probe, target: Address) -> None:
    """Wait until a request from another address is answered (see module doc)."""
    loop = asyncio.get_running_loop()
    with _udp_socket(WITNESS_IP) as witness:
        request = probe.burst(1)[0]

        async def answered() -> bool:
            witness.sendto(request, target)
            try:
                await asyncio.wait_for(loop.sock_recv(witness, 65535), WITNESS_RETRY)
            except TimeoutError:
                return False
            return True

        await eventually(answered, f"the {probe.name} witness is answered", 30)


async def reflect(
    rt: Runtime, probe: Probe, count: int, source: str = VICTIM_IP
) -> Exchange:
    """Send ``count`` requests of ``probe`` in one burst from ``source``;
    return the bytes sent and every byte that came back."""
    target = probe.target(rt)
    burst = probe.burst(count)
    with _udp_socket(source) as victim:
        for datagram in burst:
            victim.sendto(datagram, target)
        if probe.settled is not None:
            await probe.settled(rt, count)
        else:
            await _witness(probe, target)
        replies = _drain(victim)
    return Exchange(
        requests=count,
        bytes_in=sum(map(len, burst)),
        bytes_out=sum(map(len, replies)),
        replies=len(replies),
    )


async def start_for(probe: Probe, **settings: Any) -> Runtime:
    """A runtime on loopback with what ``probe`` needs (plus ``settings``)."""
    values = dict(probe.settings)
    values.update(settings)
    return await start(default_config(loopback_config(**values)))


#: The p2p rendezvous answers only probes that carry a token from ``welcome``,
#: so its probe needs a WebSocket first (not a :class:`Probe`).
P2P_SETTINGS: dict[str, Any] = {"core__only": ["p2p"]}


async def _welcome(url: str, ws: Any) -> dict[str, Any]:
    key = base64.b64encode(os.urandom(32)).decode()
    await ws.send(json.dumps({"type": "hello", "v": 1, "key": key}))
    while True:
        frame = json.loads(await asyncio.wait_for(ws.recv(), 10))
        if frame["type"] == "welcome":
            return dict(frame)


async def p2p_reflect(rt: Runtime, count: int, source: str = VICTIM_IP) -> Exchange:
    """:func:`reflect` for the p2p rendezvous port: ``count`` probes carrying a
    real peer's token (a token holder can name any source address)."""
    host, port = rt.http_address
    url = f"ws://{host}:{port}/p2p/v1/ws"
    async with websockets.connect(url) as ws, websockets.connect(url) as ws2:
        welcome = await _welcome(url, ws)
        witness_welcome = await _welcome(url, ws2)
        target = tuple(welcome["udp"][0])
        token = bytes.fromhex(welcome["token"])
        burst = [RendezvousProbe(token, 0, i).encode() for i in range(count)]
        witness_probe = Probe(
            "p2p",
            "rendezvous probe",
            lambda n: [
                RendezvousProbe(bytes.fromhex(witness_welcome["token"]), 0, 0).encode()
            ],
            lambda rt: (str(target[0]), int(target[1])),
        )
        with _udp_socket(source) as victim:
            for datagram in burst:
                victim.sendto(datagram, target)
            await _witness(witness_probe, (str(target[0]), int(target[1])))
            replies = _drain(victim)
    return Exchange(count, sum(map(len, burst)), sum(map(len, replies)), len(replies))
