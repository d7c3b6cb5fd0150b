"""Method ``unity-relay``: the two hosts meet through crossroads' Unity-Relay-
compatible relay on the lab server.

The game backend's part, done here from the server's own namespace, is the REST
API: allocate a seat for host A, get its join code, join with it for B. The
players' part is all UDP through their NATs with :mod:`crossroads.client.relay`:
A and B BIND (HMAC + nonce), B sends CONNECT_REQUEST and is ACCEPTED, then one
RELAY frame goes each way. Both sides only ever send to the relay and hear back
from it, so it connects whenever both sites can send UDP out at all, whatever
their mapping and filtering.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

from crossroads.client.relay import Allocation, RelayConnection, RelayConnectionError
from crossroads.lab import netns
from crossroads.lab.kinds import both_udp
from crossroads.lab.matrix import Attempt, Method, Outcome, register
from crossroads.lab.topology import SERVER_HTTP_PORT, SERVER_IPS, Lab
from crossroads.proto.relay.client import RelayClientConfig

#: The API key the lab's ``crossroads serve`` is started with
#: (``topology.SERVER_SETTINGS["relay.api_keys"]``).
LAB_API_KEY = "crossroads-lab-relay-key"
#: The lab loses nothing and its RTT is sub-millisecond: retry BIND/CONNECT every
#: 200 ms and give up after 1 s (five tries), so a failure means the site cannot
#: send UDP out.
CLIENT = RelayClientConfig(connect_retry=0.2, heartbeat=1.0, max_connect_time=2.0)
BIND_S = 1.0
STEP_S = 2.0
#: The whole matrix allocates from one address; a few retries ride out the API's
#: per-address rate limit (20/s with a 3 s burst by default).
RATE_LIMIT_RETRIES = 5


async def api(lab: Lab, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST to the lab server's allocations API, as a polite backend would:
    an answer 429 (rate limited) is retried after its ``Retry-After``."""
    for _ in range(RATE_LIMIT_RETRIES):
        status, content = await _post(lab, path, body)
        if status != 429:
            break
        await asyncio.sleep(1.0)
    if status >= 300:
        raise RuntimeError(f"{path}: HTTP {status}: {content[:200]!r}")
    data: dict[str, Any] = json.loads(content)["data"]
    return data


async def _post(lab: Lab, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    """POST to the lab server's allocations API from inside its namespace."""
    loop = asyncio.get_running_loop()
    payload = json.dumps(body).encode()
    request = (
        f"POST {path} HTTP/1.1\r\nHost: {SERVER_IPS[0]}\r\n"
        f"Authorization: Bearer {LAB_API_KEY}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    ).encode() + payload
    sock = netns.socket_in(lab.server_ns, socket.SOCK_STREAM)
    try:
        await asyncio.wait_for(
            loop.sock_connect(sock, (SERVER_IPS[0], SERVER_HTTP_PORT)), STEP_S
        )
        await loop.sock_sendall(sock, request)
        chunks = []
        while chunk := await asyncio.wait_for(loop.sock_recv(sock, 65536), STEP_S):
            chunks.append(chunk)
    finally:
        sock.close()
    head, _, content = b"".join(chunks).partition(b"\r\n\r\n")
    return int(head.split()[1]), content


async def run(attempt: Attempt) -> Outcome:
    lab = attempt.lab
    started = time.monotonic()
    host_alloc = Allocation.from_json(
        (await api(lab, "/v1/allocate", {"maxConnections": 1}))["allocation"]
    )
    code = (
        await api(lab, "/v1/joincode", {"allocationId": str(host_alloc.allocation_id)})
    )["joinCode"]
    join_alloc = Allocation.from_json(
        (await api(lab, "/v1/join", {"joinCode": code}))["allocation"]
    )
    host = await RelayConnection.open(
        host_alloc, config=CLIENT, sock=lab.udp_socket(attempt.a)
    )
    player = await RelayConnection.open(
        join_alloc, config=CLIENT, sock=lab.udp_socket(attempt.b)
    )
    try:
        await asyncio.gather(host.bind(BIND_S), player.bind(BIND_S))
        await player.connect(STEP_S)
        player.send(host.allocation_id, b"hello host")
        if await host.recv(STEP_S) != (player.allocation_id, b"hello host"):
            return Outcome(False, detail="wrong frame at the host")
        host.send(player.allocation_id, b"hello player")
        if await player.recv(STEP_S) != (host.allocation_id, b"hello player"):
            return Outcome(False, detail="wrong frame at the player")
    except (TimeoutError, RelayConnectionError) as exc:
        return Outcome(False, detail=f"{type(exc).__name__}: {exc}")
    finally:
        await player.close()
        await host.close()
    return Outcome(True, "relay", time.monotonic() - started)


METHOD = register(
    Method(
        name="unity-relay",
        summary="crossroads' Unity-Relay-compatible relay: join code, BIND, CONNECT, RELAY",
        run=run,
        # The relay needs UDP from both sites to the node.
        expected=both_udp,
        timeout=20.0,
        needs=("relay",),
    )
)
