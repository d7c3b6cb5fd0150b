"""RakNet's NAT type names and CanConnect matrix (reference §2.2)."""

from __future__ import annotations

import itertools

import pytest

from crossroads.proto.punch.nattype import (
    ADDRESS,
    ADDRESS_AND_PORT,
    INDEPENDENT,
    NatType,
    can_connect,
    from_behaviour,
    to_string,
    to_string_friendly,
)

N = NatType
# The matrix as printed in the reference (row a, column b), T/F.
MATRIX = {
    N.NONE: "TTTTTFFT",
    N.FULL_CONE: "TTTTTFFT",
    N.ADDRESS_RESTRICTED: "TTTTTFFT",
    N.SUPPORTS_UPNP: "TTTTTFFT",
    N.PORT_RESTRICTED: "TTTTFFFT",
    N.SYMMETRIC: "TTTFFFFT",
    N.UNKNOWN: "FFFFFFFF",
    N.DETECTION_IN_PROGRESS: "FFFFFFFF",
}
COLUMNS = [
    N.NONE,
    N.FULL_CONE,
    N.ADDRESS_RESTRICTED,
    N.PORT_RESTRICTED,
    N.SYMMETRIC,
    N.UNKNOWN,
    N.DETECTION_IN_PROGRESS,
    N.SUPPORTS_UPNP,
]


@pytest.mark.parametrize(("a", "b"), list(itertools.product(COLUMNS, COLUMNS)))
def test_can_connect_matches_the_published_matrix(a: NatType, b: NatType) -> None:
    assert can_connect(a, b) == (MATRIX[a][COLUMNS.index(b)] == "T")
    assert can_connect(a, b) == can_connect(b, a)


def test_names() -> None:
    assert [
        to_string_friendly(t)
        for t in (N.NONE, N.FULL_CONE, N.PORT_RESTRICTED, N.SYMMETRIC)
    ] == [
        "Open",
        "Relaxed",
        "Moderate",
        "Strict",
    ]
    assert to_string(N.ADDRESS_RESTRICTED) == "Address restricted"
    assert int(N.SUPPORTS_UPNP) == 7


def test_from_rfc5780_behaviour() -> None:
    assert from_behaviour(INDEPENDENT, INDEPENDENT) == N.FULL_CONE
    assert from_behaviour(INDEPENDENT, ADDRESS) == N.ADDRESS_RESTRICTED
    assert from_behaviour(INDEPENDENT, ADDRESS_AND_PORT) == N.PORT_RESTRICTED
    assert from_behaviour(ADDRESS_AND_PORT, ADDRESS_AND_PORT) == N.SYMMETRIC
    assert from_behaviour(ADDRESS, INDEPENDENT) == N.SYMMETRIC
    assert from_behaviour("?", INDEPENDENT) == N.UNKNOWN
    assert from_behaviour(INDEPENDENT, INDEPENDENT, behind_nat=False) == N.NONE
    assert (
        from_behaviour(ADDRESS_AND_PORT, ADDRESS_AND_PORT, upnp=True) == N.SUPPORTS_UPNP
    )
