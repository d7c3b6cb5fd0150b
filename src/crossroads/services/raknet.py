"""``raknet``: a drop-in server for stock RakNet 4 games (reference raknet-wire.md).

One UDP socket (61111 by default, what RakNet's samples dial for
``natpunch.jenkinssoftware.com``) runs :class:`~crossroads.proto.raknet.node.RakNetNode`:
RakNet's connection handshake and reliability layer, and NatPunchthroughServer.
A second socket (``--raknet-second-port``, optionally on ``--raknet-second-host``)
answers the port-stride NAT_PING that a RakNet client sends on its first
``OpenNAT`` (without it every client's first punch waits 5 s).

The driver is :class:`~crossroads.transport.driver.DatagramDriver`; this
module adds the second socket, the config section and the metrics. On a
wildcard bind the main socket answers from the address each client sent to
(:mod:`crossroads.transport.pktinfo`). Handshake records and connections are
two tables of the process's resource budget (``raknet-handshakes``,
``raknet-connections``: per-item costs, caps, pre-auth deadlines, and the
bytes connections hold for their peers), and answers to addresses that are
not connected are charged to the service's reflection budget. With
``--raknet-proxy-relay-nodes`` the UDP proxy also uses the forwarders of the
other instances sharing the Store (:mod:`crossroads.services.raknet_nodes`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from crossroads.config import setting
from crossroads.insight import InsightRecorder
from crossroads.metrics import add_counts, counter_by, unregister
from crossroads.proto.insight import Attempt, Step, Usage
from crossroads.proto.raknet.nattype import Socket
from crossroads.proto.raknet.node import RakNetNode
from crossroads.proto.raknet.peer import (
    CONNECT_DEADLINE_MS,
    CONNECTION_BYTES,
    HANDSHAKE_BYTES,
    HANDSHAKE_DEADLINE_MS,
    ServerConfig,
)
from crossroads.proto.raknet.punchthrough import PunchConcluded
from crossroads.services.base import ServiceContext
from crossroads.services.raknet_nodes import RelayNodes
from crossroads.transport.admission import Pool, ResourceBudget
from crossroads.transport.driver import DatagramDriver
from crossroads.transport.pktinfo import open_datagram_endpoint
from crossroads.transport.raknet_forwarder import (
    TABLE as FORWARDER_TABLE,
)
from crossroads.transport.raknet_forwarder import (
    ForwarderPool,
    ForwarderUsage,
    forwarder_table,
)
from crossroads.transport.sockets import bound_address, make_udp_socket
from crossroads.types import Address, frozen, normalize_address, show_address

NAME = "raknet"
#: A proxy asked for by a pair this soon (seconds) after its punch was
#: coordinated means the punch did not connect: RakNet's samples fall back
#: to UDPProxyClient on ID_NAT_PUNCHTHROUGH_FAILED, which a client raises
#: after its punch attempts run out (NatPunchthroughClient: a few seconds).
PUNCH_THEN_PROXY = 60.0
#: Coordinated pairs remembered for that (bounded: the oldest go first).
MAX_PUNCHED = 4096


def _ms(value: int | None) -> float | None:
    return None if value is None else float(value)


def _check_detection_hosts(value: tuple[str, ...]) -> None:
    if len(value) not in (0, 1, 3):
        raise ValueError("give one IP (all three sockets on it) or three")
    for host in value:
        ipaddress.IPv4Address(host)


@frozen
class Config:
    """``[raknet]``: RakNet 4 NAT punchthrough server (flags ``--raknet-*``)."""

    enabled: bool = setting(True, help="Run the RakNet server.")
    host: str = setting("", kind="host", help="Bind address ('' = the core --host).")
    port: int = setting(
        61111, kind="port", help="UDP port (RakNet's samples dial 61111)."
    )
    second_host: str = setting(
        "",
        kind="host",
        help="Second socket's address, for the port-stride check ('' = host).",
    )
    second_port: int = setting(
        61112, kind="port", help="Second socket's UDP port (0 = any free port)."
    )
    advertise_host: str = setting(
        "",
        kind="host",
        help="Address clients reach the sockets at, sent in the bound-address "
        "list ('' = --public-host, else the bind address).",
    )
    max_connections: int = setting(
        4096,
        help="RakNet connections at most (also capped by the memory budget); as "
        "many handshake records (REQUEST_2 answered, CONNECTION_REQUEST awaited).",
    )
    max_connections_per_ip: int = setting(
        16,
        help="RakNet connections (and handshake records) one IP or IPv6 /64 may "
        "hold; never more than an eighth of the table.",
    )
    handshakes_per_second: float = setting(
        1000.0,
        help="Connection requests answered per second, all sources together.",
    )
    handshakes_per_second_per_ip: float = setting(
        0.0,
        help="Connection requests answered per second from one IP or IPv6 /64, "
        "checked before the global rate (0 = an eighth of "
        "--raknet-handshakes-per-second).",
    )
    detection_hosts: tuple[str, ...] = setting(
        (),
        check=_check_detection_hosts,
        help="NAT type detection: IPs for its sockets s2p3, s3p4, s4p5 (one IP: "
        "all three on it, the layout the stock server really uses; three: one "
        "each). Empty: no NAT type detection.",
    )
    proxy: bool = setting(
        True,
        help="Run UDPProxyCoordinator with a built-in UDPProxyServer (forwarding "
        "ports on the bind address).",
    )
    proxy_max_forwarders: int = setting(
        1000,
        help="Forwarding ports open at once (one per pair); never more than the "
        "forwarders' share of the descriptor limit (docs/security.md).",
    )
    # 64: a whole stock UDPProxyServer's forwarder (DEFAULT_MAX_FORWARD_ENTRIES,
    # UDPForwarder.cpp) for the players behind one address; the budget lowers
    # it to an eighth of the cap in force (56 at ulimit -n 1024).
    proxy_max_forwarders_per_ip: int = setting(
        64,
        help="Forwarding ports the clients of one IP (IPv6: /64) may have asked "
        "for at once; never more than an eighth of the global cap in force.",
    )
    proxy_password: str = setting(
        "",
        help="Password external RakNet UDPProxyServers log in with ('' = none accepted).",
    )
    proxy_relay_nodes: bool = setting(
        False,
        help="UDP proxy: also use the forwarders of the other crossroads "
        "instances sharing the Store, and offer this one's to them (a relay "
        "node; needs a reachable --raknet-advertise-host / --public-host).",
    )


class _Collector(Collector):
    def __init__(self, service: RakNetService) -> None:
        self.service = service

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        node = self.service.node
        peer = node.peer
        yield GaugeMetricFamily(
            "crossroads_raknet_connections",
            "RakNet connections held (handshakes included).",
            value=len(peer.connections),
        )
        yield CounterMetricFamily(
            "crossroads_raknet_handshakes",
            "RakNet connections opened (OPEN_CONNECTION_REQUEST_2 accepted).",
            value=peer.stats.handshakes,
        )
        dropped = counter_by(
            "crossroads_raknet_dropped",
            "RakNet datagrams or connections dropped, by reason.",
            "reason",
            peer.stats.dropped,
        )
        add_counts(dropped, node.punch.stats.dropped, "punch-")
        add_counts(dropped, node.proxy.stats.dropped, "proxy-")
        dropped.add_metric(["second-socket"], node.second_dropped)
        if self.service.forwarders is not None:
            # Over RakNet's 1500-byte MTU: dropped whole by the data plane.
            dropped.add_metric(
                ["forwarder-oversized"], self.service.forwarders.oversized()
            )
        relay_nodes = self.service.relay_nodes
        if relay_nodes is not None:
            add_counts(dropped, relay_nodes.dropped, "relay-node-")
        yield dropped
        yield counter_by(
            "crossroads_raknet_unhandled_messages",
            "Messages for plugins this server does not run, by message id.",
            "id",
            {str(kind): count for kind, count in node.unhandled.items()},
        )
        punch = node.punch.stats
        outcomes = CounterMetricFamily(
            "crossroads_raknet_punchthrough_outcomes",
            "NAT punchthrough requests and their outcomes.",
            labels=["outcome"],
        )
        outcomes.add_metric(["requested"], punch.requests)
        outcomes.add_metric(["connect-at-time"], punch.connect_at_time)
        outcomes.add_metric(["unresponsive"], punch.unresponsive)
        outcomes.add_metric(["connection-lost"], punch.lost)
        yield outcomes
        proxy = node.proxy.stats
        forwarding = CounterMetricFamily(
            "crossroads_raknet_proxy_requests",
            "UDP proxy forwarding requests, by answer.",
            labels=["answer"],
        )
        forwarding.add_metric(["succeeded"], proxy.succeeded)
        add_counts(forwarding, proxy.results)
        yield forwarding
        pool = self.service.forwarders
        if pool is not None:
            yield GaugeMetricFamily(
                "crossroads_raknet_proxy_forwarders",
                "UDP proxy forwarding ports open.",
                value=len(pool.entries),
            )
            yield CounterMetricFamily(
                "crossroads_raknet_proxy_packets",
                "Datagrams forwarded by the built-in UDP proxy.",
                value=pool.packets(),
            )
        if relay_nodes is not None:
            yield GaugeMetricFamily(
                "crossroads_raknet_proxy_relay_nodes",
                "crossroads relay nodes the UDP proxy can use (this one included).",
                value=len(relay_nodes.nodes),
            )
        if node.detection is not None:
            yield counter_by(
                "crossroads_raknet_nat_type_results",
                "NAT type detection results sent, by NATTypeDetectionResult.",
                "result",
                node.detection.stats.results,
            )


class _Driver(DatagramDriver):
    """The project's driver, plus the datagrams of the detection sockets."""

    def __init__(self, service: RakNetService) -> None:
        super().__init__(service.node)
        self.service = service

    def transmit(self, now: float | None = None) -> None:
        super().transmit(now)
        for concluded in self.service.node.punch.pop_concluded():
            self.service.punch_concluded(concluded)
        relay_nodes = self.service.relay_nodes
        if relay_nodes is not None:
            relay_nodes.carry(self.service.node.proxy.pop_remote_requests())
        for data, addr, role in self.service.node.side_datagrams():
            transport = self.service.side.get(role)
            if transport is not None:
                transport.sendto(data, addr)


