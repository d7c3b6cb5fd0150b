"""Relay port allocator: range, EVEN-PORT, RESERVATION-TOKEN."""

from __future__ import annotations

import random

import pytest

from crossroads.proto.turn.ports import PortAllocator


class SeededEntropy:
    def __init__(self, seed: int = 1) -> None:
        self.rng = random.Random(seed)

    def randbelow(self, exclusive_upper_bound: int) -> int:
        return self.rng.randrange(exclusive_upper_bound)

    def token_bytes(self, nbytes: int) -> bytes:
        return self.rng.randbytes(nbytes)


def test_candidates_cover_range_once_and_skip_used() -> None:
    alloc = PortAllocator(50000, 50009, SeededEntropy(), max_attempts=100)
    alloc.take(50003)
    ports = list(alloc.candidates())
    assert sorted(ports) == [p for p in range(50000, 50010) if p != 50003]
    assert alloc.free == 9


def test_even_and_pair() -> None:
    alloc = PortAllocator(50001, 50010, SeededEntropy(), max_attempts=100)
    assert all(p % 2 == 0 for p in alloc.candidates(even=True))
    alloc.take(50005)
    pairs = list(alloc.candidates(even=True, pair=True))
    assert 50004 not in pairs and 50010 not in pairs
    assert sorted(pairs) == [50002, 50006, 50008]


def test_max_attempts_bounds_the_walk() -> None:
    alloc = PortAllocator(1024, 65535, SeededEntropy(), max_attempts=5)
    assert len(list(alloc.candidates())) == 5


def test_reservation_claim_and_expiry() -> None:
    alloc = PortAllocator(50000, 50010, SeededEntropy())
    reservation = alloc.reserve(50005, 1, now=100.0)
    assert len(reservation.token) == 8
    assert 50005 not in list(alloc.candidates())
    assert alloc.claim(b"12345678", 101.0) is None
    assert alloc.claim(reservation.token, 131.0) is None  # past 30 s
    claimed = alloc.claim(reservation.token, 120.0)
    assert claimed is reservation and claimed.port == 50005
    assert alloc.claim(reservation.token, 120.0) is None  # single use
    alloc.expire(reservation)  # no-op once claimed
    assert 50005 in alloc.in_use

    other = alloc.reserve(50007, 1, now=100.0)
    alloc.expire(other)
    assert 50007 not in alloc.in_use
    assert other.token not in alloc.reservations


def test_bad_range() -> None:
    with pytest.raises(ValueError):
        PortAllocator(10, 5, SeededEntropy())
