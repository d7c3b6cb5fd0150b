"""The TURN UDP data plane: two asyncio datagram protocols ("taps").

Theory of operation
-------------------
The control plane (:mod:`crossroads.proto.turn`) keeps the forwarding tables as
plain dicts; the taps read them, one lookup per datagram, and never call back
into the control plane for a datagram they can forward:

:class:`ListenerTap`
    Installed as the protocol of each STUN/TURN listening UDP socket (in front
    of the STUN endpoint). A ChannelData datagram from a client that has an
    allocation, on a channel that is bound, is sent to the peer from the relay
    socket. Everything else — STUN requests, Send indications, unknown
    channels, malformed ChannelData — goes to ``fallback(data, addr)``, the STUN
    endpoint, which dispatches it as usual (TURN's slow path counts the drops).
    ``clients`` maps the client ``(host, port)`` to the allocation's
    ``routes`` dict ``{channel: (relay, (peer_host, peer_port))}``.

:class:`RelayTap`
    The protocol of one relay socket. A datagram from a peer found in
    ``peer_channels`` (``(host, port) -> channel``; it only holds peers whose
    permission is live) goes to the client as ChannelData; anything else goes
    to ``fallback(data, addr)``, which sends a Data indication when the peer has
    a permission and drops it otherwise.

Two implementations with identical behaviour:

- the C accelerator :mod:`crossroads.transport._turnfast` (built at install
  time when a C compiler is present). The relay sockets — and the listening
  sockets the STUN service would read in batches — go into one epoll set
  (``Poller``) that the event loop watches as a single fd: one wakeup drains
  every ready socket with ``recvmmsg`` and sends peer->client ChannelData with
  ``sendmmsg`` — no payload copies, no Python object per datagram but its
  address. See ``benchmarks/turn.py`` for what that buys.
- the pure-Python classes below, used when the accelerator is missing or
  ``CROSSROADS_TURN_PURE_PYTHON=1`` is set: one datagram per callback, a
  couple of dict lookups, a slice and a ``sendto``.

:class:`ChannelRouter`
    The same client -> peer forwarding for listeners that read their socket
    themselves — the STUN service's batched ``recvmmsg`` endpoints — and for
    TCP connections: they call ``handle_channel_data(data, client, endpoint)``
    (the STUN extension hook) and the router looks the client up in
    ``endpoints[endpoint]``, the same dicts the listener taps use.

Both count what they forward in ``forwarded`` / ``forwarded_bytes`` and what they
drop as malformed in ``malformed`` (the service exports these).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from crossroads.transport.dataplane import PyCounters

Address = tuple[str, int]
Route = tuple[Any, Address]

#: Padding bytes after a ChannelData payload of length n over TCP: _PAD[n & 3].
PAD = (b"", b"\x00\x00\x00", b"\x00\x00", b"\x00")


class PyListenerTap(PyCounters):
    """Pure-Python :class:`ListenerTap`."""

    def __init__(self) -> None:
        self.fd = -1
        self.clients: dict[Address, dict[int, Route]] = {}
        self.fallback: Callable[[bytes, Any], None] = _unset
        super().__init__()

    def datagram_received(self, data: bytes, addr: Any) -> None:
        size = len(data)
        if size >= 4 and 0x40 <= data[0] < 0x80:
            routes = self.clients.get(addr if len(addr) == 2 else (addr[0], addr[1]))
            if routes is not None:
                route = routes.get((data[0] << 8) | data[1])
                if route is not None:
                    length = (data[2] << 8) | data[3]
                    extra = size - 4 - length
                    # RFC 8656 §12.5: shorter than claimed is dropped; over
                    # UDP up to 3 bytes of padding may follow.
                    if extra < 0 or extra > 3:
                        self.malformed += 1
                        return
                    relay = route[0]
                    if relay.bps and not relay.allow(length):
                        return  # counted by the relay
                    relay.sendto(data[4 : 4 + length], route[1])
                    self.forwarded += 1
                    self.forwarded_bytes += length
                    return
        self.fallback(data, addr)


class PyRelayTap(PyCounters):
    """Pure-Python :class:`RelayTap` (UDP clients; TCP clients override
    ``datagram_received``)."""

    def __init__(self) -> None:
        self.fd = -1
        self.peer_channels: dict[Address, int] = {}
        self.fallback: Callable[[bytes, Any], None] = _unset
        super().__init__()
        self._client: Address = ("", 0)
        self._client_sendto: Callable[[bytes, Address], None] = _unset
        #: Bandwidth limit, bytes/s both directions (0: none), token bucket.
        self.bps = 0.0
        self._tokens = 0.0
        self._stamp = 0.0

    def allow(self, size: int) -> bool:
        """Spend ``size`` bytes of the bandwidth budget; False: drop it."""
        if self.bps <= 0:
            return True
        now = time.monotonic()
        tokens = min(self.bps, self._tokens + (now - self._stamp) * self.bps)
        self._stamp = now
        if tokens < size:
            self._tokens = tokens
            self.throttled += 1
            return False
        self._tokens = tokens - size
        return True

    def set_client(
        self, fd: int, addr: Address, sendto: Callable[[bytes, Address], None]
    ) -> None:
        """Where ChannelData goes: ``sendto(frame, addr)`` from the listener."""
        self._client = addr
        self._client_sendto = sendto

    def datagram_received(self, data: bytes, addr: Any) -> None:
        key = addr if len(addr) == 2 else (addr[0], addr[1])
        channel = self.peer_channels.get(key)
        if channel is None:
            self.fallback(data, key)
            return
        size = len(data)
        if self.bps and not self.allow(size):
            return
        self._client_sendto(
            bytes((channel >> 8, channel & 0xFF, size >> 8, size & 0xFF)) + data,
            self._client,
        )
        self.forwarded += 1
        self.forwarded_bytes += size


class PyChannelRouter(PyCounters):
    """Pure-Python :class:`ChannelRouter`."""

    def __init__(self) -> None:
        self.endpoints: dict[Any, dict[Address, dict[int, Route]]] = {}
        self.fallback: Callable[[bytes, Address, Any], None] = _unset
        super().__init__()

    def handle_channel_data(self, data: bytes, client: Address, endpoint: Any) -> None:
        clients = self.endpoints.get(endpoint)
        if clients is not None:
            routes = clients.get(client)
            if routes is not None and len(data) >= 4:
                route = routes.get((data[0] << 8) | data[1])
                if route is not None:
                    length = (data[2] << 8) | data[3]
                    extra = len(data) - 4 - length
                    if extra < 0 or extra > 3:
                        self.malformed += 1
                        return
                    relay = route[0]
                    if relay.bps and not relay.allow(length):
                        return  # counted by the relay
                    relay.sendto(data[4 : 4 + length], route[1])
                    self.forwarded += 1
                    self.forwarded_bytes += length
                    return
        self.fallback(data, client, endpoint)


def _unset(*args: Any) -> None:
    raise RuntimeError("tap used before it was configured")


ListenerTapBase: type[Any]
RelayTapBase: type[Any]
ChannelRouterType: type[Any]
#: The C epoll set of taps (None in pure-Python mode).
PollerType: type[Any] | None = None
ACCELERATED = False
if os.environ.get("CROSSROADS_TURN_PURE_PYTHON", "") not in ("1", "true", "yes"):
    try:
        from crossroads.transport._turnfast import (
            ChannelRouter,
            ListenerTap,
            Poller,
            RelayTap,
        )
    except ImportError:  # not built (no C compiler at install time)
        pass
    else:
        ACCELERATED = True
if ACCELERATED:
    ListenerTapBase = ListenerTap
    RelayTapBase = RelayTap
    ChannelRouterType = ChannelRouter
    PollerType = Poller
else:
    ListenerTapBase = PyListenerTap
    RelayTapBase = PyRelayTap
    ChannelRouterType = PyChannelRouter
