"""The CONNECT lead of proto/timing.py against clients that poll their sockets."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from crossroads.proto.timing import crossing_leads

#: The GameSpy SDK sample's poll interval (natneg/simpletest/simpletest.c:
#: ``NNThink`` then ``msleep(10)``).
POLL = 0.01

one_way = st.floats(min_value=0.0, max_value=0.3)
poll_delay = st.floats(min_value=0.0, max_value=POLL, exclude_max=True)


@given(one_way, one_way, poll_delay, poll_delay)
def test_a_poll_inflated_round_trip_never_makes_the_lead_overshoot(
    d_a: float, d_b: float, p_a: float, p_b: float
) -> None:
    """Whatever the two clients' poll delays in the measured round trips, the
    held message arrives no later than the other one (so the other side's first
    ping, one peer-to-peer delay after its own message, never arrives before
    it), and the two arrive no further apart than if both were sent at once."""
    lead_a, lead_b = crossing_leads(2 * d_a + p_a, 2 * d_b + p_b, 0.35, POLL)
    arrive_a, arrive_b = lead_a + d_a, lead_b + d_b
    if lead_a > 0:
        assert arrive_a <= arrive_b + 1e-12
    if lead_b > 0:
        assert arrive_b <= arrive_a + 1e-12
    assert abs(arrive_a - arrive_b) <= abs(d_a - d_b) + 1e-12


def test_the_lead_is_the_half_difference_less_half_a_poll() -> None:
    assert crossing_leads(0.2, 0.04, 0.35, POLL) == (0.0, (0.16 - POLL) / 2)
    assert crossing_leads(0.04, 0.2, 0.35, POLL) == ((0.16 - POLL) / 2, 0.0)
    # Within one poll interval of each other: no telling who is farther.
    assert crossing_leads(0.049, 0.04, 0.35, POLL) == (0.0, 0.0)
    assert crossing_leads(0.9, 0.0, 0.2, POLL) == (0.0, 0.2)
    assert crossing_leads(None, 0.04, 0.35, POLL) == (0.0, 0.0)
    # Without polling (a client that reads at once) the lead is exact.
    assert crossing_leads(0.2, 0.04, 0.35) == (0.0, 0.08)
