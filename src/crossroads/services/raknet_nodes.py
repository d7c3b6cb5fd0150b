"""crossroads relay nodes for RakNet's UDP proxy, across instances sharing a
Store (``--raknet-proxy-relay-nodes``).

Every ``raknet`` instance with the flag and a built-in forwarder registers
itself as a relay node: ``raknet:node:<id>`` holds its RakNet address (where
clients ping it and where its forwarding ports live), refreshed every
:data:`HEARTBEAT` s with a TTL of :data:`HEARTBEATS_PER_TTL` heartbeats, as
the Unity relay's nodes are (services/relay.py). Every instance with the
flag reads the live nodes at the same pace and hands their addresses to its
UDPProxyCoordinator (:meth:`~crossroads.proto.raknet.udpproxy.UDPProxyCoordinator.set_relay_nodes`),
which lists them in RakNet's ping round and tries them best first.

A forwarding request that the coordinator of instance A gives to node B
(:class:`~crossroads.proto.raknet.udpproxy.RemoteForwardingRequest`) goes over
Store pub/sub to B's channel ``raknet:node:<B>`` as a
:class:`~crossroads.proto.raknet.nodebus.Forward`; B starts a forwarder in its
pool and answers on A's channel with a
:class:`~crossroads.proto.raknet.nodebus.Forwarded`.

A hands the answer to its coordinator as node B's (looked up by B's id in its
own listing, never taken from the message). A lost message is an unanswered
server: the coordinator moves on after ``SERVER_REPLY_TIMEOUT_MS``.

The Store is trusted (it holds every secret of the deployment), but what comes
out of it is still checked: sizes, types, addresses; bad messages are dropped
and counted (``crossroads_raknet_dropped{reason="relay-node-..."}``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from crossroads.errors import DecodeError, StoreError
from crossroads.proto import jsontext
from crossroads.proto.raknet.nodebus import (
    MAX_MESSAGE,
    Forward,
    Forwarded,
    NodeMessage,
    decode_address,
    decode_node_message,
)
from crossroads.proto.raknet.udpproxy import (
    MAX_RELAY_NODES,
    Forwarders,
    RemoteForwardingRequest,
    UDPProxyCoordinator,
)
from crossroads.services.base import stop_tasks
from crossroads.store.base import Store, Subscription
from crossroads.types import Address

log = logging.getLogger("crossroads.raknet")

#: Store key prefix of node registrations; also each node's command channel.
NODE_PREFIX = "raknet:node:"
#: Seconds between registrations and listings: a new node is used, and a dead
#: one dropped, within a few seconds (the RakNet proxy timeouts are seconds).
HEARTBEAT = 2.0
#: A registration lives this many heartbeats: one lost heartbeat is forgiven
#: (the Unity relay's nodes use the same rule, services/relay.py).
HEARTBEATS_PER_TTL = 3
#: Commands waiting to be published; beyond this they are dropped (the Store
#: lags, the coordinator must not grow without bound; the request times out).
MAX_OUTBOX = 1024


def node_key(node_id: str) -> str:
    return NODE_PREFIX + node_id


@dataclass(eq=False)
class RelayNodes:
    """This instance's side of the relay-node cluster (module docstring)."""

    store: Store
    coordinator: UDPProxyCoordinator
    forwarders: Forwarders | None
    #: Where this node registers; None: it only uses the others.
    own_address: Address | None
    public_ip: str
    #: Called (with the loop time) after a reply reached the coordinator,
    #: so the driver sends what it produced.
    wake: Any
    node_id: str = field(default_factory=lambda: uuid.uuid4().hex, init=False)
    #: Live nodes by id (this one included when it registers).
    nodes: dict[str, Address] = field(default_factory=dict, init=False)
    dropped: Counter[str] = field(default_factory=Counter, init=False)
    published: int = field(default=0, init=False)
    _outbox: deque[tuple[str, bytes]] = field(default_factory=deque, init=False)
    _outbox_ready: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    _subscription: Subscription | None = field(default=None, init=False)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list, init=False)

    async def start(self) -> None:
        self._subscription = await self.store.subscribe(node_key(self.node_id))
        try:
            await self._heartbeat_once()
        except StoreError as exc:  # the heartbeat retries; the proxy works alone
            log.debug("raknet relay nodes: %r", exc)
            self.dropped["store-error"] += 1
        self._tasks = [
            asyncio.create_task(self._receive(self._subscription)),
            asyncio.create_task(self._heartbeat_forever()),
            asyncio.create_task(self._publish_forever()),
        ]

    async def close(self) -> None:
        await stop_tasks(self._tasks)
        self._tasks.clear()
        if self._subscription is not None:
            with contextlib.suppress(Exception):
                await self._subscription.close()
            self._subscription = None
        if self.own_address is not None:
            with contextlib.suppress(StoreError):
                await self.store.delete(node_key(self.node_id))

    async def withdraw(self) -> None:
        """Stop registering (a drain): the other instances stop handing this
        node forwarders within a heartbeat; its forwarders go on."""
        own, self.own_address = self.own_address, None
        if own is not None:
            with contextlib.suppress(StoreError):
                await self.store.delete(node_key(self.node_id))

    # ------------------------------------------------------------ heartbeat

    async def _heartbeat_forever(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT)
            try:
                await self._heartbeat_once()
            except StoreError as exc:  # logged once per outage by the store
                log.debug("raknet relay nodes: %r", exc)
                self.dropped["store-error"] += 1

    async def _heartbeat_once(self) -> None:
        if self.own_address is not None:
            record = {"id": self.node_id, "raknet": list(self.own_address)}
            await self.store.set(
                node_key(self.node_id),
                json.dumps(record).encode(),
                ttl=HEARTBEAT * HEARTBEATS_PER_TTL,
            )
        nodes: dict[str, Address] = {}
        for key in (await self.store.keys(NODE_PREFIX))[: MAX_RELAY_NODES * 2]:
            raw = await self.store.get(key)
            if raw is None:
                continue  # expired between the scan and the read
            try:
                node_id, address = self._parse_record(key, raw)
            except DecodeError as exc:
                self.dropped[exc.reason] += 1
                continue
            if len(nodes) < MAX_RELAY_NODES:
                nodes[node_id] = address
        self.nodes = nodes
        own = self.own_address if self.node_id in nodes else None
        self.coordinator.set_relay_nodes(list(nodes.values()), own)

    @staticmethod
    def _parse_record(key: str, raw: bytes) -> tuple[str, Address]:
        if len(raw) > MAX_MESSAGE:
            raise DecodeError("registration too large", "too-large")
        record = jsontext.loads(raw)
        if not isinstance(record, dict) or record.get("id") != key[len(NODE_PREFIX) :]:
            raise DecodeError("malformed registration", "bad-registration")
        return str(record["id"]), decode_address(record.get("raknet"))

    # ------------------------------------------------------------- commands

    def carry(self, requests: list[RemoteForwardingRequest]) -> None:
        """Publish the coordinator's requests to the nodes they name."""
        by_address = {address: node_id for node_id, address in self.nodes.items()}
        for request in requests:
            node_id = by_address.get(request.node)
            if node_id is None:
                self.dropped["unknown-node"] += 1  # gone: the request times out
                continue
            self._queue(
                node_id,
                Forward(
                    self.node_id, request.source, request.target, request.timeout_ms
                ),
            )

    def _queue(self, node_id: str, message: NodeMessage) -> None:
        if len(self._outbox) >= MAX_OUTBOX:
            self.dropped["outbox-full"] += 1
            return
        self._outbox.append((node_id, message.encode()))
        self._outbox_ready.set()

    async def _publish_forever(self) -> None:
        while True:
            await self._outbox_ready.wait()
            self._outbox_ready.clear()
            while self._outbox:
                node_id, data = self._outbox.popleft()
                try:
                    await self.store.publish(node_key(node_id), data)
                    self.published += 1
                except StoreError:
                    self.dropped["store-error"] += 1

    async def _receive(self, subscription: Subscription) -> None:
        while True:
            try:
                raw = await subscription.get(timeout=5.0)
            except StoreError as exc:  # logged once per outage by the store
                log.debug("raknet relay nodes: %r; retrying", exc)
                await asyncio.sleep(1.0)
                continue
            if raw is None:
                continue
            try:
                self.handle(raw)
            except DecodeError as exc:
                self.dropped[exc.reason] += 1

    def handle(self, raw: bytes) -> None:
        """One command from another node (raises DecodeError when malformed)."""
        match decode_node_message(raw):
            case Forward() as forward:
                self._on_forward(forward)
            case Forwarded() as answer:
                self._on_forwarded(answer)

    def _on_forward(self, request: Forward) -> None:
        if self.forwarders is None:
            raise DecodeError("no forwarder here", "not-a-node")
        result, port = self.forwarders.start(
            request.source, request.target, request.timeout_ms
        )
        self._queue(
            request.sender,
            Forwarded(
                self.node_id,
                request.source,
                request.target,
                self.public_ip,
                int(result),
                port,
            ),
        )

    def _on_forwarded(self, answer: Forwarded) -> None:
        node = self.nodes.get(answer.sender)
        if node is None:
            raise DecodeError("answer from an unknown node", "unknown-node")
        now = asyncio.get_running_loop().time()
        self.coordinator.on_remote_reply(
            node,
            answer.source,
            answer.target,
            answer.ip,
            answer.result,
            answer.port,
            now,
        )
        self.wake(now)
