"""TURN channels on the kernel plane (``--dataplane kernel``), in namespaces.

client (192.0.2.2) -- [toc] server [top] -- peer (198.51.100.2), as in
test_kernelroutes.py. crossroads (STUN + TURN) runs in-process in the server
namespace, listening on 192.0.2.1 and relaying from 198.51.100.1; the event
loop runs there (relay sockets are made in it). Once a channel is bound, the
eBPF program forwards its ChannelData both ways: the kernel routes' counters
grow, the socket taps forward nothing, and the service's counters (metrics,
insight) include the kernel's. When a permission lapses or the allocation
ends, the kernel stops forwarding at once.

The red-team cases (a lapsed permission, a freed allocation, an expired
channel) run on every plane (``plane``: python, c, kernel) in the same
namespaces: routes, counters and teardown behave the same on each.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest

from crossroads.client.turn import TurnClient
from crossroads.config import default_config
from crossroads.proto.turn.constants import (
    CHANNEL_LIFETIME,
    CHANNEL_QUARANTINE,
    PERMISSION_LIFETIME,
)
from crossroads.runtime import Runtime, start
from crossroads.services.turn import TurnService
from crossroads.transport.kernelplane import KernelPlane
from crossroads.transport.turnrelay import ClientLink
from tests.conftest import loopback_config, running_service
from tests.interop.test_turn import command_output
from tests.transport.netns_support import inside, relay_lab, tx_checksum
from tests.transport.plane_support import (
    PLANES,
    keep_plane_globals,
    skip_unless_kernel_loads,
    wire_like,
)

pytestmark = pytest.mark.timeout(60)

CLIENT_IP, PEER_IP = "192.0.2.2", "198.51.100.2"
LISTEN_IP, RELAY_IP = "192.0.2.1", "198.51.100.1"
USER, PASSWORD = "alice", "secret123"
LOST = re.compile(r"Total lost packets (\d+) \(([\d.]+)%\)")
TOTALS = re.compile(r"start_mclient: tot_send_msgs=(\d+), tot_recv_msgs=(\d+)")


@pytest.fixture(params=PLANES)
def plane(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The relay data plane a test runs crossroads on."""
    keep_plane_globals(monkeypatch)
    value: str = request.param
    return value


@contextlib.asynccontextmanager
async def turn_lab(
    plane: str = "kernel",
    **overrides: Any,
) -> AsyncIterator[tuple[dict[str, str], Runtime, TurnService]]:
    """The namespaces and crossroads on ``plane`` in the server one.

    Everything after start runs with this thread in the server namespace:
    the relay sockets an Allocate opens are made there."""
    if (
        subprocess.run(["id", "-u"], capture_output=True, text=True).stdout.strip()
        != "0"
    ):
        pytest.skip("needs root for namespaces and eBPF")
    xdp = plane == "xdp"
    with (
        relay_lab("kt") as names,
        wire_like(names) if xdp else contextlib.nullcontext(),
        inside(names["server"]),
    ):
        if plane in ("kernel", "xdp"):
            skip_unless_kernel_loads()
        rt = await start(
            default_config(
                loopback_config(
                    core__only=["stun", "turn"],
                    core__host=LISTEN_IP,
                    core__dataplane="kernel" if xdp else plane,
                    core__kernel_hook="xdp" if xdp else "tc",
                    turn__relay_ip=RELAY_IP,
                    turn__user=[f"{USER}:{PASSWORD}"],
                    turn__allowed_peers=["198.51.100.0/24"],
                    **overrides,
                )
            )
        )
        try:
            yield names, rt, running_service(rt, "turn", TurnService)
        finally:
            await rt.close()


def kernel_counts(service: TurnService) -> tuple[int, int]:
    """Packets the kernel forwarded, on live routes and removed ones: (to
    peer, to client)."""
    to_peer, _, to_client, _ = service.routes.kernel_counters()
    return to_peer, to_client


def kernel_plane(rt: Runtime) -> KernelPlane:
    assert rt.dataplane is not None and rt.dataplane.kernel is not None
    return rt.dataplane.kernel


