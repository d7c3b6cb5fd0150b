"""TURN on the relay data plane: the routes a UDP allocation puts in the tables.

Theory of operation
-------------------
TURN forwards through the same route table as every other relay
(:mod:`crossroads.transport.dataplane`); it is the relay whose routes *rewrite*
the datagram and spend a bandwidth budget. The control plane
(:mod:`crossroads.proto.turn`) decides; the service writes, per live channel
binding, two routes:

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

Both routes of an allocation's relay spend one :func:`~crossroads.transport.
dataplane.make_budget` (``--turn-max-bps``, both directions, as before).
Everything else — STUN requests, Send indications, unknown channels, peers
without a channel (Data indication when permitted) — goes to the taps'
fallbacks, the service's Python path, which counts every drop by reason.

Clients the C plane cannot send to from the right place get no peer -> client
routes (their relay's fallback sends the ChannelData in Python): TCP/TLS/DTLS
clients (framing, padding to 4 bytes over TCP, encryption) and clients of a
wildcard-bound listener (replies leave from the address the client sent to,
which the endpoint tracks per client).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any, Protocol

from crossroads.transport.dataplane import (
    ACCELERATED,
    BudgetLike,
    Rewrite,
    RouteLike,
    RouteTapLike,
    make_route,
    make_tap,
)
from crossroads.types import Address

__all__ = [
    "ACCELERATED",
    "CHANNEL_KEY_BYTES",
    "PAD",
    "channel_header",
    "channel_key",
    "listener_tap",
    "to_client_route",
    "to_peer_route",
]

#: ChannelData's channel number: the first 2 bytes of the message (RFC 8656 §12.4).
CHANNEL_KEY_BYTES = 2

#: Padding bytes after a ChannelData payload of length n over TCP: PAD[n & 3]
#: (RFC 8656 §12.5).
PAD = (b"", b"\x00\x00\x00", b"\x00\x00", b"\x00")


class SendsTo(Protocol):
    """An out "socket" for routes: a fd for C, ``sendto`` for the twin."""

    def fileno(self) -> int: ...
    def sendto(self, data: bytes, addr: Address, /) -> Any: ...


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


def to_client_route(
    listener: SendsTo, client: Address, number: int, budget: BudgetLike
) -> RouteLike:
    """Peer -> client: the peer's datagram as ChannelData on ``number``, from
    the listening socket."""
    return make_route(
        listener,  # type: ignore[arg-type]
        client,
        rewrite=Rewrite.WRAP_CHANNEL,
        channel=number,
        budget=budget,
    )
