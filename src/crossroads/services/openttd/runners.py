"""Runners: each drives one sans-I/O OpenTTD core against real sockets.

An :class:`AttemptRunner` runs a join's
:class:`~crossroads.proto.openttd.ladder.ConnectAttempt`, a
:class:`RegistrationRunner` a registration's
:class:`~crossroads.proto.openttd.registration.ServerRegistration`. Each executes
its core's commands in order, one at a time (a command may await the Store or
the bus); a Store request's answer goes back into the core as an input
(:func:`run_store_request` is the one place a Store request becomes a registry
call; :func:`run_store_flow` runs the flows that wait on nothing else). No
runner has a timer of its own: after every input a runner reports its core's
deadline to the coordinator (:meth:`RunnerOwner.schedule`), whose one
``get_timer`` / ``handle_timer`` covers them all
(:class:`~crossroads.proto.openttd.deadlines.DeadlineBook`). What a command needs
from the coordinator service is the small :class:`RunnerOwner` interface.

A :class:`DutyRunner` runs the service's periodic
:class:`~crossroads.proto.openttd.duties.Duties` on one timer of its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

from crossroads.errors import StoreError
from crossroads.proto.openttd.codes import split_ticket
from crossroads.proto.openttd.coordinator import GcMessage
from crossroads.proto.openttd.duties import Duties, Duty
from crossroads.proto.openttd.ladder import (
    Command,
    ConnectAttempt,
    Finished,
    IssueTicket,
    SendToClient,
    SendToServer,
    Side,
)
from crossroads.proto.openttd.record import ServerRecord
from crossroads.proto.openttd.registration import (
    EndSession,
    Refused,
    Registered,
    RegistrationCommand,
    ServerRegistration,
    StoreFailed,
)
from crossroads.proto.openttd.store import (
    AllServers,
    AnnounceInstance,
    DeadInstances,
    DeleteServer,
    DropTicket,
    GetServer,
    GetTicket,
    IndexNewgrfs,
    InstanceAlive,
    KeepCode,
    LoadNewgrfs,
    NewCode,
    NewgrfCounter,
    PutServer,
    PutTicket,
    StoreRead,
    StoreWrite,
    SweepServers,
)
from crossroads.proto.openttd.verify import Probe
from crossroads.services.base import stop_tasks
from crossroads.services.openttd.conn import PacketConnection
from crossroads.services.openttd.metrics import CoordinatorMetrics
from crossroads.services.openttd.probe import probe_game_server
from crossroads.services.openttd.registry import Registry
from crossroads.transport.driver import CoreTimer

log = logging.getLogger("crossroads.openttd")


async def run_store_request(
    registry: Registry, request: StoreRead | StoreWrite
) -> object:
    """Run a core's Store request: a read's answer, None for a write unless
    the write names one (what the core's ``store_result`` takes). Raises
    StoreError."""
    match request:
        case StoreRead(query=GetServer(code)):
            return await registry.get_server(code)
        case StoreRead(query=InstanceAlive(instance)):
            return await registry.instance_alive(instance)
        case StoreRead(query=NewCode()):
            return await registry.new_code()
        case StoreWrite(update=KeepCode(code)):
            await registry.keep_code(code)
        case StoreWrite(update=PutServer(record)):
            await registry.put_server(record)
        case StoreWrite(update=IndexNewgrfs(newgrfs, budget)):
            return await registry.index_newgrfs(newgrfs, budget)
        case StoreWrite(update=DeleteServer(code, session)):
            await registry.delete_server(code, session)
        case StoreRead(query=AllServers()):
            return await registry.all_servers()
        case StoreRead(query=DeadInstances(owners)):
            return await registry.dead_instances(set(owners))
        case StoreRead(query=NewgrfCounter()):
            return await registry.newgrf_counter()
        case StoreWrite(update=SweepServers(codes)):
            await registry.sweep(list(codes))
        case StoreWrite(update=LoadNewgrfs()):
            await registry.load_newgrfs()
        case StoreWrite(update=AnnounceInstance(instance)):
            return await registry.announce_instance(instance)
        case StoreRead(query=GetTicket(ticket_id)):
            return await registry.get_ticket(ticket_id)
        case StoreWrite(update=PutTicket(ticket_id, secret)):
            await registry.put_ticket(ticket_id, secret)
        case StoreWrite(update=DropTicket(ticket_id)):
            await registry.drop_ticket(ticket_id)
    return None


OutcomeT = TypeVar("OutcomeT")
OutcomeT_co = TypeVar("OutcomeT_co", covariant=True)


class StoreFlow(Protocol[OutcomeT_co]):
    """A short flow that only waits on the Store (a join's code lookup, a
    server's update or leaving): its commands are Store requests until one
    outcome ends it."""

    def start(self) -> Sequence[StoreRead | StoreWrite | OutcomeT_co]: ...
    def store_result(
        self, request: int, answer: object
    ) -> Sequence[StoreRead | StoreWrite | OutcomeT_co]: ...
    def store_failed(
        self, request: int
    ) -> Sequence[StoreRead | StoreWrite | OutcomeT_co]: ...


async def run_store_flow(
    registry: Registry, flow: StoreFlow[OutcomeT]
) -> OutcomeT | None:
    """Run ``flow`` to its outcome, executing its Store requests one at a time
    and feeding each answer (or failure) back; None if the flow stopped
    without an outcome."""
    commands = flow.start()
    while commands:
        command = commands[0]
        if not isinstance(command, StoreRead | StoreWrite):
            return command
        try:
            answer = await run_store_request(registry, command)
        except StoreError:
            commands = flow.store_failed(command.request)
        else:
            commands = flow.store_result(command.request, answer)
    return None


class ProbeSettings(Protocol):
    @property
    def probe_timeout(self) -> float: ...


class RunnerOwner(Protocol):
    """What the runners use of the coordinator service."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...
    @property
    def registry(self) -> Registry: ...
    @property
    def metrics(self) -> CoordinatorMetrics: ...
    @property
    def settings(self) -> ProbeSettings: ...
    @property
    def probe_slots(self) -> asyncio.Semaphore: ...
    @property
    def local_servers(self) -> dict[str, PacketConnection]: ...

    def send(self, conn: PacketConnection, message: GcMessage) -> None: ...

    async def send_to_server(
        self, record: ServerRecord, message: GcMessage
    ) -> None: ...

    def attempt_finished(self, runner: AttemptRunner, result: Finished) -> None: ...

    def registration_refused(
        self, runner: RegistrationRunner, refused: Refused
    ) -> None: ...

    def registration_store_failed(
        self, runner: RegistrationRunner, failed: StoreFailed
    ) -> None: ...

    def registration_concluded(
        self, runner: RegistrationRunner, registered: Registered
    ) -> None: ...

    async def end_session(self, owner: str, code: str, session: str) -> None: ...

    def schedule(self, runner: Runner) -> None:
        """``runner``'s deadline may have changed (after every input)."""
        ...


class Runner:
    """Executes a core's commands in order, one at a time; its deadline is kept
    by the coordinator's one timer."""

    def __init__(self, coordinator: RunnerOwner) -> None:
        self.coordinator = coordinator
        self.loop = coordinator.loop
        self.queue: deque[Any] = deque()
        self.task: asyncio.Task[None] | None = None
        self.finished = False

    def feed(self, commands: list[Any]) -> None:
        if commands:
            self.queue.extend(commands)
            if self.task is None:
                self.task = asyncio.create_task(self._drain())
        self.coordinator.schedule(self)

    async def _drain(self) -> None:
        try:
            while self.queue:
                await self.execute(self.queue.popleft())
        except Exception:
            log.exception("openttd: command failed")
        finally:
            self.task = None

    def fire(self, now: float) -> None:
        """The coordinator's timer found this runner's deadline due."""
        if not self.finished:
            self.feed(self.on_timer(now))

    def cancel(self) -> None:
        self.finished = True
        self.coordinator.schedule(self)

    def deadline(self) -> float | None:
        raise NotImplementedError

    def on_timer(self, now: float) -> list[Any]:
        raise NotImplementedError

    async def execute(self, command: Any) -> None:
        raise NotImplementedError


@dataclasses.dataclass(eq=False)
class AttemptRunner(Runner):
    """Drives one :class:`ConnectAttempt` against real sockets."""

    coordinator: RunnerOwner
    attempt: ConnectAttempt
    client: PacketConnection
    record: ServerRecord
    #: Messages held back to time a STUN pairing, with when each goes
    #: (their deadlines are this runner's too; dropped with the runner).
    held: list[tuple[float, Command]] = dataclasses.field(
        default_factory=list, init=False
    )

    def __post_init__(self) -> None:
        super().__init__(self.coordinator)

    def deadline(self) -> float | None:
        deadline = self.attempt.get_timer()
        for release, _ in self.held:
            if deadline is None or release < deadline:
                deadline = release
        return deadline

    def on_timer(self, now: float) -> list[Command]:
        released = [command for release, command in self.held if release <= now]
        self.held = [(release, c) for release, c in self.held if release > now]
        self.measure_round_trips()
        self.attempt.handle_timer(now)
        return released + self.attempt.pop_events()

    def measure_round_trips(self) -> None:
        """Tell the attempt both coordinator connections' round trips (the
        server's only when its connection is on this instance)."""
        attempt = self.attempt
        attempt.round_trip(Side.CLIENT, self.client.round_trip())
        server = self.coordinator.local_servers.get(self.record.code)
        attempt.round_trip(Side.SERVER, server.round_trip() if server else None)

    def _hold(self, delay: float, command: Command) -> None:
        # Never before a message still held for the same connection: a later
        # attempt's GC_STUN_CONNECT (a shorter lead) must not overtake the
        # earlier attempt's on the way to the server.
        release = self.loop.time() + delay
        for earlier, held in self.held:
            if type(held) is type(command):
                release = max(release, earlier)
        self.held.append((release, command))
        self.coordinator.schedule(self)

    def cancel(self) -> None:
        self.held.clear()
        super().cancel()

    async def execute(self, command: Command) -> None:
        coordinator = self.coordinator
        log.debug("openttd: join %s -> %s", self.record.code, command)
        match command:
            case SendToClient(message, delay) | SendToServer(message, delay) if (
                delay > 0
            ):
                self._hold(delay, dataclasses.replace(command, delay=0.0))
            case SendToClient(message):
                coordinator.send(self.client, message)
            case SendToServer(message):
                await coordinator.send_to_server(self.record, message)
            case IssueTicket(ticket):
                parts = split_ticket(ticket)
                if parts is not None:
                    try:
                        await run_store_request(
                            coordinator.registry, StoreWrite(0, PutTicket(*parts))
                        )
                    except StoreError:
                        coordinator.metrics.store_errors.inc()
            case Finished():
                coordinator.attempt_finished(self, command)


class RegistrationRunner(Runner):
    """Drives one :class:`ServerRegistration`: Store requests (answers fed
    back), probes, STUN, then the seat and the ACK."""

    def __init__(
        self,
        coordinator: RunnerOwner,
        flow: ServerRegistration,
        conn: PacketConnection,
    ) -> None:
        super().__init__(coordinator)
        self.flow = flow
        self.conn = conn
        self.probes: set[asyncio.Task[None]] = set()

    def deadline(self) -> float | None:
        return self.flow.get_timer()

    def on_timer(self, now: float) -> list[RegistrationCommand]:
        self.flow.handle_timer(now)
        return self.flow.pop_events()

    async def execute(self, command: RegistrationCommand) -> None:
        if self.finished:
            return  # the connection went away: nothing more to do or store
        coordinator = self.coordinator
        match command:
            case StoreRead() | StoreWrite():
                try:
                    answer = await run_store_request(coordinator.registry, command)
                except StoreError:
                    self._feed_failure(command.request)
                else:
                    self._feed_answer(command.request, answer)
            case SendToServer(message):
                coordinator.send(self.conn, message)
            case Probe(host, port):
                task = asyncio.create_task(self._probe(host, port))
                self.probes.add(task)
                task.add_done_callback(self.probes.discard)
            case EndSession(owner, code, session):
                try:
                    await coordinator.end_session(owner, code, session)
                except StoreError:
                    coordinator.metrics.store_errors.inc()
            case Refused():
                coordinator.registration_refused(self, command)
            case StoreFailed():
                coordinator.registration_store_failed(self, command)
            case Registered():
                coordinator.registration_concluded(self, command)

    def _feed_answer(self, request: int, answer: object) -> None:
        if not self.finished:
            self.feed(self.flow.store_result(request, answer, self.loop.time()))

    def _feed_failure(self, request: int) -> None:
        if not self.finished:
            self.feed(self.flow.store_failed(request, self.loop.time()))

    async def _probe(self, host: str, port: int) -> None:
        coordinator = self.coordinator
        async with coordinator.probe_slots:
            ok = await probe_game_server(host, port, coordinator.settings.probe_timeout)
        coordinator.metrics.probes.labels("ok" if ok else "failed").inc()
        if not self.finished:
            self.feed(self.flow.probe_result(host, ok, self.loop.time()))

    def cancel(self) -> None:
        super().cancel()
        for task in list(self.probes):
            task.cancel()


class DutyRunner:
    """Runs the service's periodic duties (proto/openttd/duties.py) on one
    timer, each duty as a task that never overlaps itself."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.duties = Duties()
        self.actions: dict[Duty, Callable[[], Awaitable[None]]] = {}
        self.running: set[asyncio.Task[None]] = set()
        self.timer = CoreTimer(self.loop, self.duties.get_timer, self.handle_timer)

    def add(
        self, duty: Duty, period: float, action: Callable[[], Awaitable[None]]
    ) -> None:
        """Run ``action`` now and every ``period`` seconds after it finished."""
        self.actions[duty] = action
        self.duties.add(duty, period, self.loop.time())
        self.timer.rearm()

    def handle_timer(self, now: float) -> None:
        self.duties.handle_timer(now)
        for duty in self.duties.pop_events():
            task = asyncio.create_task(self._run(duty))
            self.running.add(task)
            task.add_done_callback(self.running.discard)

    async def _run(self, duty: Duty) -> None:
        try:
            await self.actions[duty]()
        except StoreError as exc:
            # The store logs the outage once (store/redis.py); a line per duty
            # and period would bury it.
            log.debug("openttd: %s failed: %s", duty.value, exc)
        except Exception:
            log.exception("openttd: %s failed", duty.value)
        finally:
            self.duties.finished(duty, self.loop.time())
            self.timer.rearm()

    async def close(self) -> None:
        self.timer.close()
        await stop_tasks(self.running)