class _SideSocket(asyncio.DatagramProtocol):
    """A NAT type detection socket; only s3p4 reads what arrives."""

    def __init__(self, service: RakNetService, role: Socket) -> None:
        self.service = service
        self.role = role

    def datagram_received(self, data: bytes, addr: tuple[Any, ...]) -> None:
        driver = self.service.driver
        if self.role is not Socket.S3P4 or driver is None:
            return
        now = asyncio.get_running_loop().time()
        self.service.node.receive_s3p4(data, normalize_address(addr), now)
        driver.transmit(now)

    def error_received(self, exc: Exception) -> None:
        pass


class _SecondSocket(asyncio.DatagramProtocol):
    def __init__(self, service: RakNetService) -> None:
        self.service = service

    def datagram_received(self, data: bytes, addr: tuple[Any, ...]) -> None:
        driver = self.service.driver
        if driver is None or not data:
            return
        now = asyncio.get_running_loop().time()
        self.service.node.receive_second(data, normalize_address(addr), now)
        driver.transmit(now)

    def error_received(self, exc: Exception) -> None:
        pass


class RakNetService:
    name = NAME

    def __init__(self, node: RakNetNode) -> None:
        self.node = node
        self.driver: DatagramDriver | None = None
        self.addresses: list[Address] = []
        #: NAT type detection's sockets (transports), by role.
        self.side: dict[Socket, asyncio.DatagramTransport] = {}
        self.side_addresses: dict[Socket, Address] = {}
        self._transports: list[asyncio.BaseTransport] = []
        self.forwarders: ForwarderPool | None = None
        #: The relay-node cluster (``--raknet-proxy-relay-nodes``), else None.
        self.relay_nodes: RelayNodes | None = None
        self._collector: _Collector | None = None
        self._registry: Any = None
        #: The process budget the connection tables are registered with.
        self.resources: ResourceBudget | None = None
        #: Where punch and proxy records go (crossroads.insight).
        self.insight = InsightRecorder()
        #: Pairs of IPs whose punch was coordinated, and when (loop time): a
        #: proxy the same pair asks for soon after says the punch failed.
        self._punched: OrderedDict[frozenset[str], float] = OrderedDict()

    # Connection insight ---------------------------------------------------

    def punch_concluded(self, c: PunchConcluded) -> None:
        """One NAT punchthrough attempt as the server saw it. Whether the
        punch itself worked the server cannot see (the clients tell only
        their games): a coordinated punch is recorded with the winner
        "punch" and outcome "direct", and a proxy the same pair asks for
        within :data:`PUNCH_THEN_PROXY` seconds names it as failed."""
        insight = self.insight
        now = asyncio.get_running_loop().time()
        duration = max(0.0, c.ended - c.requested)
        started = c.started if c.started is not None else c.ended
        waited = max(0.0, started - c.requested)
        steps = []
        if waited > 0:
            steps.append(Step("queued", 0.0, waited, "ok"))
        coordinated = c.outcome == "coordinated"
        steps.append(
            Step("ports", waited, duration - waited, "ok" if coordinated else c.outcome)
        )
        if coordinated:
            steps.append(Step("punch", duration, 0.0, "coordinated"))
            if c.recipient is not None:
                self._punched[frozenset((c.sender[0], c.recipient[0]))] = c.ended
                self._punched.move_to_end(frozenset((c.sender[0], c.recipient[0])))
                while len(self._punched) > MAX_PUNCHED:
                    self._punched.popitem(last=False)
        sides = [insight.side(c.sender[0], rtt_ms=_ms(c.rtt_ms[0]))]
        if c.recipient is not None:
            sides.append(insight.side(c.recipient[0], rtt_ms=_ms(c.rtt_ms[1])))
        insight.record(
            Attempt(
                family="raknet",
                session=f"punch-{c.session_id}",
                started=insight.now() - (now - c.requested),
                duration=duration,
                sides=tuple(sides),
                steps=tuple(steps),
                winner="punch" if coordinated else "",
                outcome="direct" if coordinated else "failed",
                cause="" if coordinated else c.outcome,
            )
        )

    def _ping_ms(self, address: Address) -> float | None:
        """RakNet's ping of a client still connected to the server, in ms."""
        conn = self.node.peer.connection(address)
        return None if conn is None else _ms(conn.rtt_ms)

    def proxy_released(self, u: ForwarderUsage) -> None:
        """One UDP proxy forwarder, with what it carried each way."""
        insight = self.insight
        now = asyncio.get_running_loop().time()
        pair = frozenset((u.side1[0], u.side2[0]))
        punched = self._punched.pop(pair, None)
        if punched is not None and u.opened - punched <= PUNCH_THEN_PROXY:
            cause = "punch did not connect: the pair asked for the proxy"
        else:
            cause = "proxy asked for"
        lived = max(0.0, u.released - u.opened)
        insight.record(
            Attempt(
                family="raknet",
                session=f"proxy-{u.port}",
                started=insight.now() - (now - u.opened),
                duration=lived,
                sides=(
                    insight.side(u.side1[0], rtt_ms=self._ping_ms(u.side1)),
                    insight.side(u.side2[0], rtt_ms=self._ping_ms(u.side2)),
                ),
                steps=(Step("proxy", 0.0, lived, u.reason),),
                winner="proxy",
                outcome="relayed",
                cause=cause,
                usage=Usage(u.packets_up, u.bytes_up, u.packets_down, u.bytes_down),
            )
        )

    def describe(self) -> list[str]:
        if not self.addresses:
            return ["disabled"]
        roles = ["RakNet", "RakNet port-stride"]
        return [
            f"udp {show_address(address)} ({role})"
            for address, role in zip(self.addresses, roles, strict=False)
        ]

    async def drain(self) -> None:
        """Leave the relay-node listing; the forwarders (relayed game
        traffic) go on until they end. The punchthrough, type detection and
        master server keep answering: their exchanges last seconds, and
        /readyz (503) takes the instance out of the load balancer."""
        if self.relay_nodes is not None:
            await self.relay_nodes.withdraw()

    def live_sessions(self) -> int:
        """Open UDP proxy forwarders (RakNet connections through this node)."""
        return 0 if self.forwarders is None else len(self.forwarders.entries)

    async def close(self) -> None:
        if self.relay_nodes is not None:
            await self.relay_nodes.close()
            self.relay_nodes = None
        for transport in self._transports:
            transport.close()
        self._transports.clear()
        self.side.clear()
        if self.forwarders is not None:
            await self.forwarders.close()
            self.forwarders.admission.budget.forget(FORWARDER_TABLE)
            self.forwarders = None
        self.driver = None
        if self._collector is not None and self._registry is not None:
            unregister(self._registry, self._collector)
            self._collector = None
        if self.resources is not None:
            self.resources.forget(HANDSHAKE_TABLE)
            self.resources.forget(CONNECTION_TABLE)
            self.resources = None


