"""``raknet``: a drop-in server for stock RakNet 4 games (reference raknet-wire.md).

One UDP socket (61111 by default, what RakNet's samples dial for
``natpunch.jenkinssoftware.com``) runs :class:`~crossroads.proto.raknet.node.RakNetNode`:
RakNet's connection handshake and reliability layer, and NatPunchthroughServer.
A second socket (``--raknet-second-port``, optionally on ``--raknet-second-host``)
answers the port-stride NAT_PING that a RakNet client sends on its first
``OpenNAT`` (without it every client's first punch waits 5 s).

The driver is :class:`~crossroads.transport.udp.CoreDatagramProtocol`; this
module adds the second socket, the config section and the metrics.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from crossroads.config import setting
from crossroads.proto.raknet.node import RakNetNode
from crossroads.proto.raknet.peer import ServerConfig
from crossroads.services.base import ServiceContext
from crossroads.transport.udp import (
    CoreDatagramProtocol,
    bound_address,
    make_udp_socket,
)
from crossroads.types import Address, normalize_address

NAME = "raknet"


@dataclass(frozen=True, slots=True)
class Config:
    """``[raknet]``: RakNet 4 NAT punchthrough server (flags ``--raknet-*``)."""

    enabled: bool = setting(True, kind="bool", help="Run the RakNet server.")
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
        4096, kind="int", help="RakNet connections at most (handshakes included)."
    )
    max_connections_per_ip: int = setting(
        16, kind="int", help="RakNet connections one IP may hold."
    )
    handshakes_per_second: float = setting(
        1000.0,
        kind="float",
        help="Connection requests answered per second, all sources together.",
    )
    split_memory: int = setting(
        64 * 1024 * 1024,
        kind="int",
        help="Bytes of split messages held for reassembly, all connections together.",
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
        dropped = CounterMetricFamily(
            "crossroads_raknet_dropped",
            "RakNet datagrams or connections dropped, by reason.",
            labels=["reason"],
        )
        for reason, count in sorted(peer.stats.dropped.items()):
            dropped.add_metric([reason], count)
        for reason, count in sorted(node.punch.stats.dropped.items()):
            dropped.add_metric([f"punch-{reason}"], count)
        dropped.add_metric(["second-socket"], node.second_dropped)
        yield dropped
        unhandled = CounterMetricFamily(
            "crossroads_raknet_unhandled_messages",
            "Messages for plugins this server does not run, by message id.",
            labels=["id"],
        )
        for kind, count in sorted(node.unhandled.items()):
            unhandled.add_metric([str(kind)], count)
        yield unhandled
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
        self.driver: CoreDatagramProtocol | None = None
        self.addresses: list[Address] = []
        self._transports: list[asyncio.BaseTransport] = []
        self._collector: _Collector | None = None
        self._registry: Any = None

    def describe(self) -> list[str]:
        if not self.addresses:
            return ["disabled"]
        roles = ["RakNet", "RakNet port-stride"]
        return [
            f"udp {h}:{p} ({r})"
            for (h, p), r in zip(self.addresses, roles, strict=False)
        ]

    async def close(self) -> None:
        for transport in self._transports:
            transport.close()
        self._transports.clear()
        self.driver = None
        if self._collector is not None and self._registry is not None:
            try:
                self._registry.unregister(self._collector)
            except KeyError:  # pragma: no cover - already unregistered
                pass
            self._collector = None


def _advertised(host: str, bound: Address) -> Address:
    return (host, bound[1]) if host else bound


async def serve(ctx: ServiceContext) -> RakNetService:
    cfg = ctx.section(NAME, Config)
    if not cfg.enabled:
        return RakNetService(RakNetNode())
    host = cfg.host or ctx.host
    second_host = cfg.second_host or host
    sockets: list[socket.socket] = []
    try:
        sockets.append(make_udp_socket(host, cfg.port))
        sockets.append(make_udp_socket(second_host, cfg.second_port))
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    bound = [bound_address(s) for s in sockets]
    public = cfg.advertise_host or ctx.config.core.public_host
    advertised = [
        _advertised(public if public else "", bound[0]),
        _advertised(public if public and not cfg.second_host else "", bound[1]),
    ]
    node = RakNetNode(
        ServerConfig(
            max_connections=cfg.max_connections,
            max_connections_per_ip=cfg.max_connections_per_ip,
            handshakes_per_second=cfg.handshakes_per_second,
            split_budget=cfg.split_memory,
            local_addresses=(advertised[0],),
        ),
        bound_addresses=advertised,
    )
    service = RakNetService(node)
    service.addresses = bound
    loop = asyncio.get_running_loop()
    try:
        transport, driver = await loop.create_datagram_endpoint(
            lambda: CoreDatagramProtocol(node), sock=sockets[0]
        )
        service._transports.append(transport)
        service.driver = driver
        second, _ = await loop.create_datagram_endpoint(
            lambda: _SecondSocket(service), sock=sockets[1]
        )
        service._transports.append(second)
    except BaseException:
        await service.close()
        for sock in sockets:
            sock.close()
        raise
    service._registry = ctx.metrics
    service._collector = _Collector(service)
    ctx.metrics.register(service._collector)
    return service
