"""The p2p signalling message set, version 1 (JSON over WebSocket).

Every WebSocket text frame carries one JSON object with a ``"type"`` member; the
rest of the members depend on the type. The full specification, written for
implementers in other languages, is ``docs/p2p-protocol.md``; this module is its
executable form. Two tables decode the two directions (:func:`decode_client` for
what a client sends, :func:`decode_server` for what the server sends), and every
message encodes with :func:`encode`.

Decoding is strict about types and bounds (so that a bad client gets a precise
``error`` frame) and lenient about unknown members (so that a newer client can add
members without breaking an older server): unknown members are ignored.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import json
from collections.abc import Callable, Mapping
from dataclasses import MISSING, field, fields
from functools import partial
from typing import Any, ClassVar, Self, TypeVar, cast

from crossroads.errors import DecodeError
from crossroads.proto import jsontext
from crossroads.types import frozen

#: Version carried in ``hello``/``welcome``; bumped on incompatible changes only.
PROTOCOL_VERSION = 1

#: Largest text frame either side accepts. The biggest legitimate message
#: (``punch_start`` with eight local candidates each side, or a 32-member
#: ``join_start``) is about 4 KiB; 16 KiB leaves room and bounds per-frame memory.
MAX_FRAME_BYTES = 16 * 1024

#: Local (host) candidates a client may report. RakNet tries at most 5 internal
#: addresses (MAXIMUM_NUMBER_OF_INTERNAL_IDS_TO_CHECK, reference §2.1); 8 allows
#: dual-stack hosts a little more.
MAX_LOCAL_CANDIDATES = 8

#: Members of one mesh session. EOS caps P2P connections at 32 (reference §3.2);
#: a full mesh of N peers costs N-1 links each, so this also bounds client work.
MAX_MEMBERS = 32

#: ``signal`` payloads are application data forwarded verbatim; 4 KiB is enough for
#: offers, game settings or a chat line and keeps forwarding cheap.
MAX_SIGNAL_BYTES = 4096

#: Identifier lengths (peer ids, session ids, codes, reasons, names).
MAX_ID_CHARS = 64
MAX_TEXT_CHARS = 200
#: Longest instance URL in ``redirect`` (a host name, a port and a path).
MAX_URL_CHARS = 512

#: Step names of the connection ladder, as the NAT lab reports them (docs/nat-lab.md).
STEPS = ("lan", "direct", "mapping", "punch", "relay")

#: Mapping behaviours the server derives from the three rendezvous ports.
MAPPINGS = ("independent", "sequential", "random", "unknown")

ROLES = ("initiator", "responder")


# ------------------------------------------------------------------- field helpers


def _need(obj: Mapping[str, Any], key: str) -> Any:
    if key not in obj:
        raise DecodeError(f"missing member {key!r}", "missing-member")
    return obj[key]


def _str(
    obj: Mapping[str, Any],
    key: str,
    *,
    max_chars: int = MAX_ID_CHARS,
    default: str | None = None,
    allow_empty: bool = False,
) -> str:
    if default is not None and key not in obj:
        return default
    value = _need(obj, key)
    if not isinstance(value, str):
        raise DecodeError(f"{key} must be a string", "bad-type")
    if len(value) > max_chars:
        raise DecodeError(f"{key} is longer than {max_chars} characters", "too-long")
    if not value and not allow_empty:
        raise DecodeError(f"{key} must not be empty", "empty")
    return value


def _int(
    obj: Mapping[str, Any],
    key: str,
    low: int,
    high: int,
    default: int | None = None,
) -> int:
    if default is not None and key not in obj:
        return default
    value = _need(obj, key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise DecodeError(f"{key} must be an integer", "bad-type")
    if not low <= value <= high:
        raise DecodeError(f"{key} must be in {low}..{high}", "out-of-range")
    return value


def _bool(obj: Mapping[str, Any], key: str) -> bool:
    value = _need(obj, key)
    if not isinstance(value, bool):
        raise DecodeError(f"{key} must be true or false", "bad-type")
    return value


def _choice(obj: Mapping[str, Any], key: str, choices: tuple[str, ...]) -> str:
    value = _str(obj, key)
    if value not in choices:
        raise DecodeError(f"{key} must be one of {', '.join(choices)}", "bad-value")
    return value


def _key(obj: Mapping[str, Any], key: str) -> bytes:
    text = _str(obj, key, max_chars=64)
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise DecodeError(f"{key} must be base64", "bad-key") from None
    if len(raw) != 32:
        raise DecodeError(f"{key} must be a 32-byte X25519 public key", "bad-key")
    return raw


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _bounded_list(value: Any, key: str, max_items: int) -> list[Any]:
    """``value`` (member ``key``) if it is a list of at most ``max_items``."""
    if not isinstance(value, list):
        raise DecodeError(f"{key} must be a list", "bad-type")
    if len(value) > max_items:
        raise DecodeError(f"{key} has more than {max_items} items", "too-many")
    return value


def _ids(obj: Mapping[str, Any], key: str, max_items: int) -> tuple[str, ...]:
    out = []
    for item in _bounded_list(_need(obj, key), key, max_items):
        if not isinstance(item, str) or not 0 < len(item) <= MAX_ID_CHARS:
            raise DecodeError(f"{key} must hold peer ids", "bad-type")
        out.append(item)
    return tuple(out)


# -------------------------------------------------------------- declared members

#: How a message field's JSON member is read: ``read(frame, member name)``
#: returns the value or raises :class:`DecodeError` (the helpers above).
FieldReader = Callable[[Mapping[str, Any], str], Any]
#: How a field's value is written as JSON.
FieldWriter = Callable[[Any], Any]


def _same(value: Any) -> Any:
    return value


def _as_list(values: tuple[Any, ...]) -> list[Any]:
    return list(values)


def _json_list(values: tuple[TransportAddress | Member, ...]) -> list[Any]:
    return [v.to_json() for v in values]


def _to_json(value: Candidates | PeerInfo | Member | TurnInfo) -> Any:
    return value.to_json()


def _json(
    read: FieldReader,
    write: FieldWriter = _same,
    *,
    name: str = "",
    default: Any = MISSING,
) -> Any:
    """A message field carried as one JSON member: ``read`` decodes it from a
    frame, ``write`` encodes it, ``name`` is the member's name when it is not
    the field's. A message's members are written in field order."""
    metadata = {"read": read, "write": write, "name": name}
    if default is MISSING:
        return field(metadata=metadata)
    return field(default=default, metadata=metadata)


_Schema = tuple[tuple[str, str, FieldReader, FieldWriter], ...]
_SCHEMAS: dict[type, _Schema] = {}


def _schema(cls: type) -> _Schema:
    """``(field, member name, read, write)`` for each field of a message class
    (worked out once per class)."""
    schema = _SCHEMAS.get(cls)
    if schema is None:
        schema = _SCHEMAS[cls] = tuple(
            (
                f.name,
                f.metadata["name"] or f.name,
                f.metadata["read"],
                f.metadata["write"],
            )
            for f in fields(cls)
        )
    return schema


class _Members:
    """A JSON object whose members are its fields, each read and written as
    its :func:`_json` declaration says; written in field order."""

    __slots__ = ()

    def body(self) -> dict[str, Any]:
        """The JSON members."""
        return {
            member: write(getattr(self, name))
            for name, member, _, write in _schema(type(self))
        }

    @classmethod
    def parse(cls, o: Mapping[str, Any]) -> Self:
        """Read the members of a decoded JSON object; raises :class:`DecodeError`."""
        values = {name: read(o, member) for name, member, read, _ in _schema(cls)}
        return cast(Callable[..., Self], cls)(**values)


class _JsonObject(_Members):
    """A :class:`_Members` object nested in a message."""

    __slots__ = ()
    #: What a value that is not an object is called in the error ("turn").
    WHAT: ClassVar[str]

    def to_json(self) -> dict[str, Any]:
        return self.body()

    @classmethod
    def from_json(cls, value: Any) -> Self:
        if not isinstance(value, dict):
            raise DecodeError(f"{cls.WHAT} must be an object", "bad-type")
        return cls.parse(value)


def _required(from_json: Callable[[Any], _JsonObject]) -> FieldReader:
    """A nested object that must be present (``missing-member`` otherwise)."""
    return lambda o, member: from_json(_need(o, member))


def _object(from_json: Callable[[Any], _JsonObject]) -> FieldReader:
    """A nested object; absent or null is ``bad-type`` (not an object)."""
    return lambda o, member: from_json(o.get(member))


@frozen
class TransportAddress:
    """A transport address; JSON ``["203.0.113.7", 40000]`` (IPv6 without brackets)."""

    host: str
    port: int

    def to_json(self) -> list[Any]:
        return [self.host, self.port]

    @classmethod
    def from_json(cls, value: Any, what: str) -> TransportAddress:
        if not (isinstance(value, list) and len(value) == 2):
            raise DecodeError(f"{what} must be [host, port]", "bad-endpoint")
        host, port = value
        if not isinstance(host, str) or len(host) > 45:
            raise DecodeError(f"{what} host must be an IP address", "bad-endpoint")
        try:
            host = str(ipaddress.ip_address(host))
        except ValueError:
            raise DecodeError(
                f"{what} host must be an IP address", "bad-endpoint"
            ) from None
        if (
            isinstance(port, bool)
            or not isinstance(port, int)
            or not 1 <= port <= 65535
        ):
            raise DecodeError(f"{what} port must be in 1..65535", "bad-endpoint")
        return cls(host, port)

    def address(self) -> tuple[str, int]:
        return (self.host, self.port)


def _endpoint(obj: Mapping[str, Any], key: str) -> TransportAddress | None:
    value = obj.get(key)
    if value is None:
        return None
    return TransportAddress.from_json(value, key)


def _endpoints(
    obj: Mapping[str, Any], key: str, max_items: int
) -> tuple[TransportAddress, ...]:
    value = _bounded_list(obj.get(key, []), key, max_items)
    return tuple(TransportAddress.from_json(v, key) for v in value)


def _opt(value: TransportAddress | TurnInfo | None) -> Any:
    """JSON of an optional endpoint or object: null when there is none."""
    return None if value is None else value.to_json()


@frozen
class Candidates(_JsonObject):
    """What a client knows about its own reachability (sent in ``punch_ready``).

    The public (server-reflexive) address is *not* here: the server observes it on
    its rendezvous ports, so a client cannot lie about where it is.
    """

    WHAT: ClassVar[str] = "candidates"
    local: tuple[TransportAddress, ...] = _json(
        partial(_endpoints, max_items=MAX_LOCAL_CANDIDATES), _json_list, default=()
    )
    #: External address of a UPnP / NAT-PMP / PCP port mapping, if one is held.
    mapped: TransportAddress | None = _json(_endpoint, _opt, default=None)
    #: A relayed address (TURN) the peer may send to, if the client holds one.
    relay: TransportAddress | None = _json(_endpoint, _opt, default=None)
    #: The client's own NAT classification (informational, e.g. "port-restricted").
    nat: str = _json(
        partial(_str, max_chars=40, default="", allow_empty=True), default=""
    )
    #: New destinations the peer socket sent to since its first rendezvous probes
    #: (RakNet's "most recent port" in another form): a sequential NAT has
    #: allocated that many ports since, so the next one is further on.
    flows: int = _json(partial(_int, low=0, high=1_000_000, default=0), default=0)


def _ports(o: Mapping[str, Any], member: str) -> tuple[int, ...]:
    ports = _need(o, member)
    if not isinstance(ports, list) or len(ports) > 3:
        raise DecodeError("ports must be a list of up to 3 ports", "bad-type")
    for p in ports:
        if isinstance(p, bool) or not isinstance(p, int) or not 1 <= p <= 65535:
            raise DecodeError("ports must hold port numbers", "bad-type")
    return tuple(ports)


@frozen
class PeerInfo(_JsonObject):
    """Everything one side of a punch needs about the other (``punch_start``)."""

    WHAT: ClassVar[str] = "peer info"
    #: The address the server saw on its primary rendezvous port.
    public: TransportAddress | None = _json(_endpoint, _opt)
    #: Ports the server saw on its primary, first and second alternate rendezvous
    #: ports, in the order the client probed them (empty when UDP never arrived).
    ports: tuple[int, ...] = _json(_ports, _as_list)
    #: "independent", "sequential", "random" or "unknown" (see coordinator).
    mapping: str = _json(partial(_choice, choices=MAPPINGS))
    #: Port increment per new destination for a sequential mapping, else 0.
    stride: int = _json(partial(_int, low=-65535, high=65535))
    candidates: Candidates = _json(_required(Candidates.from_json), _to_json)

    @classmethod
    def parse(cls, o: Mapping[str, Any]) -> Self:
        ports = _ports(o, "ports")  # checked first: its errors name the frame
        return cls(
            public=_endpoint(o, "public"),
            ports=ports,
            mapping=_choice(o, "mapping", MAPPINGS),
            stride=_int(o, "stride", -65535, 65535),
            candidates=Candidates.from_json(_need(o, "candidates")),
        )


@frozen
class Member(_JsonObject):
    """One participant of a mesh session."""

    WHAT: ClassVar[str] = "member"
    peer: str = _json(_str)
    key: bytes = _json(_key, _b64)
    #: Join order: 0 for the creator, then 1, 2, ... The lowest present member is
    #: the host (FullyConnectedMesh2's rule, reference §2.6).
    seniority: int = _json(partial(_int, low=0, high=2**31))


def _members(obj: Mapping[str, Any], key: str) -> tuple[Member, ...]:
    value = _need(obj, key)
    if not isinstance(value, list) or len(value) > MAX_MEMBERS:
        raise DecodeError(f"{key} must be a list of members", "bad-type")
    return tuple(Member.from_json(v) for v in value)


def _json_value(value: Any) -> Any:
    encoded = json.dumps(value, separators=(",", ":"))
    if len(encoded.encode()) > MAX_SIGNAL_BYTES:
        raise DecodeError(
            f"signal data is larger than {MAX_SIGNAL_BYTES} bytes", "too-large"
        )
    return value


# ------------------------------------------------------------------------ messages


class Message(_Members):
    """Base of every signalling message: its members are its fields."""

    __slots__ = ()
    TYPE: ClassVar[str]


M = TypeVar("M", bound=Message)

_CLIENT: dict[str, Callable[[Mapping[str, Any]], Message]] = {}
_SERVER: dict[str, Callable[[Mapping[str, Any]], Message]] = {}


def _client(cls: type[M]) -> type[M]:
    _CLIENT[cls.TYPE] = cls.parse
    return cls


def _server(cls: type[M]) -> type[M]:
    _SERVER[cls.TYPE] = cls.parse
    return cls


# Readers shared by several messages (bounds as docs/p2p-protocol.md gives them).
_VERSION = partial(_int, low=0, high=1_000_000)
_PING_ID = partial(_int, low=0, high=2**53)
_SENIORITY = partial(_int, low=0, high=2**31)
_ATTEMPT = partial(_int, low=1, high=2**31)
_CODE = partial(_str, max_chars=32)
_REASON = partial(_str, max_chars=MAX_TEXT_CHARS, default="", allow_empty=True)
_PEERS = partial(_ids, max_items=MAX_MEMBERS)


def _optional_turn(o: Mapping[str, Any], member: str) -> TurnInfo | None:
    """``turn``: TURN credentials, null or absent when there are none."""
    value = o.get(member)
    return None if value is None else TurnInfo.from_json(value)


@_client
@frozen
class Hello(Message):
    """First client frame: protocol version and the peer-channel public key."""

    TYPE: ClassVar[str] = "hello"
    v: int = _json(_VERSION)
    key: bytes = _json(_key, _b64)
    name: str = _json(
        partial(_str, max_chars=MAX_ID_CHARS, default="", allow_empty=True), default=""
    )


@frozen
class TurnInfo(_JsonObject):
    """TURN servers and time-limited credentials for this peer (the coturn
    "REST API" scheme: username ``<expiry unix time>:<peer id>``, password
    ``base64(HMAC-SHA1(shared secret, username))``)."""

    WHAT: ClassVar[str] = "turn"
    servers: tuple[TransportAddress, ...] = _json(
        partial(_endpoints, max_items=4), _json_list
    )
    username: str = _json(partial(_str, max_chars=128))
    password: str = _json(partial(_str, max_chars=128))
    expires: int = _json(partial(_int, low=0, high=2**40))


@_server
@frozen
class Welcome(Message):
    """Answer to ``hello``: the peer id, the UDP rendezvous token and addresses."""

    TYPE: ClassVar[str] = "welcome"
    v: int = _json(_VERSION)
    peer: str = _json(_str)
    #: Hex token the client puts in its rendezvous datagrams.
    token: str = _json(_str)
    #: The client's IP as the server saw the WebSocket connection.
    ip: str = _json(_str)
    #: Primary, first and second alternate rendezvous UDP ports, in probe order.
    udp: tuple[TransportAddress, ...] = _json(
        partial(_endpoints, max_items=3), _json_list
    )
    #: Always null from crossroads (a free relay for anyone otherwise): TURN
    #: credentials go only to peers in a session (``hosted``, ``join_start``,
    #: ``turn``). Still decoded, for servers that send them here.
    turn: TurnInfo | None = _json(_optional_turn, _opt, default=None)


@_client
@_server
@frozen
class Ping(Message):
    """Round-trip probe, either direction; the receiver answers ``pong`` at once."""

    TYPE: ClassVar[str] = "ping"
    id: int = _json(_PING_ID)


@_client
@_server
@frozen
class Pong(Message):
    TYPE: ClassVar[str] = "pong"
    id: int = _json(_PING_ID)


@_client
@frozen
class Host(Message):
    """Create a mesh session; answered by ``hosted`` with its invite code."""

    TYPE: ClassVar[str] = "host"
    max_members: int = _json(
        partial(_int, low=2, high=MAX_MEMBERS, default=MAX_MEMBERS),
        default=MAX_MEMBERS,
    )


@_server
@frozen
class Hosted(Message):
    TYPE: ClassVar[str] = "hosted"
    session: str = _json(_str)
    code: str = _json(_str)
    seniority: int = _json(_SENIORITY)
    #: TURN for the relay step, when the server hands out credentials.
    turn: TurnInfo | None = _json(_optional_turn, _opt, default=None)


@_client
@frozen
class Join(Message):
    """Ask to join the session behind an invite code (starts a verified join)."""

    TYPE: ClassVar[str] = "join"
    code: str = _json(_CODE)


@_server
@frozen
class Redirect(Message):
    """The session behind ``code`` lives on another server instance: reconnect
    to ``url`` (a fresh ``hello`` there) and send the ``join`` again."""

    TYPE: ClassVar[str] = "redirect"
    code: str = _json(_CODE)
    url: str = _json(partial(_str, max_chars=MAX_URL_CHARS))

    @classmethod
    def parse(cls, o: Mapping[str, Any]) -> Self:
        # The URL first: a bad one is the reason a frame is refused.
        url = _str(o, "url", max_chars=MAX_URL_CHARS)
        if not url.startswith(("ws://", "wss://")):
            raise DecodeError("redirect: url must be ws:// or wss://")
        return cls(code=_CODE(o, "code"), url=url)


@_server
@frozen
class JoinStart(Message):
    """The members a joiner must connect to before it may join (FCM2 step 1)."""

    TYPE: ClassVar[str] = "join_start"
    session: str = _json(_str)
    host: str = _json(_str)
    members: tuple[Member, ...] = _json(_members, _json_list)
    #: TURN for the relay step, when the server hands out credentials.
    turn: TurnInfo | None = _json(_optional_turn, _opt, default=None)


@_client
@frozen
class TurnRefresh(Message):
    """Ask for fresh TURN credentials (only a peer in a session gets them)."""

    TYPE: ClassVar[str] = "turn_refresh"


@_server
@frozen
class Turn(Message):
    """Fresh TURN credentials, the answer to ``turn_refresh``."""

    TYPE: ClassVar[str] = "turn"
    turn: TurnInfo = _json(_object(TurnInfo.from_json), _to_json)


@_client
@frozen
class JoinResult(Message):
    """The joiner's outcome: which members it reached over the peer channel."""

    TYPE: ClassVar[str] = "join_result"
    session: str = _json(_str)
    connected: tuple[str, ...] = _json(_PEERS, _as_list)
    failed: tuple[str, ...] = _json(
        lambda o, member: _PEERS(o, member) if member in o else (), _as_list, default=()
    )


