"""The TURN data-plane taps, C and pure Python, on real loopback sockets.

Both implementations must make the same decisions: forward routed ChannelData to
the peer, hand everything else to the fallback in order, drop malformed
ChannelData (counted), and wrap peer data in ChannelData for the client.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest

from crossroads.transport import turnplane

IMPLEMENTATIONS: list[Any] = [
    pytest.param(
        (turnplane.PyListenerTap, turnplane.PyRelayTap, turnplane.PyChannelRouter),
        id="python",
    )
]
try:
    from crossroads.transport import _turnfast
except ImportError:  # pragma: no cover - built by `make install`
    _turnfast = None  # type: ignore[assignment]
else:
    IMPLEMENTATIONS.append(
        pytest.param(
            (_turnfast.ListenerTap, _turnfast.RelayTap, _turnfast.ChannelRouter),
            id="c",
        )
    )


def udp(host: str = "127.0.0.1") -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    sock.bind((host, 0))
    sock.settimeout(2.0)
    return sock


def recv(sock: socket.socket, timeout: float = 2.0) -> bytes | None:
    sock.settimeout(timeout)
    try:
        return sock.recv(70000)
    except TimeoutError:
        return None


def relay_class(base: type[Any]) -> type[Any]:
    class Relay(base):  # type: ignore[misc,valid-type]
        def __init__(self, sock: socket.socket) -> None:
            base.__init__(self)
            self.fd = sock.fileno()
            self.sock = sock
            self.peer_channels = {}
            self.fallen: list[tuple[bytes, Any]] = []
            self.fallback = lambda data, addr: self.fallen.append((data, addr))

        def sendto(self, data: bytes, addr: Any) -> None:
            self.sock.sendto(data, addr)

    return Relay


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_listener_tap_forwards_and_falls_back(impl: Any) -> None:
    ListenerTap, RelayTap, _ = impl
    relay_sock, peer, listener = udp(), udp(), udp()
    try:
        relay = relay_class(RelayTap)(relay_sock)
        tap = ListenerTap()
        fallen: list[tuple[bytes, Any]] = []
        tap.fallback = lambda data, addr: fallen.append((data, addr))
        tap.fd = -1  # no draining: datagrams are handed in directly
        client = ("127.0.0.1", 40000)
        tap.clients = {client: {0x4001: (relay, peer.getsockname())}}
        tap.datagram_received(b"\x40\x01\x00\x05hello", client)
        assert recv(peer) == b"hello"
        tap.datagram_received(b"\x40\x01\x00\x02hi\x00\x00", client)  # padding
        assert recv(peer) == b"hi"
        for bad in (b"\x40\x01\x00\x09short", b"\x40\x01\x00\x01x" + bytes(4)):
            tap.datagram_received(bad, client)
        assert tap.malformed == 2
        others = [
            (b"\x40\x02\x00\x01x", client),  # unbound channel
            (b"\x40\x01\x00\x01x", ("127.0.0.1", 40001)),  # unknown client
            (b"\x00\x01\x00\x00" + bytes(16), client),  # STUN
            (b"\x40", client),  # too short
        ]
        for data, addr in others:
            tap.datagram_received(data, addr)
        assert fallen == others
        assert (tap.forwarded, tap.forwarded_bytes) == (2, 7)
        assert recv(peer, 0.1) is None
    finally:
        for sock in (relay_sock, peer, listener):
            sock.close()


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_relay_tap_wraps_peer_data_in_channeldata(impl: Any) -> None:
    _, RelayTap, _ = impl
    relay_sock, peer, listener, client = udp(), udp(), udp(), udp()
    try:
        relay = relay_class(RelayTap)(relay_sock)
        relay.fd = -1
        relay.set_client(listener.fileno(), client.getsockname(), listener.sendto)
        relay.peer_channels[peer.getsockname()] = 0x4ABC
        relay.datagram_received(b"payload", peer.getsockname())
        assert recv(client) == b"\x4a\xbc\x00\x07payload"
        stranger = ("127.0.0.1", 9)
        relay.datagram_received(b"who", stranger)
        assert relay.fallen == [(b"who", stranger)]
        assert (relay.forwarded, relay.forwarded_bytes) == (1, 7)
    finally:
        for sock in (relay_sock, peer, listener, client):
            sock.close()


@pytest.mark.skipif(_turnfast is None, reason="C data plane not built")
def test_c_taps_drain_the_socket_in_batches() -> None:
    relay_sock, peer, listener, client = udp(), udp(), udp(), udp()
    try:
        relay = relay_class(_turnfast.RelayTap)(relay_sock)
        relay_sock.setblocking(False)
        relay.set_client(listener.fileno(), client.getsockname())
        relay.peer_channels[peer.getsockname()] = 0x4001
        for n in range(100):
            peer.sendto(b"%03d" % n, relay_sock.getsockname())
        time.sleep(0.2)
        # The event loop would hand over the first datagram; the tap drains
        # the rest with recvmmsg and sends them with sendmmsg.
        first = relay_sock.recv(100)
        relay.datagram_received(first, peer.getsockname())
        got = [recv(client) for _ in range(100)]
        assert got == [b"\x40\x01\x00\x03%03d" % n for n in range(100)]
        assert relay.drained == 99 and relay.batches >= 4
        assert relay.forwarded == 100
    finally:
        for sock in (relay_sock, peer, listener, client):
            sock.close()


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_channel_router(impl: Any) -> None:
    _, RelayTap, ChannelRouter = impl
    relay_sock, peer = udp(), udp()
    try:
        relay = relay_class(RelayTap)(relay_sock)
        router = ChannelRouter()
        fallen: list[tuple[bytes, Any, Any]] = []
        router.fallback = lambda data, client, endpoint: fallen.append(
            (data, client, endpoint)
        )
        endpoint = object()
        client = ("127.0.0.1", 5)
        router.endpoints = {endpoint: {client: {0x4000: (relay, peer.getsockname())}}}
        router.handle_channel_data(b"\x40\x00\x00\x03abc\x00", client, endpoint)
        assert recv(peer) == b"abc"
        router.handle_channel_data(b"\x40\x00\x00\x03abc", client, object())
        router.handle_channel_data(b"\x40\x09\x00\x03abc", client, endpoint)
        assert len(fallen) == 2
        router.handle_channel_data(b"\x40\x00\x00\x09abc", client, endpoint)
        assert router.malformed == 1 and router.forwarded == 1
    finally:
        relay_sock.close()
        peer.close()


@pytest.mark.skipif(_turnfast is None, reason="C data plane not built")
def test_c_taps_refuse_misuse() -> None:
    tap = _turnfast.ListenerTap()
    with pytest.raises(RuntimeError):
        tap.datagram_received(b"x", ("127.0.0.1", 1))
    tap.clients = {}
    tap.fallback = lambda data, addr: None
    with pytest.raises(TypeError):
        tap.datagram_received("not bytes", ("127.0.0.1", 1))  # type: ignore[arg-type]
    relay = _turnfast.RelayTap()
    with pytest.raises(ValueError):
        relay.set_client(3, ("not an ip", 1))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_bandwidth_budget(impl: Any) -> None:
    _, RelayTap, _ = impl
    sock = udp()
    try:
        relay = relay_class(RelayTap)(sock)
        assert relay.allow(10**9)  # no limit by default
        relay.bps = 1000.0
        assert relay.allow(600)
        assert relay.allow(400)
        assert not relay.allow(100)  # the second's budget is spent
        assert relay.throttled == 1
    finally:
        sock.close()
