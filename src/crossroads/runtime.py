"""Start the configured services in one process, and stop them cleanly."""

from __future__ import annotations

import asyncio
import datetime
import functools
import json
import logging
import os
import re
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Gauge

from crossroads.config import Config, CoreConfig
from crossroads.errors import ConfigError
from crossroads.insight import Config as InsightConfig
from crossroads.insight import InsightRecorder, recorder_for
from crossroads.services import load_service_modules
from crossroads.services.base import Drainable, Reloadable, Service, ServiceContext
from crossroads.services.openttd import OpenTTDService
from crossroads.services.relay import RelayService
from crossroads.services.relay_allocations import NodeInfo
from crossroads.services.stun import StunService
from crossroads.state import MATRIX_FILE, resolve_state_dir, results_dir
from crossroads.store import open_store
from crossroads.store.base import Store
from crossroads.transport import reuseport
from crossroads.transport.admission import (
    BudgetCollector,
    ResourceBudget,
    raise_fd_limit,
)
from crossroads.transport.kernel_drops import KernelDropCollector
from crossroads.transport.planes import Dataplane
from crossroads.transport.planes import announce as announce_dataplane
from crossroads.transport.planes import select as select_dataplane
from crossroads.transport.routes import RouteTable
from crossroads.transport.sockets import (
    bound_address,
    live_listeners,
    make_tcp_listener,
)
from crossroads.transport.tls import (
    Certificates,
    TlsAcceptor,
    certificates_for,
    tls_tables,
)
from crossroads.transport.tls_sort import ALPN, Application, TlsSorter
from crossroads.types import Address, show_address
from crossroads.web.app import EmbeddedServer, create_app, make_http_server
from crossroads.web.console import Console
from crossroads.web.guard import HttpGuard
from crossroads.web.insight import insight_router
from crossroads.workers import WorkerSlot

if TYPE_CHECKING:
    # Imported when --acme-domain is set: the ACME library (and requests) load
    # only for the processes that use them.
    from crossroads.acme import AcmeManager, ChallengeListener, Challenges

log = logging.getLogger("crossroads")

#: Seconds between two counts of the live sessions while draining: an exit a
#: second after the last session ends is soon enough for any orchestrator.
DRAIN_POLL = 1.0


