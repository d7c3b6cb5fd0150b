"""TURN on the relay data plane: the routes a UDP allocation puts in the tables.

Theory of operation
-------------------
TURN forwards through the same taps as every other relay
(:mod:`crossroads.transport.dataplane`), its routes written by the same route
table (:class:`crossroads.transport.routes.RouteTable`); it is the relay whose
routes *rewrite* the datagram and spend a bandwidth budget. The control plane
(:mod:`crossroads.proto.turn`) decides; TURN's side of the route table
(:class:`crossroads.transport.turnrelay.TurnRoutes`) has it write, per live
channel binding, two routes (and, on the kernel plane, their twins in the
eBPF map):

client -> peer, on the listening side
    Key ``((client host, port), channel number as 2 bytes)`` (:func:`channel_key`)
    in the table of the listening endpoint the client uses: read by a tap with
    ``prefix=`` :data:`CHANNEL_KEY_BYTES` (:func:`listener_tap`) that drains the
    STUN/TURN socket itself (C, recvmmsg) or takes what another reader hands
    in (asyncio endpoints, TCP, TLS, DTLS). Value: :func:`to_peer_route`, from
    the relay socket to the peer, ChannelData header off
    (``Rewrite.UNWRAP_CHANNEL``; a length field that disagrees with the size
    is dropped and counted as malformed, RFC 8656 §12.5). A binding needs no
    permission check in this direction (RFC 8656 §12.5), so the route lives
    exactly as long as the binding.
peer -> client, on the relay socket
    Key: the peer ``(host, port)`` in the relay socket's table. Value:
    :func:`to_client_route`, from the listening socket to the client,
    ChannelData header on (``Rewrite.WRAP_CHANNEL``). It exists only while the
    binding *and* the peer's permission are live (RFC 8656 §9, §12): the core
    adds and removes it as either changes, so one lookup answers "ChannelData
    or not" and "allowed or not" at once.

Send and Data indications (RFC 8656 §11) take the plane too:

Send indication, client -> peer
    Key ``((client host, port), b"\\x00\\x16")`` (the message type) in the
    listening table, installed with the allocation's relay (:func:`send_route`)
    where a tap sees the socket's datagrams first. The route parses the
    indication in place (what :func:`~crossroads.proto.turn.fastpath.
    parse_send_indication` accepts, FINGERPRINT checked), looks its peer's IP
    up in the allocation's live permission table and sends the DATA from the
    relay socket. Anything unusual, an IP without a permission or a peer of the
    other family goes to the fallback: the Python path as before. So does one
    of the service's own hosts (the control plane judges those per port), until
    the Python path approved that port: then for :data:`SELF_PEER_APPROVAL`
    seconds (:func:`approve`).
Data indication, peer -> client
    A permitted peer without a channel is answered in Python the first time
    (:meth:`crossroads.transport.turnrelay.UdpRelay.from_peer`, the core deciding), which then installs
    a :func:`data_route` under the peer's address (at most
    :data:`MAX_DATA_ROUTES` per relay); it goes when the permission lapses or
    a channel is bound to the peer. The indication is byte for byte what the
    Python path writes (fresh transaction id: 8 random bytes and a counter).

Every route of an allocation's relay spends one :func:`~crossroads.transport.
dataplane.make_budget` (``--turn-max-bps``, both directions, as before).
Everything else — STUN requests, unusual Send indications, unknown channels,
peers without a permission — goes to the taps' fallbacks, the service's Python
path, which counts every drop by reason.

Clients the C plane cannot send to from the right place get no peer -> client
routes (their relay's fallback sends the ChannelData in Python): TCP/TLS/DTLS
clients (framing, padding to 4 bytes over TCP, encryption) and clients of a
wildcard-bound listener (replies leave from the address the client sent to,
which the endpoint tracks per client).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any, Protocol, Unpack

from crossroads.transport.dataplane import (
    ACCELERATED,
    BudgetLike,
    Rewrite,
    RouteLike,
    RouteOptions,
    RouteTapLike,
    make_route,
    make_tap,
)
from crossroads.types import Address

__all__ = [
    "ACCELERATED",
    "CHANNEL_KEY_BYTES",
    "MAX_APPROVED",
    "MAX_DATA_ROUTES",
    "PAD",
    "SELF_PEER_APPROVAL",
    "SEND_INDICATION_KEY",
    "channel_header",
    "channel_key",
    "data_route",
    "listener_tap",
    "send_route",
    "to_client_route",
    "to_peer_route",
]

#: ChannelData's channel number: the first 2 bytes of the message (RFC 8656 §12.4).
CHANNEL_KEY_BYTES = 2
#: A Send indication's first 2 bytes (its STUN message type, RFC 8656 §11.4):
#: the listening side's key of a client's Send route is ``(client, this)``.
SEND_INDICATION_KEY = b"\x00\x16"
#: Data indication routes a relay learns (one per permitted peer address that
#: sent without a channel). A permitted peer could spray source ports; past
#: this many its datagrams take the Python path, which works the same.
MAX_DATA_ROUTES = 64
#: How long a Send route forwards to a (host, port) of the service's own hosts
#: after the control plane approved it (it is judged per port: a service port
#: of this host is refused, RFC 8656 §9 leaves that policy to the server). One
#: Python judgement per such peer per second instead of per datagram; a port
#: that became a service port within the second is the exposure.
SELF_PEER_APPROVAL = 1.0
#: (host, port) approvals a Send route holds at most (a bound on memory).
MAX_APPROVED = 64

#: Padding bytes after a ChannelData payload of length n over TCP: PAD[n & 3]
#: (RFC 8656 §12.5).
PAD = (b"", b"\x00\x00\x00", b"\x00\x00", b"\x00")


class SendsTo(Protocol):
    """An out "socket" for routes: a fd for C, ``sendto`` for the twin,
    ``getsockname`` for the route's kernel twin (where it leaves from)."""

    def fileno(self) -> int: ...
    def sendto(self, data: bytes, addr: Address, /) -> Any: ...
    def getsockname(self) -> Any: ...


