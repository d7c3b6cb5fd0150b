"""Visible failures.

Authentication failures are logged, one line per reason per interval with a
count of the lines held back, never with a secret; the kernel's UDP receive
drops of every socket of the process are exported as metrics.
docs/security.md, section "Visible failures".
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from crossroads.client.turn import TurnClient, TurnClientError, rest_credentials
from crossroads.config import default_config
from crossroads.proto.natneg.server import SessionId
from crossroads.proto.raknet.udpproxy import ForwarderResult
from crossroads.proto.stun import Method, encode, request
from crossroads.ratelog import RateLimitedLog
from crossroads.runtime import Runtime, start
from crossroads.services.natneg import NatNegService
from crossroads.services.raknet import RakNetService
from crossroads.services.stun import StunService
from crossroads.transport.kernel_drops import RELAYED, KernelDropCollector, udp_table
from tests.conftest import eventually, loopback_config
from tests.e2e.relay_support import API_KEY, api, raw_bind, relay_runtime

PASSWORD = "correct-horse-battery"
SECRET = "rest-shared-secret-123"


# ------------------------------------------------------------------ the helper


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_one_line_per_reason_per_interval_with_the_count_held_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    limited = RateLimitedLog(logging.getLogger("test.ratelog"), 60.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.ratelog"):
        for _ in range(500):
            limited.log("bad-hmac", "bad HMAC from %s", "192.0.2.1")
        limited.log("bad-token", "bad token from %s", "192.0.2.2")
        clock.now += 61
        limited.log("bad-hmac", "bad HMAC from %s", "192.0.2.3")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "bad HMAC from 192.0.2.1",
        "bad token from 192.0.2.2",
        "bad HMAC from 192.0.2.3 (499 similar in the last 61 s not logged)",
    ]
    assert (limited.written, limited.suppressed) == (3, 499)


# ------------------------------------------------------------------ TURN


@pytest.fixture
async def turn_runtime() -> Any:
    runtime = await start(
        default_config(
            loopback_config(
                core__only=["stun", "turn"],
                turn__user=[f"alice:{PASSWORD}"],
                turn__secret=[SECRET],
            )
        )
    )
    try:
        yield runtime
    finally:
        await runtime.close()


def _turn_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "crossroads.turn" and "authentication failed" in r.getMessage()
    ]


async def test_turn_auth_failures_are_logged_once_per_reason_without_secrets(
    turn_runtime: Runtime, caplog: pytest.LogCaptureFixture
) -> None:
    stun = turn_runtime.services["stun"]
    assert isinstance(stun, StunService)
    expired_user, expired_password = rest_credentials(SECRET, "carl", ttl=-10)
    attempts = [("alice", "wrong-password-1")] * 20 + [
        ("mallory", PASSWORD),
        (expired_user, expired_password),
    ]
    with caplog.at_level(logging.WARNING, logger="crossroads.turn"):
        for username, password in attempts:
            async with await TurnClient.connect(
                stun.primary, username, password, timeout=5
            ) as client:
                with pytest.raises(TurnClientError) as failed:
                    await client.allocate()
                assert failed.value.code == 401
        # A client that does authenticate logs nothing: its first, unsigned
        # Allocate gets the normal 401 challenge.
        async with await TurnClient.connect(stun.primary, "alice", PASSWORD) as ok:
            await ok.allocate()
    lines = _turn_lines(caplog)
    assert len(lines) == 3, lines
    assert "(auth-bad-integrity) from 127.0.0.1, username 'alice'" in lines[0]
    assert "(auth-unknown-user)" in lines[1]
    assert "(auth-expired)" in lines[2]
    for secret in ("wrong-password-1", PASSWORD, expired_password, SECRET):
        assert secret not in caplog.text


# ------------------------------------------------------------------ relay


async def test_relay_bad_hmac_and_bad_api_key_are_logged_without_secrets(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from tests.e2e.relay_support import RawPeer

    async with relay_runtime() as rt, api(rt) as http:
        with caplog.at_level(logging.WARNING, logger="crossroads.relay"):
            grant = (
                await http.post("/v1/allocate", json={"maxConnections": 2})
            ).json()["data"]["allocation"]
            server = (grant["relayServer"]["ipV4"], grant["relayServer"]["port"])
            evil = RawPeer(server)
            try:
                for nonce in range(30):
                    evil.send(raw_bind(grant, nonce=nonce, key=bytes(64)))
                assert await evil.silent()
            finally:
                evil.close()
            wrong = "not-the-key-42"
            async with httpx.AsyncClient(
                base_url=str(http.base_url),
                headers={"Authorization": f"Bearer {wrong}"},
            ) as stranger:
                for _ in range(10):
                    response = await stranger.post(
                        "/v1/allocate", json={"maxConnections": 2}
                    )
                    assert response.status_code == 401

            def lines(word: str) -> list[str]:
                return [
                    r.getMessage() for r in caplog.records if word in r.getMessage()
                ]

            await eventually(
                lambda: _async(len(lines("BIND rejected")) == 1), "one BIND line"
            )
            assert "(bad-hmac) from 127.0.0.1" in lines("BIND rejected")[0]
            assert len(lines("API key")) == 1
            for secret in (wrong, API_KEY, grant["key"]):
                assert secret not in caplog.text


# ------------------------------------------------------------------ kernel drops


@pytest.fixture
def unread_udp() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A UDP socket nobody reads, with a small receive buffer, and a sender."""
    receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        receiver.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        receiver.bind(("127.0.0.1", 0))
        yield receiver, sender
    finally:
        receiver.close()
        sender.close()


