"""The kernel data plane (eBPF on tc ingress) in network namespaces joined by veth.

client (192.0.2.2) -- [toc] server [top] -- peer (198.51.100.2): the program
runs on both of the server's devices; sockets on the server stand for the
TURN listening socket (192.0.2.1:3478) and a relayed address
(198.51.100.1:50000). A datagram the kernel forwards never reaches them; one
it does not forward does.
"""

from __future__ import annotations

import socket
import struct
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from crossroads.transport.kernelplane import (
    KernelPlane,
    KernelPlaneUnavailable,
    KernelRoute,
    RouteKind,
)
from tests.transport.netns_support import (
    inside,
    ipv4_udp_frame,
    mac_of,
    relay_lab,
    tx_checksum,
)

LISTEN = ("192.0.2.1", 3478)
RELAYED = ("198.51.100.1", 50000)
CLIENT = ("192.0.2.2", 40000)
PEER = ("198.51.100.2", 60000)
CHANNEL = 0x4001
#: A raw frame's source MAC (locally administered; the server does not check it).
SENDER_MAC = bytes.fromhex("020000000001")

TO_PEER = KernelRoute(RouteKind.UNWRAP_CHANNEL, CLIENT, LISTEN, RELAYED, PEER, CHANNEL)
TO_CLIENT = KernelRoute(RouteKind.WRAP_CHANNEL, PEER, RELAYED, LISTEN, CLIENT, CHANNEL)


def _plane_or_skip() -> KernelPlane:
    try:
        return KernelPlane.load()
    except KernelPlaneUnavailable as exc:
        pytest.skip(f"kernel plane unavailable: {exc}")


class Lab:
    def __init__(self, names: dict[str, str]) -> None:
        self.ns = names
        self.client = self.udp("client", CLIENT)
        self.listen = self.udp("server", LISTEN)
        self.relayed = self.udp("server", RELAYED)
        self.peer = self.udp("peer", PEER)
        with inside(names["server"]):
            self.plane = _plane_or_skip()
            self.plane.attach("toc")
            self.plane.attach("top")

    def udp(self, role: str, addr: tuple[str, int]) -> socket.socket:
        with inside(self.ns[role]):
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(addr)
        sock.settimeout(2.0)
        return sock

    def install(self, route: KernelRoute) -> bool:
        with inside(self.ns["server"]):
            return self.plane.install(route)

    def close(self) -> None:
        with inside(self.ns["server"]):
            self.plane.close()
        for s in (self.client, self.listen, self.relayed, self.peer):
            s.close()


@pytest.fixture
def lab() -> Iterator[Lab]:
    if (
        subprocess.run(["id", "-u"], capture_output=True, text=True).stdout.strip()
        != "0"
    ):
        pytest.skip("needs root for namespaces and eBPF")
    with relay_lab("kp") as names:
        rig = Lab(names)
        try:
            yield rig
        finally:
            rig.close()


def recv(sock: socket.socket, timeout: float = 2.0) -> tuple[bytes, Any] | None:
    sock.settimeout(timeout)
    try:
        return sock.recvfrom(70000)
    except TimeoutError:
        return None


def channel_data(payload: bytes, channel: int = CHANNEL) -> bytes:
    return struct.pack("!HH", channel, len(payload)) + payload


def test_turn_channel_both_ways_with_exact_bytes_and_counters(lab: Lab) -> None:
    assert lab.install(TO_PEER) and lab.install(TO_CLIENT)
    sizes = [0, 1, 2, 3, 5, 100, 1199, 1400]
    for n in sizes:
        data = bytes((i * 7 + n) % 256 for i in range(n))
        lab.client.sendto(channel_data(data), LISTEN)
        assert recv(lab.peer) == (data, RELAYED)
        lab.peer.sendto(data, RELAYED)
        assert recv(lab.client) == (channel_data(data), LISTEN)
    # Nothing reached the server's sockets: the kernel forwarded all of it.
    assert recv(lab.listen, 0.2) is None and recv(lab.relayed, 0.2) is None
    assert lab.plane.counters(TO_PEER) == (len(sizes), sum(sizes))
    assert lab.plane.counters(TO_CLIENT) == (len(sizes), sum(sizes))


def test_removal_stops_forwarding_at_once(lab: Lab) -> None:
    """The red-team case: a channel to a freed relayed port must not forward."""
    assert lab.install(TO_PEER) and lab.install(TO_CLIENT)
    lab.client.sendto(channel_data(b"before"), LISTEN)
    assert recv(lab.peer) == (b"before", RELAYED)
    with inside(lab.ns["server"]):
        lab.plane.remove(TO_PEER)
        lab.plane.remove(TO_CLIENT)
    assert lab.plane.counters(TO_PEER) is None
    lab.client.sendto(channel_data(b"after"), LISTEN)
    lab.peer.sendto(b"after", RELAYED)
    # Both reach the server's sockets (the control plane decides), not the far side.
    assert recv(lab.listen) == (channel_data(b"after"), CLIENT)
    assert recv(lab.relayed) == (b"after", PEER)
    assert recv(lab.peer, 0.3) is None and recv(lab.client, 0.3) is None