@dataclass
class Runtime:
    """A running crossroads: its services, store and HTTP server."""

    config: Config
    store: Store
    metrics: CollectorRegistry
    services: dict[str, Service] = field(default_factory=dict)
    http_address: Address = ("", 0)
    console: Console | None = None
    #: The TLS certificate, reloaded on SIGHUP; None when TLS is off.
    certificates: Certificates | None = None
    _http: EmbeddedServer | None = None
    _http_task: asyncio.Task[None] | None = None
    _http_guard: HttpGuard | None = None
    #: The HTTPS listener (--https-port with a certificate), and its address.
    _https: asyncio.Server | None = None
    https_address: Address | None = None
    #: The one resource budget: listeners and per-client tables (caps, counts).
    resources: ResourceBudget = field(default_factory=ResourceBudget)
    #: Connection insight: the records services write (crossroads.insight).
    insight: InsightRecorder = field(default_factory=InsightRecorder)
    #: True once :meth:`drain` was called (SIGTERM, ``crossroads drain``).
    draining: bool = False
    #: Set when a drain is over: the last session ended or the timeout passed.
    drained: asyncio.Event = field(default_factory=asyncio.Event)
    #: Called instead of :meth:`drain` by the admin API when another process
    #: must start the drain (a ``--workers`` supervisor drains every worker).
    drain_request: Callable[[], None] | None = None
    _drain_deadline: float = 0.0
    _drain_task: asyncio.Task[None] | None = None
    _draining_gauge: Gauge | None = None
    #: Automatic certificates (--acme-domain): the renewal task and the
    #: HTTP-01 listener (--acme-http-port), None when off.
    acme: AcmeManager | None = None
    acme_listener: ChallengeListener | None = None
    _closed: bool = False
    #: The relay data plane in use (--dataplane; crossroads.transport.planes).
    dataplane: Dataplane | None = None

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
        lines.append(
            f"http: tcp {show_address((host, port))} (console /, /admin, /healthz, /metrics)"
        )
        if self.https_address is not None:
            lines.append(
                f"https: tcp {show_address(self.https_address)} (the same, over TLS)"
            )
        if self.acme is not None:
            where = (
                f"tcp {show_address(self.acme_listener.address)} and the HTTP port"
                if self.acme_listener is not None
                else "the HTTP port"
            )
            lines.append(
                f"acme: certificate for {', '.join(self.acme.order.domains)} from "
                f"{self.acme.order.directory_url} (http-01 on {where})"
            )
        return lines

    # -- what the console shows of particular services (web/ does not import
    # services/: the runtime, above both, hands these to it)

    async def relay_nodes(self) -> list[NodeInfo]:
        """Every live relay node, as the allocations API sees them."""
        relay = self.services.get("relay")
        return await relay.live_nodes() if isinstance(relay, RelayService) else []

    def bound_ports(self) -> dict[str, int]:
        """The ports clients reach this process's services on, as bound."""
        found: dict[str, int] = {}
        stun = self.services.get("stun")
        if isinstance(stun, StunService):
            found["stun"] = stun.primary[1]
        openttd = self.services.get("openttd")
        if isinstance(openttd, OpenTTDService):
            found["coordinator"] = openttd.address("coordinator")[1]
            found["openttd_stun"] = openttd.address("stun")[1]
        relay = self.services.get("relay")
        if isinstance(relay, RelayService) and relay.node is not None:
            found["relay"] = relay.node.info.port
        return found

    def turn_tls_port(self) -> int | None:
        """The port TURN over TLS listens on, None when it does not."""
        stun = self.services.get("stun")
        if isinstance(stun, StunService) and stun.tls_addresses:
            return stun.tls_addresses[0][1]
        return None

    def live_sessions(self) -> dict[str, int]:
        """Live sessions per drainable service (what a drain waits for)."""
        return {
            name: service.live_sessions()
            for name, service in self.services.items()
            if isinstance(service, Drainable)
        }

    def drain_status(self) -> dict[str, Any]:
        """What the admin API and ``crossroads drain`` show."""
        left = (
            max(0.0, self._drain_deadline - asyncio.get_running_loop().time())
            if self.draining
            else None
        )
        return {
            "draining": self.draining,
            "live_sessions": self.live_sessions(),
            "seconds_left": left,
        }

    def request_drain(self) -> dict[str, Any]:
        """The admin API's drain: this process's, or the supervisor's."""
        if self.drain_request is not None and not self.draining:
            self.drain_request()
        else:
            self.drain()
        return self.drain_status()

    def drain(self) -> None:
        """Stop taking new work; keep the live sessions until they end or
        ``--drain-timeout`` passes, then set :attr:`drained` (idempotent).

        Every :class:`Drainable` service refuses or redirects new sessions
        (TURN: 300 Try Alternate naming a peer node, else 486; the Unity relay
        node leaves the store's node listing, so the API places new hosts on
        other nodes ...); ``/readyz`` answers 503 and ``crossroads_draining``
        is 1. Live sessions keep working meanwhile."""
        if self.draining or self._closed:
            return
        loop = asyncio.get_running_loop()
        self.draining = True
        self._drain_deadline = loop.time() + self.config.core.drain_timeout
        if self._draining_gauge is not None:
            self._draining_gauge.set(1)
        self._drain_task = asyncio.create_task(self._drain(), name="drain")

    async def _drain(self) -> None:
        for name, service in self.services.items():
            if isinstance(service, Drainable):
                try:
                    await service.drain()
                except Exception:
                    log.exception("%s: drain failed; its sessions still end", name)
        loop = asyncio.get_running_loop()
        live = sum(self.live_sessions().values())
        log.info(
            "draining: %d live session(s); new sessions go to other instances; "
            "exiting when they end or in %.0f s (a second SIGTERM exits now)",
            live,
            self.config.core.drain_timeout,
        )
        while live:
            if loop.time() >= self._drain_deadline:
                log.warning(
                    "drain timeout (--drain-timeout %.0f s): exiting with %d "
                    "live session(s)",
                    self.config.core.drain_timeout,
                    live,
                )
                break
            await asyncio.sleep(
                min(DRAIN_POLL, max(0.0, self._drain_deadline - loop.time()))
            )
            live = sum(self.live_sessions().values())
        else:
            log.info("drained: no live session left")
        self.drained.set()

    def reload(self, config: Config) -> list[str]:
        """Hand a new configuration to every service that can apply it live.

        Raises:
            ConfigError: from the first service that refuses it.
        """
        applied: list[str] = []
        if self.certificates is not None and self.certificates.reload():
            applied.append("tls: certificate")
        if self.acme is not None:
            self.acme.check_now()
        for service in self.services.values():
            if isinstance(service, Reloadable):
                applied += service.reload(config)
        return applied

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._drain_task is not None:
            self._drain_task.cancel()
        if self._https is not None:
            self._https.close()
        if self.acme is not None:
            await self.acme.close()
        if self.acme_listener is not None:
            await self.acme_listener.close()
        if self._http is not None:
            self._http.should_exit = True
        if self._http_task is not None:
            try:
                await asyncio.wait_for(self._http_task, 5)
            except (TimeoutError, asyncio.CancelledError):
                self._http_task.cancel()
        if self.console is not None:
            await self.console.close()
        if self._http_guard is not None:
            await self._http_guard.close()
        for name, service in reversed(list(self.services.items())):
            try:
                await service.close()
            except Exception:
                log.exception("error while closing %s", name)
        await self.insight.close()
        await self.store.close()
        if self.dataplane is not None:
            self.dataplane.close()


