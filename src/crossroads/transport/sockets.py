"""Listening sockets: the one place services create and register them.

Every UDP socket and TCP listener of a service comes from
:func:`make_udp_socket` / :func:`make_tcp_listener` (or is registered with
:func:`register_listener`), so socket options — dual-stack, buffer sizes,
``SO_REUSEPORT`` — are set in one place and TURN knows every port it must never
relay into (:func:`listening_ports`). The driver that runs a core on such a
socket is :mod:`crossroads.transport.driver`.
"""

from __future__ import annotations

import ipaddress
import socket
import weakref

from crossroads.types import Address, normalize_address

#: Kernel socket buffers for busy UDP services; the default (~200 KiB) drops
#: bursts long before Python is the bottleneck.
SOCKET_BUFFER_BYTES = 4 * 1024 * 1024


#: Every listening socket of a service in this process (UDP sockets from
#: :func:`make_udp_socket`, TCP listeners from :func:`make_tcp_listener`, and
#: the ones services register themselves). TURN reads their ports so a client
#: can never relay into them (:mod:`crossroads.proto.policy`). Weak: a closed
#: and dropped socket leaves by itself.
_LISTENERS: weakref.WeakSet[socket.socket] = weakref.WeakSet()


def register_listener(sock: socket.socket) -> None:
    """Count ``sock`` among the service listeners (see :func:`listening_ports`)."""
    _LISTENERS.add(sock)


def listening_ports() -> frozenset[int]:
    """Local ports of the live service listeners of this process."""
    ports: set[int] = set()
    for sock in list(_LISTENERS):
        if sock.fileno() < 0:
            continue
        try:
            ports.add(sock.getsockname()[1])
        except OSError:
            continue
    return frozenset(ports)


def make_udp_socket(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A bound, non-blocking UDP socket with large buffers.

    ``::`` is bound dual-stack where the OS allows it, so one socket serves IPv4
    (as mapped addresses) and IPv6.
    """
    family = (
        socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    )
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        if family == socket.AF_INET6:
            sock.setsockopt(
                socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if host == "::" else 1
            )
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
            except OSError:
                pass
        sock.bind((host, port))
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    register_listener(sock)
    return sock


def make_tcp_listener(
    host: str, port: int, *, reuse_port: bool = False
) -> socket.socket:
    family = (
        socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    )
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(
                socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if host == "::" else 1
            )
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(1024)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    register_listener(sock)
    return sock


def bound_address(sock: socket.socket) -> Address:
    return normalize_address(sock.getsockname())