def test_kernel_drops_are_counted_and_survive_the_socket(
    unread_udp: tuple[socket.socket, socket.socket],
) -> None:
    receiver, sender = unread_udp
    collector = KernelDropCollector(lambda: {})
    before = collector.drops()[RELAYED]
    for _ in range(200):
        sender.sendto(bytes(1000), receiver.getsockname())
    during = collector.drops()[RELAYED]
    assert during - before >= 150  # a 4 KiB buffer holds a few datagrams
    receiver.close()
    assert collector.drops()[RELAYED] >= during  # a counter never goes down


async def test_kernel_drops_of_a_listener_are_exported_by_service() -> None:
    runtime = await start(default_config(loopback_config(core__only=["stun"])))
    try:
        stun = runtime.services["stun"]
        assert isinstance(stun, StunService)
        # While this loop sends, the event loop cannot read: the STUN socket's
        # receive buffer fills and the kernel drops the rest.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
            datagram = encode(request(Method.BINDING, bytes(12))) + bytes(1200)
            for _ in range(30_000):
                sender.sendto(datagram, stun.primary)
        host, port = runtime.http_address
        async with httpx.AsyncClient() as client:
            text = (await client.get(f"http://{host}:{port}/metrics")).text
        line = next(
            line
            for line in text.splitlines()
            if line.startswith('crossroads_udp_kernel_drops_total{socket="stun"}')
        )
        assert float(line.split()[-1]) > 0
        assert "crossroads_tcp_listen_overflows_total" in text
        assert "crossroads_tcp_listen_drops_total" in text
    finally:
        await runtime.close()


async def test_kernel_drops_of_turn_relayed_sockets_are_exported(
    turn_runtime: Runtime,
) -> None:
    """The C data plane reads relayed sockets itself (recvmmsg): their drops
    are counted all the same, as ``relayed``."""
    stun = turn_runtime.services["stun"]
    assert isinstance(stun, StunService)
    host, port = turn_runtime.http_address

    async def relayed_drops() -> float:
        async with httpx.AsyncClient() as client:
            text = (await client.get(f"http://{host}:{port}/metrics")).text
        return float(
            next(
                line.split()[-1]
                for line in text.splitlines()
                if line.startswith(
                    f'crossroads_udp_kernel_drops_total{{socket="{RELAYED}"}}'
                )
            )
        )

    async with await TurnClient.connect(stun.primary, "alice", PASSWORD) as client:
        relayed = await client.allocate()
        before = await relayed_drops()
        # The event loop is busy sending: nothing reads the relayed socket.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
            for _ in range(30_000):
                sender.sendto(bytes(1200), relayed)
        assert await relayed_drops() > before