#: "udp 127.0.0.1:3478" or "udp [::]:3478" in a service's describe() line.
_UDP_ADDRESS = re.compile(r"\budp (?:\[[0-9a-fA-F:.]*\]|[0-9.]+):(\d+)")


async def _listen_https(
    runtime: Runtime, ctx: ServiceContext, certificates: Certificates, guard: HttpGuard
) -> asyncio.Server:
    """The HTTP app over TLS on ``--https-port``, behind the same admission
    and deadlines as the HTTP port, with the certificate reloaded on SIGHUP.

    When TURN over TLS asked for the same port, connections are sorted by ALPN
    or first bytes (:mod:`crossroads.transport.tls_sort`)."""
    assert runtime._http is not None
    core = ctx.config.core
    sock = make_tcp_listener(core.host, core.https_port)
    address = bound_address(sock)
    http_protocol = runtime._http.protocol_factory()
    # Handshake and sorting failures, with the HTTP port's other closes.
    drop = guard.admission.closed
    turn = ctx.https_port_guest
    context = certificates.context
    protocol: Callable[[], asyncio.Protocol] = http_protocol
    # Its own connection table until the handshake (and the sorting) is
    # done, so that a flood of idle TLS connections here leaves the plain HTTP
    # port its share; then the HTTP guard admits the connection to the HTTP
    # table like any request. Its own handshake and TLS connection tables
    # too (a flood of another TLS port leaves its handshakes alone).
    connections = runtime.resources.listener(
        "https", core.http_max_connections, core.http_max_connections_per_ip
    )
    tables = tls_tables(
        runtime.resources,
        "https",
        listener=connections,
        max_connections=core.http_max_connections,
        max_per_source=core.http_max_connections_per_ip,
        trusted=guard.is_trusted_proxy,
    )
    if turn is not None:
        context = certificates.context_with_alpn(list(ALPN))
        factories = {
            Application.TURN: turn.tls_protocol_factory(),
            Application.HTTP: http_protocol,
        }
        protocol = functools.partial(TlsSorter, factories, drop, admission=connections)
        turn.add_tls_address(address)
    try:
        server = await asyncio.get_running_loop().create_server(
            functools.partial(TlsAcceptor, context, protocol, tables, drop),
            sock=sock,
        )
    except BaseException:
        sock.close()
        tables.forget()
        runtime.resources.forget(connections.name)
        raise
    runtime.https_address = address
    runtime.resources.listen("http", "https", "tcp", address, connections.name)
    return server


