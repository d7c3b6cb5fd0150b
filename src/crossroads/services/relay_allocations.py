"""The relay's allocations model: node records, allocations and join codes in the store.

The allocations API (:mod:`crossroads.services.relay_api`) hands players sealed grants
through :class:`Allocator`; the relay nodes (:mod:`crossroads.services.relay`)
register themselves as :class:`NodeInfo` records and keep their allocations'
records alive. Both sides meet only in the store, under the keys below (the
layout is described in :mod:`crossroads.services.relay`).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import random
import time
import uuid
from collections.abc import Callable, Collection, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING, Any

from crossroads.errors import CrossroadsError, DecodeError
from crossroads.proto.relay import joincode
from crossroads.proto.relay.token import AllocationClaims, Role, TokenSealer
from crossroads.services.qos import registered_servers
from crossroads.store.base import Store
from crossroads.types import frozen, show_address

if TYPE_CHECKING:
    from crossroads.services.relay import Config

log = logging.getLogger("crossroads.relay")

#: Registrations live for this many heartbeats: one lost heartbeat is forgiven,
#: three mean the node is gone (the OpenTTD coordinator uses 10 s / 15 s alike).
HEARTBEATS_PER_TTL = 3
#: Attempts at a fresh join code before giving up (20**6 codes: a collision is
#: already rare, ten in a row means the store is broken).
JOIN_CODE_ATTEMPTS = 10


# ------------------------------------------------------------------ store records


@frozen
class NodeInfo:
    """A live relay node as registered in the store."""

    node_id: str
    region: str
    description: str
    host: str
    port: int
    capacity: int
    load: int
    #: UDP port of the node's DTLS endpoint (0: none).
    dtls_port: int = 0
    #: TCP ports of the ws and wss endpoints (0: not served), and the host
    #: name the wss certificate is for.
    ws_port: int = 0
    wss_port: int = 0
    wss_host: str = ""
    #: The node drains (SIGTERM, ``crossroads drain``): no new host is placed
    #: on it and no listing shows it; its live sessions still take joiners.
    draining: bool = False
    #: The node's QoS server (services/qos.py), what clients measure the
    #: region with; port 0: none.
    qos_host: str = ""
    qos_port: int = 0

    @property
    def full(self) -> bool:
        """No seat left (discovery does not list a full node's QoS server)."""
        return self.load >= self.capacity

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "id": self.node_id,
                "region": self.region,
                "description": self.description,
                "host": self.host,
                "port": self.port,
                "capacity": self.capacity,
                "load": self.load,
                "dtlsPort": self.dtls_port,
                "wsPort": self.ws_port,
                "wssPort": self.wss_port,
                "wssHost": self.wss_host,
                "draining": self.draining,
                "qosHost": self.qos_host,
                "qosPort": self.qos_port,
            }
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> NodeInfo:
        data = json.loads(raw)
        return cls(
            node_id=str(data["id"]),
            region=str(data["region"]),
            description=str(data.get("description", "")),
            host=str(data["host"]),
            port=int(data["port"]),
            capacity=int(data["capacity"]),
            load=int(data["load"]),
            dtls_port=int(data.get("dtlsPort", 0)),
            ws_port=int(data.get("wsPort", 0)),
            wss_port=int(data.get("wssPort", 0)),
            wss_host=str(data.get("wssHost", "")),
            draining=data.get("draining") is True,
            qos_host=str(data.get("qosHost", "")),
            qos_port=int(data.get("qosPort", 0)),
        )


#: Fields the API writes in ``relay:alloc:<uuid>``; a hash without them is a remnant.
RECORD_FIELDS = frozenset({"node", "region", "maxConnections", "connectionData"})


def node_key(node_id: str) -> str:
    return f"relay:node:{node_id}"


def pending_key(node_id: str) -> str:
    return f"relay:pending:{node_id}"


def alloc_key(allocation_id: uuid.UUID) -> str:
    return f"relay:alloc:{allocation_id}"


def code_key(code: str) -> str:
    return f"relay:joincode:{code}"