@_server
@frozen
class JoinCapable(Message):
    """To the host: this joiner reached every member; accept or reject it."""

    TYPE: ClassVar[str] = "join_capable"
    session: str = _json(_str)
    peer: str = _json(_str)
    key: bytes = _json(_key, _b64)


@_client
@frozen
class JoinAnswer(Message):
    """The host's decision on a ``join_capable`` joiner."""

    TYPE: ClassVar[str] = "join_answer"
    session: str = _json(_str)
    peer: str = _json(_str)
    accept: bool = _json(_bool)
    reason: str = _json(_REASON, default="")


@_server
@frozen
class JoinAccepted(Message):
    TYPE: ClassVar[str] = "join_accepted"
    session: str = _json(_str)
    seniority: int = _json(_SENIORITY)
    host: str = _json(_str)
    members: tuple[Member, ...] = _json(_members, _json_list)


@_server
@frozen
class JoinRejected(Message):
    TYPE: ClassVar[str] = "join_rejected"
    session: str = _json(_str)
    reason: str = _json(partial(_str, max_chars=MAX_TEXT_CHARS, allow_empty=True))


@_server
@frozen
class MemberJoined(Message):
    TYPE: ClassVar[str] = "member_joined"
    session: str = _json(_str)
    member: Member = _json(_object(Member.from_json), _to_json)