async def _start_acme(
    runtime: Runtime,
    core: CoreConfig,
    certificates: Certificates,
    challenges: Challenges,
) -> None:
    """The HTTP-01 listener (unless --acme-http-port is 0) and the renewal
    task, which reloads ``certificates`` as SIGHUP does (crossroads.acme)."""
    from crossroads.acme import (
        AcmeCollector,
        AcmeManager,
        AcmeOrder,
        acme_dir,
        listen_challenges,
    )

    if core.acme_http_port:
        runtime.acme_listener = await listen_challenges(
            runtime.resources,
            core.host,
            core.acme_http_port,
            challenges,
            max_connections=core.http_max_connections,
            max_per_ip=core.http_max_connections_per_ip,
            request_timeout=core.http_request_timeout,
        )
    order = AcmeOrder(
        directory_url=core.acme_directory,
        domains=core.acme_domain,
        files=acme_dir(resolve_state_dir(core.state_dir)),
        challenges=challenges,
        email=core.acme_email,
        ca_bundle=core.acme_ca_bundle,
    )
    runtime.acme = AcmeManager(
        order,
        renew_before=datetime.timedelta(days=core.acme_renew_days),
        check_interval=core.acme_check_interval,
        reload=certificates.reload,
    )
    runtime.metrics.register(
        AcmeCollector(runtime.acme, lambda: certificates.not_after.timestamp())
    )
    runtime.acme.start()


def _record_listeners(
    budget: ResourceBudget, service: str, sockets: set[socket.socket]
) -> None:
    """Put every socket ``service`` bound while starting into the registry,
    under the service's name unless the service recorded it itself with a
    finer kind: a listener nobody describes is still attacked by the battery."""
    known = {(e.transport, e.address) for e in budget.listeners}
    for sock in sockets:
        try:
            address = bound_address(sock)
        except OSError:
            continue
        transport = "tcp" if sock.type == socket.SOCK_STREAM else "udp"
        if (transport, address) not in known:
            budget.listen(service, service, transport, address)


