"""The OpenTTD service's periodic duties on one timer."""

from __future__ import annotations

import pytest

from crossroads.proto.openttd.duties import Duties, Duty
from tests.proto.openttd.timers import fire


def test_a_duty_runs_at_once_then_a_period_after_it_finished() -> None:
    duties = Duties()
    duties.add(Duty.HEARTBEAT, 10.0, now=0.0)
    duties.add(Duty.SWEEP, 30.0, now=0.0)
    assert duties.get_timer() == 0.0
    assert sorted(fire(duties, 0.0), key=lambda d: d.value) == [
        Duty.HEARTBEAT,
        Duty.SWEEP,
    ]
    # Handed out and not finished: no deadline, never twice at once.
    assert duties.get_timer() is None
    assert fire(duties, 100.0) == []
    duties.finished(Duty.HEARTBEAT, 2.5)  # a slow store: 2.5 s for one beat
    duties.finished(Duty.SWEEP, 0.1)
    assert duties.get_timer() == 12.5
    assert fire(duties, 12.4) == []
    assert fire(duties, 12.5) == [Duty.HEARTBEAT]
    assert duties.get_timer() == 30.1
    # A finish that was not handed out (a stray call) changes nothing.
    duties.finished(Duty.SWEEP, 5.0)
    assert duties.get_timer() == 30.1


def test_periods_must_be_positive() -> None:
    with pytest.raises(ValueError):
        Duties().add(Duty.SWEEP, 0.0, now=0.0)
