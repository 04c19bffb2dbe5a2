"""Engine profiles: the least-squares fit of step times, and its online refinement."""

from __future__ import annotations

import dataclasses

import pytest

from services.common.engine_profile import EngineProfile, ProfileSource
from services.common.profile_fit import ProfileRefiner, StepSample, fit_timing, relative_error
from services.common.step_timing import TimingModel

pytestmark = pytest.mark.timeout(10)

TRUE = TimingModel(a_ms=3.0, b_ms_per_tok=0.05, c_ms_per_tok2=1e-5, prefill_floor_ms=0.0,
                   d_ms=4.0, e_ms_per_seq=0.2, f_ms_per_ctx_tok=0.001)


def _sweep(timing: TimingModel, noise: float = 0.0) -> list[StepSample]:
    """A calibration's steps as timing would take them (alternately noise too slow and too fast)."""
    samples = [StepSample(0, 0, (n,), timing.step_ms(0, 0, (n,))) for n in (16, 64, 128, 256, 512, 1024)]
    samples += [StepSample(b, b * c, (), timing.step_ms(b, b * c, ())) for b in (1, 2, 4, 8) for c in (40, 400)]
    return [dataclasses.replace(s, ms=s.ms * (1 + (noise if i % 2 else -noise))) for i, s in enumerate(samples)]


def _profile(timing: TimingModel) -> EngineProfile:
    return EngineProfile(timing, 2048, 32, 4096, ProfileSource.CALIBRATED, num_samples=20)


def test_the_fit_recovers_the_coefficients_that_produced_the_step_times() -> None:
    fitted = fit_timing(_sweep(TRUE))
    for field in ("a_ms", "b_ms_per_tok", "c_ms_per_tok2", "d_ms", "e_ms_per_seq", "f_ms_per_ctx_tok"):
        assert getattr(fitted, field) == pytest.approx(getattr(TRUE, field), rel=1e-4), field
    assert relative_error(fitted, _sweep(TRUE)) < 1e-6


def test_noisy_step_times_fit_within_their_noise_and_no_coefficient_goes_negative() -> None:
    fitted = fit_timing(_sweep(TRUE, noise=0.05))
    assert relative_error(fitted, _sweep(TRUE)) < 0.05
    # Decode steps that do not grow with context: f is held at 0, not fitted below it.
    flat = [StepSample(b, b * c, (), 5.0 + 0.1 * b - 1e-6 * b * c) for b in (1, 4, 16) for c in (100, 1000)]
    assert fit_timing(flat).f_ms_per_ctx_tok == 0.0
    assert all(v >= 0 for v in dataclasses.astuple(fit_timing(flat)))


def test_a_fit_needs_a_timed_step() -> None:
    with pytest.raises(ValueError, match="samples"):
        fit_timing([StepSample(1, 10, (), 0.0)])


def test_online_refinement_follows_an_engine_slower_than_calibrated() -> None:
    refiner = ProfileRefiner(_profile(TRUE), refit_every=16, min_interval_s=10.0)
    slower = dataclasses.replace(TRUE, d_ms=8.0, e_ms_per_seq=0.4)
    steps = [StepSample(b, b * 300, (), slower.decode_step_ms(b, b * 300)) for b in (1, 2, 4, 8, 16, 32)] * 20
    for step in steps[:15]:
        refiner.observe(step)
    assert refiner.refit(now=0.0) is None  # not enough new steps yet
    for step in steps[15:]:
        refiner.observe(step)
    refined = refiner.refit(now=0.0)
    assert refined is not None and refined.source is ProfileSource.ONLINE
    assert refined.num_samples == 20 + len(steps)
    assert abs(refined.timing.decode_step_ms(8, 2400) - slower.decode_step_ms(8, 2400)) < (
        0.1 * (slower.decode_step_ms(8, 2400) - TRUE.decode_step_ms(8, 2400)))
    # Prefill was not observed: it keeps the calibration's coefficients.
    assert refined.timing.prefill_ms([512]) == pytest.approx(TRUE.prefill_ms([512]), rel=0.02)
    for step in steps[:16]:
        refiner.observe(step)
    assert refiner.refit(now=5.0) is None  # each refit is re-registered: not more often than min_interval_s
    assert refiner.refit(now=10.0) is not None


def test_a_window_of_single_sequence_decodes_cannot_make_up_a_batch_coefficient() -> None:
    refiner = ProfileRefiner(_profile(TRUE), refit_every=8)
    for c in range(100, 900, 10):
        refiner.observe(StepSample(1, c, (), TRUE.decode_step_ms(1, c) * 1.1))
    refined = refiner.refit(now=0.0)
    assert refined is not None
    assert refined.timing.e_ms_per_seq == pytest.approx(TRUE.e_ms_per_seq, rel=0.5)
    assert refined.timing.decode_step_ms(1, 500) == pytest.approx(TRUE.decode_step_ms(1, 500) * 1.1, rel=0.05)