async def start(config: Config, *, store: Store | None = None) -> Runtime:
    """Start every enabled service and the HTTP server; return when all listen."""
    modules = load_service_modules()
    store = store if store is not None else open_store(config.core.store)
    metrics = CollectorRegistry()
    core = config.core
    if core.acme_domain:
        from crossroads.acme import prepare_files

        # The ACME files (a placeholder until the first order completes).
        certificates: Certificates | None = Certificates(
            *prepare_files(resolve_state_dir(core.state_dir), core.acme_domain)
        )
    else:
        certificates = certificates_for(
            core.tls_cert, core.tls_key, host=core.host, dev_dir=core.tls_dev_cert_dir
        )
    runtime = Runtime(
        config=config, store=store, metrics=metrics, certificates=certificates
    )
    # The hard descriptor limit is the budget; TCP listeners share half of it
    # (crossroads.transport.admission explains the split).
    budget = runtime.resources = ResourceBudget(
        raise_fd_limit(), core.memory_budget or None
    )
    metrics.register(BudgetCollector(budget))
    runtime.dataplane = select_dataplane(
        core.dataplane, gso=core.udp_gso, hook=core.kernel_hook
    )
    announce_dataplane(runtime.dataplane, metrics)
    runtime._draining_gauge = Gauge(
        "crossroads_draining",
        "1 while this instance drains (SIGTERM, crossroads drain): it takes no "
        "new sessions and exits when the live ones end or --drain-timeout passes.",
        registry=metrics,
    )
    kernel_drops = KernelDropCollector(runtime.udp_ports)
    metrics.register(kernel_drops)
    insight_config = config.sections.get("insight")
    insight = runtime.insight = recorder_for(
        insight_config
        if isinstance(insight_config, InsightConfig)
        else InsightConfig(),
        store,
        resolve_state_dir(core.state_dir),
    )
    insight.register(metrics)
    insight.start()
    ctx = ServiceContext(
        config=config,
        store=store,
        metrics=metrics,
        log=log,
        running=runtime.services,
        resources=budget,
        kernel_drops=kernel_drops,
        certificates=certificates,
        insight=insight,
        route_table=RouteTable(runtime.dataplane.kernel),
    )
    guard = HttpGuard(
        budget.listener(
            "http", core.http_max_connections, core.http_max_connections_per_ip
        ),
        core.http_request_timeout,
        core.trusted_proxies,
    )
    sock: socket.socket | None = None
    try:
        # Bound first, so services know the HTTP port they are reached on (the
        # p2p service advertises its signalling URL to other instances).
        sock = make_tcp_listener(config.core.host, config.core.http_port)
        runtime.http_address = ctx.http_address = bound_address(sock)
        budget.listen("http", "http", "tcp", runtime.http_address, "http")
        for name, module in modules.items():
            if config.enabled(name):
                before = live_listeners()
                service: Service = await module.serve(ctx)
                runtime.services[name] = service
                _record_listeners(budget, name, live_listeners() - before)
        runtime.console = Console(
            config=config,
            metrics=metrics,
            services=lambda: runtime.services,
            relay_nodes_source=runtime.relay_nodes,
            bound_ports=runtime.bound_ports,
            turn_tls_port=runtime.turn_tls_port,
            resources=budget.snapshot,
            certificates=certificates,
            draining=lambda: runtime.draining,
            drain=runtime.request_drain,
            matrix_path=results_dir(resolve_state_dir(config.core.state_dir))
            / MATRIX_FILE,
        )
        runtime.console.start()
        challenges: Challenges | None = None
        if core.acme_domain:
            from crossroads.acme import Challenges

            challenges = Challenges()
            ctx.routers.append(challenges.router())
        app = create_app(
            metrics=metrics,
            store=store,
            routers=[
                *ctx.routers,
                runtime.console.router(),
                insight_router(insight, runtime.console.refusal),
            ],
            services=lambda: list(runtime.services),
            ready=lambda: not runtime.draining,
            api_docs=core.api_docs,
        )
        runtime._http = make_http_server(app, guard, core.trusted_proxies)
        runtime._http_guard = guard
        guard.start()
        runtime._http_task = asyncio.create_task(runtime._http.serve(sockets=[sock]))
        while not runtime._http.started:
            if runtime._http_task.done():
                runtime._http_task.result()
                raise RuntimeError("HTTP server stopped during start-up")
            await asyncio.sleep(0.01)
        if challenges is not None and certificates is not None:
            await _start_acme(runtime, core, certificates, challenges)
        if core.https_port and certificates is not None:
            runtime._https = await _listen_https(runtime, ctx, certificates, guard)
        elif core.https_port:
            log.warning("no certificate (--tls-cert): no HTTPS on %d", core.https_port)
    except BaseException:
        if runtime._http is None and sock is not None:
            sock.close()  # bound, but no server took it over
        await runtime.close()
        raise
    return runtime


