"""One server's registration, SERVER_REGISTER to GC_REGISTER_ACK (sans-I/O).

Theory of operation
-------------------
A registration that passed the admission tests
(:func:`~crossroads.proto.openttd.admission.refuse_registration`) goes through
three stages. The core never touches the Store: it emits a typed request with a
correlation id (:class:`StoreRead` / :class:`StoreWrite`) and waits for the
service to feed the answer back (:meth:`ServerRegistration.store_result`, or
:meth:`ServerRegistration.store_failed` when the Store could not answer). Only
the answer to the request it waits for is taken; anything else is ignored.

1. **Choose the invite code** (reference ``openttd-coordinator.md`` section 3).
   A registration naming a code with a secret signed by one of our keys
   (:func:`~crossroads.proto.openttd.codes.check_invite_code_secret`) keeps
   that code: read its record (:class:`GetServer`); when a record exists and its
   owner is another instance, ask whether that instance lives
   (:class:`InstanceAlive`); :func:`~crossroads.proto.openttd.admission.may_take_over`
   decides. A second server with a copied secret is refused
   (REUSE_OF_INVITE_CODE); the same server reconnecting ends its old session
   (:class:`EndSession`); then the code's reservation is renewed
   (:class:`KeepCode`). The same connection registering again keeps its code;
   any other registration gets a fresh one (:class:`NewCode`).
2. **Check reachability**: the
   :class:`~crossroads.proto.openttd.verify.RegistrationCheck` runs inside this
   core; its commands (:class:`~crossroads.proto.openttd.ladder.SendToServer`,
   :class:`~crossroads.proto.openttd.verify.Probe`) pass through, its timer is
   this core's timer, and STUN reports and probe results are fed through.
3. **Store the record**: the check's conclusion becomes the server's record
   (:func:`~crossroads.proto.openttd.admission.registered_record`), written with
   :class:`PutServer`; once written, :class:`Registered` tells the service to
   seat the server and ACK.

A Store failure while choosing the code ends the registration with
:class:`StoreFailed` without an answer (OpenTTD retries with back-off, whereas
REGISTRATION_FAILED would switch the server to a local game for good); a
failure to write the record answers REGISTRATION_FAILED, as the server has
waited through the whole check.

Wall-clock time (the record's timestamps) is derived from ``now``: the service
gives the wall time that corresponded to the ``now`` it started the core with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, InitVar, dataclass, field
from enum import Enum

from crossroads.proto.core import EventQueue
from crossroads.proto.openttd.admission import (
    CODE_IN_USE,
    CODES_EXHAUSTED,
    Refusal,
    may_take_over,
    registered_record,
)
from crossroads.proto.openttd.codes import (
    check_invite_code_secret,
    looks_like_invite_code,
)
from crossroads.proto.openttd.coordinator import ErrorType, GcError, ServerRegister
from crossroads.proto.openttd.ladder import SendToServer
from crossroads.proto.openttd.record import ServerRecord
from crossroads.proto.openttd.store import (
    AwaitedRequest,
    GetServer,
    InstanceAlive,
    KeepCode,
    NewCode,
    PutServer,
    StoreQuery,
    StoreRead,
    StoreUpdate,
    StoreWrite,
)
from crossroads.proto.openttd.verify import (
    Concluded,
    Probe,
    RegistrationCheck,
    VerifyCommand,
)
from crossroads.types import frozen

# ----------------------------------------------------------------- outcomes


@frozen
class EndSession:
    """The server re-registers while its old session is still seated (at
    ``owner``, maybe this instance): close that session."""

    owner: str
    code: str
    session: str


@frozen
class Refused:
    """Answer GC_ERROR as ``refusal`` says and close; its ``result`` labels
    the registrations metric."""

    refusal: Refusal


@frozen
class StoreFailed:
    """The Store failed: count it, send ``answer`` if any, close."""

    answer: GcError | None


@frozen
class Registered:
    """The record is stored: seat the server under ``record.code`` and ACK
    with ``concluded.connection_type``."""

    record: ServerRecord
    concluded: Concluded


RegistrationCommand = (
    StoreRead
    | StoreWrite
    | SendToServer
    | Probe
    | EndSession
    | Refused
    | StoreFailed
    | Registered
)


class Stage(Enum):
    CHOOSING = "choosing"
    CHECKING = "checking"
    STORING = "storing"
    DONE = "done"


class Step(Enum):
    """What stage 1 waits for."""

    NEW_CODE = "new-code"
    GET_SERVER = "get-server"
    INSTANCE_ALIVE = "instance-alive"
    KEEP_CODE = "keep-code"


@frozen
class Registrant:
    """Who registers: the connection's source and what it holds already."""

    #: Source address of the registration (the connection's peer).
    host: str
    #: Code the connection is registered under already, if any.
    current_code: str | None = None
    #: That code's record (its session, registration time and game info are
    #: kept when the same code registers again on the same connection).
    current_record: ServerRecord | None = None