def expire_everything(service: TurnService) -> None:
    """Run the service's timer two hours ahead (uclient leaves its
    allocations behind): every one ends through the real relays."""
    later = service.loop.time() + 7200
    deadline = service.core.get_timer()
    while deadline is not None and deadline <= later:
        service.core.handle_timer(later)
        service._process_events()
        deadline = service.core.get_timer()


def udp(ns: str, host: str) -> socket.socket:
    with inside(ns):
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    sock.bind((host, 0))
    return sock


async def recv(sock: socket.socket, timeout: float = 2.0) -> tuple[bytes, Any] | None:
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout):
            return await loop.sock_recvfrom(sock, 4096)
    except TimeoutError:
        return None


async def in_ns(ns: str, *command: str, timeout: float = 30) -> str:
    return await command_output("ip", "netns", "exec", ns, *command, timeout=timeout)


@pytest.mark.parametrize("checksums", ["partial", "finished"])
async def test_uclient_channels_forwarded_by_the_kernel(checksums: str) -> None:
    """coturn's turnutils_uclient, channels over UDP, with turnutils_peer
    echoing: 0 loss, every ChannelData forwarded by the eBPF program (the
    listener taps forwarded none), the service's counters include it, and
    the counts outlive the routes when the allocations end.

    Sockets on veth send CHECKSUM_PARTIAL datagrams, and tc moves their data
    by the ChannelData header; with the client's and peer's transmit
    checksum offload off they arrive finished, as from a NIC, and tc moves
    the headers instead (relay.bpf.c ``tc_moves``)."""
    async with turn_lab() as (ns, rt, service):
        if checksums == "finished":
            for role in ("client", "peer"):
                tx_checksum(ns[role], "eth0", False)
        sent, received = await uclient_channels(ns, service)
        # The kernel forwarded it: both directions counted on its routes
        # (uclient deletes the allocations it used: removed routes' counts)...
        to_peer, to_client = kernel_counts(service)
        assert to_peer >= sent and to_client >= received
        moves = kernel_plane(rt).tc_moves()
        moved = "headers" if checksums == "finished" else "data"
        assert moves[moved] == to_peer + to_client, moves
        # /metrics says so: tc on each device, and how it moved ChannelData.
        scraped = rt.metrics.get_sample_value
        for device in ("toc", "top"):
            labels = {"device": device, "hook": "tc"}
            assert scraped("crossroads_dataplane_device_info", labels) == 1
        for way, count in moves.items():
            labels = {"moved": way}
            assert (
                scraped("crossroads_dataplane_tc_channel_moves_total", labels) == count
            )
        # ...the listener taps and relay taps forwarded nothing...
        assert all(tap.forwarded == 0 for tap in service.routes.taps.values())
        assert all(tap.forwarded == 0 for tap in service.routes.relay_taps.values())
        # ...and what the user sees (metrics, insight) includes it.
        counters = service.counters()
        assert counters[0] >= to_peer and counters[2] >= to_client
        live = service.routes.kernel_routes.values()
        assert len(kernel_plane(rt)) == sum(
            len(c.to_peer) + len(c.to_client) for c in live
        )
        expire_everything(service)
        assert len(kernel_plane(rt)) == 0 and service.routes.kernel_routes == {}
        # The counts outlive the routes.
        assert service.counters() == counters


