"""natneg relay pairs and RakNet forwarders on the kernel plane, in namespaces.

client (192.0.2.2) -- [toc] server [top] -- peer (198.51.100.2), as in
test_kernelplane.py. The relay's sockets live in the server namespace, bound
to the wildcard address, and the event loop runs there (the adapter resolves
devices and local addresses in its own namespace). Once a pair or forwarder
has learned its clients, the eBPF program forwards their datagrams: its
counters grow, the socket taps' routes stay at 0, and the relays' own counts
(idle sweeps, metrics, insight) include the kernel's. When the pair or
forwarder ends, forwarding stops at once.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest

from crossroads.proto.natneg.packets import ConnectPing
from crossroads.proto.natneg.server import SessionId
from crossroads.proto.policy import AddressPolicy
from crossroads.proto.raknet.udpproxy import ForwarderResult
from crossroads.transport.admission import ResourceBudget
from crossroads.transport.kernelplane import KernelPlane, KernelPlaneUnavailable
from crossroads.transport.natneg_relay import RelayPool
from crossroads.transport.raknet_forwarder import ForwarderPool, forwarder_table
from crossroads.transport.routes import RouteTable
from tests.transport.netns_support import inside, relay_lab
from tests.transport.plane_support import skip_unless_kernel_loads
from tests.transport.test_natneg_relay import recv
from tests.transport.test_relay import SEALER

pytestmark = pytest.mark.timeout(60)

CLIENT_IP, PEER_IP = "192.0.2.2", "198.51.100.2"
TOWARD_CLIENT, TOWARD_PEER = "192.0.2.1", "198.51.100.1"
LAB = (ipaddress.ip_network("192.0.2.0/24"), ipaddress.ip_network("198.51.100.0/24"))


@pytest.fixture
def lab() -> Iterator[tuple[dict[str, str], KernelPlane]]:
    if (
        subprocess.run(["id", "-u"], capture_output=True, text=True).stdout.strip()
        != "0"
    ):
        pytest.skip("needs root for namespaces and eBPF")
    with relay_lab("kb") as names:
        with inside(names["server"]):
            try:
                plane = KernelPlane.load()
            except KernelPlaneUnavailable as exc:
                pytest.skip(f"kernel plane unavailable: {exc}")
        try:
            yield names, plane
        finally:
            with inside(names["server"]):
                plane.close()


def udp(ns: str, host: str) -> socket.socket:
    with inside(ns):
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    sock.bind((host, 0))
    return sock


def ping(cookie: int) -> bytes:
    return ConnectPing(4, cookie, "192.0.2.2", 1, 0, 0).encode()


async def test_natneg_pair_forwards_through_the_kernel_and_stops_when_released(
    lab: tuple[dict[str, str], KernelPlane],
) -> None:
    ns, plane = lab
    released: list[tuple[tuple[int, int], tuple[int, int]]] = []
    a = udp(ns["client"], CLIENT_IP)
    b = udp(ns["peer"], PEER_IP)
    with inside(ns["server"]):
        pool = RelayPool(
            bind_host="0.0.0.0",
            advertise_host=TOWARD_CLIENT,
            port_range=None,
            idle_timeout=30.0,
            max_pairs=2,
            policy=AddressPolicy(allow=LAB),
            table=RouteTable(plane),
            on_release=lambda _s, _t, first, second: released.append((first, second)),
        )
        try:
            session = SessionId(77, 1)
            pair = pool.allocate(session, (CLIENT_IP, PEER_IP))
            assert pair is not None
            side0 = (TOWARD_CLIENT, pair[0][1])
            side1 = (TOWARD_PEER, pair[1][1])
            # Learning goes through the sockets: the second ping is forwarded
            # by hand and installs the routes, in the taps and in the kernel.
            a.sendto(ping(77), side0)
            await asyncio.sleep(0.1)
            b.sendto(ping(77), side1)
            assert await recv(a) == (ping(77), side0)
            assert len(plane) == 2
            sizes = [1, 100, 1400]
            for n in sizes:
                a.sendto(bytes(n), side0)
                assert await recv(b) == (bytes(n), side1)
                b.sendto(b"r" * n, side1)
                assert await recv(a) == (b"r" * n, side0)
            sides = pool._pairs[session].sides
            # The kernel forwarded it all: the taps' routes saw nothing...
            assert all(r.packets == 0 for s in sides for r in s.routes.values())
            # ...and the pool's counts (sweeps, metrics, insight) see it.
            assert pool.packets() == 1 + 2 * len(sizes)
            pool.release(session)
            assert len(plane) == 0
            assert released == [
                ((len(sizes), sum(sizes)), (1 + len(sizes), len(ping(77)) + sum(sizes)))
            ]
            # Released: nothing crosses any more, at once.
            a.sendto(b"late", side0)
            b.sendto(b"late", side1)
            assert await recv(b, 0.3) is None and await recv(a, 0.3) is None
        finally:
            await pool.close()
            a.close()
            b.close()


async def test_raknet_forwarder_between_stock_peers_through_the_kernel(
    lab: tuple[dict[str, str], KernelPlane],
) -> None:
    """Two stock RakNet 4 peers (PyPI wheel) RakNet-connect through a
    UDPProxy forwarder; once both sides are confirmed, the kernel forwards."""
    from tests.interop.raknet_support import ID, RakNetPeer

    ns, plane = lab
    with inside(ns["client"]):
        a = RakNetPeer(host=CLIENT_IP)
    with inside(ns["peer"]):
        b = RakNetPeer(host=PEER_IP)
    b.peer.max_incoming_connections = 4  # b hosts the game
    with inside(ns["server"]):
        pool = ForwarderPool(
            "0.0.0.0",
            forwarder_table(ResourceBudget(), 4, 4),
            table=RouteTable(plane),
        )
        try:
            result, port = pool.start((CLIENT_IP, a.port), (PEER_IP, b.port), 5000)
            assert result == ForwarderResult.SUCCESS
            await a.connect(TOWARD_CLIENT, port)
            await b.expect(ID.ID_NEW_INCOMING_CONNECTION)
            for i in range(20):
                a.send(b"\x86through the kernel %d" % i)
                assert await b.expect(0x86) == b"\x86through the kernel %d" % i
            (entry,) = pool.entries.values()
            assert len(entry.kernel_routes) == 2
            kernel = sum(r.packets for r in entry.kernel_routes.values())
            assert kernel >= 20
            assert all(r.packets == 0 for r in entry.routes.values())
            assert pool.packets() == entry.forwarded_elsewhere + kernel
            await pool.close()
            assert len(plane) == 0
            assert pool.packets() >= kernel
            # Removed with the forwarder: the connection's traffic stops at once.
            a.send(b"\x86after")
            with pytest.raises(AssertionError):
                await b.expect(0x86, timeout=1.0)
        finally:
            await pool.close()
            a.close()
            b.close()


@pytest.mark.parametrize("plane", ["kernel", "c"])
async def test_the_runtime_hands_the_kernel_plane_to_both_relays(plane: str) -> None:
    """With --dataplane kernel the natneg relay pool and the RakNet forwarder
    pool get the runtime's kernel routes; on any other plane they get none."""
    from crossroads.config import default_config
    from crossroads.runtime import start
    from crossroads.services.natneg import NatNegService
    from crossroads.services.raknet import RakNetService
    from tests.conftest import loopback_config, running_service

    if plane == "kernel":
        skip_unless_kernel_loads()
    rt = await start(
        default_config(
            loopback_config(
                core__only="natneg,raknet",
                core__dataplane=plane,
                natneg__relay_host="127.0.0.1",
                natneg__relay_allow="127.0.0.0/8",
                natneg__natneg2_host="127.0.0.2",
                natneg__natneg3_host="127.0.0.3",
                natneg__probe_host="127.0.0.4",
            )
        )
    )
    try:
        natneg = running_service(rt, "natneg", NatNegService)
        raknet = running_service(rt, "raknet", RakNetService)
        assert natneg.relay is not None and raknet.forwarders is not None
        kernel = rt.dataplane.kernel if rt.dataplane is not None else None
        assert (kernel is not None) == (plane == "kernel")
        for routes in (natneg.relay.table, raknet.forwarders.table):
            assert (routes.plane if routes is not None else None) is kernel
    finally:
        await rt.close()


