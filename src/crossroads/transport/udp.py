"""UDP plumbing shared by the services.

:class:`CoreDatagramProtocol` drives any sans-I/O datagram core the aioquic way:
feed ``loop.time()`` and the datagram in, send what the core wants to send, and
keep exactly one ``call_at`` timer armed at the core's next deadline.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import weakref
from typing import Protocol, cast

from crossroads.types import Address, normalize_address

#: Kernel socket buffers for busy UDP services; the default (~200 KiB) drops
#: bursts long before Python is the bottleneck.
SOCKET_BUFFER_BYTES = 4 * 1024 * 1024


class DatagramCore(Protocol):
    """The sans-I/O datagram interface (see DESIGN.md, "A protocol is a pure core")."""

    def receive_datagram(self, data: bytes, addr: Address, now: float) -> None: ...

    def datagrams_to_send(self, now: float) -> list[tuple[bytes, Address]]: ...

    def get_timer(self) -> float | None: ...

    def handle_timer(self, now: float) -> None: ...


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


class CoreDatagramProtocol(asyncio.DatagramProtocol):
    """Runs one :class:`DatagramCore` on one UDP socket."""

    def __init__(self, core: DatagramCore) -> None:
        self.core = core
        self.transport: asyncio.DatagramTransport | None = None
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's UDPTransport is not a subclass of asyncio.DatagramTransport,
        # so no isinstance check here (it failed under `crossroads serve`).
        self.transport = cast(asyncio.DatagramTransport, transport)
        self._rearm()

    def datagram_received(self, data: bytes, addr: tuple[str | object, ...]) -> None:
        now = self._loop.time()
        self.core.receive_datagram(data, normalize_address(addr), now)
        self.transmit(now)

    def error_received(self, exc: Exception) -> None:
        # ICMP errors for earlier sends (port unreachable, ...): nothing to do for
        # a connectionless server.
        pass

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def transmit(self, now: float | None = None) -> None:
        if self.transport is None:
            return
        now = self._loop.time() if now is None else now
        for data, addr in self.core.datagrams_to_send(now):
            self.transport.sendto(data, addr)
        self._rearm()

    def _rearm(self) -> None:
        deadline = self.core.get_timer()
        if deadline == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = deadline
        if deadline is not None:
            self._timer = self._loop.call_at(deadline, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        now = self._loop.time()
        self.core.handle_timer(now)
        self.transmit(now)
