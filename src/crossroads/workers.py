"""``crossroads serve --workers N``: one supervisor, N worker processes.

Theory of operation. The supervisor (the process the operator started) binds
nothing and opens no store: it starts N copies of ``crossroads serve`` with the
same arguments and ``CROSSROADS_WORKER_INDEX`` = 0..N-1 in their environment
(worker 0 first, the others once it says it is ready),
restarts one that dies (after 0.5 s, doubling to 30 s while it keeps dying
young), forwards SIGHUP to all of them (each re-reads flags, environment and
TOML as a single process does) and stops them all on SIGINT/SIGTERM.

Worker 0 is a whole crossroads: every enabled service, the HTTP port, every TCP
listener, the banner and ``server.json`` (with the supervisor's pid, so
``crossroads reload`` signals the supervisor). Workers 1..N-1 run only what
scales without moving per-client state between processes
(:func:`plan_workers`):

- STUN and TURN over UDP on the *same* ports, shared with SO_REUSEPORT
  (:mod:`crossroads.transport.reuseport`). The kernel hashes each datagram's
  4-tuple to one socket of the group, so a client keeps talking to one worker,
  which holds its allocation and owns its relayed sockets; a relayed socket is
  an ordinary ephemeral port of that worker, reached by peers directly.
- With a shared store (Redis), a Unity relay node each, on its own port
  (``--relay-port`` + index) and registered in the store like the nodes of any
  other instance: the allocations API (worker 0) places a host on the least
  loaded node, and the host and its joiners all talk to the address in their
  allocation, so they meet on that node's worker whatever the kernel's hash.
  This is exactly the multi-instance Redis mode of tests/e2e/test_relay_cluster.py.

What stays in worker 0 and why: STUN/TURN over TCP and TLS (an RFC 6062 data
connection must reach the worker of its control connection, and a new TCP
connection's hash says nothing about that), natneg (a negotiation's two clients
pair up by cookie in one process's memory), the OpenTTD coordinator's TCP TURN
pairing, RakNet punchthrough, p2p (its sessions live on one instance and its
redirects name an HTTP URL) and the HTTP port (the console's admin pages list
the sessions of the process that answers). Each extra worker serves its own
HTTP app (``/metrics``, ``/healthz``) on ``--http-port`` + index.

Worker 0 binds the shared UDP sockets of every worker at once, so each
SO_REUSEPORT group is whole before a client is served. The supervisor keeps a
duplicate of each (handed over with SCM_RIGHTS), gives a worker the ones made
for it, and gives them back to a restarted worker, so a worker's death never
changes the groups and never moves the other workers' clients (:mod:`crossroads.transport.reuseport` explains the kernel's
side). docs/architecture.md, "Workers", says why things are split this way.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Mapping, Sequence

from crossroads.config import Config, iter_settings
from crossroads.errors import ConfigError
from crossroads.services.relay import Config as RelayConfig
from crossroads.services.stun import Config as StunConfig
from crossroads.transport import reuseport
from crossroads.types import frozen

log = logging.getLogger("crossroads.workers")

#: Set by the supervisor in each worker's environment.
WORKER_INDEX_ENV = "CROSSROADS_WORKER_INDEX"
WORKER_COUNT_ENV = "CROSSROADS_WORKER_COUNT"
SUPERVISOR_PID_ENV = "CROSSROADS_SUPERVISOR_PID"

#: First restart delay of a dead worker, doubled while it keeps dying within
#: STABLE_AFTER of its start, up to RESTART_MAX: a worker that cannot start
#: (a port taken, Redis refusing) must not spin a core.
RESTART_MIN = 0.5
RESTART_MAX = 30.0
STABLE_AFTER = 30.0
#: How long stopping workers get to close cleanly before SIGKILL (each closes
#: its HTTP server within 5 s, crossroads.runtime.Runtime.close).
STOP_GRACE = 15.0
#: `crossroads serve` exits with 2 on a configuration or start-up error
#: (cli.fail); a worker doing so at its first start stops the whole server.
EXIT_CONFIG = 2

#: Services workers 1..N-1 may run (module docstring).
_SCALING_SERVICES = ("stun", "turn", "relay")


@frozen
class WorkerSlot:
    """Which worker this process is, from the supervisor's environment."""

    index: int
    count: int
    supervisor_pid: int


