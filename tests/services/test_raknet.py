"""The ``raknet`` service (``crossroads serve --only raknet``) with real RakNet
4.081 peers (PyPI ``raknet==0.3.0``) scripting NatPunchthroughClient's side of
the exchange (the wheel exposes the peer, not the plugin; message layouts from
reference raknet-wire.md §3), plus the port-stride ping on the second socket."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from crossroads.config import default_config
from crossroads.proto.raknet import messages as m
from crossroads.proto.raknet.bitstream import BitReader, BitWriter
from crossroads.proto.raknet.nattype import Socket
from crossroads.proto.raknet.udpproxy import Sub
from crossroads.runtime import Runtime, start
from crossroads.services.raknet import RakNetService
from crossroads.types import Address
from tests.conftest import eventually, loopback_config, running_service
from tests.interop.raknet_support import ID, RakNetPeer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def rt() -> AsyncIterator[Runtime]:
    runtime = await start(default_config(loopback_config(core__only="raknet")))
    try:
        yield runtime
    finally:
        await runtime.close()


def service_of(rt: Runtime) -> RakNetService:
    return running_service(rt, "raknet", RakNetService)


async def guid_of(service: RakNetService, peer: RakNetPeer) -> int:
    """The GUID the server knows a wheel peer by (the wheel does not expose it)."""

    async def known() -> bool:
        return any(u.address[1] == peer.port for u in service.node.punch.users.values())

    await eventually(known, "the server has the peer as a punchthrough user")
    return next(
        g for g, u in service.node.punch.users.items() if u.address[1] == peer.port
    )


def connect_at_time(data: bytes) -> tuple[int, tuple[str, int], int, bool]:
    """(session, peer public address, peer GUID, we-are-sender) of a
    ``1b`` Time ``3b`` ... message."""
    assert (
        data[0] == m.MessageId.TIMESTAMP and data[9] == m.MessageId.NAT_CONNECT_AT_TIME
    )
    reader = BitReader(data, start_bits=10 * 8)
    session = reader.read_u16()
    public = reader.read_address()
    for _ in range(10):
        reader.read_address()
    return session, public, reader.read_u64(), reader.read_bool()


async def test_punchthrough_between_two_stock_raknet_peers(
    rt: Runtime, peers: tuple[RakNetPeer, RakNetPeer]
) -> None:
    service = service_of(rt)
    port = service.addresses[0][1]
    a, b = peers
    await a.connect("127.0.0.1", port)
    await b.connect("127.0.0.1", port)
    b_guid = await guid_of(service, b)
    a_guid = await guid_of(service, a)

    a.send(bytes([m.MessageId.NAT_PUNCHTHROUGH_REQUEST]) + b_guid.to_bytes(8, "big"))
    ask_a = await a.expect(m.MessageId.NAT_GET_MOST_RECENT_PORT)
    ask_b = await b.expect(m.MessageId.NAT_GET_MOST_RECENT_PORT)
    assert ask_a == ask_b and len(ask_a) == 3
    session = ask_a[1:3]
    for peer in (a, b):
        peer.send(ask_a[:1] + session + peer.port.to_bytes(2, "big"))
    at_a = connect_at_time(await a.expect(m.MessageId.TIMESTAMP))
    at_b = connect_at_time(await b.expect(m.MessageId.TIMESTAMP))
    assert at_a == (int.from_bytes(session, "big"), ("127.0.0.1", b.port), b_guid, True)
    assert at_b == (
        int.from_bytes(session, "big"),
        ("127.0.0.1", a.port),
        a_guid,
        False,
    )

    # an unknown target
    a.send(bytes([m.MessageId.NAT_CLIENT_READY]))
    b.send(bytes([m.MessageId.NAT_CLIENT_READY]))
    a.send(bytes([m.MessageId.NAT_PUNCHTHROUGH_REQUEST]) + (12345).to_bytes(8, "big"))
    refused = await a.expect(m.MessageId.NAT_TARGET_NOT_CONNECTED)
    assert refused == bytes([0x3E]) + (12345).to_bytes(8, "big")

    # the target leaves mid-attempt
    a.send(bytes([m.MessageId.NAT_PUNCHTHROUGH_REQUEST]) + b_guid.to_bytes(8, "big"))
    await b.expect(m.MessageId.NAT_GET_MOST_RECENT_PORT)
    b.peer.shutdown(0.3)
    lost = await a.expect(m.MessageId.NAT_CONNECTION_TO_TARGET_LOST)
    assert lost[1:9] == b_guid.to_bytes(8, "big")

    # Insight: the server saw one punch coordinated (whether it connected the
    # clients tell only their games) and one lost with its target; the
    # unknown target was refused before it became an attempt.
    records = [r for r in rt.insight.ring if r.family == "raknet"]
    assert [(r.outcome, r.winner, r.cause) for r in records] == [
        ("direct", "punch", ""),
        ("failed", "", "target-lost"),
    ]
    assert [(s.name, s.outcome) for s in records[0].steps][-2:] == [
        ("ports", "ok"),
        ("punch", "coordinated"),
    ]
    assert records[0].session == f"punch-{int.from_bytes(session, 'big')}"
    assert len(records[0].sides) == 2


async def test_bound_addresses_and_port_stride_ping(
    rt: Runtime, peers: tuple[RakNetPeer, RakNetPeer]
) -> None:
    service = service_of(rt)
    first, second = service.addresses
    a, _ = peers
    await a.connect("127.0.0.1", first[1])
    a.send(bytes([m.MessageId.NAT_REQUEST_BOUND_ADDRESSES]))
    answer = await a.expect(m.MessageId.NAT_RESPOND_BOUND_ADDRESSES)
    reader = BitReader(answer, start_bits=8)
    assert reader.read_u8() == 2
    assert [reader.read_address(), reader.read_address()] == [first, second]

    # The client's out-of-band NAT_PING to the second socket: the pong comes
    # from the first, with the port as reported and as seen.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.settimeout(5)
        ping = m.OutOfBand(99, bytes([0x0A]) + (4242).to_bytes(2, "big")).encode()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, sock.sendto, ping, second)
        data, source = await loop.run_in_executor(None, sock.recvfrom, 2048)
        seen = sock.getsockname()[1]
    assert source == first
    pong = m.OutOfBand.decode(data)
    assert pong.guid == service.node.peer.guid
    assert pong.payload == bytes([0x0B]) + (4242).to_bytes(2, "big") + seen.to_bytes(
        2, "big"
    )


async def test_garbage_does_not_disturb_a_connected_peer(
    rt: Runtime, peers: tuple[RakNetPeer, RakNetPeer]
) -> None:
    service = service_of(rt)
    first, second = service.addresses
    a, _ = peers
    await a.connect("127.0.0.1", first[1])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for garbage in (b"", b"\x84", b"\xc0\xff\xff", b"\x05" + m.MAGIC, bytes(600)):
            sock.sendto(garbage, first)
            sock.sendto(garbage, second)
    a.send(bytes([m.MessageId.NAT_REQUEST_BOUND_ADDRESSES]))
    await a.expect(m.MessageId.NAT_RESPOND_BOUND_ADDRESSES)
    assert not [d for d, _ in a.backlog if d[0] == ID.ID_CONNECTION_LOST]
    dropped = service.node.peer.stats.dropped
    assert sum(dropped.values()) >= 3 and service.node.second_dropped >= 3
    host, port = rt.http_address
    async with httpx.AsyncClient() as http:
        metrics = (await http.get(f"http://{host}:{port}/metrics")).text
    assert 'crossroads_raknet_dropped_total{reason="second-socket"}' in metrics
    assert "crossroads_raknet_connections 1.0" in metrics
    # The UDP proxy's forwarders drop datagrams over RakNet's MTU (counted).
    assert 'crossroads_raknet_dropped_total{reason="forwarder-oversized"}' in metrics


@pytest.fixture
async def rt_detection() -> AsyncIterator[Runtime]:
    runtime = await start(
        default_config(
            loopback_config(core__only="raknet", raknet__detection_hosts=["127.0.0.1"])
        )
    )
    try:
        yield runtime
    finally:
        await runtime.close()


async def test_nat_type_detection_with_a_stock_raknet_peer(
    rt_detection: Runtime, peers: tuple[RakNetPeer, RakNetPeer]
) -> None:
    """The client side scripted as NatTypeDetectionClient does it (the wheel
    has the peer, not the plugin): C1 is the wheel's socket, C2 a plain one."""
    service = service_of(rt_detection)
    sides = service.side_addresses
    a, _ = peers
    await a.connect("127.0.0.1", service.addresses[0][1])
    guid = await guid_of(service, a)
    loop = asyncio.get_running_loop()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as c2:
        c2.bind(("127.0.0.1", 0))
        c2.settimeout(5)
        request = BitWriter()
        request.write_u8(m.MessageId.NAT_TYPE_DETECTION_REQUEST)
        request.write_bool(True)
        request.write_u16(c2.getsockname()[1])
        a.send(request.data())
        # NONE: the raw byte 00 from s4p5 to C2
        data, source = await loop.run_in_executor(None, c2.recvfrom, 100)
        assert (data, source) == (b"\x00", sides[Socket.S4P5])
        # FULL_CONE from s2p3 and ADDRESS_RESTRICTED from s1p2, out of band to C1
        full = await a.expect(lambda d: d == bytes([0x0D, 0x02, 0x01]))
        restricted = await a.expect(lambda d: d == bytes([0x0D, 0x02, 0x02]))
        assert full and restricted
        # PORT_RESTRICTED: where to send the probe, over the connection
        probe = await a.expect(m.MessageId.NAT_TYPE_DETECTION_REQUEST)
        reader = BitReader(probe, start_bits=8)
        s3p4 = (reader.read_rakstring().decode(), reader.read_u16())
        assert s3p4 == sides[Socket.S3P4]
        # a probe from another port than the connection's: SYMMETRIC
        c2.sendto(b"\x03" + guid.to_bytes(8, "big"), s3p4)
        result = await a.expect(m.MessageId.NAT_TYPE_DETECTION_RESULT)
    assert result == bytes([0x61, 4])


