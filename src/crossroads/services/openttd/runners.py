"""What runs the sans-I/O OpenTTD cores' commands, knowing no service.

:func:`run_store_request` is the one place a core's Store request becomes a
registry call; :func:`run_store_flow` runs the flows that wait on nothing but
the Store (a join's code lookup, a server's update or leaving) to their
outcome. A :class:`CommandQueue` executes one core's commands in order, one at
a time, with the executor its owner gives: the coordinator service
(:mod:`.coordinator`) runs each join's
:class:`~crossroads.proto.openttd.ladder.ConnectAttempt` and each
registration's :class:`~crossroads.proto.openttd.registration.ServerRegistration`
that way, under its one timer. Nothing here calls back into the service.

A :class:`DutyRunner` runs the service's periodic
:class:`~crossroads.proto.openttd.duties.Duties` on one timer of its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

from crossroads.errors import StoreError
from crossroads.proto.openttd.duties import Duties, Duty
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
from crossroads.services.base import stop_tasks
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


class CommandQueue:
    """A core's commands, executed in order, one at a time (a command may
    await the Store or the bus). ``execute`` is the service's: the queue
    knows no owner, it only keeps the order."""

    __slots__ = ("_execute", "queue", "task")

    def __init__(self, execute: Callable[[Any], Awaitable[None]]) -> None:
        self._execute = execute
        self.queue: deque[Any] = deque()
        self.task: asyncio.Task[None] | None = None

    def extend(self, commands: Sequence[Any]) -> None:
        """Queue ``commands`` after those not yet executed."""
        if commands:
            self.queue.extend(commands)
            if self.task is None:
                self.task = asyncio.create_task(self._drain())

    async def _drain(self) -> None:
        try:
            while self.queue:
                await self._execute(self.queue.popleft())
        except Exception:
            log.exception("openttd: command failed")
        finally:
            self.task = None

    def stop(self) -> None:
        """Cancel the command being executed (the service stops)."""
        if self.task is not None:
            self.task.cancel()


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
