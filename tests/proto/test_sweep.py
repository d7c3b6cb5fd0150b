"""The periodic sweep timer the cores share."""

from __future__ import annotations

from crossroads.proto.sweep import SweepTimer


def test_idle_timer_is_never_due() -> None:
    timer = SweepTimer(0.25)
    assert timer.deadline is None
    assert not timer.due(100.0)


def test_arm_sets_one_deadline_and_later_work_does_not_push_it_back() -> None:
    timer = SweepTimer(0.25)
    timer.arm(10.0)
    timer.arm(10.2)
    assert timer.deadline == 10.25


def test_due_at_the_deadline_sets_the_next_from_now() -> None:
    timer = SweepTimer(0.25)
    timer.arm(10.0)
    assert not timer.due(10.2)
    assert timer.deadline == 10.25
    assert timer.due(10.25)
    # A late timer counts the next interval from when it ran.
    assert timer.due(10.7)
    assert timer.deadline == 10.95


def test_stop_ends_the_sweeps_until_armed_again() -> None:
    timer = SweepTimer(10.0)
    timer.arm(0.0)
    timer.stop()
    assert not timer.due(50.0)
    timer.arm(50.0)
    assert timer.deadline == 60.0