async def test_udp_proxy_two_stock_peers_then_talk_through_the_forwarder(
    rt: Runtime, peers: tuple[RakNetPeer, RakNetPeer]
) -> None:
    """UDPProxyClient's request scripted from a real RakNet peer; then the two
    peers RakNet-connect through the forwarding port and exchange a message."""
    service = service_of(rt)
    a, b = peers
    b.peer.max_incoming_connections = 4  # b hosts the game
    await a.connect("127.0.0.1", service.addresses[0][1])
    await b.connect("127.0.0.1", service.addresses[0][1])
    b_guid = await guid_of(service, b)
    # First a punch, coordinated: the proxy the pair asks for next says the
    # punch did not connect them.
    a.send(bytes([m.MessageId.NAT_PUNCHTHROUGH_REQUEST]) + b_guid.to_bytes(8, "big"))
    ask = await a.expect(m.MessageId.NAT_GET_MOST_RECENT_PORT)
    await b.expect(m.MessageId.NAT_GET_MOST_RECENT_PORT)
    for peer in (a, b):
        peer.send(ask + peer.port.to_bytes(2, "big"))
    for peer in (a, b):
        await peer.expect(m.MessageId.TIMESTAMP)
    request = BitWriter()
    request.write_u8(m.MessageId.UDP_PROXY_GENERAL)
    request.write_u8(6)  # FORWARDING_REQUEST_FROM_CLIENT_TO_COORDINATOR
    request.write_address(("0.0.0.0", 0))
    request.write_bool(False)
    request.write_u64(b_guid)
    request.write_u32(5000)
    request.write_bool(False)
    a.send(request.data())
    succeeded = await a.expect(m.MessageId.UDP_PROXY_GENERAL)
    notified = await b.expect(m.MessageId.UDP_PROXY_GENERAL)
    assert succeeded[1] == 0 and notified[1] == 1
    reader = BitReader(succeeded, start_bits=16 + 7 * 8 * 2 + 64)
    proxy = (reader.read_rakstring().decode(), reader.read_u16())
    assert proxy[0] == "127.0.0.1"
    # a connects to the proxy; b sees an incoming connection from it
    a.server = None
    await a.connect(*proxy)
    await b.expect(m.MessageId.NEW_INCOMING_CONNECTION)
    a.send(b"\x86through the proxy")
    assert await b.expect(0x86) == b"\x86through the proxy"
    assert service.forwarders is not None and service.forwarders.packets() > 0
    # Insight: when the forwarder goes, one relayed record with what it
    # carried each way (the RakNet handshake and the message), read from its
    # routes.
    await service.forwarders.close()
    punched, record = [r for r in rt.insight.ring if r.family == "raknet"]
    assert (punched.winner, punched.outcome) == ("punch", "direct")
    assert (record.winner, record.outcome) == ("proxy", "relayed")
    assert record.cause == "punch did not connect: the pair asked for the proxy"
    assert record.session == f"proxy-{proxy[1]}"
    assert record.usage is not None
    assert record.usage.packets_up > 0 and record.usage.packets_down > 0
    assert record.usage.packets == service.forwarders.packets()
    assert record.usage.bytes_up > len(b"\x86through the proxy")
    # Both ends are still connected to the server: RakNet's pings name
    # their round trips.
    assert all(side.rtt_ms is not None for side in record.sides)