async def serve_forever(
    config: Config,
    reread: Callable[[], Config] | None = None,
    worker: WorkerSlot | None = None,
) -> None:
    """``crossroads serve``: start, log the addresses, run until SIGINT, or
    until a drain (SIGTERM, ``crossroads drain``) is over (Runtime.drain); a
    second SIGTERM stops a drain at once.

    Missing credentials are filled in from the state directory first
    (:mod:`crossroads.firstrun`); the development ones are printed to stdout, not
    logged (DESIGN: nothing secret in logs), with commands to try them. The
    state directory also gets ``server.json`` (pid and URL) for the admin CLI.
    SIGHUP calls ``reread`` (flags, environment and the TOML file again) and
    applies the result to the services that can reload live; a bad new
    configuration is logged and the running one kept. ``worker``: this process
    is one of ``--workers N`` (:mod:`crossroads.workers`); only worker 0 prints
    the banner and writes ``server.json``, naming the supervisor's pid.
    """
    from crossroads.firstrun import banner, prepare

    first_run = prepare(config)
    # Handlers first: /healthz answers before start() returns, and a SIGTERM
    # sent as soon as it does (or as soon as a supervisor reads the first
    # "ready" line) must stop the process cleanly, not kill it.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        runtime = await start(first_run.config)
    except BaseException:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
        raise
    primary = worker is None or worker.index == 0
    server_file: Path | None = None
    if primary:
        server_file = write_server_file(
            first_run.state_dir,
            runtime,
            pid=worker.supervisor_pid if worker is not None else None,
        )
    if worker is not None:
        register_worker_metric(runtime.metrics, worker)
        reuseport.announce_ready()
        # The admin API's drain drains every worker: the supervisor passes
        # its SIGTERM on to each (crossroads.workers).
        runtime.drain_request = functools.partial(
            os.kill, worker.supervisor_pid, signal.SIGTERM
        )

    def terminate() -> None:
        # The first SIGTERM drains (orchestrators send it, then wait their
        # grace period); a second one, or SIGINT, stops at once.
        if runtime.draining:
            log.info("second SIGTERM: stopping now")
            stop.set()
        else:
            runtime.drain()

    loop.add_signal_handler(signal.SIGTERM, terminate)
    drained = asyncio.create_task(runtime.drained.wait(), name="drained")
    drained.add_done_callback(lambda _: stop.set())
    for line in runtime.describe():
        log.info("%s", line)
    stun = runtime.services.get("stun")
    lines = (
        banner(
            first_run,
            stun=stun.primary if isinstance(stun, StunService) else None,
            http=runtime.http_address,
        )
        if primary
        else []
    )
    if lines:
        sys.stdout.write("\n".join(lines) + "\n")
        sys.stdout.flush()

    def reload() -> None:
        if reread is None:
            log.warning("reload: this server cannot re-read its configuration")
            if runtime.certificates is not None:
                runtime.certificates.reload()
            return
        try:
            applied = runtime.reload(prepare(reread()).config)
        except ConfigError as exc:
            log.error("reload refused, configuration unchanged: %s", exc)
            return
        for line in applied:
            log.info("reloaded %s", line)
        log.info("reload done (%d change(s) applied)", len(applied))

    loop.add_signal_handler(signal.SIGHUP, reload)
    try:
        await stop.wait()
        log.info("shutting down")
    finally:
        drained.cancel()
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.remove_signal_handler(signum)
        if server_file is not None:
            remove_server_file(
                server_file, worker.supervisor_pid if worker is not None else None
            )
        await runtime.close()
    log.info("stopped")


def register_worker_metric(metrics: CollectorRegistry, worker: WorkerSlot) -> None:
    """``crossroads_worker_info{worker, workers}``: which worker of how many
    answers this ``/metrics`` (each worker serves its own, crossroads.workers)."""
    gauge = Gauge(
        "crossroads_worker_info",
        "This process's worker index and the worker count (--workers).",
        ["worker", "workers"],
        registry=metrics,
    )
    gauge.labels(str(worker.index), str(worker.count)).set(1)


#: What ``crossroads serve`` leaves in the state directory while it runs.
SERVER_FILE = "server.json"


def remove_server_file(path: Path, pid: int | None = None) -> None:
    """Remove ``server.json`` if it is still ours (another server started on
    the same state directory since then owns it now); ``pid`` as in
    :func:`write_server_file`."""
    try:
        if json.loads(path.read_text()).get("pid") == (pid or os.getpid()):
            path.unlink()
    except (OSError, ValueError, AttributeError):
        pass


def write_server_file(
    state_dir: Path, runtime: Runtime, pid: int | None = None
) -> Path:
    """Record pid and HTTP URL so the admin CLI finds this server; ``pid``:
    the process to signal (the supervisor of ``--workers N``), default this one."""
    host, port = runtime.http_address
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    path = state_dir / SERVER_FILE
    body = {"pid": pid or os.getpid(), "url": f"http://{show_address((host, port))}"}
    try:
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.write_text(json.dumps(body) + "\n")
    except OSError as exc:
        log.warning("cannot write %s: %s (the admin CLI needs --url)", path, exc)
    return path