async def test_unity_host_and_joiner_through_the_kernel_until_revoked(
    lab: tuple[dict[str, str], KernelPlane],
) -> None:
    """A Unity-flow host (client side) and joiner (peer side): BIND and
    CONNECT go through the relay's socket; once connected, RELAY frames are
    forwarded by the kernel, as is, each way (the tap's routes see nothing,
    the core's counts see everything), and a revoked allocation stops the
    forwarding at once."""
    from crossroads.proto.relay import messages as m
    from crossroads.proto.relay.server import RelayServer, RelayServerConfig
    from crossroads.proto.relay.token import Role
    from crossroads.transport.relay import RelayEndpoint
    from crossroads.transport.sockets import make_udp_socket
    from tests.transport.test_relay import Peer, allocation, bind_message

    ns, plane = lab
    loop = asyncio.get_running_loop()
    # The loop runs in the server's namespace: the table resolves devices
    # and local addresses there when a route is installed.
    with inside(ns["server"]):
        core = RelayServer(
            RelayServerConfig(node_id="node", policy=AddressPolicy(allow=LAB)),
            SEALER,
            wall_offset=time.time() - loop.time(),
        )
        endpoint = RelayEndpoint(
            core, make_udp_socket("0.0.0.0", 0), table=RouteTable(plane)
        )
        endpoint.start()
        port = endpoint.sock.getsockname()[1]
        with inside(ns["client"]):
            host = Peer(socket.AF_INET, CLIENT_IP, (TOWARD_CLIENT, port))
        with inside(ns["peer"]):
            joiner = Peer(socket.AF_INET, PEER_IP, (TOWARD_PEER, port))
        try:
            hid, htoken = allocation(Role.HOST)
            jid, jtoken = allocation(Role.JOINER, hid)
            bound = m.BindReceived().encode()
            assert await host.request(bind_message(hid, htoken, 0)) == bound
            assert await joiner.request(bind_message(jid, jtoken, 0)) == bound
            connect = m.ConnectRequest(jid, m.pad_connection_data(htoken)).encode()
            assert await joiner.request(connect) == m.Accepted(hid, jid).encode()
            assert len(plane) == 2  # one RELAY route each way
            frames = 20
            for n in range(frames):
                up = m.Relay(jid, hid, b"up %d" % n).encode()
                joiner.sock.sendto(up, joiner.server)
                assert await host.recv() == up  # as is, from the address it uses
                down = m.Relay(hid, jid, b"down %d" % n).encode()
                host.sock.sendto(down, host.server)
                assert await joiner.recv() == down
            # A frame whose DataLength lies is not the kernel's: the socket's
            # core refuses it (nothing reaches the host).
            bad = m.Relay(jid, hid, b"x").encode() + b"trailing"
            joiner.sock.sendto(bad, joiner.server)
            # The kernel forwarded it all: the taps' routes saw nothing...
            assert all(r.packets == 0 for r in endpoint.routes.values())
            kernel = sum(
                getattr(link.forward, "kernel_packets", 0)
                for link in core._links.values()
            )
            assert kernel == 2 * frames
            # ...and the core's counts (idle timers, metrics, insight) see it.
            assert core.relayed()[0] == 2 * frames
            # Revoked: both routes leave the kernel and forwarding stops at once.
            assert core.kick(jid, loop.time())
            assert len(plane) == 0
            late = m.Relay(jid, hid, b"late").encode()
            joiner.sock.sendto(late, joiner.server)
            host.sock.sendto(m.Relay(hid, jid, b"late").encode(), host.server)
            assert late not in await drain(host.sock)
            assert m.Relay(hid, jid, b"late").encode() not in await drain(joiner.sock)
            assert core.drops  # the socket plane refused them
        finally:
            endpoint.close()
            host.sock.close()
            joiner.sock.close()


async def drain(sock: socket.socket, quiet: float = 0.3) -> list[bytes]:
    """Everything ``sock`` receives until ``quiet`` seconds pass without any."""
    got: list[bytes] = []
    while (item := await recv(sock, quiet)) is not None:
        got.append(item[0])
    return got


@pytest.mark.parametrize("plane", ["kernel", "c"])
async def test_the_runtime_hands_the_kernel_plane_to_the_unity_relay(
    plane: str,
) -> None:
    """With --dataplane kernel the Unity relay's endpoint writes its routes
    through the runtime's route table, which holds the kernel plane."""
    from crossroads.config import default_config
    from crossroads.runtime import start
    from crossroads.services.relay import RelayService
    from tests.conftest import loopback_config, running_service

    if plane == "kernel":
        skip_unless_kernel_loads()
    rt = await start(
        default_config(loopback_config(core__only="relay", core__dataplane=plane))
    )
    try:
        relay = running_service(rt, "relay", RelayService)
        kernel = rt.dataplane.kernel if rt.dataplane is not None else None
        assert (kernel is not None) == (plane == "kernel")
        assert relay.node is not None
        assert relay.node.endpoint.table.plane is kernel
    finally:
        await rt.close()
