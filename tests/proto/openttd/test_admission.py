"""Admission of registrations and joins, and the record a registration
leaves (proto/openttd/admission.py)."""

from __future__ import annotations

import dataclasses

import pytest

from crossroads.proto.openttd.admission import (
    MAX_ATTEMPTS_PER_CONNECTION,
    Refusal,
    TakeOver,
    may_take_over,
    refuse_join,
    refuse_registration,
    registered_record,
)
from crossroads.proto.openttd.coordinator import (
    ConnectionType,
    ErrorType,
    ServerGameType,
    ServerRegister,
)
from crossroads.proto.openttd.gameinfo import GameInfo
from crossroads.proto.openttd.verify import Concluded

PUBLIC = ServerRegister(6, ServerGameType.PUBLIC, 3979)
FAILED = ErrorType.REGISTRATION_FAILED


@pytest.mark.parametrize(
    ("msg", "rate_ok", "registered", "servers", "result"),
    [
        (PUBLIC, True, False, 0, None),
        (PUBLIC, False, False, 0, "rate-limited"),
        (ServerRegister(6, ServerGameType.LOCAL, 3979), True, False, 0, "refused"),
        (ServerRegister(6, 7, 3979), True, False, 0, "refused"),
        (ServerRegister(6, ServerGameType.INVITE_ONLY, 0), True, False, 0, "refused"),
        (PUBLIC, True, False, 4, "over-address-limit"),
        # A server already registered on this connection re-registers freely.
        (PUBLIC, True, True, 4, None),
        # The rate limit is tested first.
        (ServerRegister(6, 7, 0), False, False, 9, "rate-limited"),
    ],
)
def test_registration_refusals_in_order(
    msg: ServerRegister,
    rate_ok: bool,
    registered: bool,
    servers: int,
    result: str | None,
) -> None:
    refusal = refuse_registration(msg, rate_ok, registered, servers, 4)
    assert (refusal.result if refusal else None) == result
    if refusal is not None:
        assert refusal.error is FAILED and refusal.close


def test_join_refusals() -> None:
    assert refuse_join("+abc", True, 0) is None
    unknown = refuse_join("+" + "x" * 100, False, 0)
    assert unknown == Refusal(
        "invalid-code", ErrorType.INVALID_INVITE_CODE, "+" + "x" * 62, close=False
    )
    too_many = refuse_join("+abc", True, MAX_ATTEMPTS_PER_CONNECTION)
    assert too_many is not None and too_many.result == "too-many" and too_many.close


def test_a_first_registration_starts_a_session_and_a_second_keeps_it() -> None:
    direct = Concluded(ConnectionType.DIRECT, (("192.0.2.1", 3979),), True)
    first = registered_record(
        code="+abc",
        instance="0a1b2c3d",
        msg=PUBLIC,
        result=direct,
        source="192.0.2.1",
        new_session="check-1",
        previous=None,
        wall=100.0,
        ttl=60.0,
    )
    assert (first.session, first.registered, first.expires) == ("check-1", 100.0, 160.0)
    assert first.direct == [("192.0.2.1", 3979)] and first.info is None
    updated = dataclasses.replace(first, info=GameInfo(server_name="x"), updated=120.0)
    again = registered_record(
        code="+abc",
        instance="0a1b2c3d",
        msg=dataclasses.replace(PUBLIC, game_type=ServerGameType.INVITE_ONLY),
        result=Concluded(ConnectionType.TURN),
        source="192.0.2.1",
        new_session="check-2",
        previous=updated,
        wall=200.0,
        ttl=60.0,
    )
    assert (again.session, again.registered, again.expires) == ("check-1", 100.0, 260.0)
    assert again.info == updated.info and again.updated == 120.0
    assert again.connection_type == ConnectionType.TURN and again.direct == []
    assert again.game_type == ServerGameType.INVITE_ONLY


def test_only_the_same_server_takes_a_live_code_over() -> None:
    existing = registered_record(
        code="+abc",
        instance="0a1b2c3d",
        msg=PUBLIC,
        result=Concluded(ConnectionType.DIRECT),
        source="192.0.2.1",
        new_session="s",
        previous=None,
        wall=0.0,
        ttl=60.0,
    )
    # The same address and game port: the server came back; drop the old session.
    assert may_take_over(existing, "192.0.2.1", 3979, True) == TakeOver(True)
    # Another address or port with the secret while the owner lives: refused.
    assert may_take_over(existing, "192.0.2.2", 3979, True) is None
    assert may_take_over(existing, "192.0.2.1", 3980, True) is None
    # The owner is gone: anyone with the secret takes the stale code.
    assert may_take_over(existing, "198.51.100.7", 1, False) == TakeOver(False)
