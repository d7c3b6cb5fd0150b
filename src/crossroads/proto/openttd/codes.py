"""Invite codes, their secrets, attempt tokens and TURN tickets.

Invite codes (reference ``openttd-coordinator.md`` section 11): ``+`` followed by
7 symbols of a 53-symbol alphabet that leaves out look-alike characters (0, 1,
I, L, O, P, i, l, o). 53^7 is about 2^40 codes; the service claims each new code
in the store with ``SET NX``, so a collision is retried, never shared.

The secret handed out with a code lets the same server claim the code again
after a reconnect or restart. It is ``HMAC-SHA256(key, code)`` in hex (64
characters; the field holds 79): stateless, so any instance with the same key
validates it, and compared in constant time. OpenTTD treats it as opaque.

Tokens name one connection attempt or registration check. The first character
tells the side (``C`` client, ``S`` server, ``V`` registration verify), as peers
echo the token verbatim and the coordinator strips that character (reference
section 4); then 8 hex digits name the coordinator instance that owns the
attempt, so a STUN observation or a server's report reaches it across processes;
then 24 random hex digits make it unguessable.

Randomness comes in as bytes from the caller: nothing here draws it.
"""

from __future__ import annotations

import hashlib
import hmac
from enum import Enum

from crossroads.types import frozen

ALPHABET = "abcdefghjkmnpqrstuvwxyzABCDEFGHJKMNQRSTUVWXYZ23456789"
_ALPHABET_SET = frozenset(ALPHABET)
#: Symbols in a code we issue; 53**7 ~ 1.2e12 codes.
CODE_SYMBOLS = 7
#: Random bytes :func:`make_invite_code` consumes (> log2(53**7) = 40.1 bits, so
#: the modulo bias is below 2**-23).
CODE_RANDOM_BYTES = 8
#: Hex digits of an instance id inside a token.
INSTANCE_ID_HEX = 8
#: Random bytes per token (96 bits: unguessable for the 20 s an attempt lives).
TOKEN_RANDOM_BYTES = 12
#: Random bytes per half of a TURN ticket (``<16 hex>:<16 hex>`` as in the reference).
TICKET_HALF_BYTES = 8


def make_invite_code(random_bytes: bytes) -> str:
    """An invite code from :data:`CODE_RANDOM_BYTES` random bytes."""
    if len(random_bytes) < CODE_RANDOM_BYTES:
        raise ValueError("not enough random bytes for an invite code")
    value = int.from_bytes(random_bytes[:CODE_RANDOM_BYTES], "little")
    symbols = []
    for _ in range(CODE_SYMBOLS):
        value, digit = divmod(value, len(ALPHABET))
        symbols.append(ALPHABET[digit])
    return "+" + "".join(symbols)


def looks_like_invite_code(code: str) -> bool:
    """``+`` and 1..30 alphabet symbols: the shape a code from any GC has.

    (Codes of the openttd.org coordinator use the same alphabet, 7-9 symbols.)
    """
    return (
        code.startswith("+")
        and 1 <= len(code) - 1 <= 30
        and all(c in _ALPHABET_SET for c in code[1:])
    )


def invite_code_secret(key: bytes, code: str) -> str:
    """The secret that proves ownership of ``code``."""
    return hmac.new(key, code.encode(), hashlib.sha256).hexdigest()


def check_invite_code_secret(key: bytes, code: str, secret: str) -> bool:
    """Constant-time check of a secret presented with a code."""
    return hmac.compare_digest(invite_code_secret(key, code), secret)


class TokenSide(Enum):
    """Which peer a token was given to."""

    CLIENT = "C"
    SERVER = "S"
    VERIFY = "V"


@frozen
class ParsedToken:
    side: TokenSide
    instance: str
    attempt: str

    @property
    def attempt_key(self) -> str:
        """Instance and attempt together: the key shared by the C and S tokens."""
        return self.instance + self.attempt


def make_attempt_id(instance: str, random_bytes: bytes) -> str:
    """The side-less part of a token: instance id + random hex."""
    if len(instance) != INSTANCE_ID_HEX or len(random_bytes) < TOKEN_RANDOM_BYTES:
        raise ValueError("bad instance id or not enough random bytes")
    return instance + random_bytes[:TOKEN_RANDOM_BYTES].hex()


def token_for(side: TokenSide, attempt_key: str) -> str:
    return side.value + attempt_key


def parse_token(token: str) -> ParsedToken | None:
    """Split a token we issued; None for anything else."""
    if len(token) != 1 + INSTANCE_ID_HEX + 2 * TOKEN_RANDOM_BYTES:
        return None
    try:
        side = TokenSide(token[0])
    except ValueError:
        return None
    body = token[1:]
    if any(c not in "0123456789abcdef" for c in body):
        return None
    return ParsedToken(side, body[:INSTANCE_ID_HEX], body[INSTANCE_ID_HEX:])


def make_ticket(random_bytes: bytes) -> str:
    """A TURN ticket ``<id>:<secret>``: the id finds it, the secret proves it."""
    if len(random_bytes) < 2 * TICKET_HALF_BYTES:
        raise ValueError("not enough random bytes for a ticket")
    left = random_bytes[:TICKET_HALF_BYTES].hex()
    right = random_bytes[TICKET_HALF_BYTES : 2 * TICKET_HALF_BYTES].hex()
    return f"{left}:{right}"


def split_ticket(ticket: str) -> tuple[str, str] | None:
    left, sep, right = ticket.partition(":")
    hexdigits = "0123456789abcdef"
    if (
        not sep
        or len(left) != 2 * TICKET_HALF_BYTES
        or len(right) != 2 * TICKET_HALF_BYTES
        or any(c not in hexdigits for c in left + right)
    ):
        return None
    return left, right
