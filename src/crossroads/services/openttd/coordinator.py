"""The OpenTTD Game Coordinator service (TCP 3976).

This module is I/O glue around the sans-I/O cores in
:mod:`crossroads.proto.openttd`: it decodes packets, keeps per-connection state,
runs one :class:`~crossroads.proto.openttd.registration.ServerRegistration` per
registering server (invite code, reachability check, record) and one
:class:`~crossroads.proto.openttd.ladder.ConnectAttempt` per join
(its one :class:`Join` or :class:`Check` each: the coordinator executes the
core's commands in order, Store requests included, and feeds the answers back;
the cores call nothing, and :mod:`.runners` only keeps the order). The flows that only wait on the Store run through
:func:`~crossroads.services.openttd.runners.run_store_flow`: a join's code
lookup, a SERVER_UPDATE and a closed server's record
(:mod:`crossroads.proto.openttd.update`). Every deadline of every flow is under
one timer (:meth:`Coordinator.get_timer` / :meth:`Coordinator.handle_timer`).
The decisions are sans-I/O: who may register or join
(:mod:`crossroads.proto.openttd.admission`), where a report or any other bus
send goes (:mod:`crossroads.proto.openttd.routing`), what is listed
(:mod:`crossroads.proto.openttd.listing`). A command for a server held by
another instance, or a report for an attempt owned by another instance,
travels over the bus as a typed message (:mod:`crossroads.proto.openttd.bus`).

Rules for answering bad input (reference section 3, "How OpenTTD 13 reacts"):
an undecodable packet or a wrong protocol version gets GC_ERROR(UNKNOWN), which
makes OpenTTD close, and we close too; an unknown invite code gets
GC_ERROR(INVALID_INVITE_CODE) and the connection stays; a refused registration
gets REGISTRATION_FAILED (REUSE_OF_INVITE_CODE for a code held by another live
server, for peers at protocol 6).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from crossroads.errors import StoreError
from crossroads.insight import InsightRecorder
from crossroads.proto.budget import BudgetConfig, FailureBudget
from crossroads.proto.insight import MAX_STEPS, Attempt, Step, Usage
from crossroads.proto.openttd.admission import (
    Refusal,
    refuse_join,
    refuse_registration,
)
from crossroads.proto.openttd.attempts import AttemptBook
from crossroads.proto.openttd.bus import (
    BusMessage,
    DropSession,
    ForwardToServer,
    PeerReport,
    Report,
    StunReport,
    StunSeen,
)
from crossroads.proto.openttd.codes import (
    ParsedToken,
    TokenSide,
    invite_code_secret,
    make_attempt_id,
    make_ticket,
    split_ticket,
)
from crossroads.proto.openttd.coordinator import (
    VERSION_INVITE_CODES,
    VERSION_NEWGRF_LOOKUP,
    ClientConnect,
    ClientConnected,
    ClientListing,
    ConnectFailed,
    ErrorType,
    GcError,
    GcMessage,
    GcRegisterAck,
    PeerMessage,
    ServerGameType,
    ServerRegister,
    ServerUpdate,
    StunResult,
    decode_peer_packet,
    encode_gc_packet,
    error_for_version,
    listing_shape,
)
from crossroads.proto.openttd.deadlines import DeadlineBook
from crossroads.proto.openttd.ladder import (
    Command,
    ConnectAttempt,
    Finished,
    IssueTicket,
    SendToClient,
    SendToServer,
    Side,
)
from crossroads.proto.openttd.listing import lookup_packets
from crossroads.proto.openttd.lookup import CodeLookup
from crossroads.proto.openttd.record import ServerRecord
from crossroads.proto.openttd.registration import (
    EndSession,
    Refused,
    Registered,
    Registrant,
    RegistrationCommand,
    RegistrationSettings,
    ServerRegistration,
    StoreFailed,
)
from crossroads.proto.openttd.routing import (
    Forward,
    Ignore,
    Local,
    attempt_commands,
    check_commands,
    peer_report,
    report_side,
    route_end_session,
    route_forwarded_report,
    route_peer_report,
    route_stun_seen,
    route_to_server,
)
from crossroads.proto.openttd.seats import Seats
from crossroads.proto.openttd.store import PutTicket, StoreRead, StoreWrite
from crossroads.proto.openttd.update import (
    ServerLeavingFlow,
    ServerUpdateFlow,
    Updated,
    UpdateFailed,
)
from crossroads.proto.openttd.verify import Probe
from crossroads.services.openttd.bus import Bus
from crossroads.services.openttd.conn import PacketConnection
from crossroads.services.openttd.limits import AddressRateLimiter
from crossroads.services.openttd.listing import ListingCache
from crossroads.services.openttd.metrics import CoordinatorMetrics
from crossroads.services.openttd.probe import probe_game_server
from crossroads.services.openttd.registry import Registry
from crossroads.services.openttd.runners import (
    CommandQueue,
    run_store_flow,
    run_store_request,
)
from crossroads.services.openttd.turn import TurnHandler
from crossroads.transport.driver import CoreTimer
from crossroads.types import frozen

log = logging.getLogger("crossroads.openttd")

#: New NewGRFs one server session may add to the shared lookup table (a server
#: has at most 255; twice that covers a change of NewGRFs without letting a
#: bogus server fill the table).
NEWGRF_BUDGET_PER_SESSION = 512
#: Concurrent direct probes, process wide (each holds a socket for up to 3 s).
MAX_CONCURRENT_PROBES = 256


@frozen
class CoordinatorSettings:
    """The coordinator's knobs (from the service Config)."""

    connect_timeout: float
    stun_wait: float
    verify_timeout: float
    probe_timeout: float
    server_ttl: float
    registrations_per_minute: float
    max_servers_per_address: int
    listing_cache: float


