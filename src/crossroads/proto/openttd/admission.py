"""Whether a registration or a join may start, and the record a registration
leaves (sans-I/O).

Theory of operation. A SERVER_REGISTER passes, in this order: the per-source
rate limit (the caller spends a token first, services/openttd/limits.py), a
game type and port OpenTTD can list (PUBLIC or INVITE_ONLY, a non-zero
port), and for a connection not yet registered the cap of servers per source
(an IPv4 address or IPv6 /64). The first failed test refuses with
GC_ERROR(REGISTRATION_FAILED) and a close (reference section 3: OpenTTD then
falls back to a local game rather than retrying in a loop). A CLIENT_CONNECT
needs a known invite code (else INVALID_INVITE_CODE, and the connection
stays for the next try) and fewer than :data:`MAX_ATTEMPTS_PER_CONNECTION`
joins under way on the connection.

A registration that names an invite code with a valid secret takes the code
over from a live record only when it is the same server coming back
(:func:`may_take_over`).

When a registration check concludes, :func:`registered_record` builds the
server's record: a first registration starts a session named by the check,
a re-registration of the same code on the same connection keeps its session,
registration time and game info. Wall-clock time comes in as ``wall``.
"""

from __future__ import annotations

from crossroads.proto.openttd.coordinator import (
    ErrorType,
    ServerGameType,
    ServerRegister,
)
from crossroads.proto.openttd.record import ServerRecord
from crossroads.proto.openttd.verify import Concluded
from crossroads.types import frozen

#: Joins one client connection may have under way at once (OpenTTD runs one at
#: a time; a few allow for refresh-hammering, more is abuse).
MAX_ATTEMPTS_PER_CONNECTION = 8
#: Game types a server may register as (LOCAL servers never register).
LISTABLE_GAME_TYPES = (ServerGameType.PUBLIC, ServerGameType.INVITE_ONLY)


@frozen
class Refusal:
    """Answer GC_ERROR(``error``, ``detail``); ``result`` labels the metric."""

    result: str
    error: ErrorType
    detail: str
    close: bool = True


#: A server claims an invite code (with its valid secret) that another live
#: server holds.
CODE_IN_USE = Refusal(
    "code-in-use",
    ErrorType.REUSE_OF_INVITE_CODE,
    "invite code is in use by another server",
)


#: A new server when ``--openttd-max-invite-codes`` codes are reserved: each
#: lives 30 days, so without a global cap many source addresses (IPv6 /64s
#: are cheap), each within its rate, could grow the store without bound.
CODES_EXHAUSTED = Refusal(
    "codes-exhausted",
    ErrorType.REGISTRATION_FAILED,
    "no invite codes left on this coordinator, try again later",
)


def refuse_registration(
    msg: ServerRegister,
    rate_ok: bool,
    already_registered: bool,
    servers_from_source: int,
    max_servers_per_source: int,
) -> Refusal | None:
    """Why this SERVER_REGISTER is refused, or None when it may go on."""
    failed = ErrorType.REGISTRATION_FAILED
    if not rate_ok:
        return Refusal(
            "rate-limited", failed, "too many registrations from your address"
        )
    if msg.game_type not in LISTABLE_GAME_TYPES or msg.server_port == 0:
        return Refusal("refused", failed, "invalid game type or port")
    if not already_registered and servers_from_source >= max_servers_per_source:
        return Refusal(
            "over-address-limit", failed, "too many servers from your address"
        )
    return None


def refuse_join(code: str, known: bool, attempts_under_way: int) -> Refusal | None:
    """Why this CLIENT_CONNECT to ``code`` is refused, or None."""
    if not known:
        return Refusal("invalid-code", ErrorType.INVALID_INVITE_CODE, code[:63], False)
    if attempts_under_way >= MAX_ATTEMPTS_PER_CONNECTION:
        return Refusal("too-many", ErrorType.UNKNOWN, "too many joins at once")
    return None


def registered_record(
    *,
    code: str,
    instance: str,
    msg: ServerRegister,
    result: Concluded,
    source: str,
    new_session: str,
    previous: ServerRecord | None,
    wall: float,
    ttl: float,
) -> ServerRecord:
    """The record a concluded registration stores (module docstring)."""
    return ServerRecord(
        code=code,
        owner=instance,
        session=previous.session if previous else new_session,
        protocol=msg.protocol,
        game_type=msg.game_type,
        connection_type=int(result.connection_type),
        source=source,
        port=msg.server_port,
        direct=list(result.direct),
        registered=previous.registered if previous else wall,
        expires=wall + ttl,
        game_info_version=previous.game_info_version if previous else 0,
        info=previous.info if previous else None,
        updated=previous.updated if previous else 0.0,
    )


@frozen
class TakeOver:
    """The code may be taken; ``drop_session`` closes the old connection."""

    drop_session: bool


def may_take_over(
    existing: ServerRecord, host: str, server_port: int, owner_alive: bool
) -> TakeOver | None:
    """A live record of the wanted code exists: is this the same server?

    The same source address and game port can only be the same server (two
    servers cannot listen on one address and port), typically reconnecting
    before we noticed its old connection died; its old session is dropped. A
    record whose instance is gone is stale. Anything else (None) is a second
    server with a copied secret, and gets REUSE_OF_INVITE_CODE.
    """
    same = existing.source == host and existing.port == server_port
    if owner_alive and not same:
        return None
    return TakeOver(drop_session=owner_alive)