@_server
@frozen
class MemberLeft(Message):
    """A member left (or its signalling connection dropped); ``host`` is the
    host after the departure, by seniority."""

    TYPE: ClassVar[str] = "member_left"
    session: str = _json(_str)
    peer: str = _json(_str)
    host: str = _json(partial(_str, allow_empty=True))


@_client
@frozen
class Leave(Message):
    TYPE: ClassVar[str] = "leave"
    session: str = _json(_str)


@_client
@frozen
class Connect(Message):
    """Ask the coordinator for a punch-through to ``peer``."""

    TYPE: ClassVar[str] = "connect"
    peer: str = _json(_str)


@_server
@frozen
class PunchPrepare(Message):
    """Refresh your mapping (rendezvous probes with this attempt), then answer
    ``punch_ready`` — RakNet's GET_MOST_RECENT_PORT (reference §2.1 step 2)."""

    TYPE: ClassVar[str] = "punch_prepare"
    attempt: int = _json(_ATTEMPT)
    peer: str = _json(_str)


@_client
@frozen
class PunchReady(Message):
    TYPE: ClassVar[str] = "punch_ready"
    attempt: int = _json(_ATTEMPT)
    candidates: Candidates = _json(_required(Candidates.from_json), _to_json)


@_server
@frozen
class PunchStart(Message):
    """Start the connection ladder ``delay_ms`` after receiving this frame.

    The server already subtracted half of this client's RTT, so both sides start
    together (RakNet's CONNECT_AT_TIME, reference §2.1 step 3).
    """

    TYPE: ClassVar[str] = "punch_start"
    attempt: int = _json(_ATTEMPT)
    peer: str = _json(_str)
    key: bytes = _json(_key, _b64)
    role: str = _json(partial(_choice, choices=ROLES))
    delay_ms: int = _json(partial(_int, low=0, high=60_000))
    you: PeerInfo = _json(_required(PeerInfo.from_json), _to_json)
    them: PeerInfo = _json(_required(PeerInfo.from_json), _to_json)


