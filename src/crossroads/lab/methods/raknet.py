"""Method ``raknet``: RakNet's NAT traversal through crossroads' ``raknet`` service.

Both hosts are RakNet clients of the lab server's RakNet service
(:mod:`crossroads.services.raknet`, UDP 61111 on the first server address),
speaking RakNet's own protocol from one UDP socket each: the offline
handshake and the reliability layer of :mod:`crossroads.proto.raknet`, and
NatPunchthroughClient's side of the exchange (reference raknet-wire.md §3):
host a asks for b (``ID_NAT_PUNCHTHROUGH_REQUEST``), both report the port the
server sees (``ID_NAT_GET_MOST_RECENT_PORT``), both get
``ID_NAT_CONNECT_AT_TIME`` with the other's address and punch: first, as the
stock client does, a two-byte datagram with IP TTL 2 (``RakPeer::SendTTL``):
it opens the sender's own NAT mapping and dies at the next router -- the
lab's internet router, which routes between the sites as the internet does
(tests/lab/test_raknet.py checks that it dies there) -- then out-of-band
``ID_NAT_ESTABLISH_UNIDIRECTIONAL`` / ``_BIDIRECTIONAL`` datagrams at the
normal TTL for up to :data:`PUNCH_S`.

When that fails, UDPProxyClient's fallback: a asks the coordinator for a
forwarder (``ID_UDP_PROXY_GENERAL`` ``FORWARDING_REQUEST``). The coordinator
has two forwarders to choose from: its own (a relay node,
``--raknet-proxy-relay-nodes``) and :class:`LabProxyServer`, a RakNet
UDPProxyServer on the server's second address that logged in with the lab's
proxy password. So both hosts get the list to ping (``5c 07``), ping each
forwarder with RakNet's unconnected ping, report (``5c 08``), and the
coordinator asks the one with the lowest summed ping; both then send through
the port they are given. Connected when a game datagram crosses both ways.

A matrix run starts one :class:`LabProxyServer` for all its attempts
(:func:`prepare`), as a real proxy server outlives the games it carries. One
per attempt, closed when its attempt ended, was listed to the attempts running
beside it too: one that picked it by ping lost its forwarder in the middle of
its game data when the other attempt finished (1 cell in ~100 failed under
load, always a relay pair).

This is crossroads' emulation of the client plugins, not the stock C++
client (the PyPI wheel exposes the peer, not the plugins); what it proves is
the server side: the exchange and the forwarders between real kernel NATs.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from typing import Any

from crossroads.errors import DecodeError
from crossroads.lab import netns
from crossroads.lab.kinds import NatKind, both_udp
from crossroads.lab.matrix import Attempt, Method, Outcome, register
from crossroads.lab.methods.punch import expected as punch_expected
from crossroads.lab.topology import LAB_RAKNET_PROXY_PASSWORD, SERVER_IPS, Lab
from crossroads.lab.udp import recv, send
from crossroads.proto.admission import LocalTable
from crossroads.proto.raknet import messages as m
from crossroads.proto.raknet.bitstream import BitReader, BitWriter
from crossroads.proto.raknet.messages import MessageId
from crossroads.proto.raknet.reliability import (
    Reliability,
    ReliabilityLayer,
)
from crossroads.proto.raknet.udpproxy import Sub
from crossroads.transport.admission import ResourceBudget
from crossroads.transport.raknet_forwarder import ForwarderPool, forwarder_table
from crossroads.transport.tasks import cancel_and_wait
from crossroads.types import Address

#: RakNet's default port, where the lab server's ``raknet`` service listens.
SERVER: Address = (SERVER_IPS[0], 61111)
#: NatPunchthroughClient's out-of-band sub-ids (reference §3, §7).
ESTABLISH_UNIDIRECTIONAL = 0x00
ESTABLISH_BIDIRECTIONAL = 0x01
#: How long the two sides punch, and the interval between their datagrams
#: (the lab's round trip is far below a millisecond).
PUNCH_S = 3.0
PUNCH_INTERVAL_S = 0.05
#: Each server exchange is a lab round trip; this is generous.
STEP_S = 5.0
GAME_DATA = b"\x86raknet lab"
#: What ``RakPeer::SendTTL`` sends before punching: two bytes (``00 01``) with
#: IP TTL 2, enough to leave the sender's NAT and no further (RakPeer.cpp
#: SendTTL; NatPunchthroughClient.cpp:782-792, 829-845; reference §3, §8).
TTL_PROBE = b"\x00\x01"
TTL_PROBE_HOPS = 2
#: How long a client waits for one forwarder's unconnected pong, per try.
PING_WAIT_S = 0.5
PING_TRIES = 3
#: Forwarding ports the lab's second UDPProxyServer opens at once.
LAB_PROXY_FORWARDERS = 64


def send_with_ttl(sock: socket.socket, data: bytes, to: Address, ttl: int) -> None:
    """Send one datagram with IP TTL ``ttl``, then set the socket's TTL back
    (as ``SocketLayer::SendToTTL`` does)."""
    old = sock.getsockopt(socket.IPPROTO_IP, socket.IP_TTL)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_TTL, ttl)
    try:
        send(sock, data, to)
    finally:
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_TTL, old)


class LabClient:
    """A RakNet client on one lab socket (see the module docstring)."""

    def __init__(self, sock: socket.socket, server: Address = SERVER) -> None:
        self.sock = sock
        self.server = server
        self.guid = int.from_bytes(os.urandom(8), "big")
        self.layer = ReliabilityLayer(1492, LocalTable(max_bytes=1 << 20))
        self.inbox: list[bytes] = []
        self.offline: list[bytes] = []
        self.others: list[tuple[bytes, Address]] = []
        self.external: Address = ("0.0.0.0", 0)
        self._loop = asyncio.get_running_loop()

    def _now_ms(self) -> int:
        return int(self._loop.time() * 1000)

    def _flush(self) -> None:
        for data in self.layer.datagrams(self._now_ms()):
            send(self.sock, data, self.server)

    async def pump(self, timeout: float) -> None:
        got = await recv(self.sock, timeout)
        if got is None:
            self._flush()
            return
        data, addr = got
        if addr != self.server:
            self.others.append((data, addr))
        elif data and data[0] & 0x80 and not m.is_offline(data):
            self.inbox += self.layer.receive(data, self._now_ms())
        else:
            self.offline.append(data)
        self._flush()

    async def expect(self, kind: int, timeout: float = STEP_S) -> bytes:
        deadline = self._loop.time() + timeout
        while True:
            for i, payload in enumerate(self.inbox):
                if payload[0] == kind:
                    return self.inbox.pop(i)
            if self._loop.time() > deadline:
                raise TimeoutError(f"no message {kind:#04x} from the server")
            await self.pump(0.05)

    async def offline_reply(self, data: bytes, kind: int) -> bytes:
        deadline = self._loop.time() + STEP_S
        while self._loop.time() < deadline:
            send(self.sock, data, self.server)
            end = self._loop.time() + 0.5
            while self._loop.time() < end:
                await self.pump(0.05)
                for reply in self.offline:
                    if reply[0] == kind:
                        self.offline.remove(reply)
                        return reply
        raise TimeoutError(f"no offline reply {kind:#04x}")

    def send(self, payload: bytes) -> None:
        self.layer.send(payload, Reliability.RELIABLE_ORDERED, 0, self._now_ms())
        self._flush()

    async def connect(self) -> None:
        await self.offline_reply(m.OpenConnectionRequest1(6, 1492).encode(), 0x06)
        await self.offline_reply(
            m.OpenConnectionRequest2(self.server, 1492, self.guid).encode(), 0x08
        )
        writer = BitWriter()
        writer.write_u8(MessageId.CONNECTION_REQUEST)
        writer.write_u64(self.guid)
        writer.write_u64(self._now_ms())
        writer.write_bool(False)
        self.send(writer.data())
        accepted = await self.expect(MessageId.CONNECTION_REQUEST_ACCEPTED)
        self.external = BitReader(accepted, start_bits=8).read_address()
        writer = BitWriter()
        writer.write_u8(MessageId.NEW_INCOMING_CONNECTION)
        writer.write_address(self.server)
        writer.write_address(self.sock.getsockname()[:2])
        for _ in range(9):
            writer.write_address(("0.0.0.0", 0))
        writer.write_u64(self._now_ms())
        writer.write_u64(self._now_ms())
        self.send(writer.data())

    def out_of_band(self, payload: bytes, to: Address) -> None:
        send(self.sock, m.OutOfBand(self.guid, payload).encode(), to)

    def _take_pong(self, sender: Address) -> bool:
        """Whether an unconnected pong from ``sender`` arrived (and take it)."""
        pong = bytes([MessageId.UNCONNECTED_PONG])
        if sender == self.server:
            for data in self.offline:
                if data[:1] == pong:
                    self.offline.remove(data)
                    return True
            return False
        for data, addr in self.others:
            if addr == sender and data[:1] == pong:
                self.others.remove((data, addr))
                return True
        return False

    async def ping(self, servers: list[Address]) -> dict[Address, int]:
        """RakNet's unconnected ping to every one of ``servers`` at once: the
        round trips in ms of those that answered."""
        pings: dict[Address, int] = {}
        for _ in range(PING_TRIES):
            sent_ms = self._now_ms()
            waiting = [server for server in servers if server not in pings]
            for server in waiting:
                send(self.sock, m.unconnected_ping(sent_ms, self.guid), server)
            end = self._loop.time() + PING_WAIT_S
            while waiting and self._loop.time() < end:
                await self.pump(0.02)
                for server in [s for s in waiting if self._take_pong(s)]:
                    pings[server] = max(0, self._now_ms() - sent_ms)
                    waiting.remove(server)
            if not waiting:
                break
        return pings

    def disconnect(self) -> None:
        """Say goodbye (``15``), so the server forgets this client at once."""
        self.send(bytes([MessageId.DISCONNECTION_NOTIFICATION]))


async def punch_side(client: LabClient, peer: Address, session: int) -> Address | None:
    """Punch towards ``peer``; the address the peer was heard from, or None."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + PUNCH_S
    heard: Address | None = None
    acked = False
    next_send = 0.0
    send_with_ttl(client.sock, TTL_PROBE, peer, TTL_PROBE_HOPS)
    while loop.time() < deadline and not (heard and acked):
        if loop.time() >= next_send:
            kind = ESTABLISH_BIDIRECTIONAL if heard else ESTABLISH_UNIDIRECTIONAL
            client.out_of_band(
                bytes([kind]) + session.to_bytes(2, "big"), heard or peer
            )
            next_send = loop.time() + PUNCH_INTERVAL_S
        await client.pump(max(0.001, next_send - loop.time()))
        while client.others:
            data, addr = client.others.pop(0)
            if data[:1] == bytes([MessageId.OUT_OF_BAND_INTERNAL]) and m.is_offline(
                data
            ):
                sub = m.OutOfBand.decode(data).payload[:1]
                heard = addr
                acked = acked or sub == bytes([ESTABLISH_BIDIRECTIONAL])
    if heard and acked:
        for _ in range(2):  # so the peer learns it was heard, too
            client.out_of_band(
                bytes([ESTABLISH_BIDIRECTIONAL]) + session.to_bytes(2, "big"), heard
            )
        return heard
    return None