# ---------------------------------------------------------------- allocation API


@frozen
class QosResult:
    """One region's QoS measurement, as a client reports it with an
    allocation request (``qosResults``)."""

    region: str
    #: Average round trip, ms.
    latency_ms: float
    #: Share of requests unanswered, 0..1.
    packet_loss: float = 0.0


#: A region whose measurement lost this much is not considered (Unity's QoS
#: client marks a server with no answer as invalid, loss 1.0).
MAX_USABLE_LOSS = 0.99


def rank_qos_results(results: Sequence[QosResult]) -> list[QosResult]:
    """Measured regions, best first: latency inflated by loss (a region losing
    a fifth of its packets counts as a quarter slower: the retransmissions a
    game's reliable channel needs), unusable ones left out."""
    usable = [r for r in results if r.packet_loss < MAX_USABLE_LOSS]
    return sorted(
        usable, key=lambda r: (r.latency_ms / (1.0 - r.packet_loss), r.region)
    )


class AllocationError(CrossroadsError):
    """An allocations API failure, in Unity's error vocabulary.

    ``code`` is the Relay error code (reference §1.3: 15001 InvalidRequest,
    15007 RegionNotFound, 15008 AllocationNotFound, 15009 JoinCodeNotFound,
    15010 NoSuitableRelay; 154xx mirror HTTP statuses).
    """

    def __init__(self, status: int, code: int, title: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.code = code
        self.title = title
        self.detail = detail


@frozen
class Grant:
    """An allocation handed to a player."""

    allocation_id: uuid.UUID
    key: bytes = field(repr=False)
    connection_data: bytes
    node: NodeInfo
    host_connection_data: bytes | None = None


@dataclass(eq=False)
class Allocator:
    """Chooses relay nodes and creates allocations and join codes in the store."""

    store: Store
    sealer: TokenSealer = field(repr=False)
    cfg: Config = field(repr=False)
    _: KW_ONLY
    clock: Callable[[], float] = time.time
    random_bytes: Callable[[int], bytes] = os.urandom

    def record_ttl(self) -> float:
        """How long an allocation's records live unless the node refreshes them."""
        return self.cfg.bind_timeout + self.cfg.heartbeat * HEARTBEATS_PER_TTL

    async def live_nodes(self) -> list[NodeInfo]:
        """Registered nodes that take new hosts (a draining one does not)."""
        nodes = []
        for key in await self.store.keys("relay:node:"):
            raw = await self.store.get(key)
            if raw is None:
                continue
            try:
                node = NodeInfo.from_json(raw)
            except (ValueError, KeyError, TypeError):
                log.warning("ignoring malformed relay node record %s", key)
                continue
            if not node.draining:
                nodes.append(node)
        return nodes

    async def regions(self) -> list[tuple[str, str]]:
        """(id, description) of every region with a live node."""
        found: dict[str, str] = {}
        for node in await self.live_nodes():
            if node.description or node.region not in found:
                found[node.region] = node.description or node.region
        return sorted(found.items())

    async def _pending_seats(self, node_id: str, now: float) -> int:
        seats = 0
        stale = []
        for field_name, raw in (await self.store.hgetall(pending_key(node_id))).items():
            try:
                weight_text, deadline_text = raw.decode().split(":")
                weight, deadline = int(weight_text), float(deadline_text)
            except ValueError:
                stale.append(field_name)
                continue
            if deadline < now:
                stale.append(field_name)
            else:
                seats += weight
        if stale:
            await self.store.hdel(pending_key(node_id), *stale)
        return seats

    async def _choose_measured(
        self, region: str | None, seats: int, qos_results: Sequence[QosResult]
    ) -> NodeInfo:
        """The node for a request: in ``region`` when it names one; else in
        the best measured region that has room (Unity: "Relay considers both
        latency and packet loss", docs/qos.md); else as :meth:`choose_node`."""
        if region is None and not self.cfg.default_region:
            for result in rank_qos_results(qos_results):
                try:
                    return await self.choose_node(result.region, seats)
                except AllocationError:
                    continue  # no live node there, or none with room: next best
        return await self.choose_node(region, seats)

    async def choose_node(self, region: str | None, seats: int) -> NodeInfo:
        nodes = await self.live_nodes()
        wanted = region or self.cfg.default_region or None
        if wanted is not None:
            nodes = [n for n in nodes if n.region == wanted]
            if not nodes:
                raise AllocationError(
                    400, 15007, "RegionNotFound", f"region {wanted!r} has no live relay"
                )
        now = self.clock()
        best: tuple[float, float, NodeInfo] | None = None
        for node in nodes:
            used = node.load + await self._pending_seats(node.node_id, now)
            if used + seats > node.capacity:
                continue
            # Least loaded by share of capacity; ties broken at random so that
            # equal nodes share a burst.
            candidate = (used / node.capacity, random.random(), node)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        if best is None:
            raise AllocationError(
                503, 15010, "NoSuitableRelay", "no relay node has room; retry later"
            )
        return best[2]

    def _grant(
        self,
        node: NodeInfo,
        role: Role,
        max_connections: int,
        host_id: bytes | None,
        now: float,
    ) -> Grant:
        allocation_id = uuid.UUID(bytes=self.random_bytes(16), version=4)
        claims = AllocationClaims(
            allocation_id=allocation_id.bytes,
            host_allocation_id=host_id or allocation_id.bytes,
            role=role,
            max_connections=max_connections,
            bind_deadline=now + self.cfg.bind_timeout,
        )
        return Grant(
            allocation_id=allocation_id,
            key=self.sealer.key_for(allocation_id.bytes),
            connection_data=self.sealer.seal(claims, node.node_id),
            node=node,
        )

    async def qos_servers(
        self, regions: Collection[str] | None = None
    ) -> list[tuple[str, str]]:
        """(region, ``host:port``) of every QoS server a client should measure:
        each live relay node's that has room (a full node is not listed: an
        allocation would not land there), and each QoS server registered on
        its own (services/qos.py) in a region that has such a node. Sorted by
        region, without duplicates."""
        open_regions: set[str] = set()
        found: set[tuple[str, str]] = set()
        for node in await self.live_nodes():
            if node.full or (regions and node.region not in regions):
                continue
            open_regions.add(node.region)
            if node.qos_port:
                found.add((node.region, show_address((node.qos_host, node.qos_port))))
        for server in await registered_servers(self.store):
            if server.region in open_regions:
                found.add((server.region, server.endpoint))
        return sorted(found)

    async def allocate(
        self,
        max_connections: int,
        region: str | None,
        qos_results: Sequence[QosResult] = (),
    ) -> Grant:
        if not 1 <= max_connections <= self.cfg.max_connections:
            raise AllocationError(
                400,
                15001,
                "InvalidRequest",
                f"maxConnections must be between 1 and {self.cfg.max_connections}",
            )
        seats = 1 + max_connections
        node = await self._choose_measured(region, seats, qos_results)
        now = self.clock()
        grant = self._grant(node, Role.HOST, max_connections, None, now)
        ttl = self.record_ttl()
        pkey = pending_key(node.node_id)
        await self.store.hset(
            pkey,
            {
                grant.allocation_id.hex: f"{seats}:{now + self.cfg.bind_timeout}".encode()
            },
        )
        await self.store.expire(pkey, ttl)
        await self.store.hset(
            alloc_key(grant.allocation_id),
            {
                "node": node.node_id.encode(),
                "region": node.region.encode(),
                "maxConnections": str(max_connections).encode(),
                "connectionData": grant.connection_data,
                "connections": b"0",
            },
        )
        await self.store.expire(alloc_key(grant.allocation_id), ttl)
        return grant

    async def join_code(self, allocation_id: uuid.UUID) -> str:
        record = await self.store.hgetall(alloc_key(allocation_id))
        if not RECORD_FIELDS <= set(record):
            raise AllocationError(
                404,
                15008,
                "AllocationNotFound",
                "no such host allocation (it may have timed out; keep it alive with PING)",
            )
        ttl = await self.store.ttl(alloc_key(allocation_id)) or self.record_ttl()
        existing = record.get("joinCode")
        if existing:
            code = existing.decode()
            await self.store.set(code_key(code), str(allocation_id).encode(), ttl=ttl)
            return code
        for _ in range(JOIN_CODE_ATTEMPTS):
            code = joincode.generate(self.cfg.join_code_length, self.random_bytes)
            claimed = await self.store.set(
                code_key(code),
                str(allocation_id).encode(),
                ttl=ttl,
                only_if_absent=True,
            )
            if claimed:
                await self.store.hset(
                    alloc_key(allocation_id), {"joinCode": code.encode()}
                )
                return code
        raise AllocationError(
            503, 15503, "ServiceUnavailable", "could not find a free join code"
        )

    async def join(self, code_text: str) -> Grant:
        try:
            code = joincode.normalize(code_text)
        except DecodeError as exc:
            raise AllocationError(
                400, 15001, "InvalidRequest", f"joinCode: {exc}"
            ) from None
        not_found = AllocationError(
            404, 15009, "JoinCodeNotFound", f"join code {code} is unknown or expired"
        )
        raw_id = await self.store.get(code_key(code))
        if raw_id is None:
            raise not_found
        host_id = uuid.UUID(raw_id.decode())
        record = await self.store.hgetall(alloc_key(host_id))
        if not RECORD_FIELDS <= set(record):
            raise not_found  # gone, or a remnant without the API's fields
        raw_node = await self.store.get(node_key(record["node"].decode()))
        if raw_node is None:
            raise not_found
        try:
            node = NodeInfo.from_json(raw_node)
            max_connections = int(record["maxConnections"])
            connections = int(record.get("connections", b"0"))
        except (ValueError, KeyError, TypeError):
            raise not_found from None
        if connections >= max_connections:
            raise AllocationError(
                409,
                15409,
                "SessionFull",
                f"the session already has its {max_connections} connections",
            )
        grant = self._grant(
            node, Role.JOINER, max_connections, host_id.bytes, self.clock()
        )
        return Grant(
            allocation_id=grant.allocation_id,
            key=grant.key,
            connection_data=grant.connection_data,
            node=node,
            host_connection_data=record["connectionData"],
        )


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _endpoint(
    connection_type: str, network: str, secure: bool, host: str, port: int
) -> dict[str, Any]:
    return {
        "connectionType": connection_type,
        "network": network,
        "reliable": network == "tcp",
        "secure": secure,
        "host": host,
        "port": port,
    }


def server_endpoints(node: NodeInfo) -> list[dict[str, Any]]:
    """Unity's ``serverEndpoints`` of ``node``: one per transport it serves.

    ``RelayServerData(allocation, type)`` takes the endpoint whose
    ``connectionType`` is exactly ``type``, and reads ``secure`` to add TLS;
    ``network`` must be "udp" or "tcp", the enum the SDK decodes
    (unity-secure-transports.md §3)."""
    endpoints = [_endpoint("udp", "udp", False, node.host, node.port)]
    if node.dtls_port:
        endpoints.append(_endpoint("dtls", "udp", True, node.host, node.dtls_port))
    if node.ws_port:
        endpoints.append(_endpoint("ws", "tcp", False, node.host, node.ws_port))
    if node.wss_port:
        host = node.wss_host or node.host
        endpoints.append(_endpoint("wss", "tcp", True, host, node.wss_port))
    return endpoints


def encode_grant(grant: Grant) -> dict[str, Any]:
    """A grant as Unity's Allocation / JoinAllocation JSON object."""
    node = grant.node
    body: dict[str, Any] = {
        "allocationId": str(grant.allocation_id),
        "allocationIdBytes": b64(grant.allocation_id.bytes),
        "key": b64(grant.key),
        "connectionData": b64(grant.connection_data),
        "serverEndpoints": server_endpoints(node),
        "relayServer": {"ipV4": node.host, "port": node.port},
        "region": node.region,
    }
    if grant.host_connection_data is not None:
        body["hostConnectionData"] = b64(grant.host_connection_data)
    return body
