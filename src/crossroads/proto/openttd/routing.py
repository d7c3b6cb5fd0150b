"""Where a peer's report goes, and what it does there (sans-I/O).

Theory of operation. Every join attempt and registration check is owned by
the coordinator instance that started it; its tokens carry that instance's id
(proto/openttd/codes.py). Peers report on tokens to whichever instance their
coordinator connection is on:

- a report on one of this instance's tokens is handled here (:class:`Local`);
- a *server's* report on another instance's attempt is forwarded to that
  instance as a :class:`~crossroads.proto.openttd.bus.PeerReport`
  (:class:`Forward`): the server's connection may sit on any instance, the
  client's is always on the attempt's owner;
- anything else is ignored with a reason the service counts (:class:`Ignore`).

Every other bus send is decided here too, as a :class:`Forward`: a packet for
a server seated on another instance (:func:`route_to_server`), the end of a
superseded session held elsewhere (:func:`route_end_session`), and what the
STUN listener saw (:func:`route_stun_request`); the service only publishes.

Once at the owner, :func:`report_side` checks that the report came from the
peer the token was given to (the client's own connection, or the server
registered under the attempt's code), and :func:`attempt_commands` /
:func:`check_commands` turn it into the core's commands. Pure: connections
appear only as "is it the attempt's client" booleans, time comes in as ``now``.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

from crossroads.proto.openttd.bus import (
    BusMessage,
    ConnectedReport,
    ConnectFailedReport,
    DropSession,
    ForwardToServer,
    PeerReport,
    Report,
    StunReport,
    StunSeen,
)
from crossroads.proto.openttd.codes import ParsedToken, TokenSide, parse_token
from crossroads.proto.openttd.coordinator import (
    ClientConnected,
    ConnectFailed,
    StunResult,
)
from crossroads.proto.openttd.ladder import Command, ConnectAttempt, Side
from crossroads.types import frozen

CommandT = TypeVar("CommandT")


class TakesStunResults(Protocol[CommandT]):
    """A registration check, or the registration flow around one."""

    def stun_result(self, family: int, ok: bool, now: float) -> list[CommandT]: ...


@frozen
class Ignore:
    """Dropped; ``reason`` labels ``crossroads_openttd_ignored``."""

    reason: str


@frozen
class Local:
    """Ours: handle it with the attempt or check ``parsed`` names."""

    parsed: ParsedToken


@frozen
class Forward:
    """Publish ``message`` to coordinator ``instance`` over the bus (the one
    command every bus send of the service is)."""

    instance: str
    message: BusMessage


def peer_report(message: ConnectFailed | ClientConnected | StunResult) -> Report:
    """The report a peer's packet on a token carries (reference
    ``openttd-coordinator.md`` section 4): a failed method, the client's
    success, or whether a STUN packet went out."""
    match message:
        case ConnectFailed(tracking_number=tracking_number):
            return ConnectFailedReport(tracking_number)
        case ClientConnected():
            return ConnectedReport()
        case StunResult(family=family, result=result):
            return StunReport(family, result)


def route_peer_report(
    token: str, report: Report, instance: str, server_code: str | None
) -> Local | Forward | Ignore:
    """A report a peer sent this ``instance`` on its coordinator connection
    (``server_code``: the code the connection is registered as, if any)."""
    parsed = parse_token(token)
    if parsed is None:
        return Ignore("unknown-token")
    if parsed.instance == instance:
        return Local(parsed)
    if parsed.side is TokenSide.SERVER and server_code is not None:
        return Forward(parsed.instance, PeerReport(token, server_code, report))
    return Ignore("foreign-token")


def route_to_server(
    code: str, owner: str, seated_here: bool, data: bytes
) -> Forward | None:
    """A packet for the server registered as ``code``: None when its
    connection is on this instance (``seated_here``: send it there), else
    forwarded to its record's ``owner``."""
    return None if seated_here else Forward(owner, ForwardToServer(code, data))


def route_end_session(
    owner: str, code: str, session: str, instance: str
) -> Forward | None:
    """Close the seated session ``session`` of ``code``: None when ``owner``
    is this ``instance`` (close it here), else told to the owner."""
    return None if owner == instance else Forward(owner, DropSession(code, session))


def route_stun_request(
    token: str, family: int, host: str, port: int
) -> Forward | Ignore:
    """The STUN listener saw ``token`` from ``host``:``port``: tell the
    instance named in the token (which may be this one: the bus delivers
    that without the Store)."""
    parsed = parse_token(token)
    if parsed is None:
        return Ignore("unknown-token")
    return Forward(parsed.instance, StunSeen(token, family, host, port))


def route_forwarded_report(message: PeerReport, instance: str) -> Local | Ignore:
    """A server's report another instance forwarded here: only server tokens
    of this instance's attempts travel."""
    parsed = parse_token(message.token)
    if (
        parsed is None
        or parsed.instance != instance
        or parsed.side is not TokenSide.SERVER
    ):
        return Ignore("bad-bus-event")
    return Local(parsed)


def route_stun_seen(token: str, instance: str) -> Local | Ignore:
    """The STUN service saw ``token``: only this instance's tokens count."""
    parsed = parse_token(token)
    if parsed is None or parsed.instance != instance:
        return Ignore("unknown-token")
    return Local(parsed)


def report_side(
    parsed: ParsedToken, from_client: bool, server_code: str | None, attempt_code: str
) -> Side | Ignore:
    """Which side of the attempt sent the report, when it is the peer the
    token was given to: for a C token the attempt's client connection
    (``from_client``), for an S token the server registered as the attempt's
    invite code."""
    if parsed.side is TokenSide.CLIENT:
        return Side.CLIENT if from_client else Ignore("wrong-sender")
    return Side.SERVER if server_code == attempt_code else Ignore("wrong-sender")


def attempt_commands(
    attempt: ConnectAttempt, side: Side, report: Report, now: float
) -> list[Command] | Ignore:
    """What ``side``'s report does to a join attempt."""
    match report:
        case ConnectFailedReport(tracking_number):
            return attempt.connect_failed(side, tracking_number, now)
        case ConnectedReport() if side is Side.CLIENT:
            return attempt.connected(now)
        case StunReport(family, ok):
            return attempt.stun_result(side, family, ok, now)
        case _:
            return Ignore("bad-report")


def check_commands(
    check: TakesStunResults[CommandT], report: Report, now: float
) -> list[CommandT]:
    """What a report on a V token does to a registration check: only the STUN
    result carries something the check needs."""
    if isinstance(report, StunReport):
        return check.stun_result(report.family, report.ok, now)
    return []