def current_worker(env: Mapping[str, str] | None = None) -> WorkerSlot | None:
    """This process's slot, or None when it is not a supervised worker."""
    env = os.environ if env is None else env
    raw = env.get(WORKER_INDEX_ENV)
    if raw is None:
        return None
    try:
        return WorkerSlot(
            int(raw), int(env[WORKER_COUNT_ENV]), int(env[SUPERVISOR_PID_ENV])
        )
    except (KeyError, ValueError):
        raise ConfigError(
            f"{WORKER_INDEX_ENV} is set but {WORKER_COUNT_ENV} or "
            f"{SUPERVISOR_PID_ENV} is missing or not a number"
        ) from None


@frozen
class WorkerPlan:
    """How many workers, and what workers 1..count-1 run."""

    count: int
    extra_services: tuple[str, ...]
    #: One log line saying why (empty for an explicit ``--workers 1``).
    reason: str


def _extra_services(config: Config) -> tuple[str, ...]:
    extra: list[str] = []
    if config.enabled("stun") and "stun" in config.sections:
        if config.section("stun", StunConfig).port != 0:
            # TURN runs on the STUN sockets: it goes where they go.
            extra += [s for s in ("stun", "turn") if config.enabled(s)]
    if (
        config.core.store != "memory"
        and config.enabled("relay")
        and "relay" in config.sections
    ):
        relay = config.section("relay", RelayConfig)
        if relay.port != 0 and not relay.api_only:
            extra.append("relay")
    return tuple(extra)


def plan_workers(config: Config, cpu_count: int | None = None) -> WorkerPlan:
    """Decide the worker count from ``--workers`` (0 = auto) and the config.

    Auto is one worker per core when the store is shared (Redis) and something
    can run in several workers; else 1, with the reason. An explicit count above
    1 with nothing to spread is a configuration error.
    """
    requested = config.core.workers
    extra = _extra_services(config)
    if requested == 1:
        return WorkerPlan(1, (), "")
    if requested == 0:
        if config.core.store == "memory":
            return WorkerPlan(
                1,
                (),
                "1 worker: the in-memory store is not shared between processes "
                "(--store redis://... runs one worker per core; --workers N "
                "spreads STUN/TURN over UDP even without it)",
            )
        cores = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
        if not extra or cores == 1:
            return WorkerPlan(
                1,
                (),
                "1 worker: "
                + (
                    "one core"
                    if extra
                    else "no service that runs in several workers (STUN/TURN "
                    "on a fixed --stun-port, a relay node on a fixed --relay-port)"
                ),
            )
        requested = cores
    if not extra:
        raise ConfigError(
            f"workers: {requested} workers need STUN/TURN on a fixed --stun-port "
            "(or, with a Redis --store, a relay node on a fixed --relay-port); "
            "nothing else runs in more than one process"
        )
    kept = [
        name
        for name in _SCALING_SERVICES
        if config.enabled(name) and name in config.sections and name not in extra
    ]
    why_kept = ""
    if "relay" in kept and config.core.store == "memory":
        why_kept = " (relay too: the in-memory store is not shared; use Redis)"
    return WorkerPlan(
        requested,
        extra,
        f"{requested} workers: every worker serves {', '.join(extra)} "
        f"(UDP, SO_REUSEPORT); worker 0 also runs the rest{why_kept}",
    )


def _offset_port(name: str, port: int, index: int) -> int:
    if port == 0:
        return 0
    if port + index > 65535:
        raise ConfigError(f"{name}: {port} + worker index {index} is above 65535")
    return port + index


def worker_config(config: Config, index: int, plan: WorkerPlan) -> Config:
    """The configuration worker ``index`` runs (module docstring)."""
    if index == 0:
        return config
    core = dataclasses.replace(
        config.core,
        only=plan.extra_services,
        http_port=_offset_port("http_port", config.core.http_port, index),
        # TLS listeners (TURN over TLS) stay with worker 0, as TCP does.
        tls_cert="",
        tls_key="",
        tls_dev_cert_dir="",
        # Worker 0 orders and renews the certificate (and holds port 80).
        acme_domain=(),
    )
    sections = dict(config.sections)
    if "stun" in sections:
        sections["stun"] = dataclasses.replace(
            config.section("stun", StunConfig), tcp=False
        )
    if "relay" in plan.extra_services:
        relay = config.section("relay", RelayConfig)
        sections["relay"] = dataclasses.replace(
            relay,
            port=_offset_port("relay.port", relay.port, index),
            # DTLS (PSK, no certificate) is UDP like the node; 7790 + index
            # keeps clear of the nodes' 7780 + index. WebSockets are TCP,
            # which stays with worker 0.
            dtls_port=_offset_port("relay.dtls_port", relay.dtls_port, index),
            websocket=False,
            public_port=_offset_port("relay.public_port", relay.public_port, index),
            node_only=True,
            node_id=f"{relay.node_id}-w{index}" if relay.node_id else "",
        )
    return Config(core=core, sections=sections)


