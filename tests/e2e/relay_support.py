"""Helpers shared by the relay tests: a runtime running the relay service, and
hand-written Unity Relay messages (built from the reference tables with struct and
hmac, deliberately NOT with crossroads' codec)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import socket
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

from crossroads.config import default_config
from crossroads.runtime import Runtime, start
from tests.conftest import loopback_config

API_KEY = "test-key-0123456789"


def relay_overrides(**extra: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "core__only": "relay",
        "relay__api_keys": API_KEY,
        "relay__allow_private_peers": True,
    }
    values.update(extra)
    return loopback_config(**values)


@asynccontextmanager
async def relay_runtime(**extra: Any) -> AsyncIterator[Runtime]:
    rt = await start(default_config(relay_overrides(**extra)))
    try:
        yield rt
    finally:
        await rt.close()


def base_url(rt: Runtime) -> str:
    host, port = rt.http_address
    return f"http://{host}:{port}"


def api(rt: Runtime) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=base_url(rt),
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=10,
    )


def server_endpoint(allocation: dict[str, Any], kind: str) -> dict[str, Any]:
    """The one ``serverEndpoints`` entry of ``kind`` (udp, dtls, ws, wss), as
    Unity picks it."""
    found = [e for e in allocation["serverEndpoints"] if e["connectionType"] == kind]
    assert len(found) == 1, allocation["serverEndpoints"]
    return found[0]


def endpoint_address(allocation: dict[str, Any], kind: str) -> tuple[str, int]:
    """(host, port) of the ``kind`` endpoint of an allocation."""
    entry = server_endpoint(allocation, kind)
    return entry["host"], entry["port"]


async def allocate(http: httpx.AsyncClient, max_connections: int) -> dict[str, Any]:
    """A host allocation (the ``allocation`` object of the response)."""
    body = {"maxConnections": max_connections}
    result: dict[str, Any] = (await http.post("/v1/allocate", json=body)).json()[
        "data"
    ]["allocation"]
    return result


async def allocate_pair(
    http: httpx.AsyncClient, max_connections: int = 2
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A host allocation and a joiner's allocation of it, through its join code."""
    host = await allocate(http, max_connections)
    body = {"allocationId": host["allocationId"]}
    code = (await http.post("/v1/joincode", json=body)).json()["data"]["joinCode"]
    joiner = (await http.post("/v1/join", json={"joinCode": code})).json()["data"][
        "allocation"
    ]
    return host, joiner


def allocation_id(allocation: dict[str, Any]) -> bytes:
    """The 16 raw bytes of ``allocationIdBytes``, as relay messages carry them."""
    return base64.b64decode(allocation["allocationIdBytes"])


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus text page (0 when absent)."""
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    needle = f"{name}{{{wanted}}} " if labels else f"{name} "
    for line in text.splitlines():
        if line.startswith(needle):
            return float(line.split()[-1])
    return 0.0


# --------------------------------------------------- raw Unity Relay, by hand
# Reference §1.1: header DA 72 00 <type>; BIND = accept mode u8, nonce u16 LE,
# length u8, connection data[255], HMAC[32] over the first 263 bytes; PING = id[16],
# seq u16; CONNECT_REQUEST = id[16], length u8, data[255]; RELAY = from[16], to[16],
# length u16 big-endian, payload; ERROR = id[16], code u8.


def raw_bind(allocation: dict[str, Any], nonce: int, key: bytes | None = None) -> bytes:
    data = base64.b64decode(allocation["connectionData"])
    signed = (
        b"\xda\x72\x00\x00"
        + b"\x00"
        + struct.pack("<H", nonce)
        + b"\xff"
        + data.ljust(255, b"\x00")
    )
    key = key if key is not None else base64.b64decode(allocation["key"])
    return signed + hmac.new(key, signed, hashlib.sha256).digest()


def raw_ping(allocation_id: bytes) -> bytes:
    return b"\xda\x72\x00\x02" + allocation_id + struct.pack("<H", 1)


def raw_connect(allocation_id: bytes, host_connection_data: bytes) -> bytes:
    return (
        b"\xda\x72\x00\x03"
        + allocation_id
        + b"\xff"
        + host_connection_data.ljust(255, b"\x00")
    )


def raw_relay(from_id: bytes, to_id: bytes, payload: bytes) -> bytes:
    return (
        b"\xda\x72\x00\x0a"
        + from_id
        + to_id
        + struct.pack(">H", len(payload))
        + payload
    )


def raw_accepted(host_id: bytes, joiner_id: bytes) -> bytes:
    """ACCEPTED (type 6): the relay's answer to a joiner's CONNECT_REQUEST."""
    return b"\xda\x72\x00\x06" + host_id + joiner_id


def raw_error(allocation_id: bytes, code: int) -> bytes:
    return b"\xda\x72\x00\x0c" + allocation_id + bytes([code])


BIND_RECEIVED = b"\xda\x72\x00\x01"


class RawPeer:
    """A UDP socket on 127.0.0.1 talking to the relay without crossroads code."""

    def __init__(self, server: tuple[str, int]) -> None:
        self.server = server
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.setblocking(False)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.sock.getsockname()
        return host, port

    def send(self, data: bytes) -> None:
        self.sock.sendto(data, self.server)

    async def recv(self, timeout: float = 2.0) -> bytes:
        loop = asyncio.get_running_loop()
        data, _ = await asyncio.wait_for(loop.sock_recvfrom(self.sock, 70000), timeout)
        return data

    async def silent(self, timeout: float = 0.3) -> bool:
        """True when nothing arrives within ``timeout``."""
        try:
            await self.recv(timeout)
        except TimeoutError:
            return True
        return False

    async def request(
        self, data: bytes, timeout: float = 1.0, attempts: int = 3
    ) -> bytes:
        """Send and wait for a reply, resending on loss (UDP, even on loopback)."""
        for _ in range(attempts - 1):
            self.send(data)
            try:
                return await self.recv(timeout)
            except TimeoutError:
                continue
        self.send(data)
        return await self.recv(timeout)

    def close(self) -> None:
        self.sock.close()