@dataclass(eq=False)
class Join:
    """One join in progress: its core, the joining client's connection, the
    server's record, and the queue that runs its commands."""

    attempt: ConnectAttempt
    client: PacketConnection
    record: ServerRecord
    commands: CommandQueue = field(init=False)
    #: Messages held back to time a STUN pairing, with when each goes
    #: (their deadlines are the join's too; dropped with it).
    held: list[tuple[float, Command]] = field(default_factory=list)
    finished: bool = False


@dataclass(eq=False)
class Check:
    """One registration in progress: its core, the server's connection, the
    queue that runs its commands, and its direct probes."""

    flow: ServerRegistration
    conn: PacketConnection
    commands: CommandQueue = field(init=False)
    probes: set[asyncio.Task[None]] = field(default_factory=set)
    finished: bool = False


@dataclass(slots=True)
class PeerState:
    """What the coordinator knows about one connection."""

    version: int = 0
    #: Registered (ACKed) invite code, when this connection is a server.
    code: str | None = None
    session: str = ""
    server_port: int = 0
    game_type: int = 0
    check: Check | None = None
    record: ServerRecord | None = None
    newgrf_budget: int = NEWGRF_BUDGET_PER_SESSION
    superseded: bool = False


class Coordinator:
    """Game Coordinator logic for one instance (see the module docstring)."""

    def __init__(
        self,
        *,
        settings: CoordinatorSettings,
        registry: Registry,
        bus: Bus,
        metrics: CollectorRegistry,
        instance: str,
        secret_key: bytes,
        turn_address: Callable[[PacketConnection], str | None],
        random_bytes: Callable[[int], bytes] = os.urandom,
        wall_clock: Callable[[], float] = time.time,
        guesses: FailureBudget | None = None,
        insight: InsightRecorder | None = None,
    ) -> None:
        self.settings = settings
        #: Where each finished join's record goes (crossroads.insight).
        self.insight = insight if insight is not None else InsightRecorder()
        #: This instance's TURN relay, when it runs one: a join it relays
        #: keeps its record until the relay ends, to add the bytes carried.
        self.turn: TurnHandler | None = None
        #: Budget of CONNECTs naming an unknown invite code, per source and in
        #: total (proto/budget.py); the connection stayed open for the next
        #: guess, so nothing else bounded them.
        self.guesses = guesses or FailureBudget(BudgetConfig(0.0, 1.0, 0.0, 1.0))
        self.registry = registry
        self.bus = bus
        self.instance = instance
        self.secret_key = secret_key
        #: Keys this instance signed invite-code secrets with before it adopted
        #: another instance's re-published key (store/shared_secret.py): the
        #: servers it gave codes to keep them.
        self.previous_secret_keys: list[bytes] = []
        self.turn_address = turn_address
        self.random_bytes = random_bytes
        self.wall_clock = wall_clock
        self.loop = asyncio.get_running_loop()
        self.metrics = CoordinatorMetrics(metrics)
        self.seats: Seats[PacketConnection] = Seats()
        #: The servers registered here, by invite code (the seats' own dict).
        self.local_servers = self.seats.by_code
        self.attempts: AttemptBook[Join, PacketConnection] = AttemptBook()
        self.checks: dict[str, Check] = {}
        self.listing = ListingCache(registry, settings.listing_cache)
        self.register_limiter = AddressRateLimiter(settings.registrations_per_minute)
        self.probe_slots = asyncio.Semaphore(MAX_CONCURRENT_PROBES)
        #: Every join's and check's deadline, under one timer
        #: (proto/openttd/deadlines.py).
        self.deadlines: DeadlineBook[Join | Check] = DeadlineBook()
        self.timer = CoreTimer(self.loop, self.get_timer, self.handle_timer)

    # ---------------------------------------------------------------- timer

    def get_timer(self) -> float | None:
        """The earliest deadline of any join or registration check."""
        return self.deadlines.get_timer()

    def handle_timer(self, now: float) -> None:
        """Run the timers of the joins and checks whose deadline has come."""
        for due in self.deadlines.due(now):
            if due.finished:
                continue
            if isinstance(due, Check):
                due.flow.handle_timer(now)
                self._feed(due, due.flow.pop_events())
                continue
            released = [c for release, c in due.held if release <= now]
            due.held = [(release, c) for release, c in due.held if release > now]
            self._measure_round_trips(due)
            due.attempt.handle_timer(now)
            self._feed(due, released + due.attempt.pop_events())

    def _deadline(self, flow: Join | Check) -> float | None:
        if flow.finished:
            return None
        if isinstance(flow, Check):
            return flow.flow.get_timer()
        deadline = flow.attempt.get_timer()
        for release, _ in flow.held:
            if deadline is None or release < deadline:
                deadline = release
        return deadline

    def _schedule(self, flow: Join | Check) -> None:
        """Record ``flow``'s current deadline and re-arm the one timer."""
        self.deadlines.update(flow, self._deadline(flow))
        self.timer.rearm()

    def _feed(self, flow: Join | Check, commands: Sequence[Any]) -> None:
        """Queue a core's output for execution (after every input)."""
        flow.commands.extend(commands)
        self._schedule(flow)

    def _end(self, flow: Join | Check) -> None:
        flow.finished = True
        if isinstance(flow, Join):
            flow.held.clear()
        else:
            for task in list(flow.probes):
                task.cancel()
        self._schedule(flow)

    # ------------------------------------------------------------- plumbing

    @staticmethod
    def state(conn: PacketConnection) -> PeerState:
        if conn.state is None:
            conn.state = PeerState()
        assert isinstance(conn.state, PeerState)
        return conn.state

    def send(self, conn: PacketConnection, message: GcMessage) -> None:
        version = self.state(conn).version or 1
        if isinstance(message, GcError):
            message = GcError(error_for_version(message.error, version), message.detail)
            self.metrics.errors.labels(message.error.name).inc()
        conn.send(encode_gc_packet(message, version))

    def fail(
        self, conn: PacketConnection, error: ErrorType, detail: str, close: bool
    ) -> None:
        self.send(conn, GcError(error, detail[:99]))
        if close:
            conn.close(f"gc-error-{error.name.lower()}")

    def refuse(self, conn: PacketConnection, refusal: Refusal, kind: str) -> None:
        """A refused registration: counted, answered, closed."""
        self.metrics.registrations.labels(refusal.result, kind).inc()
        self.fail(conn, refusal.error, refusal.detail, refusal.close)

    def local_server_list(self) -> list[tuple[str, PacketConnection, PeerState]]:
        """(invite code, connection, state) of every server registered here."""
        return [
            (code, conn, self.state(conn)) for code, conn in self.local_servers.items()
        ]

    def kick_server(self, code: str) -> bool:
        """Unregister a server on an operator's order: GC_ERROR then close (the
        usual end of a connection; its record is withdrawn from the listing)."""
        conn = self.local_servers.get(code)
        if conn is None:
            return False
        self.fail(conn, ErrorType.REGISTRATION_FAILED, "removed by the operator", True)
        return True

    async def send_to_server(self, record: ServerRecord, message: GcMessage) -> None:
        data = encode_gc_packet(message, record.protocol)
        conn = self.local_servers.get(record.code)
        forward = route_to_server(record.code, record.owner, conn is not None, data)
        if forward is not None:
            await self.bus.publish(forward)
        elif conn is not None:
            conn.send(data)

    # ------------------------------------------------------ PacketHandler API

    async def handle(
        self, conn: PacketConnection, packet_type: int, payload: bytes
    ) -> None:
        message = decode_peer_packet(packet_type, payload)
        state = self.state(conn)
        if state.version == 0:
            state.version = message.protocol
        try:
            await self._dispatch(conn, state, message)
        except StoreError:
            # Our state is unreachable. Close without GC_ERROR: OpenTTD then
            # retries with back-off, whereas REGISTRATION_FAILED would switch a
            # server to a local game for good.
            self.metrics.store_errors.inc()
            conn.close("store-error")

    async def _dispatch(
        self, conn: PacketConnection, state: PeerState, message: PeerMessage
    ) -> None:
        match message:
            case ServerRegister():
                await self.on_register(conn, state, message)
            case ServerUpdate():
                await self.on_update(conn, state, message)
            case ClientListing():
                await self.on_listing(conn, state, message)
            case ClientConnect():
                await self.on_connect(conn, state, message)
            case ConnectFailed() | ClientConnected() | StunResult():
                report = peer_report(message)
                await self.on_report(conn, state, message.token, report)

    def rejected(self, conn: PacketConnection, reason: str) -> None:
        # GC_ERROR(UNKNOWN) makes OpenTTD close its side (Receive_GC_ERROR).
        self.fail(conn, ErrorType.UNKNOWN, f"malformed packet: {reason}", close=False)

    def closed(self, conn: PacketConnection) -> None:
        state = conn.state
        if not isinstance(state, PeerState):
            return
        now = self.loop.time()
        if state.check is not None:
            self.checks.pop(state.check.flow.key, None)
            self._end(state.check)
            state.check = None
        for join in self.attempts.of_client(conn):
            self._feed(join, join.attempt.peer_gone(Side.CLIENT, now))
        code = state.code
        if code is not None and self.seats.release(code, conn):
            self.metrics.servers.set(len(self.seats))
            for join in self.attempts.of_code(code):
                self._feed(join, join.attempt.peer_gone(Side.SERVER, now))
            if not state.superseded:
                task = asyncio.create_task(self._forget_server(code, state.session))
                task.add_done_callback(_log_task_error)

    async def _forget_server(self, code: str, session: str) -> None:
        left = await run_store_flow(self.registry, ServerLeavingFlow(code, session))
        if left is None or left.store_failed:
            self.metrics.store_errors.inc()
        self.listing.invalidate()

    # --------------------------------------------------------- registration

    async def on_register(
        self, conn: PacketConnection, state: PeerState, msg: ServerRegister
    ) -> None:
        now = self.loop.time()
        if state.check is not None:
            self.metrics.ignored.labels("register-during-check").inc()
            return
        refusal = refuse_registration(
            msg,
            self.register_limiter.allow(conn.host, now),
            state.code is not None,
            self.seats.count_from(conn.host),
            self.settings.max_servers_per_address,
        )
        if refusal is not None:
            self.refuse(conn, refusal, "none")
            return
        key = make_attempt_id(self.instance, self.random_bytes(12))
        flow = ServerRegistration(
            key=key,
            message=msg,
            registrant=Registrant(conn.host, state.code, state.record),
            settings=RegistrationSettings(
                instance=self.instance,
                secret_keys=(self.secret_key, *self.previous_secret_keys),
                turn_available=self.turn_address(conn) is not None,
                verify_timeout=self.settings.verify_timeout,
                server_ttl=self.settings.server_ttl,
            ),
            now=now,
            wall=self.wall_clock(),
        )
        check = Check(flow, conn)
        check.commands = CommandQueue(functools.partial(self._execute_check, check))
        state.check = check
        self.checks[key] = check
        self._feed(check, flow.start(now))

    async def _execute_check(self, check: Check, command: RegistrationCommand) -> None:
        """Execute one command of a registration's core."""
        if check.finished:
            return  # the connection went away: nothing more to do or store
        flow = check.flow
        match command:
            case StoreRead() | StoreWrite():
                try:
                    answer = await run_store_request(self.registry, command)
                except StoreError:
                    if not check.finished:
                        now = self.loop.time()
                        self._feed(check, flow.store_failed(command.request, now))
                else:
                    if not check.finished:
                        now = self.loop.time()
                        self._feed(
                            check, flow.store_result(command.request, answer, now)
                        )
            case SendToServer(message):
                self.send(check.conn, message)
            case Probe(host, port):
                task = asyncio.create_task(self._probe(check, host, port))
                check.probes.add(task)
                task.add_done_callback(check.probes.discard)
            case EndSession(owner, code, session):
                try:
                    await self.end_session(owner, code, session)
                except StoreError:
                    self.metrics.store_errors.inc()
            case Refused():
                self.registration_refused(check, command)
            case StoreFailed():
                self.registration_store_failed(check, command)
            case Registered():
                self.registration_concluded(check, command)

    async def _probe(self, check: Check, host: str, port: int) -> None:
        async with self.probe_slots:
            ok = await probe_game_server(host, port, self.settings.probe_timeout)
        self.metrics.probes.labels("ok" if ok else "failed").inc()
        if not check.finished:
            self._feed(check, check.flow.probe_result(host, ok, self.loop.time()))

    async def end_session(self, owner: str, code: str, session: str) -> None:
        """Close the seated session ``session`` of ``code``, here or at
        ``owner`` (a server re-registered while its old connection lived)."""
        forward = route_end_session(owner, code, session, self.instance)
        if forward is None:
            self.drop_local(code, session)
        else:
            await self.bus.publish(forward)

    def drop_local(self, code: str, session: str) -> None:
        conn = self.local_servers.get(code)
        if conn is None:
            return
        state = self.state(conn)
        if state.session != session:
            return
        state.superseded = True
        self.metrics.ignored.labels("superseded-session").inc()
        conn.close("superseded")

    def _registration_ended(self, check: Check) -> PeerState:
        state = self.state(check.conn)
        self.checks.pop(check.flow.key, None)
        self._end(check)
        if state.check is check:
            state.check = None
        return state

    def registration_refused(self, check: Check, refused: Refused) -> None:
        self._registration_ended(check)
        self.refuse(check.conn, refused.refusal, "none")

    def registration_store_failed(self, check: Check, failed: StoreFailed) -> None:
        self._registration_ended(check)
        self.metrics.store_errors.inc()
        if failed.answer is None:
            # Close without GC_ERROR: OpenTTD then retries with back-off.
            check.conn.close("store-error")
        else:
            self.fail(check.conn, failed.answer.error, failed.answer.detail, True)

    def registration_concluded(self, check: Check, registered: Registered) -> None:
        conn = check.conn
        state = self._registration_ended(check)
        if conn.closed:
            return
        record = registered.record
        code = record.code
        msg = check.flow.message
        displaced = self.seats.take(code, conn, conn.host, state.code)
        if displaced is not None:
            self.state(displaced).superseded = True
            displaced.close("superseded")
        self.metrics.servers.set(len(self.seats))
        state.code = code
        state.session = record.session
        state.record = record
        state.server_port = msg.server_port
        state.game_type = msg.game_type
        self.listing.invalidate()
        kind = registered.concluded.connection_type
        secret = invite_code_secret(self.secret_key, code)
        self.send(conn, GcRegisterAck(kind, code, secret))
        self.metrics.registrations.labels("ok", kind.name.lower()).inc()
        log.info(
            "openttd: server %s registered from %s:%d as %s (%s)",
            code,
            conn.host,
            msg.server_port,
            ServerGameType(msg.game_type).name.lower().replace("_", "-"),
            kind.name.lower(),
        )

    async def on_update(
        self, conn: PacketConnection, state: PeerState, msg: ServerUpdate
    ) -> None:
        record = state.record
        if record is None or state.code is None:
            # Updates only follow an ACK; anything else is a confused peer.
            self.fail(conn, ErrorType.UNKNOWN, "update before registration", close=True)
            return
        flow = ServerUpdateFlow(
            record,
            msg,
            state.newgrf_budget,
            self.wall_clock(),
            self.settings.server_ttl,
        )
        outcome = await run_store_flow(self.registry, flow)
        match outcome:
            case Updated(indexed, became_listable):
                state.newgrf_budget -= indexed
                if became_listable:
                    self.listing.invalidate()
                self.metrics.updates.inc()
            case UpdateFailed(indexed):
                state.newgrf_budget -= indexed
                self.metrics.store_errors.inc()

    def adopt_secret_key(self, key: bytes, previous: list[bytes]) -> None:
        """Sign new invite-code secrets with ``key``; still accept ``previous``."""
        self.secret_key = key
        self.previous_secret_keys = list(previous)

    def local_records(self) -> list[ServerRecord]:
        """The records of the servers connected to this instance."""
        records = []
        for conn in self.local_servers.values():
            record = self.state(conn).record
            if record is not None:
                records.append(record)
        return records

    # -------------------------------------------------------------- listing

    async def on_listing(
        self, conn: PacketConnection, state: PeerState, msg: ClientListing
    ) -> None:
        await self.listing.all(self.loop.time())
        version, nst = listing_shape(msg.protocol, msg.game_info_version)
        if msg.protocol >= VERSION_NEWGRF_LOOKUP:
            for data in lookup_packets(
                self.registry.newgrf_by_index, msg.newgrf_cursor
            ):
                conn.send(data)
        packets = self.listing.packer.packets(
            version, nst, msg.protocol >= VERSION_INVITE_CODES, msg.revision
        )
        for data in packets:
            conn.send(data)
            await conn.drain()
        self.metrics.listings.inc()

    # ---------------------------------------------------------------- joins

    async def on_connect(
        self, conn: PacketConnection, state: PeerState, msg: ClientConnect
    ) -> None:
        code = msg.invite_code
        if not self.guesses.try_spend(conn.host, self.loop.time()):
            # OpenTTD has no "slow down" error: UNKNOWN with a text, and the
            # connection closed so a guesser pays a reconnect per try.
            self.metrics.connects.labels("guess-budget", "none").inc()
            self.fail(conn, ErrorType.UNKNOWN, "too many unknown invite codes", True)
            return
        local = self.local_servers.get(code)
        resolved = await run_store_flow(
            self.registry,
            CodeLookup(code, self.state(local).record if local is not None else None),
        )
        assert resolved is not None  # a lookup always resolves
        record = resolved.record
        if resolved.store_failed:
            self.metrics.store_errors.inc()
        if record is not None or resolved.store_failed:
            self.guesses.refund(conn.host)  # not a wrong guess
        refusal = refuse_join(
            code, record is not None, self.attempts.count_of_client(conn)
        )
        if refusal is not None:
            self.metrics.connects.labels(refusal.result, "none").inc()
            self.fail(conn, refusal.error, refusal.detail, refusal.close)
            return
        assert record is not None
        now = self.loop.time()
        key = make_attempt_id(self.instance, self.random_bytes(12))
        turn = self.turn_address(conn)
        attempt = ConnectAttempt(
            attempt_key=key,
            invite_code=code,
            client_version=msg.protocol,
            server_version=record.protocol,
            direct=record.direct,
            turn_address=turn,
            ticket=make_ticket(self.random_bytes(16)),
            now=now,
            timeout=self.settings.connect_timeout,
            stun_wait=self.settings.stun_wait,
        )
        join = Join(attempt, conn, record)
        join.commands = CommandQueue(functools.partial(self._execute_join, join))
        self._measure_round_trips(join)
        self.attempts.add(key, code, conn, join)
        self._feed(join, attempt.start(now))

    def _measure_round_trips(self, join: Join) -> None:
        """Tell the attempt both coordinator connections' round trips (the
        server's only when its connection is on this instance)."""
        attempt = join.attempt
        attempt.round_trip(Side.CLIENT, join.client.round_trip())
        server = self.local_servers.get(join.record.code)
        attempt.round_trip(Side.SERVER, server.round_trip() if server else None)

    async def _execute_join(self, join: Join, command: Command) -> None:
        """Execute one command of a join's core."""
        log.debug("openttd: join %s -> %s", join.record.code, command)
        match command:
            case SendToClient(message, delay) | SendToServer(message, delay) if (
                delay > 0
            ):
                self._hold(join, delay, dataclasses.replace(command, delay=0.0))
            case SendToClient(message):
                self.send(join.client, message)
            case SendToServer(message):
                await self.send_to_server(join.record, message)
            case IssueTicket(ticket):
                parts = split_ticket(ticket)
                if parts is not None:
                    try:
                        await run_store_request(
                            self.registry, StoreWrite(0, PutTicket(*parts))
                        )
                    except StoreError:
                        self.metrics.store_errors.inc()
            case Finished():
                self.attempt_finished(join, command)

    def _hold(self, join: Join, delay: float, command: Command) -> None:
        # Never before a message still held for the same connection: a later
        # attempt's GC_STUN_CONNECT (a shorter lead) must not overtake the
        # earlier attempt's on the way to the server.
        release = self.loop.time() + delay
        for earlier, held in join.held:
            if type(held) is type(command):
                release = max(release, earlier)
        join.held.append((release, command))
        self._schedule(join)

    def attempt_finished(self, join: Join, result: Finished) -> None:
        self._end(join)
        key = join.attempt.attempt_key
        self.attempts.remove(key)
        outcome = "ok" if result.success else "failed"
        self.metrics.connects.labels(outcome, result.method).inc()
        log.info(
            "openttd: join of %s %s (%s, %s)",
            join.record.code,
            "succeeded" if result.success else "failed",
            result.method,
            result.reason,
        )
        record = join_record(self.insight, join, result)
        ticket = split_ticket(join.attempt.ticket)
        if (
            result.success
            and result.method == "turn"
            and self.turn is not None
            and ticket is not None
            and self.turn.watch(
                ticket[0], join.client.host, functools.partial(self._relayed, record)
            )
        ):
            return
        self.insight.record(record)

    def _relayed(self, record: Attempt, up: int, down: int) -> None:
        """A join's TURN relay ended here: its record, with what it carried
        (a TCP stream: bytes, no packets)."""
        usage = Usage(bytes_up=up, bytes_down=down)
        self.insight.record(dataclasses.replace(record, usage=usage))

    # --------------------------------------------------- reports and routing

    async def on_report(
        self,
        conn: PacketConnection,
        state: PeerState,
        token: str,
        report: Report,
    ) -> None:
        match route_peer_report(token, report, self.instance, state.code):
            case Local(parsed):
                self.local_report(parsed, report, conn, state.code)
            case Forward() as forward:
                await self.bus.publish(forward)
            case Ignore(reason):
                self.metrics.ignored.labels(reason).inc()

    def local_report(
        self,
        parsed: ParsedToken,
        report: Report,
        conn: PacketConnection | None,
        server_code: str | None,
    ) -> None:
        """A report on one of our attempts or checks (proto/openttd/routing.py)."""
        now = self.loop.time()
        log.debug(
            "openttd: report %s on %s%s", report, parsed.side.value, parsed.attempt_key
        )
        key = parsed.attempt_key
        if parsed.side is TokenSide.VERIFY:
            check = self.checks.get(key)
            if check is None or conn is not check.conn:
                self.metrics.ignored.labels("stale-token").inc()
                return
            self._feed(check, check_commands(check.flow, report, now))
            return
        join = self.attempts.get(key)
        if join is None:
            self.metrics.ignored.labels("stale-token").inc()
            return
        side = report_side(parsed, conn is join.client, server_code, join.record.code)
        if isinstance(side, Ignore):
            self.metrics.ignored.labels(side.reason).inc()
            return
        if isinstance(report, StunReport):
            self._measure_round_trips(join)
        commands = attempt_commands(join.attempt, side, report, now)
        if isinstance(commands, Ignore):
            self.metrics.ignored.labels(commands.reason).inc()
            return
        self._feed(join, commands)

    def stun_seen(self, token: str, family: int, host: str, port: int) -> None:
        """The STUN service saw ``token`` (ours) arrive from host:port."""
        route = route_stun_seen(token, self.instance)
        if isinstance(route, Ignore):
            self.metrics.ignored.labels(route.reason).inc()
            return
        parsed = route.parsed
        log.debug(
            "openttd: STUN saw %s family %d from %s:%d", token, family, host, port
        )
        now = self.loop.time()
        if parsed.side is TokenSide.VERIFY:
            check = self.checks.get(parsed.attempt_key)
            if check is not None:
                self._feed(check, check.flow.stun_observed(family, host, now))
            return
        join = self.attempts.get(parsed.attempt_key)
        if join is None:
            self.metrics.ignored.labels("stale-token").inc()
            return
        side = Side.CLIENT if parsed.side is TokenSide.CLIENT else Side.SERVER
        self._measure_round_trips(join)
        self._feed(join, join.attempt.stun_observed(side, family, host, port, now))

    def on_bus(self, message: BusMessage) -> None:
        """A command from another instance (or from our own STUN listener)."""
        match message:
            case ForwardToServer(code, data):
                conn = self.local_servers.get(code)
                if conn is None:
                    self.metrics.ignored.labels("send-to-unknown-server").inc()
                    return
                conn.send(data)
            case PeerReport(_, code, report):
                match route_forwarded_report(message, self.instance):
                    case Local(parsed):
                        self.local_report(parsed, report, None, code)
                    case Ignore(reason):
                        self.metrics.ignored.labels(reason).inc()
            case StunSeen(token, family, host, port):
                self.stun_seen(token, family, host, port)
            case DropSession(code, session):
                self.drop_local(code, session)

    # ------------------------------------------------------------ lifecycle

    async def close(self) -> None:
        self.timer.close()
        for join in self.attempts.drivers():
            self._end(join)
            join.commands.stop()
        for check in list(self.checks.values()):
            self._end(check)
            check.commands.stop()
        self.attempts.clear()
        self.checks.clear()
        for code, conn in list(self.local_servers.items()):
            await run_store_flow(
                self.registry, ServerLeavingFlow(code, self.state(conn).session)
            )
        await asyncio.sleep(0)


