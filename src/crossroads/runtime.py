"""Start the configured services in one process, and stop them cleanly."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from crossroads.config import Config
from crossroads.services import load_service_modules
from crossroads.services.base import Service, ServiceContext
from crossroads.store.base import Store, open_store
from crossroads.transport.tls import Certificates, certificates_for
from crossroads.transport.udp import bound_address, make_tcp_listener
from crossroads.types import Address
from crossroads.web.app import EmbeddedServer, create_app, make_http_server

log = logging.getLogger("crossroads")


@dataclass
class Runtime:
    """A running crossroads: its services, store and HTTP server."""

    config: Config
    store: Store
    metrics: CollectorRegistry
    services: dict[str, Service] = field(default_factory=dict)
    http_address: Address = ("", 0)
    #: The TLS certificate, reloaded on SIGHUP; None when TLS is off.
    certificates: Certificates | None = None
    _http: EmbeddedServer | None = None
    _http_task: asyncio.Task[None] | None = None
    _closed: bool = False

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
        for name, service in reversed(list(self.services.items())):
            try:
                await service.close()
            except Exception:
                log.exception("error while closing %s", name)
        await self.store.close()


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def start(config: Config, *, store: Store | None = None) -> Runtime:
    """Start every enabled service and the HTTP server; return when all listen."""
    modules = load_service_modules()
    store = store if store is not None else open_store(config.core.store)
    metrics = CollectorRegistry()
    core = config.core
    certificates = certificates_for(
        core.tls_cert, core.tls_key, host=core.host, dev_dir=core.tls_dev_cert_dir
    )
    runtime = Runtime(
        config=config, store=store, metrics=metrics, certificates=certificates
    )
    ctx = ServiceContext(
        config=config,
        store=store,
        metrics=metrics,
        log=log,
        running=runtime.services,
        certificates=certificates,
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
        runtime._http = make_http_server(app)
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
    """``crossroads serve``: start, log the addresses, run until SIGINT/SIGTERM;
    SIGHUP reloads the TLS certificate (live connections stay up)."""
    runtime = await start(config)
    for line in runtime.describe():
        log.info("%s", line)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    if runtime.certificates is not None:
        loop.add_signal_handler(signal.SIGHUP, runtime.certificates.reload)
    try:
        await stop.wait()
        log.info("shutting down")
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.remove_signal_handler(signum)
        await runtime.close()
    log.info("stopped")
