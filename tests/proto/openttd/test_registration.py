"""A server's registration flow as a core: Store requests out, answers in."""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from crossroads.proto.openttd.admission import Refusal
from crossroads.proto.openttd.codes import invite_code_secret
from crossroads.proto.openttd.coordinator import (
    ConnectionType,
    ErrorType,
    GcConnectFailed,
    GcError,
    GcStunRequest,
    ServerGameType,
    ServerRegister,
)
from crossroads.proto.openttd.ladder import SendToServer
from crossroads.proto.openttd.record import ServerRecord
from crossroads.proto.openttd.registration import (
    EndSession,
    Refused,
    Registered,
    Registrant,
    RegistrationSettings,
    ServerRegistration,
    StoreFailed,
)
from crossroads.proto.openttd.store import (
    GetServer,
    InstanceAlive,
    KeepCode,
    NewCode,
    PutServer,
    StoreRead,
    StoreWrite,
)
from crossroads.proto.openttd.verify import CHECK_TIMEOUT, Probe
from tests.proto.openttd.timers import fire

KEY = b"instance key"
CODE = "+abcdefg"
SOURCE = "198.51.100.7"
SETTINGS = RegistrationSettings(
    instance="me",
    secret_keys=(KEY, b"older key"),
    turn_available=True,
    verify_timeout=CHECK_TIMEOUT,
    server_ttl=90.0,
)
#: The wall clock read when the flow started at now = 0.
WALL = 1_700_000_000.0
AF_INET, AF_INET6 = 2, 10


def flow(
    msg: ServerRegister | None = None,
    registrant: Registrant | None = None,
    version: int = 6,
) -> ServerRegistration:
    return ServerRegistration(
        key="me-check",
        message=msg or ServerRegister(version, ServerGameType.PUBLIC, 3979),
        registrant=registrant or Registrant(SOURCE),
        settings=SETTINGS,
        now=0.0,
        wall=WALL,
    )


def with_code(code: str = CODE, key: bytes = KEY) -> ServerRegister:
    return ServerRegister(
        6, ServerGameType.PUBLIC, 3979, code, invite_code_secret(key, code)
    )


def record(owner: str, source: str = SOURCE, port: int = 3979) -> ServerRecord:
    return ServerRecord(
        code=CODE,
        owner=owner,
        session="old-session",
        protocol=6,
        game_type=ServerGameType.PUBLIC,
        connection_type=ConnectionType.DIRECT,
        source=source,
        port=port,
        direct=[(source, port)],
        registered=WALL - 100,
        expires=WALL + 10,
    )


def only(commands: list[Any], kind: type) -> Any:
    assert len(commands) == 1 and isinstance(commands[0], kind), commands
    return commands[0]


def check_to_conclusion(reg: ServerRegistration, now: float) -> StoreWrite:
    """The server answers STUN (IPv4 seen and probed OK): the check concludes
    DIRECT and the flow writes the record."""
    assert reg.stun_result(AF_INET6, False, now) == []
    probes = reg.stun_observed(AF_INET, SOURCE, now)
    assert probes == []  # the source was probed at the start already
    assert reg.stun_result(AF_INET, True, now) == []
    out = reg.probe_result(SOURCE, True, now)
    assert reg.check is not None
    assert out[0] == SendToServer(GcConnectFailed(reg.check.token))
    return only(out[1:], StoreWrite)


def test_a_new_server_gets_a_new_code_then_is_checked_then_stored() -> None:
    reg = flow()
    read = only(reg.start(0.0), StoreRead)
    assert read.query == NewCode()
    assert reg.get_timer() is None  # no deadline while the Store answers
    started = reg.store_result(read.request, CODE, 0.5)
    assert reg.check is not None
    assert started == [
        SendToServer(GcStunRequest(reg.check.token)),
        Probe(SOURCE, 3979),
    ]
    assert reg.get_timer() == 0.5 + CHECK_TIMEOUT
    write = check_to_conclusion(reg, 2.0)
    assert isinstance(write.update, PutServer)
    stored = write.update.record
    assert (stored.code, stored.owner, stored.session) == (CODE, "me", "me-check")
    assert stored.registered == WALL + 2.0  # wall time derived from now
    assert stored.expires == WALL + 2.0 + 90.0
    assert stored.direct == [(SOURCE, 3979)]
    done = only(reg.store_result(write.request, None, 2.1), Registered)
    assert done.record is stored
    assert done.concluded.connection_type is ConnectionType.DIRECT
    assert reg.done and reg.get_timer() is None


def test_a_code_with_a_valid_secret_and_no_record_is_kept() -> None:
    reg = flow(with_code(key=b"older key"))  # signed before a key change
    read = only(reg.start(0.0), StoreRead)
    assert read.query == GetServer(CODE)
    keep = only(reg.store_result(read.request, None, 0.1), StoreWrite)
    assert keep.update == KeepCode(CODE)
    started = reg.store_result(keep.request, None, 0.2)
    assert Probe(SOURCE, 3979) in started and reg.code == CODE


def test_a_forged_secret_gets_a_new_code() -> None:
    msg = dataclasses.replace(with_code(), invite_code_secret="0" * 64)
    assert only(flow(msg).start(0.0), StoreRead).query == NewCode()