def _log_task_error(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("openttd: background task failed: %s", task.exception())


def join_record(insight: InsightRecorder, join: Join, result: Finished) -> Attempt:
    """A finished join as an insight record: the rungs tried (direct per
    address, STUN's request and pairs, TURN), the one that carried the game
    (only the client reports success, CLIENT_CONNECTED), and why the others
    did not. A join relayed by this instance's TURN relay gets the relay's
    bytes each way when the relay ends (:meth:`Coordinator._relayed`); one
    relayed by another instance has none (counted there, in
    ``crossroads_openttd_turn_bytes_total``)."""
    attempt = join.attempt
    history = attempt.history
    steps = tuple(
        Step(s.name, s.start, s.duration, s.outcome) for s in history[:MAX_STEPS]
    )
    duration = history[-1].start + history[-1].duration if history else 0.0
    missed = "; ".join(f"{s.name} {s.outcome}" for s in history if s.outcome != "ok")
    if result.success:
        relayed = result.method == "turn"
        outcome = "relayed" if relayed else "direct"
        cause = (missed or "turn only") if relayed else ""
    else:
        outcome = "failed"
        cause = missed or result.reason
    record = join.record
    return Attempt(
        family="openttd",
        session=record.code,
        started=insight.now() - duration,
        duration=duration,
        sides=(insight.side(join.client.host), insight.side(record.source)),
        steps=steps,
        winner=result.method if result.success else "",
        outcome=outcome,
        cause=cause,
        game=record.code,
    )
