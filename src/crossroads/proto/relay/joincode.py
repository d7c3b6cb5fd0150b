"""Join codes: short, case-insensitive, hard to misread.

Unity's join codes are 6–12 characters from ``6789BCDFGHJKLMNPQRTW``: 20 symbols
with no vowels (no words) and no look-alikes (0/O, 1/I/L, 5/S, 2/Z, ...). Six
characters give 20**6 = 64 million codes (reference §1.3, "Join code").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from crossroads.errors import DecodeError, LocalProtocolError

ALPHABET: Final = "6789BCDFGHJKLMNPQRTW"
MIN_LENGTH: Final = 6
MAX_LENGTH: Final = 12
_SYMBOLS: Final = frozenset(ALPHABET)
#: Largest multiple of 20 below 256: bytes at or above it are redrawn, so every
#: symbol is equally likely (no modulo bias).
_UNBIASED_LIMIT: Final = 256 - 256 % len(ALPHABET)


def generate(length: int, random_bytes: Callable[[int], bytes]) -> str:
    """A uniformly random join code of ``length`` symbols."""
    if not MIN_LENGTH <= length <= MAX_LENGTH:
        raise LocalProtocolError(f"join codes are {MIN_LENGTH}-{MAX_LENGTH} characters")
    symbols: list[str] = []
    while len(symbols) < length:
        for byte in random_bytes(length * 2):
            if byte < _UNBIASED_LIMIT and len(symbols) < length:
                symbols.append(ALPHABET[byte % len(ALPHABET)])
    return "".join(symbols)


def normalize(code: str) -> str:
    """The canonical (upper-case, trimmed) form of a code a player typed.

    Raises:
        DecodeError: wrong length or a character outside the alphabet.
    """
    text = code.strip().upper()
    if not MIN_LENGTH <= len(text) <= MAX_LENGTH:
        raise DecodeError(
            f"a join code has {MIN_LENGTH} to {MAX_LENGTH} characters",
            reason="bad-length",
        )
    if not set(text) <= _SYMBOLS:
        raise DecodeError(
            f"a join code uses only the characters {ALPHABET}", reason="bad-character"
        )
    return text