#: The resource-budget tables of the service (see the module docstring).
HANDSHAKE_TABLE = "raknet-handshakes"
CONNECTION_TABLE = "raknet-connections"
#: Handshake records are small and short-lived: a quarter of a connection
#: table's weight in the memory budget is ample.
HANDSHAKE_WEIGHT = 0.25


def _advertised(host: str, bound: Address) -> Address:
    return (host, bound[1]) if host else bound


async def serve(ctx: ServiceContext) -> RakNetService:
    cfg = ctx.section(NAME, Config)
    if not cfg.enabled:
        return RakNetService(RakNetNode())
    host = cfg.host or ctx.host
    second_host = cfg.second_host or host
    sockets: list[socket.socket] = []
    side_hosts: dict[Socket, str] = {}
    if cfg.detection_hosts:
        ips = (
            cfg.detection_hosts * 3
            if len(cfg.detection_hosts) == 1
            else cfg.detection_hosts
        )
        side_hosts = {
            Socket.S1P2: host,
            Socket.S2P3: ips[0],
            Socket.S3P4: ips[1],
            Socket.S4P5: ips[2],
        }
    side_sockets: dict[Socket, socket.socket] = {}
    try:
        sockets.append(make_udp_socket(host, cfg.port))
        sockets.append(make_udp_socket(second_host, cfg.second_port))
        for role, side_host in side_hosts.items():
            side_sockets[role] = make_udp_socket(side_host, 0)
    except BaseException:
        for sock in [*sockets, *side_sockets.values()]:
            sock.close()
        raise
    bound = [bound_address(s) for s in sockets]
    side_bound = {role: bound_address(s) for role, s in side_sockets.items()}
    public = cfg.advertise_host or ctx.config.core.public_host
    advertised = [
        _advertised(public if public else "", bound[0]),
        _advertised(public if public and not cfg.second_host else "", bound[1]),
    ]
    forwarders = (
        ForwarderPool(
            host,
            # One UDP socket per forwarder: admitted by the one budget, so
            # the cap in force is the smaller of the configured one and the
            # table's share of the descriptors (transport/admission.py).
            forwarder_table(
                ctx.resources,
                cfg.proxy_max_forwarders,
                cfg.proxy_max_forwarders_per_ip,
            ),
            # Each forwarder's socket is closed counting its kernel drops.
            ctx.kernel_drops,
            # Confirmed sides forwarded by the eBPF program (--dataplane kernel).
            ctx.route_table,
        )
        if cfg.proxy
        else None
    )
    resources = ctx.resources
    handshakes = resources.table(
        HANDSHAKE_TABLE,
        max_items=cfg.max_connections,
        max_per_source=cfg.max_connections_per_ip,
        pool=Pool.NONE,
        bytes_per_item=HANDSHAKE_BYTES,
        weight=HANDSHAKE_WEIGHT,
        preauth_deadline=HANDSHAKE_DEADLINE_MS / 1000,
    )
    connections = resources.table(
        CONNECTION_TABLE,
        max_items=cfg.max_connections,
        max_per_source=cfg.max_connections_per_ip,
        pool=Pool.NONE,
        bytes_per_item=CONNECTION_BYTES,
        preauth_deadline=CONNECT_DEADLINE_MS / 1000,
    )
    node = RakNetNode(
        ServerConfig(
            max_connections=cfg.max_connections,
            max_connections_per_ip=cfg.max_connections_per_ip,
            handshakes_per_second=cfg.handshakes_per_second,
            handshakes_per_second_per_ip=cfg.handshakes_per_second_per_ip,
            local_addresses=(advertised[0],),
        ),
        bound_addresses=advertised,
        s3p4=side_bound.get(Socket.S3P4),
        forwarders=forwarders,
        proxy_public_ip=public,
        proxy_password=cfg.proxy_password,
        handshakes=handshakes,
        connections=connections,
        reflection=ctx.reflection_budget(),
    )
    service = RakNetService(node)
    service.insight = ctx.insight
    if forwarders is not None:
        forwarders.on_release = service.proxy_released
    service.resources = resources
    service.forwarders = forwarders
    service.addresses = bound
    service.side_addresses = side_bound
    resources.listen(NAME, "raknet", "udp", bound[0], CONNECTION_TABLE)
    # The port-stride and NAT-type sockets answer or probe for connected
    # clients only (an unconnected NAT_PING gets a reflection-budgeted echo):
    # whatever state they lead to is a connection's.
    resources.listen(NAME, "raknet-port-stride", "udp", bound[1], CONNECTION_TABLE)
    for role, side_address in side_bound.items():
        resources.listen(
            NAME,
            f"raknet-nat-type-{role.name.lower()}",
            "udp",
            side_address,
            CONNECTION_TABLE,
        )
    loop = asyncio.get_running_loop()
    try:
        driver = _Driver(service)
        # On a wildcard bind, answers leave from the address each client
        # sent to (a stock client only accepts them from there).
        service._transports.append(await open_datagram_endpoint(driver, sockets[0]))
        service.driver = driver
        second, _ = await loop.create_datagram_endpoint(
            lambda: _SecondSocket(service), sock=sockets[1]
        )
        service._transports.append(second)
        for role, sock in side_sockets.items():
            side, _ = await loop.create_datagram_endpoint(
                lambda role=role: _SideSocket(service, role),  # type: ignore[misc]
                sock=sock,
            )
            service._transports.append(side)
            service.side[role] = side
    except BaseException:
        await service.close()
        for sock in [*sockets, *side_sockets.values()]:
            sock.close()
        raise
    if cfg.proxy_relay_nodes:
        own = advertised[0] if forwarders is not None else None
        if own is not None and ipaddress.ip_address(own[0]).is_unspecified:
            ctx.log.warning(
                "raknet: --raknet-proxy-relay-nodes needs --raknet-advertise-host "
                "or --public-host to offer this forwarder to other instances"
            )
            own = None
        relay_nodes = RelayNodes(
            ctx.store, node.proxy, forwarders, own, public, driver.transmit
        )
        service.relay_nodes = relay_nodes
        try:
            await relay_nodes.start()
        except BaseException:
            await service.close()
            raise
    service._registry = ctx.metrics
    service._collector = _Collector(service)
    ctx.metrics.register(service._collector)
    return service