async def game_data_crosses(
    a: LabClient, to_b: Address, b: LabClient, to_a: Address
) -> bool:
    """Each side sends game data every 100 ms (as a game keeps sending) until
    both have received the other's, for 2 s at most. A single burst is not
    enough through the UDP proxy: the forwarder learns a symmetric NAT's
    source port from that side's first datagram, and with delay lines the
    other side's burst can arrive before it and be dropped."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 2.0
    got = {a: False, b: False}
    while loop.time() < deadline and not all(got.values()):
        send(a.sock, GAME_DATA, to_b)
        send(b.sock, GAME_DATA, to_a)
        end = loop.time() + 0.1
        while loop.time() < end and not all(got.values()):
            await asyncio.gather(a.pump(0.02), b.pump(0.02))
            for client in (a, b):
                got[client] = got[client] or any(
                    data == GAME_DATA for data, _ in client.others
                )
    return all(got.values())


def connect_at_time(payload: bytes) -> tuple[int, Address]:
    reader = BitReader(payload, start_bits=10 * 8)  # 1b Time 3b
    return reader.read_u16(), reader.read_address()


async def request_punch(a: LabClient, b: LabClient) -> bytes:
    """a asks for b and gets the server's NAT_GET_MOST_RECENT_PORT. When b is
    farther from the server than a (delay lines), b's NEW_INCOMING_CONNECTION
    can still be on its way: the server answers NAT_TARGET_NOT_CONNECTED, and a
    asks again, as a game polling its lobby would."""
    request = bytes([MessageId.NAT_PUNCHTHROUGH_REQUEST]) + b.guid.to_bytes(8, "big")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + STEP_S
    while True:
        a.send(request)
        answer = await asyncio.wait_for(
            _first_of(
                a,
                MessageId.NAT_GET_MOST_RECENT_PORT,
                MessageId.NAT_TARGET_NOT_CONNECTED,
            ),
            max(0.0, deadline - loop.time()),
        )
        if answer[0] == MessageId.NAT_GET_MOST_RECENT_PORT:
            return answer
        await asyncio.sleep(PUNCH_INTERVAL_S)


async def _first_of(client: LabClient, *kinds: int) -> bytes:
    while True:
        for i, payload in enumerate(client.inbox):
            if payload[0] in kinds:
                return client.inbox.pop(i)
        await client.pump(0.05)


async def punchthrough(a: LabClient, b: LabClient) -> bool:
    asks = await asyncio.gather(
        request_punch(a, b),
        b.expect(MessageId.NAT_GET_MOST_RECENT_PORT),
    )
    for client, ask in zip((a, b), asks, strict=True):
        client.send(ask + client.external[1].to_bytes(2, "big"))
    at_a, at_b = await asyncio.gather(
        a.expect(MessageId.TIMESTAMP), b.expect(MessageId.TIMESTAMP)
    )
    (session, b_addr), (_, a_addr) = connect_at_time(at_a), connect_at_time(at_b)
    heard = await asyncio.gather(
        punch_side(a, b_addr, session), punch_side(b, a_addr, session)
    )
    for client in (a, b):
        client.send(bytes([MessageId.NAT_CLIENT_READY]))
    if heard[0] is None or heard[1] is None:
        return False
    return await game_data_crosses(a, heard[0], b, heard[1])


class LabProxyServer:
    """A second forwarder for the coordinator: RakNet's UDPProxyServer side
    (login ``5c 0b``; ``5c 09`` answered with ``5c 0a``; unconnected pings
    answered), a RakNet client of the lab server from the server's second
    address, forwarding with crossroads' own forwarder in the server's
    namespace."""

    def __init__(self, lab: Lab) -> None:
        self.namespace = lab.server_ns
        self.client = LabClient(lab.server_udp_socket(SERVER_IPS[1]))
        self.pool = ForwarderPool(
            SERVER_IPS[1],
            forwarder_table(
                ResourceBudget(), LAB_PROXY_FORWARDERS, LAB_PROXY_FORWARDERS
            ),
        )
        self.logged_in = False
        self.forwarded = 0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Connect and log in; a lab server without the password (an older
        lab) leaves the coordinator with its own forwarder only."""
        await self.client.connect()
        writer = BitWriter()
        writer.write_u8(MessageId.UDP_PROXY_GENERAL)
        writer.write_u8(Sub.LOGIN_REQUEST_FROM_SERVER_TO_COORDINATOR)
        writer.write_rakstring(LAB_RAKNET_PROXY_PASSWORD.encode())
        self.client.send(writer.data())
        answer = await self.client.expect(MessageId.UDP_PROXY_GENERAL)
        self.logged_in = answer[1] in (
            Sub.LOGIN_SUCCESS_FROM_COORDINATOR_TO_SERVER,
            Sub.ALREADY_LOGGED_IN_FROM_COORDINATOR_TO_SERVER,
        )
        self._task = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        client = self.client
        while True:
            await client.pump(0.02)
            heard, client.others = client.others, []
            for data, addr in heard:  # only pings are expected here
                if data[:1] != bytes([MessageId.UNCONNECTED_PING]):
                    continue
                try:
                    ping = m.UnconnectedPing.decode(data)
                except DecodeError:
                    continue
                pong = m.unconnected_pong(ping.time, client.guid, b"")
                send(client.sock, pong, addr)
            asked, client.inbox = client.inbox, []
            for payload in asked:
                if payload[:2] != bytes(
                    [
                        MessageId.UDP_PROXY_GENERAL,
                        Sub.FORWARDING_REQUEST_FROM_COORDINATOR_TO_SERVER,
                    ]
                ):
                    continue
                try:
                    self._forward(payload)
                except DecodeError:
                    continue

    def _forward(self, payload: bytes) -> None:
        reader = BitReader(payload, start_bits=16)
        source, target = reader.read_address(), reader.read_address()
        with netns.entered(self.namespace):  # the forwarding port's socket
            result, port = self.pool.start(source, target, reader.read_u32())
        self.forwarded += 1
        writer = BitWriter()
        writer.write_u8(MessageId.UDP_PROXY_GENERAL)
        writer.write_u8(Sub.FORWARDING_REPLY_FROM_SERVER_TO_COORDINATOR)
        writer.write_address(source)
        writer.write_address(target)
        writer.write_rakstring(SERVER_IPS[1].encode())
        writer.write_u8(result)
        writer.write_u16(port)
        self.client.send(writer.data())

    async def close(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
        await self.pool.close()
        # A logged-in server that vanished would be listed (and pinged) in
        # the next attempts until RakNet's 10 s timeout.
        self.client.disconnect()
        self.client.sock.close()


async def report_pings(client: LabClient, listing: bytes) -> None:
    """UDPProxyClient's answer to ``5c 07``: ping every listed forwarder,
    report the round trips (``5c 08``; unanswered ones left out)."""
    reader = BitReader(listing, start_bits=16)
    source, target = reader.read_address(), reader.read_address()
    reader.read_u64()
    servers = [reader.read_address() for _ in range(reader.read_u16())]
    heard = list((await client.ping(servers)).items())
    writer = BitWriter()
    writer.write_u8(MessageId.UDP_PROXY_GENERAL)
    writer.write_u8(Sub.PING_SERVERS_REPLY_FROM_CLIENT_TO_COORDINATOR)
    writer.write_address(source)
    writer.write_address(target)
    writer.write_u16(len(heard))
    for server, ms in heard:
        writer.write_address(server)
        writer.write_u16(min(ms, 0xFFFF))
    client.send(writer.data())


async def proxy_answer(client: LabClient) -> tuple[bytes, int]:
    """The coordinator's answer, after the ping round if there is one;
    (answer, forwarders the client was asked to ping)."""
    message = await client.expect(MessageId.UDP_PROXY_GENERAL)
    if message[1] != Sub.PING_SERVERS_FROM_COORDINATOR_TO_CLIENT:
        return message, 0
    listed = BitReader(message, start_bits=16 + 2 * 56 + 64).read_u16()
    await report_pings(client, message)
    return await client.expect(MessageId.UDP_PROXY_GENERAL), listed


async def request_forwarder(a: LabClient, b: LabClient) -> tuple[Address | None, int]:
    """UDPProxyClient's request from ``a`` for a forwarder to ``b``: the
    forwarder's address (None: refused) and how many forwarders the clients
    were asked to ping first."""
    writer = BitWriter()
    writer.write_u8(MessageId.UDP_PROXY_GENERAL)
    writer.write_u8(Sub.FORWARDING_REQUEST_FROM_CLIENT_TO_COORDINATOR)
    writer.write_address(("0.0.0.0", 0))
    writer.write_bool(False)
    writer.write_u64(b.guid)
    writer.write_u32(10_000)
    writer.write_bool(False)
    a.send(writer.data())
    (answer, listed), _ = await asyncio.gather(proxy_answer(a), proxy_answer(b))
    if answer[1] != Sub.FORWARDING_SUCCEEDED:
        return None, listed
    reader = BitReader(answer, start_bits=16 + 2 * 56 + 64)
    return (reader.read_rakstring().decode(), reader.read_u16()), listed


async def proxy(a: LabClient, b: LabClient) -> str | None:
    """The UDP proxy fallback; which forwarder carried the game, or None."""
    forwarder, listed = await request_forwarder(a, b)
    if forwarder is None:
        return None
    if not await game_data_crosses(a, forwarder, b, forwarder):
        return None
    which = "second forwarder" if forwarder[0] == SERVER_IPS[1] else "server's own"
    return f"{which}, chosen by ping from {listed}" if listed else which


#: ``Attempt.shared`` key of the matrix run's :class:`LabProxyServer` (None
#: when it could not log in: the coordinator's own forwarder only).
SHARED_PROXY = "raknet-proxy-server"


async def prepare(lab: Lab, shared: dict[str, Any]) -> None:
    """One second UDPProxyServer for the whole matrix run (module docstring)."""
    if SHARED_PROXY in shared:
        return
    second = LabProxyServer(lab)
    try:
        await second.start()
    except TimeoutError:
        await second.close()
        shared[SHARED_PROXY] = None
        return
    shared[SHARED_PROXY] = second
    shared["cleanups"].append(second.close)


async def run(attempt: Attempt) -> Outcome:
    started = time.monotonic()
    a = LabClient(attempt.lab.udp_socket(attempt.a))
    b = LabClient(attempt.lab.udp_socket(attempt.b))
    # A lone attempt (no matrix run around it) brings its own second server.
    own = None if SHARED_PROXY in attempt.shared else LabProxyServer(attempt.lab)
    try:
        try:
            starts = [a.connect(), b.connect()]
            if own is not None:
                starts.append(own.start())
            await asyncio.gather(*starts)
        except TimeoutError as exc:
            return Outcome(False, detail=str(exc))
        if await punchthrough(a, b):
            return Outcome(True, "punch", time.monotonic() - started)
        via = await proxy(a, b)
        if via is not None:
            detail = f"punch failed; proxy: {via}"
            return Outcome(True, "relay", time.monotonic() - started, detail)
        return Outcome(False, detail="punch and proxy failed")
    except TimeoutError as exc:
        return Outcome(False, detail=str(exc))
    finally:
        a.sock.close()
        b.sock.close()
        if own is not None:
            await own.close()


def expected_via(x: NatKind, y: NatKind) -> str | None:
    """Punched when the reflexive addresses the server saw can be punched
    (as the ``punch`` column); otherwise the UDP proxy."""
    if not both_udp(x, y):
        return None
    return "punch" if punch_expected(x, y) else "relay"


METHOD = register(
    Method(
        name="raknet",
        summary="RakNet NatPunchthrough via crossroads' raknet service; UDP proxy fallback",
        run=run,
        # Everything with UDP connects: punched, or through the forwarder.
        expected=both_udp,
        expected_via=expected_via,
        # connect, punch request, CONNECT_AT_TIME, punch, proxy request, ping
        # round, forwarder answer: a few lab round trips each.
        timeout=6 * STEP_S + PUNCH_S + 8,
        prepare=prepare,
        needs=("raknet",),
    )
)