def channel_key(client: Address, number: int) -> tuple[Address, bytes]:
    """The listening side's route key of ChannelData on ``number`` from ``client``."""
    return (client, number.to_bytes(CHANNEL_KEY_BYTES, "big"))


def channel_header(number: int, size: int) -> bytes:
    """A ChannelData header (RFC 8656 §12.4)."""
    return bytes((number >> 8, number & 0xFF, size >> 8, size & 0xFF))


def listener_tap(
    sock: socket.socket | None,
    routes: dict[Any, Any],
    fallback: Callable[[bytes, Any], None],
) -> RouteTapLike:
    """A tap on a STUN/TURN listening socket (``None``: fed by another reader
    with ``datagram_received``); what is not routed ChannelData goes to
    ``fallback(data, addr)``."""
    return make_tap(sock, routes, fallback, prefix=CHANNEL_KEY_BYTES)


def to_peer_route(relay: socket.socket, peer: Address, budget: BudgetLike) -> RouteLike:
    """Client -> peer: ChannelData's data, from the relay socket to ``peer``."""
    return make_route(relay, peer, rewrite=Rewrite.UNWRAP_CHANNEL, budget=budget)


def _from_listener(
    listener: SendsTo, client: Address, **options: Unpack[RouteOptions]
) -> RouteLike:
    """A peer -> client route: from the listening socket to ``client``."""
    return make_route(listener, client, **options)  # type: ignore[arg-type]


def to_client_route(
    listener: SendsTo, client: Address, number: int, budget: BudgetLike
) -> RouteLike:
    """Peer -> client: the peer's datagram as ChannelData on ``number``, from
    the listening socket."""
    return _from_listener(
        listener, client, rewrite=Rewrite.WRAP_CHANNEL, budget=budget, channel=number
    )


def data_route(
    listener: SendsTo, client: Address, peer: Address, txid: bytes, budget: BudgetLike
) -> RouteLike:
    """Peer -> client without a channel: the datagram in a Data indication
    naming ``peer`` (transaction ids: ``txid``, 8 random bytes, + a counter)."""
    return _from_listener(
        listener,
        client,
        rewrite=Rewrite.DATA_INDICATION,
        budget=budget,
        peer=peer,
        txid=txid,
    )


def send_route(
    relay: socket.socket,
    permissions: dict[str, Any],
    refuse: set[str],
    budget: BudgetLike,
) -> RouteLike:
    """Client -> peer Send indications: the DATA, from the relay socket to the
    XOR-PEER-ADDRESS, when its IP is in ``permissions`` (the allocation's live
    table) and not in ``refuse`` (the service's own hosts, judged per port by
    the control plane) unless the route's ``approved`` dict holds the (host,
    port) with a deadline ahead (see :func:`approve`)."""
    return make_route(
        relay,
        None,
        rewrite=Rewrite.UNWRAP_SEND,
        budget=budget,
        permissions=permissions,
        refuse=refuse,
        approved={},
    )


def approve(route: Any, peer: Address, now: float) -> None:
    """The control plane let a Send indication to ``peer`` (one of the
    service's own hosts) through at ``time.monotonic()`` ``now``: the route
    may forward there for :data:`SELF_PEER_APPROVAL` s."""
    approved = route.approved
    if approved is None:
        return
    if len(approved) >= MAX_APPROVED and peer not in approved:
        approved.clear()  # stale ones go; each is re-earned in a second
    approved[peer] = now + SELF_PEER_APPROVAL
