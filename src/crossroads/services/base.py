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

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from fastapi import APIRouter
from prometheus_client import CollectorRegistry

from crossroads.config import Config
from crossroads.store.base import Store
from crossroads.transport.tls import Certificates, HandshakeLimits
from crossroads.types import Address

T = TypeVar("T")


class Service(Protocol):
    """A running service."""

    name: str

    def describe(self) -> list[str]:
        """Where it listens, one string each (``"udp 0.0.0.0:3478"``)."""
        ...

    async def close(self) -> None:
        """Stop listening and release every socket and task. Idempotent."""
        ...


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
    #: Free-form shared objects between services of one runtime.
    shared: dict[str, Any] = field(default_factory=dict)
    #: Where the HTTP API listens (bound before any service starts).
    http_address: Address = ("", 0)
    #: The server certificate of the TLS listeners, None when TLS is off
    #: (see :func:`crossroads.transport.tls.certificates_for`).
    certificates: Certificates | None = None
    #: Bounds on TLS handshakes in progress, shared by every TLS listener.
    tls_limits: HandshakeLimits = field(default_factory=HandshakeLimits)

    def section(self, name: str, cls: type[T]) -> T:
        return self.config.section(name, cls)

    @property
    def host(self) -> str:
        return self.config.core.host

    def add_router(self, router: APIRouter) -> None:
        self.routers.append(router)
