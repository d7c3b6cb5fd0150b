"""The relay port allocator: a configured range, EVEN-PORT and RESERVATION-TOKEN.

Theory of operation: the allocator only does bookkeeping. It proposes candidate
ports — from a random starting point (RFC 8656 §7.2 asks for unpredictable relayed
ports, and a random start spreads load over the range) walking the range once —
and the caller tries to bind each in turn, :meth:`PortAllocator.take`-ing the one
that binds. Ports in use by this process are skipped; a port another process holds
simply fails to bind and the walk goes on, at most ``max_attempts`` times.

EVEN-PORT (RFC 8656 §7.2): with the R bit the server also reserves the next
(odd) port for ~30 s and returns an 8-byte RESERVATION-TOKEN; a later Allocate
carrying that token gets exactly that port. Tokens are random (unguessable), and
expire through the core's single timer (:data:`RESERVATION_LIFETIME`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import KW_ONLY, dataclass, field
from typing import Protocol

from crossroads.proto.turn.constants import RESERVATION_LIFETIME

#: RESERVATION-TOKEN is 8 bytes (RFC 8656 §18.9).
TOKEN_SIZE = 8


class Entropy(Protocol):
    """Randomness injected into the sans-I/O core (``secrets`` fits)."""

    def randbelow(self, exclusive_upper_bound: int) -> int: ...

    def token_bytes(self, nbytes: int) -> bytes: ...


@dataclass(slots=True)
class Reservation:
    """A port held for a later Allocate with the matching RESERVATION-TOKEN."""

    token: bytes
    port: int
    family: int
    expires: float
    dead: bool = False


@dataclass(eq=False)
class PortAllocator:
    """Hands out relay ports from ``[low, high]``."""

    low: int
    high: int
    entropy: Entropy
    _: KW_ONLY
    #: A bind that fails this many times in a row ends the search (508):
    #: bounded work per Allocate even when another program holds the range.
    max_attempts: int = 64
    in_use: set[int] = field(default_factory=set, init=False)
    reservations: dict[bytes, Reservation] = field(
        default_factory=dict, init=False, repr=False
    )

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high <= 65535:
            raise ValueError(f"bad relay port range {self.low}-{self.high}")

    @property
    def size(self) -> int:
        return self.high - self.low + 1

    @property
    def free(self) -> int:
        """Ports neither in use nor reserved."""
        return self.size - len(self.in_use)

    def candidates(self, *, even: bool = False, pair: bool = False) -> Iterator[int]:
        """Free ports in random-start order.

        ``even`` yields only even ports; ``pair`` also requires the next port to be
        free and inside the range (EVEN-PORT with R=1).
        """
        span = self.size
        start = self.entropy.randbelow(span)
        tried = 0
        for offset in range(span):
            port = self.low + (start + offset) % span
            if even and port & 1:
                continue
            if port in self.in_use:
                continue
            if pair and (port + 1 > self.high or port + 1 in self.in_use):
                continue
            yield port
            tried += 1
            if tried >= self.max_attempts:
                return

    def take(self, port: int) -> None:
        """Mark ``port`` as used (after it was bound)."""
        self.in_use.add(port)

    def release(self, port: int) -> None:
        """Return ``port`` to the pool."""
        self.in_use.discard(port)

    def reserve(self, port: int, family: int, now: float) -> Reservation:
        """Hold ``port`` for a later Allocate; returns the reservation (with token)."""
        token = self.entropy.token_bytes(TOKEN_SIZE)
        while token in self.reservations:  # pragma: no cover - 2**-64
            token = self.entropy.token_bytes(TOKEN_SIZE)
        self.in_use.add(port)
        reservation = Reservation(token, port, family, now + RESERVATION_LIFETIME)
        self.reservations[token] = reservation
        return reservation

    def claim(self, token: bytes, now: float) -> Reservation | None:
        """Take the reservation for ``token`` (None when unknown or expired).

        The port stays marked in use: it now belongs to the new allocation.
        """
        reservation = self.reservations.get(token)
        if reservation is None or reservation.expires <= now:
            return None
        del self.reservations[token]
        reservation.dead = True
        return reservation

    def expire(self, reservation: Reservation) -> None:
        """Drop an unclaimed reservation and free its port."""
        if reservation.dead:
            return
        reservation.dead = True
        self.reservations.pop(reservation.token, None)
        self.in_use.discard(reservation.port)