def proxy_message(sub: int, body: BitWriter) -> bytes:
    writer = BitWriter()
    writer.write_u8(m.MessageId.UDP_PROXY_GENERAL)
    writer.write_u8(sub)
    return writer.data() + body.data()


async def answer_ping_round(
    client: RakNetPeer, ping_ms: Callable[[Address], int]
) -> tuple[int, list[Address], bytes]:
    """UDPProxyClient's side of the ping round: read ``5c 07``, really ping
    every listed server (an unconnected ping each, as UDPProxyClient does),
    and report ``ping_ms(server)`` for each in ``5c 08``. Returns (target GUID,
    the servers listed, the report sent)."""
    listing = await client.expect(m.MessageId.UDP_PROXY_GENERAL)
    assert listing[1] == Sub.PING_SERVERS_FROM_COORDINATOR_TO_CLIENT
    reader = BitReader(listing, start_bits=16)
    pair = (reader.read_address(), reader.read_address())
    guid = reader.read_u64()
    listed = [reader.read_address() for _ in range(reader.read_u16())]
    for host, port in listed:
        assert client.peer.ping(host, port)
        await client.expect(m.MessageId.UNCONNECTED_PONG)
    reply = BitWriter()
    reply.write_address(pair[0])
    reply.write_address(pair[1])
    reply.write_u16(len(listed))
    for server in listed:
        reply.write_address(server)
        reply.write_u16(ping_ms(server))
    report = proxy_message(Sub.PING_SERVERS_REPLY_FROM_CLIENT_TO_COORDINATOR, reply)
    client.send(report)
    return guid, listed, report


