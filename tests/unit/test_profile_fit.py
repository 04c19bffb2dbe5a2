"""Engine profiles: the least-squares fit of step times, and its online refinement."""

from __future__ import annotations

import dataclasses

import pytest

from services.common.engine_profile import EngineProfile, ProfileSource
from services.common.profile_fit import MAX_DRIFT, ProfileRefiner, StepSample, fit_timing, relative_error
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


# A vllm node's calibration on CPU (the tiny model, 2 cores), and ordinary decode readings beside its prefills.
CPU = TimingModel(a_ms=17.5, b_ms_per_tok=0.0193, c_ms_per_tok2=0.0, prefill_floor_ms=0.0,
                  d_ms=4.53, e_ms_per_seq=0.0174, f_ms_per_ctx_tok=0.000599)
CPU_DECODES = [StepSample(1, c, (), CPU.decode_step_ms(1, c)) for c in range(10, 300, 5)]
SHORT_PROMPTS = (3, 5, 8, 12, 16, 20, 24, 28, 32, 35, 37, 40)


def _refined(window: list[StepSample], calibrated: TimingModel = CPU) -> TimingModel:
    """The timing the node re-registers once it has observed window."""
    refiner = ProfileRefiner(EngineProfile(calibrated, 2048, 16, 4096, ProfileSource.CALIBRATED, num_samples=20,
                                           max_num_seqs=256), refit_every=len(window), min_interval_s=0.0)
    for step in window:
        refiner.observe(step)
    refined = refiner.refit(now=0.0)
    assert refined is not None and refined.source is ProfileSource.ONLINE
    return refined.timing


def _prefill(timing: TimingModel, num_tokens: int) -> float:
    return timing.prefill_ms([num_tokens])


def test_short_prompts_slowed_at_their_longest_cannot_make_up_a_quadratic_term() -> None:
    # Live: short-prompt traffic, a neighbour's burst slowing some of the longest; the node registered
    # 11.5 + 0.169·Σn + 0.0852·Σn² and the scheduler predicted 190 s for 1,490 tokens (0.14 s in fact).
    prefills = [StepSample(0, 0, (n,), _prefill(CPU, n) * (3.0 if n >= 35 and i % 2 else 1.0))
                for i in range(4) for n in SHORT_PROMPTS]
    refined = _refined(CPU_DECODES + prefills)
    for n in (512, 1490, 2048):
        assert _prefill(CPU, n) / 1.5 < _prefill(refined, n) < 1.5 * _prefill(CPU, n), n
    assert refined.c_ms_per_tok2 < 1e-6


def test_short_prompts_whose_time_does_not_follow_their_length_keep_the_per_token_cost() -> None:
    # Live: short prompts taking about 45 ms whatever their length (2.5 times the calibration); the node
    # registered 45.2 + 0·Σn, a 2,048-token prompt as quick as a 3-token one.
    prefills = [StepSample(0, 0, (n,), 45.0 + (3.0 if (i + n) % 2 else -3.0) - 0.1 * n)
                for i in range(4) for n in SHORT_PROMPTS]
    refined = _refined(CPU_DECODES + prefills)
    assert _prefill(refined, 20) > 35.0  # the short prompts' level is learned: the intercept moves
    assert refined.b_ms_per_tok > 0.5 * CPU.b_ms_per_tok
    assert _prefill(refined, 2048) - _prefill(refined, 16) > 0.5 * (_prefill(CPU, 2048) - _prefill(CPU, 16))
    assert _prefill(refined, 2048) < 2.0 * _prefill(CPU, 2048)


def test_one_slow_re_prefill_cannot_move_the_intercept_by_orders_of_magnitude() -> None:
    # Live: one resume's re-prefill under load (600 tokens in 1.2 s), among decodes; the node registered
    # an intercept of 1.19e3 ms, so every prompt was predicted at over a second.
    refined = _refined(CPU_DECODES + [StepSample(0, 0, (600,), 1200.0)])
    assert refined.a_ms < 2.0 * CPU.a_ms
    for n in (16, 600, 2048):
        assert _prefill(refined, n) < 2.0 * _prefill(CPU, n), n
    with_others = _refined(CPU_DECODES + [StepSample(0, 0, (n,), _prefill(CPU, n)) for n in SHORT_PROMPTS]
                           + [StepSample(0, 0, (600,), 1200.0)])
    assert with_others.a_ms == pytest.approx(CPU.a_ms, rel=0.2)


def test_decodes_slowed_at_their_longest_contexts_cannot_make_up_a_context_cost() -> None:
    # The same flaw on decodes: single-sequence steps of 10-300 tokens of context, half of those past 270
    # slowed by a neighbour, made the 64 × 1,024 reference batch (its quoted speed) 15 times slower.
    steps = [StepSample(1, c, (), CPU.decode_step_ms(1, c) * (3.0 if c > 270 and c % 10 else 1.0))
             for c in range(10, 300)]
    refined = _refined(steps)
    reference = CPU.decode_step_ms(64, 64 * 1024)
    assert reference / 1.5 < refined.decode_step_ms(64, 64 * 1024) < 1.5 * reference


def test_long_prompts_slower_than_calibrated_move_the_fit() -> None:
    # The refit still learns what its readings show: long prompts costing twice the calibration's per token.
    slower = dataclasses.replace(CPU, b_ms_per_tok=2 * CPU.b_ms_per_tok)
    prefills = [StepSample(0, 0, (n,), _prefill(slower, n) * (1.05 if n % 3 else 0.95)) for n in range(256, 2049, 32)]
    refined = _refined(CPU_DECODES + prefills)
    for n in (1024, 2048):
        assert abs(_prefill(refined, n) - _prefill(slower, n)) < 0.2 * (_prefill(slower, n) - _prefill(CPU, n)), n


def test_no_refit_strays_more_than_max_drift_from_the_calibration() -> None:
    # Readings ten times slower than the calibration's prefills and ten times quicker than its decodes,
    # everywhere: the refit follows them as far as MAX_DRIFT times the calibration, no further.
    prefills = [StepSample(0, 0, (n,), 10 * _prefill(CPU, n)) for n in range(16, 2049, 16)]
    decodes = [StepSample(b, b * c, (), CPU.decode_step_ms(b, b * c) / 10) for b in (1, 8, 64) for c in (128, 1024)]
    refined = _refined(prefills + decodes * 20)
    slower = [_prefill(refined, n) / _prefill(CPU, n) for n in (16, 64, 256, 1024, 2048)]
    assert all(2.0 < ratio <= MAX_DRIFT * 1.0001 for ratio in slower) and max(slower) > 0.99 * MAX_DRIFT
    quicker = [CPU.decode_step_ms(b, b * c) / refined.decode_step_ms(b, b * c) for b in (1, 8, 64) for c in (128, 2048)]
    assert all(2.0 < ratio <= MAX_DRIFT * 1.0001 for ratio in quicker) and max(quicker) > 0.99 * MAX_DRIFT
