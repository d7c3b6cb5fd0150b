"""SO_REUSEPORT for the listening sockets that several workers share.

``crossroads serve --workers N`` (:mod:`crossroads.workers`) runs N processes on
the same STUN/TURN UDP ports. Each worker binds its own socket with
SO_REUSEPORT and the kernel spreads datagrams over the group by a hash of the
4-tuple (socket(7)), so one client's datagrams keep reaching the same worker:
the one that holds its TURN allocation.

Whoever creates a shareable listening socket calls :func:`allow_port_sharing`
before ``bind``; it does nothing outside a worker, so a single process keeps
refusing a port another program already holds (EADDRINUSE, a clear error)
instead of silently splitting its traffic with it.
"""

from __future__ import annotations

import socket

_sharing = False


def share_listening_ports(enabled: bool) -> None:
    """Make :func:`allow_port_sharing` set SO_REUSEPORT (in a worker process)."""
    global _sharing
    _sharing = enabled


def sharing_listening_ports() -> bool:
    return _sharing


def allow_port_sharing(sock: socket.socket, port: int) -> None:
    """Set SO_REUSEPORT on ``sock`` (not yet bound) when this process is one of
    several workers and ``port`` is a fixed port. Port 0 never shares: with
    SO_REUSEPORT an ephemeral bind may land on a port another socket of the
    same user already holds, and the two would split its traffic."""
    if _sharing and port != 0:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
