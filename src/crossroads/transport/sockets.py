"""Listening sockets: the one place services create and register them.

Every UDP socket and TCP listener of a service comes from
:func:`make_udp_socket` / :func:`make_tcp_listener` (or is registered with
:func:`register_listener`), so socket options — dual-stack, buffer sizes,
``SO_REUSEPORT`` — are set in one place and TURN knows every port it must never
relay into (:func:`listening_ports`). The driver that runs a core on such a
socket is :mod:`crossroads.transport.driver`.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import struct
import weakref
from typing import Any

from crossroads.transport.reuseport import shared_udp_socket
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


def live_listeners() -> set[socket.socket]:
    """The registered listening sockets of this process that are still open."""
    return {sock for sock in list(_LISTENERS) if sock.fileno() >= 0}


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


def family_of(host: str) -> socket.AddressFamily:
    """``AF_INET6`` for an IPv6 literal, ``AF_INET`` for an IPv4 one."""
    return (
        socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    )


def set_buffers(sock: socket.socket, size: int = SOCKET_BUFFER_BYTES) -> None:
    """Ask for ``size``-byte kernel receive and send buffers (the kernel caps
    them at ``net.core.rmem_max`` / ``wmem_max``; a refusal leaves the default)."""
    for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, size)


def bind_socket(
    host: str,
    port: int,
    kind: socket.SocketKind,
    *,
    v6only: bool | None = None,
    reuse_port: bool = False,
    shared: bool = False,
) -> socket.socket:
    """A bound, non-blocking, registered listening socket: UDP with large
    buffers, or a TCP listener (``SO_REUSEADDR``, backlog 1024).

    ``v6only`` None binds ``::`` dual-stack where the OS allows it, so one
    socket serves IPv4 (as mapped addresses) and IPv6, and any other IPv6
    address IPv6 only; True or False sets ``IPV6_V6ONLY`` as asked.
    ``shared``: a port every worker of ``--workers N`` serves (the STUN/TURN
    UDP ports): the socket joins the port's SO_REUSEPORT group and is kept by
    the supervisor across restarts (:mod:`crossroads.transport.reuseport`
    says why); outside a worker it is an ordinary socket.
    """
    if shared and kind == socket.SOCK_DGRAM:
        sock = shared_udp_socket(
            host,
            port,
            lambda reuse: _new_socket(host, port, kind, v6only, reuse_port or reuse),
        )
    else:
        sock = _new_socket(host, port, kind, v6only, reuse_port)
    register_listener(sock)
    return sock


def _new_socket(
    host: str,
    port: int,
    kind: socket.SocketKind,
    v6only: bool | None,
    reuse_port: bool,
) -> socket.socket:
    family = family_of(host)
    sock = socket.socket(family, kind)
    try:
        if kind == socket.SOCK_STREAM:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        else:
            set_buffers(sock)
        if family == socket.AF_INET6:
            only = host != "::" if v6only is None else v6only
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1 if only else 0)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        if kind == socket.SOCK_STREAM:
            # The kernel caps it at net.core.somaxconn; accepts are bounded by
            # each listener's admission (transport/admission.py), not here.
            sock.listen(1024)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def make_udp_socket(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A bound, non-blocking UDP socket with large buffers (``::``: dual-stack)."""
    return bind_socket(host, port, socket.SOCK_DGRAM, reuse_port=reuse_port)


def make_tcp_listener(
    host: str, port: int, *, reuse_port: bool = False
) -> socket.socket:
    """A bound, listening, non-blocking TCP socket (``::``: dual-stack)."""
    return bind_socket(host, port, socket.SOCK_STREAM, reuse_port=reuse_port)


def bound_address(sock: socket.socket) -> Address:
    return normalize_address(sock.getsockname())


#: Linux ``struct tcp_info`` (include/uapi/linux/tcp.h): ``tcpi_rtt``, the
#: smoothed RTT in microseconds, follows 8 one-byte fields and 15 u32 fields.
_TCP_INFO = getattr(socket, "TCP_INFO", 11)
_TCPI_RTT_OFFSET = 8 + 15 * 4
_TCP_INFO_LEN = 104


def tcp_round_trip(sock: Any) -> float | None:
    """The kernel's smoothed round-trip time of a TCP socket (seconds), or
    None where TCP_INFO is not available (or no sample was taken yet)."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _TCP_INFO_LEN)
    except (OSError, AttributeError):
        return None
    if len(info) < _TCPI_RTT_OFFSET + 4:
        return None
    (rtt_us,) = struct.unpack_from("I", info, _TCPI_RTT_OFFSET)
    return rtt_us / 1e6 if rtt_us else None
