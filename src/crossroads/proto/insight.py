"""Connection insight: one typed record per coordinated connection attempt.

Theory of operation
-------------------
Every family crossroads coordinates (OpenTTD join ladder, natneg negotiation,
RakNet punch and proxy, the p2p SDK ladder, a Unity relay session, a TURN
allocation) ends an attempt knowing more than the game is told: both sides'
NAT behaviour as measured, the steps tried and how long each took, which one
won, and why the others did not. An :class:`Attempt` keeps that, in plain
strings and numbers (it is sent as JSON and kept in the store).

The two sides are pseudonymous by default (:class:`Pseudonymiser`): a keyed
hash of the IP address (HMAC-SHA256 with a per-deployment secret, cut to 64
bits: enough to tell a few billion players apart, useless to recover an
address without the key), the public /24 (IPv4) or /48 (IPv6: a site's
prefix, RFC 6177) so a network that fails often shows, and the NAT kind learnt.
Raw addresses appear only when the operator asks for them.

The services write records from events they already have; this module is
pure (no clock, no I/O): the recorder (:mod:`crossroads.insight`) adds the
time and stores them.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
from dataclasses import asdict, field
from typing import Any

from crossroads.errors import DecodeError
from crossroads.types import frozen

#: Families, as the API's ``family`` filter names them.
FAMILIES = ("natneg", "openttd", "raknet", "p2p", "relay", "turn")

#: Outcomes: the direct path worked, the relay carried it, or nothing did.
OUTCOMES = ("direct", "relayed", "failed")

#: Bytes of HMAC kept as a side's id: 64 bits (16 hex digits).
SIDE_ID_BYTES = 8
#: Longest string field kept from a service (a cause or detail line): records
#: are bounded whatever a client sends (a game name in a natneg REPORT).
MAX_TEXT = 200
#: Most steps and drop reasons one record keeps.
MAX_STEPS = 16


def _text(value: object, limit: int = MAX_TEXT) -> str:
    if not isinstance(value, str):
        raise DecodeError(f"expected a string, got {type(value).__name__}")
    return value[:limit]


def _number(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise DecodeError(f"expected a number, got {type(value).__name__}")
    return float(value)


def _count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise DecodeError("expected a non-negative integer")
    return value


@frozen
class Side:
    """One side of an attempt, as the record may keep it."""

    #: Keyed hash of the IP (16 hex digits), or the IP itself when the
    #: operator asked for raw addresses.
    id: str
    #: The public /24 or /48 it came from ("198.51.100.0/24"), "" if unknown.
    prefix: str = ""
    #: The NAT kind learnt ("symmetric", "port-restricted", "open", ...), ""
    #: when the protocol showed none.
    nat: str = ""
    #: Its round trip to the server in milliseconds where the protocol
    #: measured one (natneg ERT), else None.
    rtt_ms: float | None = None

    @classmethod
    def from_json(cls, raw: object) -> Side:
        if not isinstance(raw, dict):
            raise DecodeError("side must be an object")
        rtt = raw.get("rtt_ms")
        return cls(
            id=_text(raw.get("id", ""), 64),
            prefix=_text(raw.get("prefix", ""), 64),
            nat=_text(raw.get("nat", ""), 64),
            rtt_ms=None if rtt is None else _number(rtt),
        )


@frozen
class Step:
    """One step of the ladder: what was tried, when, for how long, and how it went."""

    #: "probe", "punch", "direct", "stun", "relay", "allocate", ...
    name: str
    #: Seconds after the attempt started.
    start: float
    duration: float
    #: "ok", "failed", "timeout", "skipped", "predicted-to-fail".
    outcome: str

    @classmethod
    def from_json(cls, raw: object) -> Step:
        if not isinstance(raw, dict):
            raise DecodeError("step must be an object")
        return cls(
            name=_text(raw.get("name", ""), 64),
            start=_number(raw.get("start", 0.0)),
            duration=_number(raw.get("duration", 0.0)),
            outcome=_text(raw.get("outcome", ""), 64),
        )


@frozen
class Usage:
    """What a relayed session carried, read from the relay's route counters
    when the session ended (never counted per packet for the record).

    ``up`` is from the first side (the host, the allocation's client, natneg
    client 0) to the other; ``down`` the reverse."""

    packets_up: int = 0
    bytes_up: int = 0
    packets_down: int = 0
    bytes_down: int = 0
    #: Datagrams dropped, by reason ("throttled", "slow-receiver", ...).
    drops: tuple[tuple[str, int], ...] = ()
    #: Round trip in milliseconds where the protocol shows one, else None.
    rtt_ms: float | None = None

    @property
    def bytes(self) -> int:
        return self.bytes_up + self.bytes_down

    @property
    def packets(self) -> int:
        return self.packets_up + self.packets_down

    def to_json(self) -> dict[str, Any]:
        body = asdict(self)
        body["drops"] = dict(self.drops)
        return body

    @classmethod
    def from_json(cls, raw: object) -> Usage:
        if not isinstance(raw, dict):
            raise DecodeError("usage must be an object")
        drops = raw.get("drops", {})
        if not isinstance(drops, dict):
            raise DecodeError("drops must be an object")
        rtt = raw.get("rtt_ms")
        return cls(
            packets_up=_count(raw.get("packets_up", 0)),
            bytes_up=_count(raw.get("bytes_up", 0)),
            packets_down=_count(raw.get("packets_down", 0)),
            bytes_down=_count(raw.get("bytes_down", 0)),
            drops=tuple(
                (_text(k, 64), _count(v)) for k, v in list(drops.items())[:MAX_STEPS]
            ),
            rtt_ms=None if rtt is None else _number(rtt),
        )


@frozen
class Attempt:
    """One coordinated connection attempt, whatever the family."""

    #: One of :data:`FAMILIES`.
    family: str
    #: The code or session id the game knows (invite/join code, natneg
    #: cookie, allocation id).
    session: str
    #: Unix time the attempt started (seconds).
    started: float
    #: Seconds from the start to the outcome (or to the session's end).
    duration: float
    #: The two sides (one for a TURN allocation: its client).
    sides: tuple[Side, ...]
    steps: tuple[Step, ...]
    #: The step that carried the connection ("punch", "direct", "relay"), ""
    #: when none did.
    winner: str
    #: One of :data:`OUTCOMES`.
    outcome: str
    #: Why the relay carried it or why it failed ("both-symmetric", "punch
    #: timed out", "client retried after failure"), "" for a direct success.
    cause: str = ""
    #: Who to bill: an API key's name, an OpenTTD server, a realm/user.
    game: str = ""
    #: What a relayed session carried; None when nothing was relayed.
    usage: Usage | None = None
    #: The instance that wrote the record (cluster: which process saw it).
    instance: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "family": self.family,
            "session": self.session,
            "started": self.started,
            "duration": self.duration,
            "sides": [asdict(s) for s in self.sides],
            "steps": [asdict(s) for s in self.steps],
            "winner": self.winner,
            "outcome": self.outcome,
            "cause": self.cause,
            "game": self.game,
            "usage": None if self.usage is None else self.usage.to_json(),
            "instance": self.instance,
        }

    def encode(self) -> bytes:
        return json.dumps(self.to_json(), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: object) -> Attempt:
        """A record from its JSON form (from the store: checked, bounded).

        Raises:
            DecodeError: not a record.
        """
        if not isinstance(raw, dict):
            raise DecodeError("attempt must be an object")
        sides = raw.get("sides", [])
        steps = raw.get("steps", [])
        if not isinstance(sides, list) or not isinstance(steps, list):
            raise DecodeError("sides and steps must be lists")
        usage = raw.get("usage")
        return cls(
            family=_text(raw.get("family"), 16),
            session=_text(raw.get("session", ""), 64),
            started=_number(raw.get("started", 0.0)),
            duration=_number(raw.get("duration", 0.0)),
            sides=tuple(Side.from_json(s) for s in sides[:2]),
            steps=tuple(Step.from_json(s) for s in steps[:MAX_STEPS]),
            winner=_text(raw.get("winner", ""), 32),
            outcome=_text(raw.get("outcome", ""), 16),
            cause=_text(raw.get("cause", "")),
            game=_text(raw.get("game", ""), 64),
            usage=None if usage is None else Usage.from_json(usage),
            instance=_text(raw.get("instance", ""), 64),
        )

    @classmethod
    def decode(cls, data: bytes) -> Attempt:
        try:
            raw = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise DecodeError(f"not JSON: {exc}") from None
        return cls.from_json(raw)


def public_prefix(host: str) -> str:
    """The /24 (IPv4) or /48 (IPv6) holding ``host``; "" when it is not an IP.
    An IPv4-mapped IPv6 address counts as its IPv4 address."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return ""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped
    bits = 24 if address.version == 4 else 48
    return str(ipaddress.ip_network(f"{address}/{bits}", strict=False))


@frozen
class Pseudonymiser:
    """Turns an address into a :class:`Side` (see the module docstring)."""

    key: bytes = field(repr=False)
    #: Keep the IP itself as the side's id (the operator asked for it).
    raw: bool = False

    def side(self, host: str, nat: str = "", rtt_ms: float | None = None) -> Side:
        prefix = public_prefix(host)
        if self.raw:
            return Side(id=host, prefix=prefix, nat=nat, rtt_ms=rtt_ms)
        try:
            canonical = str(ipaddress.ip_address(host.split("%", 1)[0]))
        except ValueError:
            canonical = host
        digest = hmac.new(self.key, canonical.encode(), hashlib.sha256).digest()
        return Side(
            id=digest[:SIDE_ID_BYTES].hex(), prefix=prefix, nat=nat, rtt_ms=rtt_ms
        )
