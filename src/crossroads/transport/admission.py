"""The one resource budget of a process: every listener and every per-client
table registers with it.

Theory of operation
-------------------
A process has one descriptor limit (``RLIMIT_NOFILE``), one amount of memory
it may use for state that strangers make it keep (``--memory-budget``), and
many listeners that strangers talk to. Without one plan the first listener to
be flooded takes every descriptor or every byte and the others fail: 1,100
half-sent HTTP requests under ``ulimit -n 1024`` broke TURN; 1,000 RakNet
forwarders (one UDP socket each) broke everything else. So nothing that holds
per-client state is allowed to size itself:

1. At start the soft descriptor limit is raised to the hard limit
   (:func:`raise_fd_limit`).
2. Every per-client state table registers with :class:`ResourceBudget` and
   gets an :class:`Admission`: accepted TCP connections of a listener, TLS and
   DTLS handshakes, WebSocket connections, RakNet connections in any state,
   UDPProxy forwarders, natneg relay pairs, TURN allocations and their relay
   sockets, OpenTTD stream routes. A table declares what one item costs — its
   descriptors (:attr:`Admission.descriptors_per_item`) and its fixed memory
   (:attr:`Admission.bytes_per_item`, the per-item overhead: objects, kernel
   and library buffers, not the payload alone) — and, for state held before a
   client proved anything, the deadline in seconds after which it is dropped
   (:attr:`Admission.preauth_deadline`).
3. The budget derives every cap from those costs; none is guessed:

   - descriptors: :data:`MIN_RESERVE` are kept for the process's own files;
     tables in :attr:`Pool.CONNECTIONS` (accepted TCP connections) share
     :data:`LISTENER_FRACTION` of the limit, the per-client socket tables in
     :attr:`Pool.RELAY` share the rest, each in proportion to its weight;
   - memory: tables with a per-item cost share ``--memory-budget`` in
     proportion to their weight;
   - a table's global cap (:attr:`Admission.max_items`) is the smallest of its
     configured maximum, its descriptor share divided by its descriptors per
     item and its memory share divided by its bytes per item;
   - a source's cap (:attr:`Admission.max_per_source`) is at most
     :data:`PER_SOURCE_FRACTION` of that global cap, so one source (an IPv4
     address or an IPv6 /64) can never take a table by itself.

4. :meth:`Admission.admit` is asked once per new item with its source and
   refuses over either cap (counted by reason); :meth:`Admission.release` is
   called once when the item ends. Variable buffered bytes (split and ordered
   RakNet data, queued writes) are charged with :meth:`Admission.charge` against
   the table's memory share and refunded with :meth:`Admission.uncharge`.
5. Every socket a service listens on is recorded with its service and kind
   (:meth:`ResourceBudget.listen`); :meth:`ResourceBudget.snapshot` is what the
   admin API, ``crossroads doctor`` and the adversarial battery
   (tests/adversarial/test_battery.py) read: the battery attacks every
   listener in it and fails when the process holds more sockets than the
   registry accounts for.

Metrics (one collector per runtime): ``crossroads_budget_items{table}``,
``crossroads_budget_item_limit{table}``, ``crossroads_budget_bytes{table}``,
``crossroads_budget_refused_total{table,reason}``, and for the TCP listeners
the older names ``crossroads_tcp_connections{listener}``,
``crossroads_tcp_connection_limit{listener}``,
``crossroads_tcp_refused_total{listener,reason}``,
``crossroads_tcp_closed_total{listener,reason}``; ``crossroads_fd_limit`` and
``crossroads_memory_budget_bytes``.
"""

from __future__ import annotations

import enum
import logging
import os
import resource
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from crossroads.proto.admission import TableCounts
from crossroads.types import Address, frozen, show_address

log = logging.getLogger("crossroads")

