"""Admission of accepted TCP connections, shared by every TCP listener.

Theory of operation
-------------------
A process has one file-descriptor limit (``RLIMIT_NOFILE``) and several TCP
listeners (HTTP with the p2p WebSocket, STUN/TURN over TCP, the three OpenTTD
ports). Without a plan the first listener to be flooded takes every descriptor
and the others fail with ``EMFILE`` ("Too many open files"): 1,100 half-sent
HTTP requests under ``ulimit -n 1024`` used to break TURN allocations and
OpenTTD. So:

1. At start the soft limit is raised to the hard limit (:func:`raise_fd_limit`):
   the administrator's hard limit is the real budget, the soft one is often a
   1,024 left over from ``select()`` days.
2. :class:`ConnectionBudget` splits the limit. Half of it
   (:data:`LISTENER_FRACTION`) is for connections accepted by the TCP listeners,
   shared *evenly* among the listeners that registered; the other half stays for
   everything else (UDP relay sockets, one per TURN allocation, RFC 6062 peer
   connections, Redis connections, the listening sockets, log files). A
   listener's global cap is the smaller of its configured maximum and its share,
   so a flooded listener stops at its share and the others keep theirs.
3. Each listener owns one :class:`Admission`: :meth:`Admission.admit` is asked
   once per accepted connection with the peer's address and refuses the
   connection over the listener's global cap or over its per-source cap (an
   IPv4 address, or an IPv6 /64, the smallest block an IPv6 site is given, so
   one host cannot dodge the cap by rotating its interface identifier);
   :meth:`Admission.release` is called once when an admitted connection ends.
   A refused connection is closed at once: it holds its descriptor for one
   event-loop turn, never longer.
4. Read deadlines are the listener's own business (a first-message and a
   partial-message deadline for STUN/TURN, a request deadline for HTTP, packet
   deadlines for OpenTTD); the closes they cause are counted here
   (:meth:`Admission.closed`) so that every listener reports refusals and
   timeouts under the same metric names.

Metrics (one collector per runtime): ``crossroads_tcp_connections{listener}``,
``crossroads_tcp_connection_limit{listener}``,
``crossroads_tcp_refused_total{listener,reason}``,
``crossroads_tcp_closed_total{listener,reason}`` and
``crossroads_fd_limit``.
"""

from __future__ import annotations

import logging
import resource
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from crossroads.proto.budget import source_key

log = logging.getLogger("crossroads")

#: Share of the descriptor limit for connections accepted by TCP listeners,
#: split evenly among them; the rest is kept for relay sockets (one UDP socket
#: per TURN allocation), RFC 6062 peer connections, store connections and the
#: process's own files. Half and half: relays are what a connectivity server is
#: for, and they must survive a flood of any listener.
LISTENER_FRACTION = 0.5
#: Descriptors always left out of the listener shares, however small the limit
#: (listening and UDP service sockets, epoll, Redis, logs: a few dozen).
MIN_RESERVE = 64
#: Where the kernel's per-process maximum lives; used when the hard limit is
#: "unlimited", which setrlimit refuses as a soft value.
NR_OPEN = "/proc/sys/fs/nr_open"

REFUSED_OVER_LIMIT = "over-limit"
REFUSED_OVER_IP_LIMIT = "over-ip-limit"


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


@dataclass(eq=False)
class Admission:
    """The live connections of one TCP listener (see the module docstring)."""

    budget: ConnectionBudget
    name: str
    configured_max: int
    max_per_ip: int
    live: int = field(default=0, init=False)
    per_source: dict[str, int] = field(default_factory=dict, init=False)
    refused: dict[str, int] = field(default_factory=dict, init=False)
    closes: dict[str, int] = field(default_factory=dict, init=False)

    @property
    def max_connections(self) -> int:
        """The global cap in force: configured maximum or descriptor share."""
        return min(self.configured_max, self.budget.share())

    def admit(self, host: str, *, per_ip_cap: bool = True) -> str | None:
        """Count a new connection from ``host``; None if admitted, else the
        reason it is refused (counted; the caller closes the connection).
        ``per_ip_cap=False`` for a source that speaks for many clients (a
        trusted reverse proxy): only the global cap applies to it."""
        if self.live >= self.max_connections:
            reason = REFUSED_OVER_LIMIT
        else:
            key = source_key(host)
            count = self.per_source.get(key, 0)
            if count < self.max_per_ip or not per_ip_cap:
                self.per_source[key] = count + 1
                self.live += 1
                return None
            reason = REFUSED_OVER_IP_LIMIT
        self.refused[reason] = self.refused.get(reason, 0) + 1
        return reason

    def release(self, host: str) -> None:
        """An admitted connection from ``host`` ended (call exactly once)."""
        key = source_key(host)
        count = self.per_source.get(key, 0)
        if count <= 0:
            return
        if count == 1:
            del self.per_source[key]
        else:
            self.per_source[key] = count - 1
        self.live -= 1

    def closed(self, reason: str) -> None:
        """Count a connection the listener closed for ``reason`` (a deadline)."""
        self.closes[reason] = self.closes.get(reason, 0) + 1


class ConnectionBudget:
    """The descriptor limit of one process, split among its TCP listeners."""

    def __init__(self, fd_limit: int | None = None) -> None:
        self.fd_limit = fd_limit if fd_limit is not None else current_fd_limit()
        self.admissions: dict[str, Admission] = {}

    def listener(self, name: str, max_connections: int, max_per_ip: int) -> Admission:
        """Register the listener ``name`` and return its admission."""
        if name in self.admissions:
            raise ValueError(f"TCP listener {name!r} registered twice")
        admission = Admission(self, name, max_connections, max_per_ip)
        self.admissions[name] = admission
        return admission

    def forget(self, name: str) -> None:
        """The listener ``name`` stopped: its share goes back to the others."""
        self.admissions.pop(name, None)

    def reserved(self) -> int:
        """Descriptors kept out of the listener shares: what relay sockets (one
        per TURN allocation), peer connections and the process's own files may
        use. A quota sized from the descriptor limit starts from this."""
        return self.fd_limit - self.share() * max(1, len(self.admissions))

    def share(self) -> int:
        """Connections one listener may hold: an even part of the listener
        fraction of the limit, never less than one."""
        listeners = max(1, len(self.admissions))
        pool = min(int(self.fd_limit * LISTENER_FRACTION), self.fd_limit - MIN_RESERVE)
        return max(1, pool // listeners)


class BudgetCollector(Collector):
    """Exports a :class:`ConnectionBudget` at scrape time."""

    def __init__(self, budget: ConnectionBudget) -> None:
        self.budget = budget

    def collect(self) -> Iterator[Any]:
        budget = self.budget
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
            live.add_metric([name], admission.live)
            cap.add_metric([name], admission.max_connections)
            for reason, count in admission.refused.items():
                refused.add_metric([name, reason], count)
            for reason, count in admission.closes.items():
                closed.add_metric([name, reason], count)
        limit = GaugeMetricFamily(
            "crossroads_fd_limit", "Soft descriptor limit (RLIMIT_NOFILE) in force."
        )
        limit.add_metric([], budget.fd_limit)
        yield from (live, cap, refused, closed, limit)
