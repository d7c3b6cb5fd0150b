"""Small asyncio helpers over raw non-blocking UDP sockets (lab sockets are made
in other namespaces, so they are used directly rather than through transports)."""

from __future__ import annotations

import asyncio
import socket

from crossroads.types import Address


async def recv(sock: socket.socket, timeout: float) -> tuple[bytes, Address] | None:
    """One datagram, or None after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    try:
        data, addr = await asyncio.wait_for(loop.sock_recvfrom(sock, 2048), timeout)
    except TimeoutError:
        return None
    except OSError:
        # ICMP errors (port unreachable from a router) surface as ECONNREFUSED on
        # the next receive; in the lab they mean "nothing came back".
        return None
    return data, (str(addr[0]), int(addr[1]))


def send(sock: socket.socket, data: bytes, addr: Address) -> None:
    """Send one datagram; a full buffer or an ICMP error loses it, as on a wire."""
    try:
        sock.sendto(data, addr)
    except (BlockingIOError, OSError):
        pass


def local(sock: socket.socket) -> Address:
    host, port = sock.getsockname()[:2]
    return (str(host), int(port))