@_server
@frozen
class PunchFailed(Message):
    """The attempt ended without a start: ``target_not_connected``,
    ``already_in_progress``, ``target_unresponsive`` or ``connection_lost``."""

    TYPE: ClassVar[str] = "punch_failed"
    attempt: int = _json(partial(_int, low=0, high=2**31))
    peer: str = _json(_str)
    reason: str = _json(_str)


def _step(o: Mapping[str, Any], member: str) -> str:
    step = _str(o, member, max_chars=16, default="", allow_empty=True)
    if step and step not in STEPS:
        raise DecodeError(f"step must be one of {', '.join(STEPS)}", "bad-value")
    return step


@_client
@frozen
class PunchResult(Message):
    """How the ladder ended on this side (RakNet's CLIENT_READY plus the outcome)."""

    TYPE: ClassVar[str] = "punch_result"
    attempt: int = _json(_ATTEMPT)
    ok: bool = _json(_bool)
    step: str = _json(_step, default="")
    ms: int = _json(partial(_int, low=0, high=600_000, default=0), default=0)

    @classmethod
    def parse(cls, o: Mapping[str, Any]) -> Self:
        # The outcome first: a bad ``ok`` or ``step`` is the reason a frame is
        # refused even when the attempt is bad too.
        ok = _bool(o, "ok")
        step = _step(o, "step")
        return cls(
            attempt=_ATTEMPT(o, "attempt"),
            ok=ok,
            step=step,
            ms=_int(o, "ms", 0, 600_000, 0),
        )