#: Share of the descriptor limit for connections accepted by TCP listeners,
#: split among them by weight; the rest is for per-client sockets (one UDP
#: socket per TURN allocation or RakNet forwarder, RFC 6062 peer connections,
#: stream routes). Half and half: relays are what a connectivity server is
#: for, and they must survive a flood of any listener.
LISTENER_FRACTION = 0.5
#: Descriptors always left out of every share, however small the limit
#: (listening and UDP service sockets, epoll, Redis, logs: a few dozen).
MIN_RESERVE = 64
#: The largest part of a table one source may hold: one address (or /64) can
#: never fill a table alone, and 8 sources are needed to fill it. A household
#: behind one address still gets an eighth of a table that exists for many.
PER_SOURCE_FRACTION = 1 / 8
#: Where the kernel's per-process maximum lives; used when the hard limit is
#: "unlimited", which setrlimit refuses as a soft value.
NR_OPEN = "/proc/sys/fs/nr_open"
#: Default memory budget: this part of the machine's memory (or of the
#: cgroup's limit), for state that unauthenticated and authenticated clients
#: make the process keep. A quarter leaves the rest to the kernel's socket
#: buffers, the interpreter and other processes.
MEMORY_FRACTION = 0.25
#: Never more than this by default: a relay's per-client state is small, and a
#: budget larger than needed only lets an attack grow the process further.
MAX_DEFAULT_MEMORY_BUDGET = 2 << 30
#: Never less than this by default (a machine that reports very little memory
#: still runs a small server).
MIN_DEFAULT_MEMORY_BUDGET = 64 << 20


class Pool(enum.StrEnum):
    """Which part of the descriptor limit a table's items come from."""

    #: Connections accepted by a TCP listener (one descriptor each).
    CONNECTIONS = "connections"
    #: Per-client sockets a service opens itself (relay sockets, forwarders).
    RELAY = "relay"
    #: Items that hold no descriptor of their own (UDP sessions, handshakes in
    #: progress on a shared socket): memory is their only descriptor-free cost.
    NONE = "none"


def raise_fd_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit; return the new soft
    limit (the old one if the kernel refuses)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            with open(NR_OPEN, encoding="ascii") as f:
                target = int(f.read().strip())
        except (OSError, ValueError):
            return soft
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError) as exc:
            log.warning("could not raise the descriptor limit to %d: %s", target, exc)
            return soft
        log.debug("descriptor limit raised from %d to %d", soft, target)
        return target
    return soft


def current_fd_limit() -> int:
    """The soft ``RLIMIT_NOFILE`` now."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def machine_memory() -> int:
    """Bytes of memory this process may use: the machine's, or its cgroup's
    limit when that is smaller."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in (
        "/sys/fs/cgroup/memory.max",
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
    ):
        limit = _read_int(path)
        if limit is not None and 0 < limit < total:
            total = limit
    return total


def default_memory_budget() -> int:
    """``--memory-budget 0``: :data:`MEMORY_FRACTION` of :func:`machine_memory`,
    between the minimum and maximum defaults."""
    share = int(machine_memory() * MEMORY_FRACTION)
    return max(MIN_DEFAULT_MEMORY_BUDGET, min(MAX_DEFAULT_MEMORY_BUDGET, share))


@frozen
class ListenerEntry:
    """One socket a service listens on, as the registry shows it."""

    service: str
    #: What speaks on it: "stun", "turn-tls", "raknet", "relay-ws" ...
    kind: str
    #: "udp" or "tcp".
    transport: str
    address: Address
    #: The table that admits its clients' state ("" when it keeps none).
    table: str = ""

    def describe(self) -> str:
        return (
            f"{self.transport} {show_address(self.address)} {self.service}/{self.kind}"
        )


