"""A real RFC 8656 client (aioice's) shaped as the SDK's ``TurnRelay``, and a
real TURN server (coturn) on loopback, for the SDK's TURN relay tests."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aioice.turn

from crossroads.types import Address
from tests.conftest import free_udp_tcp_port

USER, PASSWORD, REALM = "sdk", "sdk-secret", "crossroads.test"


class AioiceTurn:
    """aioice's TURN client: it binds a channel (and so a permission) on the
    first send to a peer, so ``permit`` has nothing to add."""

    def __init__(self) -> None:
        self.relayed: Address = ("", 0)
        self._receiver: Callable[[bytes, Address], None] = lambda data, peer: None
        self._transport: Any = None

    @classmethod
    async def open(cls, server: Address, transport: str = "udp") -> AioiceTurn:
        self = cls()
        owner = self

        class Protocol(asyncio.DatagramProtocol):
            def datagram_received(self, data: bytes, addr: Any) -> None:
                owner._receiver(data, (addr[0], addr[1]))

        self._transport, _ = await aioice.turn.create_turn_endpoint(
            Protocol, server, USER, PASSWORD, transport=transport
        )
        host, port = self._transport.get_extra_info("sockname")[:2]
        self.relayed = (host, port)
        return self

    def set_receiver(self, receiver: Callable[[bytes, Address], None]) -> None:
        self._receiver = receiver

    async def permit(self, *hosts: str) -> None:
        return None

    def send(self, data: bytes, peer: Address) -> None:
        self._transport.sendto(data, peer)

    async def close(self) -> None:
        self._transport.close()


SECRET = "sdk-rest-secret"


@contextmanager
def coturn(rest: bool = False) -> Iterator[Address]:
    """coturn on 127.0.0.1 with long-term credentials (or, with ``rest``, the
    REST-API shared secret), loopback peers allowed."""
    binary = shutil.which("turnserver")
    assert binary is not None, "coturn is not installed (make install)"
    port = free_udp_tcp_port()
    directory = Path(tempfile.mkdtemp(prefix="xs-sdk-coturn-"))
    process = subprocess.Popen(
        [
            binary,
            "-n",
            "--listening-ip=127.0.0.1",
            f"--listening-port={port}",
            "--relay-ip=127.0.0.1",
            *(
                ["--use-auth-secret", f"--static-auth-secret={SECRET}"]
                if rest
                else ["--lt-cred-mech", f"--user={USER}:{PASSWORD}"]
            ),
            f"--realm={REALM}",
            "--allow-loopback-peers",
            "--no-cli",
            "--no-tls",
            "--no-dtls",
            f"--pidfile={directory / 'pid'}",
            "--log-file=stdout",
            "--simple-log",
            f"--db={directory / 'db'}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            out = subprocess.run(["ss", "-uln"], capture_output=True, text=True).stdout
            if f"127.0.0.1:{port}" in out:
                break
            time.sleep(0.05)
        yield ("127.0.0.1", port)
    finally:
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(directory, ignore_errors=True)