def sibling_ports(config: Config, index: int, plan: WorkerPlan) -> frozenset[int]:
    """Every fixed port the workers other than ``index`` listen on, from their
    configurations: a TURN client of this worker must not reach them."""
    ports: set[int] = set()
    for other in range(plan.count):
        if other == index:
            continue
        theirs = worker_config(config, other, plan)
        ports.add(theirs.core.http_port)
        for section, f, info in iter_settings():
            if info.kind != "port" or section == "core":
                continue
            if not theirs.enabled(section) or section not in theirs.sections:
                continue
            ports.add(getattr(theirs.sections[section], f.name))
    ports.discard(0)
    return frozenset(ports)


def worker_command() -> list[str]:
    """The command line of a worker: this one's, run again."""
    return [sys.executable, "-m", "crossroads", *sys.argv[1:]]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    # PR_SET_PDEATHSIG (prctl(2)): a supervisor killed with SIGKILL takes its
    # workers with it instead of leaving them holding the ports.
    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


class Supervisor:
    """Starts, restarts, signals and stops the workers (module docstring)."""

    def __init__(
        self,
        plan: WorkerPlan,
        command: Sequence[str],
        env: Mapping[str, str],
        drain_timeout: float = 0.0,
    ) -> None:
        self.plan = plan
        #: ``--drain-timeout``: on SIGTERM the workers drain (runtime.py) and
        #: get this long, plus :data:`STOP_GRACE`, before they are killed.
        self.drain_timeout = drain_timeout
        #: The signal that stopped the supervisor: passed on to the workers
        #: (SIGTERM drains them, SIGINT stops them at once).
        self._stop_signal = signal.SIGTERM
        self.command = list(command)
        self.env = dict(env)
        self.processes: dict[int, asyncio.subprocess.Process] = {}
        self.exit_code = 0
        self._stopping = asyncio.Event()
        #: Per worker, the shared sockets it bound (transport/reuseport.py):
        #: kept across its restarts so the SO_REUSEPORT groups never change.
        self.held: dict[int, dict[str, socket.socket]] = {}
        self._ready: dict[int, asyncio.Event] = {}

    def _signal_all(self, signum: int) -> None:
        for process in self.processes.values():
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signum)

    def stop(self, signum: int = signal.SIGTERM) -> None:
        if self._stopping.is_set():
            # A second signal: draining workers stop at once on a second SIGTERM.
            log.info("second signal: stopping the workers now")
            self._signal_all(signal.SIGTERM)
            return
        self._stop_signal = signal.Signals(signum)
        self._stopping.set()

    def reload(self) -> None:
        log.info("reload: signalling %d worker(s)", len(self.processes))
        self._signal_all(signal.SIGHUP)

    def _receive_sockets(self, index: int, channel: socket.socket) -> None:
        """Keep the shared sockets worker ``index`` hands over (SCM_RIGHTS:
        "<worker> <key>", worker 0 handing over every worker's), and note its
        readiness."""
        while True:
            try:
                message, fds, _, _ = socket.recv_fds(channel, 256, 8)
            except OSError:  # BlockingIOError included: all read
                return
            if not message:
                return
            for fd in fds:
                # Received descriptors are inheritable (recv_fds ignores
                # MSG_CMSG_CLOEXEC), and every worker started later would
                # hold every kept socket; each is given its own (pass_fds).
                os.set_inheritable(fd, False)
            if message == reuseport.READY:
                self._ready.setdefault(index, asyncio.Event()).set()
            for fd in fds[1:]:  # one socket per message; close any extra
                os.close(fd)
            if not fds:
                continue
            owner, _, key = message.decode("utf-8", "replace").partition(" ")
            try:
                held = self.held.setdefault(int(owner), {})
            except ValueError:
                os.close(fds[0])
                continue
            previous = held.pop(key, None)
            if previous is not None:
                previous.close()
            held[key] = socket.socket(fileno=fds[0])

    async def _spawn(
        self, index: int
    ) -> tuple[asyncio.subprocess.Process, socket.socket]:
        held = self.held.get(index, {})
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        ours.setblocking(False)
        env = {
            **self.env,
            WORKER_INDEX_ENV: str(index),
            WORKER_COUNT_ENV: str(self.plan.count),
            SUPERVISOR_PID_ENV: str(os.getpid()),
            reuseport.CHANNEL_ENV: str(theirs.fileno()),
            reuseport.INHERITED_ENV: json.dumps(
                {key: sock.fileno() for key, sock in held.items()}
            ),
        }
        try:
            process = await asyncio.create_subprocess_exec(
                *self.command,
                env=env,
                preexec_fn=_die_with_parent,
                pass_fds=[theirs.fileno(), *(s.fileno() for s in held.values())],
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        asyncio.get_running_loop().add_reader(
            ours.fileno(), self._receive_sockets, index, ours
        )
        return process, ours

    async def _keep(self, index: int) -> None:
        loop = asyncio.get_running_loop()
        delay = RESTART_MIN
        first = True
        while not self._stopping.is_set():
            process, channel = await self._spawn(index)
            self.processes[index] = process
            if self._stopping.is_set():  # stopped while it was being spawned
                process.terminate()
            log.info(
                "worker %d/%d started (pid %d)", index, self.plan.count, process.pid
            )
            started = loop.time()
            try:
                code = await process.wait()
            finally:
                # What it handed over before dying is already queued: keep it.
                self._receive_sockets(index, channel)
                loop.remove_reader(channel.fileno())
                channel.close()
            if self._stopping.is_set():
                return
            if first and code == EXIT_CONFIG:
                log.error("worker %d could not start (exit %d): stopping", index, code)
                self.exit_code = EXIT_CONFIG
                self.stop()
                return
            if loop.time() - started >= STABLE_AFTER:
                delay = RESTART_MIN
            log.warning(
                "worker %d (pid %d) exited with %s; restarting in %.1f s",
                index,
                process.pid,
                code,
                delay,
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)
            delay = min(delay * 2, RESTART_MAX)
            first = False

    async def _stop_all(self) -> None:
        self._signal_all(self._stop_signal)
        grace = STOP_GRACE
        if self._stop_signal == signal.SIGTERM:
            grace += self.drain_timeout
        deadline = asyncio.get_running_loop().time() + grace
        for index, process in list(self.processes.items()):
            left = max(0.0, deadline - asyncio.get_running_loop().time())
            try:
                await asyncio.wait_for(process.wait(), left)
            except TimeoutError:
                log.warning("worker %d did not stop: killing it", index)
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()

    async def run(self) -> int:
        """Run until SIGINT/SIGTERM (or a worker that cannot start); the exit code."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self.stop, signum)
        loop.add_signal_handler(signal.SIGHUP, self.reload)
        # Worker 0 first: it makes every worker's shared sockets, so the
        # SO_REUSEPORT groups are whole before anyone serves a client
        # (transport/reuseport.py); the others start once it is ready.
        keepers = [asyncio.create_task(self._keep(0))]
        try:
            ready = self._ready.setdefault(0, asyncio.Event())
            waiters = [
                asyncio.create_task(ready.wait()),
                asyncio.create_task(self._stopping.wait()),
            ]
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            for waiter in waiters:
                waiter.cancel()
            if not self._stopping.is_set():
                keepers += [
                    asyncio.create_task(self._keep(index))
                    for index in range(1, self.plan.count)
                ]
            await self._stopping.wait()
            log.info("shutting down %d worker(s)", self.plan.count)
        finally:
            # Signals stay handled while the workers drain: a second SIGTERM
            # stops them at once (Supervisor.stop).
            try:
                await self._stop_all()
            finally:
                for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                    loop.remove_signal_handler(signum)
            for keeper in keepers:
                keeper.cancel()
            await asyncio.gather(*keepers, return_exceptions=True)
            for held in self.held.values():
                for sock in held.values():
                    sock.close()
            self.held.clear()
        log.info("stopped")
        return self.exit_code