def test_only_a_live_route_forwards(lab: Lab) -> None:
    """Unknown channels, other sources, padded or short ChannelData and STUN go
    to the sockets unchanged."""
    assert lab.install(TO_PEER)
    stun = bytes.fromhex("000100002112a442") + bytes(12)
    for data in (
        channel_data(b"x", channel=0x4002),  # another channel
        channel_data(b"abc") + b"\0",  # padded: the socket plane checks it
        struct.pack("!HH", CHANNEL, 9) + b"short",  # length field too large
        stun,
    ):
        lab.client.sendto(data, LISTEN)
        assert recv(lab.listen) == (data, CLIENT)
    other = lab.udp("client", ("192.0.2.2", 40001))
    other.sendto(channel_data(b"x"), LISTEN)
    assert recv(lab.listen) == (channel_data(b"x"), ("192.0.2.2", 40001))
    other.close()
    assert recv(lab.peer, 0.3) is None
    assert lab.plane.counters(TO_PEER) == (0, 0)


def test_plain_rewrite_both_ways(lab: Lab) -> None:
    """Unity relay / natneg / RakNet forwarder: the datagram as is."""
    routes = [
        KernelRoute(RouteKind.REWRITE, CLIENT, LISTEN, RELAYED, PEER),
        KernelRoute(RouteKind.REWRITE, PEER, RELAYED, LISTEN, CLIENT),
    ]
    assert all(lab.install(r) for r in routes)
    # Payload that looks like ChannelData is still forwarded as is.
    for data in (b"\x40\x01\x00\x01x", b"game state" * 50):
        lab.client.sendto(data, LISTEN)
        assert recv(lab.peer) == (data, RELAYED)
        lab.peer.sendto(data, RELAYED)
        assert recv(lab.client) == (data, LISTEN)
    assert lab.plane.counters(routes[0]) == (2, 5 + 500)


@pytest.mark.parametrize(
    "zero_csum", [False, True], ids=["full-checksum", "no-checksum"]
)
@pytest.mark.parametrize("direction", ["to-peer", "to-client"])
def test_checksums_of_a_fully_checksummed_sender(
    lab: Lab, zero_csum: bool, direction: str
) -> None:
    """Sockets on veth leave the UDP checksum to the device (CHECKSUM_PARTIAL);
    a frame from a real NIC carries a full one (or, over IPv4, none): the
    program's incremental fix must give a datagram the far side's stack accepts."""
    assert lab.install(TO_PEER) and lab.install(TO_CLIENT)
    role, dev, src, dst, sock = (
        ("client", "toc", CLIENT, LISTEN, lab.client)
        if direction == "to-peer"
        else ("peer", "top", PEER, RELAYED, lab.peer)
    )
    receiver = lab.peer if direction == "to-peer" else lab.client
    mac = mac_of(lab.ns["server"], dev)
    with inside(lab.ns[role]):
        raw = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
        raw.bind(("eth0", 0))
    # Resolve the neighbours both ways before the raw frames.
    sock.sendto(b"", (dst[0], 9))
    try:
        for n in (0, 1, 7, 64, 1001):
            data = bytes(i % 251 for i in range(n))
            payload = channel_data(data) if direction == "to-peer" else data
            frame = ipv4_udp_frame(
                SENDER_MAC, mac, src, dst, payload, udp_checksum=not zero_csum
            )
            raw.send(frame)
            expected = (
                (data, RELAYED)
                if direction == "to-peer"
                else (channel_data(data), LISTEN)
            )
            assert recv(receiver) == expected
    finally:
        raw.close()
    # Finished (or absent) checksums: tc moved the headers, not the data.
    assert lab.plane.tc_moves() == {"headers": 5, "data": 0}


def test_a_partial_checksum_is_finished_right_by_the_egress_device(lab: Lab) -> None:
    """Sockets on veth send CHECKSUM_PARTIAL datagrams: the program updates only
    the pseudo-header's sum in them and the device finishes the checksum on the
    way out. With the server's transmit checksum offload off, the kernel
    finishes it in software and the far side's stack verifies the result (a
    wrong pseudo-header update is dropped as a checksum error there)."""
    assert lab.install(TO_PEER) and lab.install(TO_CLIENT)
    for device in ("toc", "top"):
        tx_checksum(lab.ns["server"], device, False)
    for n in (0, 1, 7, 64, 1001):
        data = bytes(i % 251 for i in range(n))
        lab.client.sendto(channel_data(data), LISTEN)
        assert recv(lab.peer) == (data, RELAYED)
        lab.peer.sendto(data, RELAYED)
        assert recv(lab.client) == (channel_data(data), LISTEN)
    assert lab.plane.counters(TO_PEER) == (5, 1073)
    # Partial checksums: tc moved the data behind headers that stayed.
    assert lab.plane.tc_moves() == {"headers": 0, "data": 10}


def test_a_route_with_a_port_no_datagram_carries_stays_on_the_sockets(
    lab: Lab,
) -> None:
    """A Unity relay joiner over WebSocket has a stream address (port
    0x10000 and up, transport/relay.py STREAM_PORT_BASE): its route cannot be
    a kernel route, and asking must say so, not raise in the relay's
    CONNECT handling (found by running the e2e suites with ``auto`` on the
    kernel plane)."""
    stream = ("192.0.2.2", 0x10000)
    assert not lab.install(
        KernelRoute(RouteKind.REWRITE, stream, LISTEN, RELAYED, PEER)
    )
    assert not lab.install(
        KernelRoute(RouteKind.REWRITE, PEER, RELAYED, LISTEN, stream)
    )
    assert len(lab.plane) == 0