async def test_kernel_drops_of_a_relay_socket_closed_between_scrapes_are_counted(
    turn_runtime: Runtime,
) -> None:
    """A relay that lives between two scrapes (a short call) is never in a
    scrape's view of ``/proc``: its drops are read when it closes (otherwise
    they would be lost)."""
    stun = turn_runtime.services["stun"]
    assert isinstance(stun, StunService)
    metrics = turn_runtime.metrics

    def relayed_drops() -> float:
        value = metrics.get_sample_value(
            "crossroads_udp_kernel_drops_total", {"socket": RELAYED}
        )
        return value or 0.0

    before = relayed_drops()
    client = await TurnClient.connect(stun.primary, "alice", PASSWORD)
    try:
        relayed = await client.allocate()
        # The event loop is busy sending: nothing reads the relayed socket.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
            for _ in range(4_000):
                sender.sendto(bytes(1200), relayed)
        dropped = next(
            drops for _inode, (port, drops) in udp_table().items() if port == relayed[1]
        )
        assert dropped > 0
    finally:
        await client.close()  # Refresh 0: the relay socket closes
    assert relayed_drops() - before >= dropped


def _open_natneg_relay(runtime: Runtime) -> tuple[int, Callable[[], None]]:
    """One natneg relay pair through the running service's pool: the port of
    its side 0, and how to release it."""
    service = runtime.services["natneg"]
    assert isinstance(service, NatNegService) and service.relay is not None
    pool = service.relay
    session = SessionId(cookie=0x0BADC0DE, serial=1)
    pair = pool.allocate(session, ("127.0.0.2", "127.0.0.3"))
    assert pair is not None
    return pair[0][1], lambda: pool.release(session)


def _open_raknet_forwarder(runtime: Runtime) -> tuple[int, Callable[[], None]]:
    """One UDPProxy forwarder through the running service's pool: its port,
    and how to end it (its client leaves before anything was forwarded)."""
    service = runtime.services["raknet"]
    assert isinstance(service, RakNetService) and service.forwarders is not None
    pool = service.forwarders
    side1, side2 = ("127.0.0.2", 40001), ("127.0.0.3", 40002)
    result, port = pool.start(side1, side2, 10_000)
    assert result is ForwarderResult.SUCCESS
    return port, lambda: pool.end_client(side1)


RELAY_SOCKETS = {
    "natneg": (
        _open_natneg_relay,
        {
            "core__only": ["natneg"],
            "natneg__relay_host": "127.0.0.1",
            "natneg__relay_allow": "127.0.0.0/8",
        },
    ),
    "raknet": (_open_raknet_forwarder, {"core__only": ["raknet"]}),
}


@pytest.mark.parametrize("kind", sorted(RELAY_SOCKETS))
async def test_kernel_drops_of_every_kind_of_relay_socket_are_counted_as_it_closes(
    kind: str,
) -> None:
    """natneg relay pairs and RakNet UDPProxy forwarders are per-client relay
    sockets like TURN's: one that lives between two scrapes must have its
    drops counted when it closes (before, only TURN's were)."""
    open_relay, overrides = RELAY_SOCKETS[kind]
    runtime = await start(default_config(loopback_config(**overrides)))
    try:
        metrics = runtime.metrics

        def relayed_drops() -> float:
            value = metrics.get_sample_value(
                "crossroads_udp_kernel_drops_total", {"socket": RELAYED}
            )
            return value or 0.0

        before = relayed_drops()  # a scrape before the socket exists
        port, close = open_relay(runtime)
        # The event loop is busy sending: nothing reads the relay socket.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
            for _ in range(4_000):
                sender.sendto(bytes(1200), ("127.0.0.1", port))
        dropped = next(drops for _inode, (p, drops) in udp_table().items() if p == port)
        assert dropped > 0
        close()
        assert port not in {p for p, _ in udp_table().values()}, "still open"
        assert relayed_drops() - before >= dropped
    finally:
        await runtime.close()


async def _async(value: bool) -> bool:
    await asyncio.sleep(0)
    return value