@dataclass(eq=False)
class Admission(TableCounts):
    """One per-client table of a process (see the module docstring); its
    counting is :class:`~crossroads.proto.admission.TableCounts`', its caps
    are derived from the budget."""

    budget: ResourceBudget
    name: str
    configured_max: int
    configured_per_source: int
    pool: Pool = Pool.CONNECTIONS
    descriptors_per_item: int = 1
    bytes_per_item: int = 0
    weight: float = 1.0
    #: Seconds an item may live before its client proved anything (a
    #: completed handshake, an authenticated request); None: no pre-auth state.
    preauth_deadline: float | None = None

    @property
    def max_items(self) -> int:
        """The global cap in force: the configured maximum, the descriptor
        share and the memory share, the smallest (never below one)."""
        cap = self.configured_max
        if self.descriptors_per_item > 0 and self.pool != Pool.NONE:
            cap = min(
                cap, self.budget.descriptor_share(self) // self.descriptors_per_item
            )
        if self.bytes_per_item > 0:
            cap = min(cap, self.budget.memory_share(self) // self.bytes_per_item)
        return max(1, cap)

    @property
    def max_per_source(self) -> int:
        """A source's cap: configured, but never above
        :data:`PER_SOURCE_FRACTION` of the global cap."""
        fraction = max(1, int(self.max_items * PER_SOURCE_FRACTION))
        return max(1, min(self.configured_per_source, fraction))

    @property
    def max_bytes(self) -> int:
        """Variable bytes this table may hold beyond its items' fixed cost."""
        return max(0, self.budget.memory_share(self) - self.live * self.bytes_per_item)

    def item_caps(self) -> tuple[int, int]:
        return self.max_items, self.max_per_source

    def byte_cap(self) -> int:
        return self.max_bytes

    def row(self) -> dict[str, Any]:
        """This table as the admin API and ``crossroads doctor`` show it."""
        return {
            "table": self.name,
            "pool": self.pool.value,
            "live": self.live,
            "max": self.max_items,
            "max_per_source": self.max_per_source,
            # The most items one source holds now (the battery checks it
            # against max_per_source).
            "largest_source": max(self.per_source.values(), default=0),
            "descriptors_per_item": self.descriptors_per_item,
            "bytes_per_item": self.bytes_per_item,
            "buffered_bytes": self.buffered,
            "max_bytes": self.budget.memory_share(self) if self.bytes_per_item else 0,
            "preauth_deadline": self.preauth_deadline,
            "refused": dict(self.refused),
            "closed": dict(self.closes),
        }


class ResourceBudget:
    """The descriptor limit and memory budget of one process, shared among
    its registered tables (see the module docstring)."""

    def __init__(self, fd_limit: int | None = None, memory: int | None = None) -> None:
        self.fd_limit = fd_limit if fd_limit is not None else current_fd_limit()
        self.memory = memory if memory is not None else default_memory_budget()
        self.admissions: dict[str, Admission] = {}
        self.listeners: list[ListenerEntry] = []

    # ------------------------------------------------------------ registry

    def listener(self, name: str, max_connections: int, max_per_ip: int) -> Admission:
        """Register the accepted connections of TCP listener ``name``."""
        return self.table(
            name,
            max_items=max_connections,
            max_per_source=max_per_ip,
            pool=Pool.CONNECTIONS,
            descriptors_per_item=1,
        )

    def table(
        self,
        name: str,
        *,
        max_items: int,
        max_per_source: int,
        pool: Pool = Pool.RELAY,
        descriptors_per_item: int = 0,
        bytes_per_item: int = 0,
        weight: float = 1.0,
        preauth_deadline: float | None = None,
    ) -> Admission:
        """Register the per-client table ``name`` and return its admission.

        Raises:
            ValueError: ``name`` is registered already, or a table holding
                descriptors names no descriptor pool.
        """
        if name in self.admissions:
            raise ValueError(f"table {name!r} registered twice")
        if descriptors_per_item > 0 and pool == Pool.NONE:
            raise ValueError(f"table {name!r} holds descriptors but names no pool")
        admission = Admission(
            self,
            name,
            max_items,
            max_per_source,
            pool=pool,
            descriptors_per_item=descriptors_per_item,
            bytes_per_item=bytes_per_item,
            weight=weight,
            preauth_deadline=preauth_deadline,
        )
        self.admissions[name] = admission
        return admission

    def forget(self, name: str) -> None:
        """The table ``name`` is gone: its shares go back to the others."""
        self.admissions.pop(name, None)

    def listen(
        self, service: str, kind: str, transport: str, address: Address, table: str = ""
    ) -> None:
        """Record that ``service`` listens on ``address`` (its clients' state
        admitted by ``table``)."""
        entry = ListenerEntry(service, kind, transport, address, table)
        if entry not in self.listeners:
            self.listeners.append(entry)

    def unlisten(self, service: str) -> None:
        """Forget every listener of ``service`` (it stopped)."""
        self.listeners = [e for e in self.listeners if e.service != service]

    # -------------------------------------------------------------- shares

    def _weights(self, pool: Pool) -> float:
        return sum(
            a.weight
            for a in self.admissions.values()
            if a.pool == pool and a.descriptors_per_item > 0
        )

    def connection_pool(self) -> int:
        """Descriptors for connections accepted by TCP listeners."""
        return max(
            0, min(int(self.fd_limit * LISTENER_FRACTION), self.fd_limit - MIN_RESERVE)
        )

    def relay_pool(self) -> int:
        """Descriptors for the per-client sockets services open themselves."""
        return max(0, self.fd_limit - MIN_RESERVE - self.connection_pool())

    def descriptor_share(self, admission: Admission) -> int:
        """Descriptors ``admission``'s table may hold: its weight's part of
        its pool."""
        if admission.pool == Pool.NONE:
            return self.fd_limit
        pool = (
            self.connection_pool()
            if admission.pool == Pool.CONNECTIONS
            else self.relay_pool()
        )
        total = self._weights(admission.pool) or admission.weight
        return max(admission.descriptors_per_item, int(pool * admission.weight / total))

    def memory_share(self, admission: Admission) -> int:
        """Bytes ``admission``'s table may hold (items and buffered data): its
        weight's part of the memory budget among tables that cost memory."""
        total = (
            sum(a.weight for a in self.admissions.values() if a.bytes_per_item > 0)
            or admission.weight
        )
        return int(self.memory * admission.weight / total)

    def share(self) -> int:
        """Connections one TCP listener of weight 1 may hold."""
        listeners = max(1, int(self._weights(Pool.CONNECTIONS)))
        return max(1, self.connection_pool() // listeners)

    def reserved(self) -> int:
        """Descriptors outside the TCP listeners' shares."""
        return self.fd_limit - self.connection_pool()

    # ------------------------------------------------------------- reading

    def descriptors_accounted(self) -> int:
        """Descriptors the registered tables hold now, plus the listeners."""
        held = sum(
            a.live * a.descriptors_per_item
            for a in self.admissions.values()
            if a.pool != Pool.NONE
        )
        return held + len(self.listeners)

    def snapshot(self) -> dict[str, Any]:
        """Everything the registry knows, as plain JSON values."""
        return {
            "fd_limit": self.fd_limit,
            "memory_budget": self.memory,
            "reserve": MIN_RESERVE,
            "connection_pool": self.connection_pool(),
            "relay_pool": self.relay_pool(),
            "per_source_fraction": PER_SOURCE_FRACTION,
            "descriptors_accounted": self.descriptors_accounted(),
            "listeners": [
                {
                    "service": e.service,
                    "kind": e.kind,
                    "transport": e.transport,
                    "host": e.address[0],
                    "port": e.address[1],
                    "table": e.table,
                }
                for e in self.listeners
            ],
            "tables": [a.row() for a in self.admissions.values()],
        }


class BudgetCollector(Collector):
    """Exports a :class:`ResourceBudget` at scrape time."""

    def __init__(self, budget: ResourceBudget) -> None:
        self.budget = budget

    def collect(self) -> Iterator[Any]:
        budget = self.budget
        items = GaugeMetricFamily(
            "crossroads_budget_items",
            "Live items per registered table.",
            labels=["table"],
        )
        item_limit = GaugeMetricFamily(
            "crossroads_budget_item_limit",
            "Global cap in force per table (configured, descriptor share and "
            "memory share, the smallest).",
            labels=["table"],
        )
        buffered = GaugeMetricFamily(
            "crossroads_budget_bytes",
            "Variable bytes charged per table (beyond the fixed per-item cost).",
            labels=["table"],
        )
        refused_any = CounterMetricFamily(
            "crossroads_budget_refused",
            "Items or bytes refused by a table's caps, per table and reason.",
            labels=["table", "reason"],
        )
        live = GaugeMetricFamily(
            "crossroads_tcp_connections",
            "Connections accepted and open, per TCP listener.",
            labels=["listener"],
        )
        cap = GaugeMetricFamily(
            "crossroads_tcp_connection_limit",
            "Global connection cap in force per TCP listener (configured maximum "
            "or descriptor share, the smaller).",
            labels=["listener"],
        )
        refused = CounterMetricFamily(
            "crossroads_tcp_refused",
            "Connections closed on accept, per listener and reason.",
            labels=["listener", "reason"],
        )
        closed = CounterMetricFamily(
            "crossroads_tcp_closed",
            "Connections closed by a read deadline, per listener and reason.",
            labels=["listener", "reason"],
        )
        for name, admission in list(budget.admissions.items()):
            items.add_metric([name], admission.live)
            item_limit.add_metric([name], admission.max_items)
            buffered.add_metric([name], admission.buffered)
            for reason, count in admission.refused.items():
                refused_any.add_metric([name, reason], count)
            if admission.pool != Pool.CONNECTIONS:
                continue
            live.add_metric([name], admission.live)
            cap.add_metric([name], admission.max_items)
            for reason, count in admission.refused.items():
                refused.add_metric([name, reason], count)
            for reason, count in admission.closes.items():
                closed.add_metric([name, reason], count)
        limit = GaugeMetricFamily(
            "crossroads_fd_limit", "Soft descriptor limit (RLIMIT_NOFILE) in force."
        )
        limit.add_metric([], budget.fd_limit)
        memory = GaugeMetricFamily(
            "crossroads_memory_budget_bytes",
            "Memory budget shared among the tables (--memory-budget).",
        )
        memory.add_metric([], budget.memory)
        yield from (items, item_limit, buffered, refused_any)
        yield from (live, cap, refused, closed, limit, memory)