async def uclient_channels(ns: dict[str, str], service: TurnService) -> tuple[int, int]:
    """coturn's turnutils_uclient in the client namespace, with channels,
    through crossroads to turnutils_peer echoing in the peer namespace;
    asserts 0 loss and returns (sent, received)."""
    # The echo peer's port: free in the peer namespace.
    probe = udp(ns["peer"], PEER_IP)
    peer_port = probe.getsockname()[1]
    probe.close()
    peer = await asyncio.create_subprocess_exec(
        "ip", "netns", "exec", ns["peer"], "turnutils_peer",
        "-L", PEER_IP, "-p", str(peer_port),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        await echoes(ns["peer"], peer_port)
        _, port = service.stun.primary
        output = await in_ns(
            ns["client"], "turnutils_uclient", "-c", "-X",
            "-e", PEER_IP, "-r", str(peer_port), "-u", USER, "-w", PASSWORD,
            "-m", "2", "-n", "10", "-z", "10", "-l", "100", "-p", str(port),
            LISTEN_IP,
        )  # fmt: skip
    finally:
        peer.kill()
        await peer.wait()
    lost, totals = LOST.search(output), TOTALS.findall(output)
    assert lost is not None and totals, output[-3000:]
    sent, received = (int(x) for x in totals[-1])
    assert lost.group(1) == "0" and sent >= 20 and received == sent, output
    return sent, received


async def echoes(ns: str, port: int) -> None:
    """Wait (bounded) until turnutils_peer answers in the peer namespace."""
    probe = udp(ns, PEER_IP)
    try:
        for _ in range(100):
            probe.sendto(b"ready?", (PEER_IP, port))
            if await recv(probe, 0.1) is not None:
                return
        raise AssertionError("turnutils_peer never echoed")
    finally:
        probe.close()


@dataclass(eq=False)
class Channel:
    """A client's allocation with a channel bound to a peer."""

    namespaces: dict[str, str]
    service: TurnService
    #: The kernel plane (None on the socket planes).
    plane: KernelPlane | None
    client: TurnClient
    peer: socket.socket
    relayed: tuple[str, int]

    def kernel_routes(self) -> int | None:
        """Routes in the kernel map (None: not on the kernel plane)."""
        return None if self.plane is None else len(self.plane)

    def kernel_counts(self) -> tuple[int, int] | None:
        return None if self.plane is None else kernel_counts(self.service)

    async def both_ways(self, n: int) -> tuple[bool, bool]:
        """Whether ChannelData from the client reaches the peer, and whether
        the peer's datagram to the relayed address reaches the client."""
        peer_addr = self.peer.getsockname()
        await self.client.send(b"up %d" % n, peer_addr)
        up = await recv(self.peer, 0.5)
        self.peer.sendto(b"down %d" % n, self.relayed)
        try:
            down = await self.client.receive(0.5)
        except TimeoutError:
            return up is not None, False
        return up is not None, down == (b"down %d" % n, peer_addr)


@contextlib.asynccontextmanager
async def bound_channel(
    plane: str = "kernel", **overrides: Any
) -> AsyncIterator[Channel]:
    """A client (TurnClient on a socket of the client namespace) with an
    allocation and a channel bound to a peer, on the kernel plane, that
    crossed once each way (through the kernel, unless ``overrides`` say
    otherwise)."""
    async with turn_lab(plane, **overrides) as (ns, rt, service):
        _, port = service.stun.primary
        with inside(ns["client"]):
            csock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        csock.bind((CLIENT_IP, 0))
        csock.connect((LISTEN_IP, port))
        csock.setblocking(False)
        client = await TurnClient.on_socket(csock, (LISTEN_IP, port), USER, PASSWORD)
        peer = udp(ns["peer"], PEER_IP)
        try:
            relayed = await client.allocate()
            assert relayed[0] == RELAY_IP
            await client.bind_channel(peer.getsockname())
            kernel = kernel_plane(rt) if plane in ("kernel", "xdp") else None
            channel = Channel(ns, service, kernel, client, peer, relayed)
            assert await channel.both_ways(1) == (True, True)
            if kernel is not None and not overrides:
                assert len(kernel) == 2
                assert kernel_counts(service) == (1, 1)  # the kernel did
                if plane == "xdp":  # in XDP, in front of tc
                    assert kernel.xdp_stats()["forwarded"] == 2
            yield channel
        finally:
            await client.close()
            peer.close()


async def test_kernel_stops_peer_data_when_the_permission_lapses(plane: str) -> None:
    """The red-team case, permission: once the peer's permission lapses its
    datagrams to the relayed address are not forwarded by the kernel (nor
    by the sockets); the channel lives on for ChannelData from the client
    (no permission check that way, RFC 8656 §12.5: the sockets' behaviour)."""
    async with bound_channel(plane) as channel:
        service = channel.service
        service.core.handle_timer(service.loop.time() + PERMISSION_LIFETIME + 1)
        service._process_events()
        assert await channel.both_ways(2) == (True, False)
        assert channel.kernel_routes() in (None, 1)
        # A ChannelBind refresh gives the permission (and the route) back.
        await channel.client.bind_channel(channel.peer.getsockname())
        assert channel.kernel_routes() in (None, 2)
        assert await channel.both_ways(3) == (True, True)
        # 3 up, 2 down (on the kernel plane all by the kernel: a removed
        # route's counts stay).
        assert channel.kernel_counts() in (None, (3, 2))
        counters = service.counters()
        assert (counters[0], counters[2]) == (3, 2)


@pytest.mark.parametrize("end", ["refresh-0", "lifetime", "revoked"])
async def test_kernel_stops_a_freed_allocations_channel(plane: str, end: str) -> None:
    """The red-team case, deallocation: after Refresh 0, the end of the
    allocation's lifetime, or a revocation (admin kick, ``crossroads
    revoke``), ChannelData on the freed channel and datagrams to the freed
    relayed port cross neither way; what the kernel forwarded stays counted."""
    async with bound_channel(plane) as channel:
        service = channel.service
        counted = service.counters()
        assert (counted[0], counted[2]) == (1, 1)
        (allocation,) = service.core.allocations.values()
        link = allocation.transport_data
        assert isinstance(link, ClientLink)
        if end == "refresh-0":
            await channel.client.refresh(0)
        elif end == "lifetime":
            service.core.handle_timer(service.loop.time() + 7200)
            service._process_events()
        else:
            service.plane.revoke(list(service.core.allocations.values()))
        assert service.core.allocations == {}
        assert await channel.both_ways(2) == (False, False)
        assert channel.kernel_routes() in (None, 0)
        assert service.routes.kernel_routes == {}
        assert service.counters()[:4] == counted[:4]
        # The allocation's insight record counts what the kernel forwarded.
        assert link.usage == [1, len(b"up 1"), 1, len(b"down 1")]


async def test_expired_channel_stops_and_rebinds_to_another_peer(plane: str) -> None:
    """Channel expiry stops the kernel at once, both ways; once the number is
    free again (RFC 8656 §12: 5 minutes later) a binding of it to another
    peer forwards to that peer only."""
    async with bound_channel(plane) as channel:
        service, client = channel.service, channel.client
        await client.refresh(3600)  # the allocation outlives the channel
        start = service.loop.time()
        service.core.handle_timer(start + CHANNEL_LIFETIME + 1)
        service._process_events()
        assert await channel.both_ways(2) == (False, False)
        assert channel.kernel_routes() in (None, 0)
        service.core.handle_timer(start + CHANNEL_LIFETIME + CHANNEL_QUARANTINE + 2)
        service._process_events()
        first = channel.peer.getsockname()
        number = client.channels.pop(first)
        with inside(channel.namespaces["peer"]):
            other = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        other.bind((PEER_IP, 0))
        other.setblocking(False)
        old, channel.peer = channel.peer, other
        try:
            await client.bind_channel(other.getsockname(), number)
            assert channel.kernel_routes() in (None, 2)
            assert await channel.both_ways(3) == (True, True)
            assert await recv(old, 0.3) is None
            assert channel.kernel_counts() in (None, (2, 2))
            counters = service.counters()
            assert (counters[0], counters[2]) == (2, 2)
        finally:
            channel.peer = old
            other.close()


async def test_a_bandwidth_limit_keeps_the_channel_on_the_sockets() -> None:
    """--turn-max-bps: the program has no token bucket, so the channel's
    routes stay in user space, where the limit is enforced."""
    async with bound_channel(turn__max_bps=1_000_000) as channel:
        assert channel.kernel_routes() == 0
        assert kernel_counts(channel.service) == (0, 0)
        counters = channel.service.counters()
        assert (counters[0], counters[2]) == (1, 1)
