"""Ping locations and the relayed / direct estimator (proto/qos/location.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crossroads.errors import DecodeError
from crossroads.proto.qos.location import (
    MAX_REGIONS,
    estimate,
    format_location,
    parse_location,
)
from crossroads.services.relay_allocations import QosResult, rank_qos_results

REGION = st.from_regex(r"[a-z][a-z0-9-]{0,15}", fullmatch=True)


@given(
    st.dictionaries(
        REGION, st.integers(0, 600_000).map(lambda x: x / 10), max_size=MAX_REGIONS
    )
)
def test_format_then_parse_is_identity(rtts: dict[str, float]) -> None:
    if not rtts:
        return
    assert parse_location(format_location(rtts)) == rtts


@given(st.text(max_size=300))
def test_random_text_parses_or_raises_decode_error(text: str) -> None:
    try:
        parse_location(text)
    except DecodeError:
        pass


@pytest.mark.parametrize(
    "text",
    ["", "eu", "eu=", "=3", "eu=-1", "eu=nan", "eu=inf", "eu=1,eu=2", "e u=1",
     "eu=70000", ",".join(f"r{i}=1" for i in range(MAX_REGIONS + 1))],
)  # fmt: skip
def test_malformed_locations_are_refused(text: str) -> None:
    with pytest.raises(DecodeError):
        parse_location(text)


def test_format_is_compact_and_best_first() -> None:
    assert format_location({"us": 84.04, "eu": 12.5, "ap": 181.0}) == (
        "eu=12.5,us=84,ap=181"
    )


def test_relayed_round_trip_is_both_legs_plus_processing() -> None:
    a = {"eu": 10.0, "us": 90.0, "ap": 200.0}
    b = {"eu": 80.0, "us": 20.0}
    result = estimate([a, b], processing_ms=0.5)
    assert [r.region for r in result.regions] == ["eu", "us"]  # ap: b has none
    assert result.regions[0].pairs == ((0, 1, 91.0),)
    assert result.regions[1].pairs == ((0, 1, 111.0),)
    assert result.best == "eu"


def test_a_group_minimises_its_worst_pair() -> None:
    # "x" is best for two of three players, but leaves the third far away.
    locations = [{"x": 5.0, "y": 30.0}, {"x": 5.0, "y": 30.0}, {"x": 150.0, "y": 35.0}]
    result = estimate(locations, processing_ms=0.0)
    assert result.best == "y"
    assert result.regions[0].worst_ms == 65.0
    assert len(result.regions[0].pairs) == 3


def test_only_live_regions_are_offered() -> None:
    result = estimate(
        [{"eu": 1.0, "us": 2.0}, {"eu": 1.0, "us": 2.0}], live_regions=frozenset({"us"})
    )
    assert [r.region for r in result.regions] == ["us"]


def test_direct_estimate_only_when_the_bounds_are_tight() -> None:
    # b sits next to region "eu" (2 ms): the direct path is within 2 ms of a's.
    near = estimate([{"eu": 40.0, "us": 100.0}, {"eu": 2.0, "us": 70.0}])
    (d,) = near.direct
    assert (d.low_ms, d.high_ms) == (38.0, 42.0)
    assert d.estimate_ms == 40.0 and d.error_ms == 2.0
    # Both far from every region: bounds, no estimate.
    far = estimate([{"eu": 50.0}, {"eu": 60.0}])
    (d,) = far.direct
    assert (d.low_ms, d.high_ms, d.estimate_ms) == (10.0, 110.0, None)


def test_measured_regions_rank_by_latency_inflated_by_loss() -> None:
    ranked = rank_qos_results(
        [
            QosResult("a", 30.0, 0.0),
            QosResult("b", 20.0, 0.5),  # counts as 40
            QosResult("c", 1.0, 1.0),  # no answer: unusable
            QosResult("d", 25.0, 0.0),
        ]
    )
    assert [r.region for r in ranked] == ["d", "a", "b"]
