"""The mean of an engine's latest decode steps that a node reports in its load."""

from __future__ import annotations

import math

import pytest

from services.common.recent_steps import MAX_READINGS, RecentSteps


def test_the_mean_covers_about_the_last_window_of_steps() -> None:
    steps = RecentSteps(window_ms=100.0)
    assert steps.mean_ms == 0
    for _ in range(10):
        steps.note(10.0)
    assert steps.mean_ms == pytest.approx(10.0)
    steps.note(60.0, steps=2)  # two steps of 30 ms, as one reading
    assert steps.mean_ms == pytest.approx((4 * 10 + 60) / 6)  # the latest 100 ms of steps: six, not twelve
    steps.note(500.0)  # one step longer than the window: it alone is the latest
    assert steps.mean_ms == pytest.approx(500.0)


def test_after_decoding_stopped_the_mean_stays_until_the_next_reading_starts_afresh() -> None:
    steps = RecentSteps()
    steps.note(80.0)
    steps.stopped()
    assert steps.mean_ms == 80.0
    steps.note(8.0)
    assert steps.mean_ms == 8.0


def test_readings_of_no_time_are_kept_but_not_without_bound() -> None:
    steps = RecentSteps()
    for _ in range(3 * MAX_READINGS):
        steps.note(0.0)
    steps.note(12.0)
    assert steps.mean_ms == pytest.approx(12.0 / MAX_READINGS)


@pytest.mark.parametrize(("step_ms", "count"), [(-1.0, 1), (math.nan, 1), (math.inf, 1), (5.0, 0)])
def test_a_reading_that_is_no_time_is_refused_naming_it(step_ms: float, count: int) -> None:
    steps = RecentSteps()
    with pytest.raises(ValueError, match="step_ms="):
        steps.note(step_ms, count)
    assert steps.mean_ms == 0


@pytest.mark.parametrize("window_ms", [0.0, -5.0, math.nan])
def test_a_window_that_is_not_positive_is_refused(window_ms: float) -> None:
    with pytest.raises(ValueError, match="window_ms="):
        RecentSteps(window_ms)
