"""Socket options set in one place (transport/sockets.py): the kernel buffers of
the service sockets and of the relay sockets."""

from __future__ import annotations

import socket
from pathlib import Path

from crossroads.transport.sockets import (
    SOCKET_BUFFER_BYTES,
    make_udp_socket,
    set_buffers,
)


def _cap(name: str) -> int:
    return int(Path(f"/proc/sys/net/core/{name}").read_text())


def _buffers(sock: socket.socket) -> tuple[int, int]:
    return (
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF),
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF),
    )


def test_set_buffers_asks_for_both_directions_up_to_the_kernel_cap() -> None:
    # Linux doubles what is asked (bookkeeping overhead) after capping it at
    # net.core.rmem_max / wmem_max (socket(7)).
    size = 1024 * 1024
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        set_buffers(sock, size)
        receive, send = _buffers(sock)
    assert receive >= min(size, _cap("rmem_max"))
    assert send >= min(size, _cap("wmem_max"))
    # Far above the cap: capped, not an error.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        set_buffers(sock, 1 << 30)
        assert _buffers(sock)[0] >= min(1 << 30, _cap("rmem_max"))


def test_service_udp_sockets_get_the_large_buffers() -> None:
    sock = make_udp_socket("127.0.0.1", 0)
    try:
        receive, send = _buffers(sock)
    finally:
        sock.close()
    assert receive >= min(SOCKET_BUFFER_BYTES, _cap("rmem_max"))
    assert send >= min(SOCKET_BUFFER_BYTES, _cap("wmem_max"))
