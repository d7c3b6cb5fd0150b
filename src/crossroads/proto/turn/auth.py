"""Long-term credentials for TURN: users, time-limited (REST) credentials, nonces.

Theory of operation. Every TURN request but a Binding is authenticated with the
long-term credential mechanism (RFC 8489 §9.2). The server answers an
unauthenticated request with 401 + REALM + NONCE; the client retries with USERNAME,
REALM, NONCE and MESSAGE-INTEGRITY(-SHA256), keyed with
``H(username ":" realm ":" password)``.

*Where passwords come from* (:class:`Credentials`):

- static users (``--turn-user alice:secret``, a users file);
- coturn-compatible time-limited credentials ("TURN REST API",
  ``use-auth-secret``): the username is ``<unix-expiry>:<user>`` and the password is
  ``base64(HMAC-SHA1(secret, username))``, so the server stores only the shared
  secret and an expired username is refused. Several secrets may be configured at
  once, so a secret can be rotated without cutting anyone off.

*Nonces* (:class:`NonceMinter`) are stateless: ``obMatJos2`` + the RFC 8489 §9.2
security-feature bits (password algorithms, so clients that know SHA-256 use it)
+ the issue time in hex + a truncated HMAC over (time, client transport address).
Nothing is stored
per nonce — a flood of unauthenticated requests creates no state (the class of
problem behind coturn's ``--stateless-nonce``) — and several worker processes that
share the key accept each other's nonces. A nonce older than its lifetime, or
presented from another address (a replayed request), is *stale*: 438 with a fresh
nonce. Issue times only grow, so nonces are monotonic.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Iterable, Mapping
from dataclasses import field
from enum import IntEnum

from crossroads.proto.turn.constants import NONCE_LIFETIME
from crossroads.types import frozen

#: RFC 8489 §9.2: a nonce starting with this cookie carries 24 feature bits in
#: the 4 base64 characters that follow.
NONCE_COOKIE = "obMatJos2"
#: Feature bit 0 (the leftmost bit in RFC 8489 §9.2's figure): "Password
#: algorithms" — the server supports PASSWORD-ALGORITHMS (SHA-256 keys).
FEATURE_PASSWORD_ALGORITHMS = 0x800000
#: 12 bytes of HMAC-SHA256 (96 bits) is plenty to stop forgery for a 10-minute
#: nonce, and keeps the 401 small (no amplification, DESIGN.md).
_TAG_BYTES = 12


def rest_password(secret: str | bytes, username: str) -> str:
    """The coturn REST-API password: ``base64(HMAC-SHA1(secret, username))``."""
    key = secret.encode() if isinstance(secret, str) else secret
    digest = hmac.new(key, username.encode(), hashlib.sha1).digest()
    return base64.b64encode(digest).decode("ascii")


def parse_rest_username(username: str, separator: str = ":") -> tuple[int, str] | None:
    """Split a time-limited username into ``(expiry, user)``.

    Accepts ``<expiry>:<user>``, and a bare ``<expiry>`` (coturn allows both; the
    user part is informational). Returns None when there is no leading integer.
    """
    head, _, tail = username.partition(separator)
    if not head.isdigit() or len(head) > 12:
        return None
    return int(head), tail


#: Slack on the credential TTL cap: the minting application's clock and ours
#: may differ a little, and a credential minted for exactly the cap must pass.
TTL_SKEW = 60


class Lookup(IntEnum):
    """Outcome of a password lookup."""

    FOUND = 0
    UNKNOWN_USER = 1
    EXPIRED = 2
    #: A time-limited username whose expiry is further away than the server's
    #: cap (``--turn-max-credential-ttl``): refused like an unknown user.
    TTL_TOO_LONG = 3


@frozen
class Credentials:
    """The sources of passwords for one realm."""

    realm: str
    #: Static users: name -> password.
    users: Mapping[str, str] = field(default_factory=dict)
    #: Shared secrets for time-limited credentials (any may match: rotation).
    secrets: tuple[str, ...] = ()
    #: Separator between expiry and user in time-limited usernames (coturn -C).
    separator: str = ":"
    #: Longest time-limited credential accepted, seconds from now (0: no cap).
    #: A leaked username valid for years is a free relay for years; whoever
    #: mints credentials with the shared secret picks the expiry, so the
    #: server caps it.
    max_ttl: float = 0.0

    @property
    def enabled(self) -> bool:
        """False when no user and no secret is configured."""
        return bool(self.users or self.secrets)

    def passwords(
        self, username: str, unix_now: float, *, allow_expired: bool = False
    ) -> tuple[Lookup, list[str]]:
        """Candidate passwords for ``username`` at wall-clock time ``unix_now``.

        A static user gives one password. A time-limited username gives one per
        configured secret (the caller accepts whichever key verifies), or
        :attr:`Lookup.EXPIRED` once its expiry is in the past (unless
        ``allow_expired``), or :attr:`Lookup.TTL_TOO_LONG` when its expiry is
        more than :attr:`max_ttl` away.
        """
        static = self.users.get(username)
        if static is not None:
            return Lookup.FOUND, [static]
        if self.secrets:
            parsed = parse_rest_username(username, self.separator)
            if parsed is not None:
                expiry, _user = parsed
                if expiry < unix_now and not allow_expired:
                    return Lookup.EXPIRED, []
                if self.max_ttl and expiry - unix_now > self.max_ttl + TTL_SKEW:
                    return Lookup.TTL_TOO_LONG, []
                return Lookup.FOUND, [rest_password(s, username) for s in self.secrets]
        return Lookup.UNKNOWN_USER, []


def parse_user_spec(spec: str) -> tuple[str, str]:
    """``"alice:secret"`` -> ``("alice", "secret")`` (the password may contain ':').

    Raises:
        ValueError: when there is no ``:`` or the name is empty.
    """
    name, sep, password = spec.partition(":")
    if not sep or not name.strip():
        raise ValueError(f"{spec!r} is not user:password")
    return name.strip(), password


def parse_users_file(text: str) -> dict[str, str]:
    """Parse a users file: one ``user:password`` per line, ``#`` comments.

    Raises:
        ValueError: ``line N: reason``.
    """
    users: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            name, password = parse_user_spec(line)
        except ValueError as exc:
            raise ValueError(f"line {number}: {exc}") from None
        users[name] = password
    return users


def merge_users(specs: Iterable[str], file_users: Mapping[str, str]) -> dict[str, str]:
    """Users from the file, then from repeated ``--turn-user`` (which win)."""
    users = dict(file_users)
    for spec in specs:
        name, password = parse_user_spec(spec)
        users[name] = password
    return users


class NonceCheck(IntEnum):
    """Outcome of :meth:`NonceMinter.check`."""

    VALID = 0
    #: Well formed and ours, but too old: 438.
    EXPIRED = 1
    #: Not ours, tampered with, or minted for another client address: 438.
    INVALID = 2


class NonceMinter:
    """Mints and checks stateless, time-limited nonces bound to a client address."""

    __slots__ = ("_key", "lifetime", "features", "_prefix")

    def __init__(
        self,
        key: bytes,
        *,
        lifetime: float = NONCE_LIFETIME,
        password_algorithms: bool = True,
    ) -> None:
        if len(key) < 16:
            raise ValueError("nonce key must be at least 16 bytes")
        self._key = key
        self.lifetime = lifetime
        self.features = FEATURE_PASSWORD_ALGORITHMS if password_algorithms else 0
        bits = self.features.to_bytes(3, "big")
        self._prefix = NONCE_COOKIE + base64.b64encode(bits).decode("ascii")

    @property
    def offers_password_algorithms(self) -> bool:
        return bool(self.features & FEATURE_PASSWORD_ALGORITHMS)

    def _tag(self, stamp: str, scope: str, port: str) -> str:
        message = f"{self._prefix}{stamp}{port}|{scope}".encode()
        digest = hmac.new(self._key, message, hashlib.sha256).digest()[:_TAG_BYTES]
        return base64.urlsafe_b64encode(digest).decode("ascii")

    def mint(self, scope: str, port: int, unix_now: float) -> str:
        """A fresh nonce for the client at ``scope`` (protocol and IP) and ``port``.

        The port is carried in the nonce (4 hex digits) and covered by the HMAC,
        so :meth:`check` can either require the same port, or — for RFC 6062
        ConnectionBind, which legitimately arrives on a new TCP connection with
        the control connection's nonce — accept any port of the same scope.
        """
        stamp = f"{int(unix_now) & 0xFFFFFFFF:08x}"
        hexport = f"{port & 0xFFFF:04x}"
        return self._prefix + stamp + hexport + self._tag(stamp, scope, hexport)

    def issued(self, nonce: str) -> int:
        """The issue time (Unix, 32 bits) a nonce claims; 0 when unreadable.

        Only meaningful for a nonce :meth:`check` accepted as valid or expired
        (its tag covers the stamp).
        """
        start = len(self._prefix)
        try:
            return int(nonce[start : start + 8], 16)
        except ValueError:
            return 0

    def check(
        self,
        nonce: str,
        scope: str,
        port: int | None,
        unix_now: float,
    ) -> NonceCheck:
        """Whether ``nonce`` was minted by us for ``scope`` and ``port`` (any
        port when ``port`` is None) and is still fresh."""
        prefix = self._prefix
        if (
            len(nonce) != len(prefix) + 8 + 4 + 16
            or not nonce.isascii()
            or not nonce.startswith(prefix)
        ):
            return NonceCheck.INVALID
        start = len(prefix)
        stamp = nonce[start : start + 8]
        hexport = nonce[start + 8 : start + 12]
        tag = nonce[start + 12 :]
        if port is not None and hexport != f"{port & 0xFFFF:04x}":
            return NonceCheck.INVALID
        if not hmac.compare_digest(tag, self._tag(stamp, scope, hexport)):
            return NonceCheck.INVALID
        try:
            issued = int(stamp, 16)
        except ValueError:  # pragma: no cover - the tag already matched
            return NonceCheck.INVALID
        age = (int(unix_now) & 0xFFFFFFFF) - issued
        if age < -5 or age > self.lifetime:
            # -5: tolerate a little clock skew between worker processes.
            return NonceCheck.EXPIRED
        return NonceCheck.VALID
