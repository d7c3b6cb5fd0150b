"""What every service module provides, and what it is given.

A service module (``crossroads/services/<name>.py`` or a package) defines:

- ``NAME``: the service name used by ``--only`` (``"stun"``);
- ``Config``: a frozen dataclass of :func:`crossroads.config.setting` fields,
  which becomes the ``[NAME]`` config section and its flags;
- ``async def serve(ctx: ServiceContext) -> Service``: bind, start, return.

``serve`` must be quick: bind sockets, start tasks, return. It logs nothing itself;
the runtime logs one line per service from :meth:`Service.describe`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

from fastapi import APIRouter
from prometheus_client import CollectorRegistry

from crossroads.config import Config
from crossroads.insight import InsightRecorder
from crossroads.proto.budget import BudgetConfig, FailureBudget
from crossroads.proto.reflection import ReflectionBudget, ReflectionSettings
from crossroads.service_types import Impairable as Impairable
from crossroads.service_types import Service as Service  # re-exported
from crossroads.service_types import SessionAdmin as SessionAdmin
from crossroads.service_types import SessionInfo as SessionInfo
from crossroads.store.base import Store
from crossroads.transport.admission import ResourceBudget
from crossroads.transport.kernel_drops import KernelDropCollector
from crossroads.transport.localaddrs import own_addresses
from crossroads.transport.routes import RouteTable
from crossroads.transport.tasks import cancel_until_done
from crossroads.transport.tls import Certificates
from crossroads.types import Address, IPAddress
from crossroads.types import show_address as show_address  # re-exported

T = TypeVar("T")


@runtime_checkable
class Reloadable(Protocol):
    """A service that applies a new configuration without dropping sessions
    (``crossroads reload``, SIGHUP)."""

    def reload(self, config: Config) -> list[str]:
        """Apply what can change live; return one line per change applied.

        Raises:
            ConfigError: the new configuration cannot be applied (the old one
                stays in force).
        """
        ...


@runtime_checkable
class Drainable(Protocol):
    """A service that can stop taking new work while its live sessions go on
    (``SIGTERM``, ``crossroads drain``: the runtime's graceful drain)."""

    async def drain(self) -> None:
        """Refuse or redirect new sessions from now on (idempotent); leave
        every listing that would send new clients here."""
        ...

    def live_sessions(self) -> int:
        """Sessions the process waits for before it exits (relayed traffic:
        allocations, relay sessions, forwarders, TURN streams)."""
        ...


class HttpsPortGuest(Protocol):
    """A service whose TLS connections arrive on the runtime's HTTPS listener,
    sorted from HTTP ones by ALPN or first bytes (:mod:`crossroads.transport.tls_sort`)."""

    def tls_protocol_factory(self) -> Callable[[], asyncio.Protocol]: ...

    def add_tls_address(self, address: Address) -> None: ...


@dataclass
class ServiceContext:
    """Everything a service gets from the runtime."""

    config: Config
    store: Store
    #: Per-runtime registry, so several runtimes can live in one test process.
    metrics: CollectorRegistry
    log: logging.Logger
    #: Routers mounted on the HTTP app before it starts.
    routers: list[APIRouter] = field(default_factory=list)
    #: Services started so far in this runtime, by name (for services that build
    #: on another, e.g. TURN on the STUN sockets).
    running: dict[str, Service] = field(default_factory=dict)
    #: The TLS service that shares the runtime's HTTPS port (TURN over TLS
    #: with ``--turn-tls-port`` equal to ``--https-port``), None when none does.
    https_port_guest: HttpsPortGuest | None = None
    #: Where the HTTP API listens (bound before any service starts).
    http_address: Address = ("", 0)
    #: The one resource budget: every listener and per-client table
    #: registers with it (:mod:`crossroads.transport.admission`).
    resources: ResourceBudget = field(default_factory=ResourceBudget)
    #: Kernel drop counters: a service closes every short-lived (per-client)
    #: UDP socket with ``kernel_drops.close(sock)``, so its drops are not lost.
    kernel_drops: KernelDropCollector = field(
        default_factory=lambda: KernelDropCollector(dict)
    )
    #: The server certificate of the TLS listeners, None when TLS is off
    #: (see :func:`crossroads.transport.tls.certificates_for`).
    certificates: Certificates | None = None
    #: Connection insight: services record each attempt they coordinated
    #: (:mod:`crossroads.insight`); the default keeps a ring only.
    insight: InsightRecorder = field(default_factory=InsightRecorder)
    #: The one writer of the address-rewrite relays' routes (the Unity
    #: relay, natneg relay pairs, RakNet forwarders): into their taps and,
    #: when ``--dataplane`` chose the kernel plane, its map.
    route_table: RouteTable = field(default_factory=RouteTable)
    _own_addresses: frozenset[IPAddress] | None = field(
        default=None, init=False, repr=False
    )

    def section(self, name: str, cls: type[T]) -> T:
        return self.config.section(name, cls)

    @property
    def host(self) -> str:
        return self.config.core.host

    def reflection_budget(self) -> ReflectionBudget:
        """A new reflection budget sized by the ``--reflection-*`` settings; each
        UDP service owns one (docs/security.md, "Reflection budget")."""
        core = self.config.core
        return ReflectionBudget(
            ReflectionSettings(
                enabled=core.reflection_budget,
                allowance=core.reflection_allowance,
                global_allowance=core.reflection_global_allowance,
                max_sources=core.reflection_max_sources,
            )
        )

    def own_addresses(self) -> frozenset[IPAddress]:
        """This host's interface and configured addresses, enumerated once per
        runtime (every relay policy refuses them as peers)."""
        if self._own_addresses is None:
            self._own_addresses = own_addresses(self.config)
        return self._own_addresses

    def add_router(self, router: APIRouter) -> None:
        self.routers.append(router)

    def guess_budget(self) -> FailureBudget:
        """A fresh budget of failed guesses (one per kind of secret) sized by
        ``--guess-per-source`` and ``--guess-global``."""
        core = self.config.core
        return FailureBudget(
            BudgetConfig.from_settings(core.guess_per_source, core.guess_global)
        )


async def stop_task(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` until it has ended (:func:`cancel_until_done`: a store
    command may swallow the first cancellation), without raising what it
    failed with."""
    await cancel_until_done(task)
    if not task.cancelled():
        task.exception()  # retrieved: a failure at shutdown is not reported twice


async def stop_tasks(tasks: Iterable[asyncio.Task[Any] | None]) -> None:
    """:func:`stop_task` for each of ``tasks`` (None skipped), all cancelled
    before the first is waited for: none goes on working while another ends."""
    live = [task for task in tasks if task is not None]
    for task in live:
        task.cancel()
    for task in live:
        await stop_task(task)