@frozen
class RegistrationSettings:
    """What the coordinator knows that the flow needs."""

    instance: str
    #: Keys invite-code secrets may be signed with (the current one first).
    secret_keys: tuple[bytes, ...]
    turn_available: bool
    verify_timeout: float
    server_ttl: float


@dataclass(eq=False)
class ServerRegistration(EventQueue[RegistrationCommand]):
    """One registration's flow; see the module docstring. The commands an
    input causes are its return value; those of the timer are queued for
    :meth:`pop_events` (the core API)."""

    _: KW_ONLY
    #: Names the flow: its check's token and the new session.
    key: str
    message: ServerRegister = field(repr=False)
    registrant: Registrant
    settings: RegistrationSettings = field(repr=False)
    now: InitVar[float]
    wall: InitVar[float]
    stage: Stage = field(default=Stage.CHOOSING, init=False)
    code: str | None = field(default=None, init=False)
    check: RegistrationCheck | None = field(default=None, init=False)
    #: Unix time minus the ``now`` clock (``RelayServer.wall_offset`` too):
    #: record timestamps are wall time, deadlines are in ``now``.
    wall_offset: float = field(init=False)
    _request: int = field(default=0, init=False)
    _awaited: AwaitedRequest = field(default_factory=AwaitedRequest, init=False)
    _step: Step = field(default=Step.NEW_CODE, init=False)
    _existing: ServerRecord | None = field(default=None, init=False)
    #: The record being written, and the check's conclusion.
    _stored: tuple[ServerRecord, Concluded] | None = field(default=None, init=False)

    def __post_init__(self, now: float, wall: float) -> None:
        super().__init__()
        self.wall_offset = wall - now

    # ----------------------------------------------------------- core API

    @property
    def _checking(self) -> RegistrationCheck | None:
        """The check, while its inputs count (stage 2)."""
        return self.check if self.stage is Stage.CHECKING else None

    def get_timer(self) -> float | None:
        check = self._checking
        return None if check is None else check.get_timer()

    def handle_timer(self, now: float) -> None:
        """The check's deadline; its commands go to :meth:`pop_events`."""
        check = self._checking
        if check is not None:
            check.handle_timer(now)
            self._events += self._from_check(check.pop_events(), now)

    @property
    def done(self) -> bool:
        return self.stage is Stage.DONE

    def start(self, now: float) -> list[RegistrationCommand]:
        """Begin: choose the code."""
        msg = self.message
        wanted, secret = msg.invite_code, msg.invite_code_secret
        if (
            wanted
            and secret
            and looks_like_invite_code(wanted)
            and any(
                check_invite_code_secret(key, wanted, secret)
                for key in self.settings.secret_keys
            )
        ):
            if self.registrant.current_code == wanted:
                # The same connection registers again (a settings change).
                return self._start_check(wanted, now)
            self.code = wanted
            self._step = Step.GET_SERVER
            return [self._read(GetServer(wanted))]
        if self.registrant.current_code is not None:
            return self._start_check(self.registrant.current_code, now)
        self._step = Step.NEW_CODE
        return [self._read(NewCode())]

    def store_result(
        self, request: int, answer: object, now: float
    ) -> list[RegistrationCommand]:
        """The answer to ``request`` (see each request's docstring)."""
        if self.stage is Stage.DONE or not self._awaited.answered(request):
            return []
        if self.stage is Stage.STORING:
            assert self._stored is not None
            self.stage = Stage.DONE
            return [Registered(*self._stored)]
        return self._choose(answer, now)

    def store_failed(self, request: int, now: float) -> list[RegistrationCommand]:
        """The Store could not answer ``request``."""
        if self.stage is Stage.DONE or not self._awaited.answered(request):
            return []
        storing = self.stage is Stage.STORING
        self.stage = Stage.DONE
        if storing:
            return [
                StoreFailed(
                    GcError(
                        ErrorType.REGISTRATION_FAILED, "coordinator storage unavailable"
                    )
                )
            ]
        return [StoreFailed(None)]

    def stun_result(
        self, family: int, ok: bool, now: float
    ) -> list[RegistrationCommand]:
        """The server's GC_STUN_RESULT for our V token."""
        return self._to_check(lambda check: check.stun_result(family, ok, now), now)

    def stun_observed(
        self, family: int, host: str, now: float
    ) -> list[RegistrationCommand]:
        """The STUN service saw the server's V token from ``host``."""
        return self._to_check(lambda check: check.stun_observed(family, host, now), now)

    def probe_result(
        self, host: str, ok: bool, now: float
    ) -> list[RegistrationCommand]:
        """A :class:`Probe` finished."""
        return self._to_check(lambda check: check.probe_result(host, ok, now), now)

    def _to_check(
        self,
        event: Callable[[RegistrationCheck], list[VerifyCommand]],
        now: float,
    ) -> list[RegistrationCommand]:
        """Feed ``event`` to the check while its inputs count (stage 2); what
        it emits, its conclusion turned into the record's write."""
        check = self._checking
        return [] if check is None else self._from_check(event(check), now)

    # -------------------------------------------------------------- stages

    def _read(self, query: StoreQuery) -> StoreRead:
        self._request += 1
        return self._awaited.read(self._request, query)

    def _write(self, update: StoreUpdate) -> StoreWrite:
        self._request += 1
        return self._awaited.write(self._request, update)

    def _choose(self, answer: object, now: float) -> list[RegistrationCommand]:
        """A step of stage 1 got its answer (a malformed one is a failure)."""
        code = self.code
        match self._step:
            case Step.NEW_CODE if isinstance(answer, str):
                return self._start_check(answer, now)
            case Step.NEW_CODE if answer is None:
                # The deployment's invite-code cap is reached.
                self.stage = Stage.DONE
                return [Refused(CODES_EXHAUSTED)]
            case Step.GET_SERVER if answer is None and code is not None:
                return [self._keep(code)]
            case Step.GET_SERVER if isinstance(answer, ServerRecord):
                self._existing = answer
                if answer.owner == self.settings.instance:
                    return self._decide(answer, True)
                self._step = Step.INSTANCE_ALIVE
                return [self._read(InstanceAlive(answer.owner))]
            case Step.INSTANCE_ALIVE if (
                isinstance(answer, bool) and self._existing is not None
            ):
                return self._decide(self._existing, answer)
            case Step.KEEP_CODE if code is not None:
                return self._start_check(code, now)
        self.stage = Stage.DONE
        return [StoreFailed(None)]

    def _keep(self, code: str) -> StoreWrite:
        self._step = Step.KEEP_CODE
        return self._write(KeepCode(code))

    def _decide(self, existing: ServerRecord, alive: bool) -> list[RegistrationCommand]:
        msg = self.message
        verdict = may_take_over(existing, self.registrant.host, msg.server_port, alive)
        if verdict is None:
            self.stage = Stage.DONE
            return [Refused(CODE_IN_USE)]
        commands: list[RegistrationCommand] = []
        if verdict.drop_session:
            commands.append(EndSession(existing.owner, existing.code, existing.session))
        commands.append(self._keep(existing.code))
        return commands

    def _start_check(self, code: str, now: float) -> list[RegistrationCommand]:
        self.code = code
        self.stage = Stage.CHECKING
        msg = self.message
        self.check = RegistrationCheck(
            check_key=self.key,
            server_version=msg.protocol,
            source_host=self.registrant.host,
            server_port=msg.server_port,
            turn_available=self.settings.turn_available,
            now=now,
            timeout=self.settings.verify_timeout,
        )
        return self._from_check(self.check.start(now), now)

    def _from_check(
        self, commands: list[VerifyCommand], now: float
    ) -> list[RegistrationCommand]:
        out: list[RegistrationCommand] = []
        for command in commands:
            if isinstance(command, Concluded):
                out.append(self._store_record(command, now))
            else:
                out.append(command)
        return out

    def _store_record(self, concluded: Concluded, now: float) -> StoreWrite:
        assert self.code is not None
        registrant = self.registrant
        record = registered_record(
            code=self.code,
            instance=self.settings.instance,
            msg=self.message,
            result=concluded,
            source=registrant.host,
            new_session=self.key,
            previous=(
                registrant.current_record
                if registrant.current_code == self.code
                else None
            ),
            wall=now + self.wall_offset,
            ttl=self.settings.server_ttl,
        )
        self.stage = Stage.STORING
        self._stored = (record, concluded)
        return self._write(PutServer(record))
