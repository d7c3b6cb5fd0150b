"""TURN nodes across instances sharing a Store: who a draining node sends new
allocations to.

Every ``turn`` instance registers ``turn:node:<id>`` with the addresses its
clients reach it on (the advertised relay address of each family and the STUN
port), refreshed every :data:`HEARTBEAT` s with a TTL of
:data:`HEARTBEATS_PER_TTL` heartbeats, as the Unity relay's and RakNet's relay
nodes are (services/relay.py, services/raknet_nodes.py): a node that dies
leaves the listing within seconds, with no goodbye needed.

A draining node deletes its own record (no other node sends clients to it) and
reads the others' at the same pace; its TURN core answers a new Allocate 300
Try Alternate naming one of them (or one of ``--turn-alternate-server``),
else 486 (RFC 8656 §7.2, RFC 8489 §10).

The Store is trusted (it holds every secret of the deployment), but a record
is still checked: JSON, at most :data:`MAX_ADDRESSES` IP literals with ports;
a malformed one is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from crossroads.errors import StoreError
from crossroads.store.base import Store
from crossroads.types import Address, show_address

log = logging.getLogger("crossroads.turn")

#: Store key prefix of TURN node registrations.
NODE_PREFIX = "turn:node:"
#: Seconds between registrations (and, while draining, reads of the peers): a
#: new node is known, and a dead one forgotten, within a few seconds; a TURN
#: client retries a 300 at once, so a stale peer costs it one round trip.
HEARTBEAT = 5.0
#: A registration lives this many heartbeats: one lost heartbeat is forgiven
#: (the relay nodes' rule, services/relay.py).
HEARTBEATS_PER_TTL = 3
#: Addresses one record may name (one per family, and room to spare).
MAX_ADDRESSES = 4
#: Peer nodes read from the store at most (the listing is scanned each beat).
MAX_PEERS = 256


def node_key(node_id: str) -> str:
    return NODE_PREFIX + node_id


def parse_record(raw: bytes) -> list[Address]:
    """The addresses of one node record; [] when malformed."""
    try:
        data = json.loads(raw)
        entries = data["addresses"]
        if not isinstance(entries, list):
            return []
        found: list[Address] = []
        for entry in entries[:MAX_ADDRESSES]:
            host, port = entry
            ip = ipaddress.ip_address(host)
            if not isinstance(port, int) or not 0 < port < 65536:
                continue
            found.append((str(ip), port))
        return found
    except (ValueError, KeyError, TypeError):
        return []


@dataclass(eq=False)
class TurnNodes:
    """This instance's registration, and the peers a drain redirects to."""

    store: Store
    #: Where clients reach this node (IP literals only: ALTERNATE-SERVER
    #: carries an address, not a name).
    addresses: Sequence[Address]
    #: Called with the peers' addresses (and the configured alternates) each
    #: heartbeat once draining.
    on_peers: Callable[[list[Address]], None]
    #: ``--turn-alternate-server``: always among the peers of a drain.
    configured: Sequence[Address] = ()
    node_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    heartbeat: float = HEARTBEAT
    draining: bool = field(default=False, init=False)
    _task: asyncio.Task[None] | None = field(default=None, init=False)
    _wake: asyncio.Event = field(default_factory=asyncio.Event, init=False)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="turn-nodes")

    def record(self) -> bytes:
        return json.dumps({"addresses": [list(a) for a in self.addresses]}).encode()

    async def peers(self) -> list[Address]:
        """The other live nodes' addresses, then the configured alternates."""
        found: list[Address] = []
        keys = await self.store.keys(NODE_PREFIX)
        for key in sorted(keys)[:MAX_PEERS]:
            if key == node_key(self.node_id):
                continue
            raw = await self.store.get(key)
            if raw is not None:
                found += parse_record(raw)
        for address in self.configured:
            if address not in found:
                found.append(address)
        return found

    async def drain(self) -> None:
        """Leave the listing now and hand the peers to the core."""
        self.draining = True
        self.on_peers(list(self.configured))
        try:
            await self.store.delete(node_key(self.node_id))
            self.on_peers(await self.peers())
        except StoreError:
            pass  # the store logs the outage; the next beat retries
        self._wake.set()

    async def _run(self) -> None:
        ttl = self.heartbeat * HEARTBEATS_PER_TTL
        while True:
            try:
                if self.draining:
                    self.on_peers(await self.peers())
                elif self.addresses:
                    await self.store.set(node_key(self.node_id), self.record(), ttl=ttl)
                    if self.draining:  # drain() ran meanwhile: undo the set
                        await self.store.delete(node_key(self.node_id))
            except StoreError:
                pass  # logged once per outage by the store; the next beat retries
            except Exception:
                log.warning(
                    "turn node %s: store update failed", self.node_id, exc_info=True
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.heartbeat)
            self._wake.clear()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        if not self.draining:
            with contextlib.suppress(Exception):
                await self.store.delete(node_key(self.node_id))

    def describe(self) -> str:
        where = ", ".join(show_address(a) for a in self.addresses) or "none"
        return f"node {self.node_id} ({where})"
