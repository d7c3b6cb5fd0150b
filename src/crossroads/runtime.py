"""Start the configured services in one process, and stop them cleanly."""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import socket
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from crossroads.config import Config
from crossroads.services import load_service_modules
from crossroads.services.base import Service, ServiceContext
from crossroads.store.base import Store, open_store
from crossroads.transport.admission import (
    BudgetCollector,
    ConnectionBudget,
    raise_fd_limit,
)
from crossroads.transport.kernel_drops import KernelDropCollector
from crossroads.transport.udp import bound_address, make_tcp_listener
from crossroads.types import Address
from crossroads.web.app import EmbeddedServer, create_app, make_http_server
from crossroads.web.guard import HttpGuard

log = logging.getLogger("crossroads")


@dataclass
class Runtime:
    """A running crossroads: its services, store and HTTP server."""

    config: Config
    store: Store
    metrics: CollectorRegistry
    services: dict[str, Service] = field(default_factory=dict)
    http_address: Address = ("", 0)
    _http: EmbeddedServer | None = None
    _http_task: asyncio.Task[None] | None = None
    _http_guard: HttpGuard | None = None
    #: The descriptor budget and per-listener admissions (caps, counts).
    connections: ConnectionBudget = field(default_factory=ConnectionBudget)
    _closed: bool = False

    def udp_ports(self) -> dict[int, str]:
        """Local UDP port -> the service listening on it, from what each
        service describes (the first service to name a port keeps it: TURN
        describes the STUN sockets it shares)."""
        ports: dict[int, str] = {}
        for name, service in self.services.items():
            for entry in service.describe():
                for match in _UDP_ADDRESS.finditer(entry):
                    ports.setdefault(int(match.group(1)), name)
        return ports

    def describe(self) -> list[str]:
        lines = [
            f"{name}: {', '.join(service.describe())}"
            for name, service in self.services.items()
        ]
        host, port = self.http_address
        lines.append(f"http: tcp {_join(host, port)} (/healthz, /metrics)")
        return lines

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._http is not None:
            self._http.should_exit = True
        if self._http_task is not None:
            try:
                await asyncio.wait_for(self._http_task, 5)
            except (TimeoutError, asyncio.CancelledError):
                self._http_task.cancel()
        if self._http_guard is not None:
            await self._http_guard.close()
        for name, service in reversed(list(self.services.items())):
            try:
                await service.close()
            except Exception:
                log.exception("error while closing %s", name)
        await self.store.close()


#: "udp 127.0.0.1:3478" or "udp [::]:3478" in a service's describe() line.
_UDP_ADDRESS = re.compile(r"\budp (?:\[[0-9a-fA-F:.]*\]|[0-9.]+):(\d+)")


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def start(config: Config, *, store: Store | None = None) -> Runtime:
    """Start every enabled service and the HTTP server; return when all listen."""
    modules = load_service_modules()
    store = store if store is not None else open_store(config.core.store)
    metrics = CollectorRegistry()
    runtime = Runtime(config=config, store=store, metrics=metrics)
    # The hard descriptor limit is the budget; TCP listeners share half of it
    # (crossroads.transport.admission explains the split).
    budget = runtime.connections = ConnectionBudget(raise_fd_limit())
    metrics.register(BudgetCollector(budget))
    metrics.register(KernelDropCollector(runtime.udp_ports))
    ctx = ServiceContext(
        config=config,
        store=store,
        metrics=metrics,
        log=log,
        running=runtime.services,
        connections=budget,
    )
    core = config.core
    guard = HttpGuard(
        budget.listener(
            "http", core.http_max_connections, core.http_max_connections_per_ip
        ),
        core.http_request_timeout,
    )
    sock: socket.socket | None = None
    try:
        # Bound first, so services know the HTTP port they are reached on (the
        # p2p service advertises its signalling URL to other instances).
        sock = make_tcp_listener(config.core.host, config.core.http_port)
        runtime.http_address = ctx.http_address = bound_address(sock)
        for name, module in modules.items():
            if config.enabled(name):
                service: Service = await module.serve(ctx)
                runtime.services[name] = service
        app = create_app(
            metrics=metrics,
            store=store,
            routers=ctx.routers,
            services=lambda: list(runtime.services),
        )
        runtime._http = make_http_server(app, guard)
        runtime._http_guard = guard
        guard.start()
        runtime._http_task = asyncio.create_task(runtime._http.serve(sockets=[sock]))
        while not runtime._http.started:
            if runtime._http_task.done():
                runtime._http_task.result()
                raise RuntimeError("HTTP server stopped during start-up")
            await asyncio.sleep(0.01)
    except BaseException:
        if runtime._http is None and sock is not None:
            sock.close()  # bound, but no server took it over
        await runtime.close()
        raise
    return runtime


async def serve_forever(config: Config) -> None:
    """``crossroads serve``: start, log the addresses, run until SIGINT/SIGTERM."""
    # Handlers first: /healthz answers before start() returns, and a SIGTERM
    # sent as soon as it does must stop the process cleanly, not kill it.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        runtime = await start(config)
    except BaseException:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
        raise
    for line in runtime.describe():
        log.info("%s", line)
    try:
        await stop.wait()
        log.info("shutting down")
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
        await runtime.close()
    log.info("stopped")
