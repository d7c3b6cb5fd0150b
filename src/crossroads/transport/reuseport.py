"""SO_REUSEPORT for the listening sockets that several workers share.

``crossroads serve --workers N`` (:mod:`crossroads.workers`) runs N processes on
the same STUN/TURN UDP ports. Each worker binds its own socket with
SO_REUSEPORT and the kernel spreads datagrams over the group by a hash of the
4-tuple (socket(7)), so one client's datagrams keep reaching the same worker:
the one that holds its TURN allocation.

The hash picks a socket by its *position* in the group, and a socket that
closes is replaced by the group's last one (Linux ``reuseport_detach_sock``):
were a dying worker's socket to close, the clients of the *other* workers would
be dealt out again, and land on workers that do not hold their allocations. So
each worker hands a duplicate of every shared socket it binds to the supervisor
(:func:`publish_shared_socket`, SCM_RIGHTS over a Unix socket pair); the socket
stays in the group while its worker is dead, and the restarted worker adopts the
very same socket (:func:`adopt_shared_socket`, an inherited descriptor), so the
group, and every client's worker, never changes.

The group must also be complete before the first client arrives: a worker
joining it later would take over part of the clients already served by the
others. So worker 0 (started alone) binds *every* worker's socket for each
shared port at once, hands them all to the supervisor and says it is ready
(:func:`announce_ready`); only then does the supervisor start workers 1..N-1,
which adopt the sockets made for them.

Whoever binds a UDP port that every worker serves gets the socket from
:func:`shared_udp_socket`; outside a worker it just binds one without
SO_REUSEPORT, so a single process keeps refusing a port another program
already holds (EADDRINUSE, a clear error) instead of silently splitting its
traffic with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Callable, Mapping

#: Set by the supervisor in a worker's environment: the descriptor of the
#: worker's end of the hand-over socket pair, and {key: descriptor} of the
#: shared sockets a previous run of this worker bound.
CHANNEL_ENV = "CROSSROADS_WORKER_CHANNEL"
INHERITED_ENV = "CROSSROADS_WORKER_SOCKETS"

#: The message a worker sends once it serves (after its shared sockets).
READY = b"ready"

_sharing = False
_index = 0
_count = 1
_channel: socket.socket | None = None
_inherited: dict[str, int] = {}
_sibling_ports: frozenset[int] = frozenset()


def share_listening_ports(
    enabled: bool,
    index: int = 0,
    count: int = 1,
    env: Mapping[str, str] | None = None,
) -> None:
    """Turn sharing on in worker ``index`` of ``count``, with the supervisor's
    hand-over channel and inherited sockets from ``env`` (default: the
    environment)."""
    global _sharing, _channel, _index, _count
    _sharing, _index, _count = enabled, index, count
    _inherited.clear()
    _channel = None
    if not enabled:
        return
    env = os.environ if env is None else env
    if CHANNEL_ENV in env:
        _channel = socket.socket(fileno=int(env[CHANNEL_ENV]))
    _inherited.update(
        {str(k): int(v) for k, v in json.loads(env.get(INHERITED_ENV, "{}")).items()}
    )


def socket_key(kind: socket.SocketKind, host: str, port: int) -> str:
    """How the supervisor names a shared socket: ``udp 0.0.0.0 3478``."""
    return f"{'udp' if kind == socket.SOCK_DGRAM else 'tcp'} {host} {port}"


def shared_udp_socket(
    host: str, port: int, make: Callable[[bool], socket.socket]
) -> socket.socket:
    """The UDP socket this process serves (host, port) with. ``make(reuse_port)``
    binds a new one (SO_REUSEPORT when asked). In a worker: the socket made for
    it by worker 0 or kept from its previous run, else a new one handed to the
    supervisor (with, in worker 0, those of the other workers). Port 0 never
    shares: with SO_REUSEPORT an ephemeral bind may land on a port another
    socket of the same user already holds, and the two would split its traffic.
    """
    adopted = adopt_shared_socket(socket.SOCK_DGRAM, host, port)
    if adopted is not None:
        adopted.setblocking(False)
        return adopted
    share = _sharing and port != 0
    sock = make(share)
    try:
        publish_shared_socket(sock, socket.SOCK_DGRAM, host, port, lambda: make(share))
    except BaseException:
        sock.close()
        raise
    return sock


def adopt_shared_socket(
    kind: socket.SocketKind, host: str, port: int
) -> socket.socket | None:
    """The socket an earlier run of this worker bound on (host, port), kept by
    the supervisor; None when there is none (first start, or no workers)."""
    if not _sharing or port == 0:
        return None
    fd = _inherited.pop(socket_key(kind, host, port), None)
    return None if fd is None else socket.socket(fileno=fd)


def publish_shared_socket(
    sock: socket.socket,
    kind: socket.SocketKind,
    host: str,
    port: int,
    make_sibling: Callable[[], socket.socket] | None = None,
) -> None:
    """Hand a duplicate of the bound, shared ``sock`` to the supervisor; in
    worker 0, also the sockets of workers 1..N-1 for the same port, made now by
    ``make_sibling`` (module docstring: the group is complete from the start)."""
    if not _sharing or port == 0 or _channel is None:
        return
    key = socket_key(kind, host, port)
    _hand_over(_index, key, sock)
    if _index != 0 or make_sibling is None:
        return
    for other in range(1, _count):
        sibling = make_sibling()
        try:
            _hand_over(other, key, sibling)
        finally:
            sibling.close()  # the supervisor holds it for worker `other`


def _hand_over(worker: int, key: str, sock: socket.socket) -> None:
    assert _channel is not None
    with contextlib.suppress(OSError):  # a gone supervisor: nothing to keep it
        socket.send_fds(_channel, [f"{worker} {key}".encode()], [sock.fileno()])


def announce_ready() -> None:
    """Tell the supervisor this worker serves (worker 0: the others may start)."""
    if _sharing and _channel is not None:
        with contextlib.suppress(OSError):
            _channel.send(READY)


def set_sibling_ports(ports: frozenset[int]) -> None:
    """The fixed ports the *other* workers of this server listen on (their
    HTTP ports, relay nodes; worker 0's natneg, OpenTTD, ... ports)."""
    global _sibling_ports
    _sibling_ports = ports


def sibling_ports() -> frozenset[int]:
    """Ports of this server held by other workers: TURN keeps its clients off
    them as off its own (crossroads.proto.policy; DESIGN: no relaying into the
    server's own services)."""
    return _sibling_ports