def test_a_second_server_with_a_copied_secret_is_refused() -> None:
    reg = flow(with_code(), Registrant("203.0.113.9"))
    read = only(reg.start(0.0), StoreRead)
    alive = only(reg.store_result(read.request, record("other"), 0.1), StoreRead)
    assert alive.query == InstanceAlive("other")
    refused = only(reg.store_result(alive.request, True, 0.2), Refused)
    assert refused == Refused(
        Refusal(
            "code-in-use",
            ErrorType.REUSE_OF_INVITE_CODE,
            "invite code is in use by another server",
        )
    )
    assert reg.done


def test_the_same_server_reconnecting_ends_its_old_session() -> None:
    reg = flow(with_code())
    read = only(reg.start(0.0), StoreRead)
    # Our own record: no need to ask whether we live.
    out = reg.store_result(read.request, record("me"), 0.1)
    assert out[0] == EndSession("me", CODE, "old-session")
    keep = only(out[1:], StoreWrite)
    assert keep.update == KeepCode(CODE)


def test_a_record_of_a_dead_instance_is_taken_over_quietly() -> None:
    reg = flow(with_code(), Registrant("203.0.113.9"))
    read = only(reg.start(0.0), StoreRead)
    alive = only(reg.store_result(read.request, record("gone"), 0.1), StoreRead)
    keep = only(reg.store_result(alive.request, False, 0.2), StoreWrite)
    assert keep.update == KeepCode(CODE)


def test_the_same_connection_registering_again_keeps_code_and_session() -> None:
    previous = record("me")
    reg = flow(with_code(), Registrant(SOURCE, CODE, previous))
    started = reg.start(0.0)  # no Store read: the code is ours already
    assert Probe(SOURCE, 3979) in started
    write = check_to_conclusion(reg, 1.0)
    assert isinstance(write.update, PutServer)
    assert write.update.record.session == "old-session"
    assert write.update.record.registered == previous.registered


def test_store_failures() -> None:
    choosing = flow()
    read = only(choosing.start(0.0), StoreRead)
    assert choosing.store_failed(read.request, 0.1) == [StoreFailed(None)]
    assert choosing.done
    storing = flow()
    read = only(storing.start(0.0), StoreRead)
    storing.store_result(read.request, CODE, 0.0)
    write = check_to_conclusion(storing, 1.0)
    failed = only(storing.store_failed(write.request, 1.1), StoreFailed)
    assert failed.answer == GcError(
        ErrorType.REGISTRATION_FAILED, "coordinator storage unavailable"
    )


def test_stale_and_malformed_answers() -> None:
    reg = flow()
    read = only(reg.start(0.0), StoreRead)
    assert reg.store_result(read.request + 1, CODE, 0.1) == []  # not asked
    assert reg.store_failed(read.request - 1, 0.1) == []
    # A NewCode answer that is no code: a Store failure, not a crash.
    assert reg.store_result(read.request, 42, 0.1) == [StoreFailed(None)]
    assert reg.store_result(read.request, CODE, 0.1) == []  # done


def test_the_check_times_out_into_the_record_of_an_unreachable_server() -> None:
    reg = flow()
    read = only(reg.start(0.0), StoreRead)
    reg.store_result(read.request, CODE, 0.0)
    assert fire(reg, CHECK_TIMEOUT - 0.1) == []
    out = fire(reg, CHECK_TIMEOUT)
    write = only(out[1:], StoreWrite)
    assert isinstance(write.update, PutServer)
    assert write.update.record.connection_type == ConnectionType.TURN
    assert reg.get_timer() is None


TERMINAL = (Registered, Refused, StoreFailed)
answers = st.one_of(
    st.none(),
    st.booleans(),
    st.just(CODE),
    st.integers(),
    st.builds(record, st.sampled_from(("me", "other"))),
)
inputs = st.lists(
    st.one_of(
        st.tuples(st.just("result"), st.integers(0, 6), answers),
        st.tuples(st.just("failed"), st.integers(0, 6), st.none()),
        st.tuples(st.just("stun"), st.sampled_from((AF_INET, AF_INET6)), st.booleans()),
        st.tuples(st.just("seen"), st.sampled_from((AF_INET, AF_INET6)), st.none()),
        st.tuples(st.just("probe"), st.just(0), st.booleans()),
        st.tuples(st.just("timer"), st.integers(0, 20), st.none()),
    ),
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from((ServerRegister(6, ServerGameType.PUBLIC, 3979), with_code())),
    inputs,
)
def test_any_input_order_ends_at_most_once(
    msg: ServerRegister, script: list[tuple[str, int, Any]]
) -> None:
    reg = flow(msg)
    seen = list(reg.start(0.0))
    now = 0.0
    for kind, number, value in script:
        now += 0.5
        match kind:
            case "result":
                seen += reg.store_result(number, value, now)
            case "failed":
                seen += reg.store_failed(number, now)
            case "stun":
                seen += reg.stun_result(number, bool(value), now)
            case "seen":
                seen += reg.stun_observed(number, SOURCE, now)
            case "probe":
                seen += reg.probe_result(SOURCE, bool(value), now)
            case _:
                seen += fire(reg, float(number))
        timer = reg.get_timer()
        assert timer is None or reg.stage.value == "checking"
    ends = [i for i, c in enumerate(seen) if isinstance(c, TERMINAL)]
    assert len(ends) <= 1
    if ends:
        assert ends[0] == len(seen) - 1 and reg.done
