"""Loopback TCP pairs for the stream-route tests."""

from __future__ import annotations

import asyncio
import socket


async def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """(client, accepted) over loopback TCP, both non-blocking."""
    loop = asyncio.get_running_loop()
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.setblocking(False)
        client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        client.setblocking(False)
        await loop.sock_connect(client, server.getsockname())
        accepted, _ = await loop.sock_accept(server)
    accepted.setblocking(False)
    return client, accepted