def _signal_data(o: Mapping[str, Any], member: str) -> Any:
    return _json_value(o.get(member))


@_client
@frozen
class Signal(Message):
    """Application data to another member of a shared session (client -> server)."""

    TYPE: ClassVar[str] = "signal"
    to: str = _json(_str)
    data: Any = _json(_signal_data)


@_server
@frozen
class SignalFrom(Message):
    """Application data from another member (server -> client)."""

    TYPE: ClassVar[str] = "signal"
    sender: str = _json(_str, name="from")
    data: Any = _json(_signal_data)


@_server
@frozen
class Error(Message):
    """A request could not be served. ``ref`` names the request type it answers."""

    TYPE: ClassVar[str] = "error"
    code: str = _json(_str)
    message: str = _json(partial(_str, max_chars=MAX_TEXT_CHARS * 2, allow_empty=True))
    ref: str = _json(partial(_str, default="", allow_empty=True), default="")


# ---------------------------------------------------------------------- codec


def encode(message: Message) -> str:
    """One WebSocket text frame for ``message``."""
    body = message.body()
    return json.dumps({"type": message.TYPE, **body}, separators=(",", ":"))


def _decode(
    text: str | bytes, table: Mapping[str, Callable[[Mapping[str, Any]], Message]]
) -> Message:
    # The limit is in bytes on the wire: a text frame's characters can take up to
    # four bytes each in UTF-8.
    size = (
        len(text)
        if isinstance(text, bytes)
        else len(text.encode("utf-8", "surrogatepass"))
    )
    if size > MAX_FRAME_BYTES:
        raise DecodeError(f"frame is larger than {MAX_FRAME_BYTES} bytes", "too-large")
    try:
        obj = jsontext.loads(text)
    except DecodeError:
        raise DecodeError("frame is not valid JSON", "bad-json") from None
    if not isinstance(obj, dict):
        raise DecodeError("frame must be a JSON object", "not-object")
    kind = obj.get("type")
    if not isinstance(kind, str):
        raise DecodeError("frame has no string member 'type'", "no-type")
    parser = table.get(kind)
    if parser is None:
        raise DecodeError(f"unknown message type {kind[:40]!r}", "unknown-type")
    try:
        return parser(obj)
    except RecursionError:
        raise DecodeError("frame nests too deeply", "bad-json") from None


def decode_client(text: str | bytes) -> Message:
    """Decode a frame sent by a client; raises :class:`DecodeError`."""
    return _decode(text, _CLIENT)


def decode_server(text: str | bytes) -> Message:
    """Decode a frame sent by the server; raises :class:`DecodeError`."""
    return _decode(text, _SERVER)


def message_type(text: str | bytes) -> str:
    """Best-effort ``type`` of a frame, for error replies (``""`` if unknown)."""
    try:
        obj = jsontext.loads(text)
    except DecodeError:
        return ""
    kind = obj.get("type") if isinstance(obj, dict) else None
    return kind[:40] if isinstance(kind, str) else ""