async def test_udp_proxy_server_chosen_by_the_clients_pings_then_fallback(
    peers: tuple[RakNetPeer, RakNetPeer],
) -> None:
    """Two external UDPProxyServers (real peers scripting UDPProxyServer's
    login and replies): both clients get the list to ping (``5c 07``), really
    ping every listed server, and report (``5c 08``); the one with the lowest
    summed ping is asked first, the next after it fails, and the built-in
    forwarder carries the game when both are out of sockets."""
    runtime = await start(
        default_config(
            loopback_config(core__only="raknet", raknet__proxy_password="pw")
        )
    )
    far, near = RakNetPeer(), RakNetPeer()
    try:
        service = service_of(runtime)
        port = service.addresses[0][1]
        a, b = peers
        b.peer.max_incoming_connections = 4  # b hosts the game
        for peer in (a, b, far, near):
            await peer.connect("127.0.0.1", port)
        for server in (far, near):
            login = BitWriter()
            login.write_rakstring(b"pw")
            server.send(proxy_message(11, login))
            assert (await server.expect(m.MessageId.UDP_PROXY_GENERAL))[1] == 12
        b_guid = await guid_of(service, b)
        request = BitWriter()
        request.write_address(("0.0.0.0", 0))
        request.write_bool(False)
        request.write_u64(b_guid)
        request.write_u32(5000)
        request.write_bool(False)
        a.send(proxy_message(6, request))
        server_ports = {far.port, near.port}
        far_address = ("127.0.0.1", far.port)
        for client in (a, b):
            # loopback pings are all ~0 ms: report "far" as 300 ms away
            guid, listed, report = await answer_ping_round(
                client, lambda server: 300 if server == far_address else 20
            )
            assert guid == b_guid and {p for _, p in listed} == server_ports
        for server in (near, far):  # best first, each out of sockets
            asked = await server.expect(m.MessageId.UDP_PROXY_GENERAL)
            assert asked[1] == 9  # FORWARDING_REQUEST_FROM_COORDINATOR_TO_SERVER
            reader = BitReader(asked, start_bits=16)
            source, target = reader.read_address(), reader.read_address()
            assert reader.read_u32() == 5000
            failed = BitWriter()
            failed.write_address(source)
            failed.write_address(target)
            failed.write_rakstring(b"")
            failed.write_u8(1)  # UDPFORWARDER_NO_SOCKETS
            failed.write_u16(0)
            server.send(proxy_message(10, failed))
        succeeded = await a.expect(m.MessageId.UDP_PROXY_GENERAL)
        assert succeeded[1] == 0
        reader = BitReader(succeeded, start_bits=16 + 7 * 8 * 2 + 64)
        proxy = (reader.read_rakstring().decode(), reader.read_u16())
        assert proxy[1] not in server_ports  # the built-in forwarder's port
        assert (await b.expect(m.MessageId.UDP_PROXY_GENERAL))[1] == 1
        a.server = None
        await a.connect(*proxy)
        await b.expect(m.MessageId.NEW_INCOMING_CONNECTION)
        a.send(b"\x86through the fallback")
        assert await b.expect(0x86) == b"\x86through the fallback"
        assert service.node.proxy.stats.dropped == {}
        # a late report (the round is over) is dropped and counted
        client.send(report)
        host, http_port = runtime.http_address
        metric = 'crossroads_raknet_dropped_total{reason="proxy-unexpected-ping-reply"}'

        async def counted() -> bool:
            async with httpx.AsyncClient() as http:
                text = (await http.get(f"http://{host}:{http_port}/metrics")).text
            return f"{metric} 1.0" in text

        await eventually(counted, "the late ping report is counted")
    finally:
        far.close()
        near.close()
        await runtime.close()


async def test_describe_brackets_an_ipv6_host() -> None:
    runtime = await start(
        default_config(
            loopback_config(
                core__only="raknet", raknet__host="::1", raknet__second_host="::1"
            )
        )
    )
    try:
        lines = runtime.services["raknet"].describe()
    finally:
        await runtime.close()
    assert [line.split(" ")[1].rsplit(":", 1)[0] for line in lines] == [
        "[::1]",
        "[::1]",
    ]
