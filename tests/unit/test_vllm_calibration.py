"""The vllm engine's readings of clean steps, its calibration sweep's limits, and a sweep slowed by a neighbour."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from services.common.engine_profile import ProfileSource
from services.common.profile_fit import StepSample, fit_timing, relative_error
from services.common.step_timing import TimingModel
from services.node_agent.engines.vllm import profiler as profiler_module
from services.node_agent.engines.vllm.calibration import StepObserver, Sweep
from services.node_agent.engines.vllm.profiler import MAX_SWEEPS, RESWEEP_AFTER_S, RESWEEP_ERROR, VllmProfiler

pytestmark = pytest.mark.timeout(10)


def test_a_prefill_is_read_only_from_a_request_alone_in_the_engine() -> None:
    observer = StepObserver()
    observer.admitted("a", num_in_flight=1, now=10.0)
    sample = observer.first_token("a", num_new_tokens=1, num_computed=480, now=10.05)
    assert sample == StepSample(0, 0, (480,), pytest.approx(50.0))
    observer.admitted("b", num_in_flight=1, now=11.0)
    observer.admitted("c", num_in_flight=2, now=11.01)  # b is no longer alone
    assert observer.first_token("b", 1, 480, now=11.05) is None
    assert observer.first_token("c", 1, 480, now=11.06) is None


def test_a_decode_is_read_only_when_no_prompt_is_prefilled_beside_it() -> None:
    assert StepObserver.decode(0.02, 2, num_decoding=4, num_context_tokens=800, num_prefilling=0) == (
        StepSample(4, 800, (), pytest.approx(10.0)))
    assert StepObserver.decode(0.02, 2, num_decoding=4, num_context_tokens=800, num_prefilling=1) is None


def test_the_sweep_keeps_within_the_engines_limits() -> None:
    sweep = Sweep().fitted_to(max_model_len=512, max_num_batched_tokens=256, max_num_seqs=4)
    assert max(sweep.prefill_sizes) == 256 and len(set(sweep.prefill_sizes)) == len(sweep.prefill_sizes)
    assert sweep.decode_batches == (1, 4) and max(sweep.decode_prompt_tokens) <= 512 - sweep.decode_steps - 2


TRUE = TimingModel(a_ms=3.0, b_ms_per_tok=0.05, c_ms_per_tok2=1e-5, prefill_floor_ms=0.0,
                   d_ms=4.0, e_ms_per_seq=0.2, f_ms_per_ctx_tok=0.001)


def _sweep(slowed: range = range(0)) -> list[StepSample]:
    """A sweep's readings as TRUE would take them (prefills twice, decodes four sequences a step), those at
    the positions in slowed three times too slow: another process ran beside them."""
    steps = [StepSample(0, 0, (n,), TRUE.step_ms(0, 0, (n,))) for n in (32, 128, 256, 512) for _ in range(2)]
    steps += [StepSample(b, b * c, (), TRUE.step_ms(b, b * c, ())) for b in (1, 4, 8) for c in (40, 400)
              for _ in range(4)]
    return [dataclasses.replace(s, ms=s.ms * 3) if i in slowed else s for i, s in enumerate(steps)]


def _calibrated(monkeypatch: pytest.MonkeyPatch, sweeps: list[list[StepSample]]) -> tuple[TimingModel, list[float]]:
    """The timing a VllmProfiler registers last when its sweeps read `sweeps` in turn, and the pauses
    before each of them (0 before the first)."""
    pauses = []
    paused = [0.0]

    async def sweep_once(*args: object) -> list[StepSample]:
        pauses.append(paused[0])
        return sweeps[len(pauses) - 1]

    async def pause(seconds: float) -> None:
        paused[0] = seconds

    monkeypatch.setattr(profiler_module, "calibrate", sweep_once)
    registered = []
    profiler = VllmProfiler(2048, 16, 1024, changed=lambda: registered.append(profiler.profile))
    profile = asyncio.run(profiler.calibrate(None, Sweep(), 1000, lambda: True, lambda: 0.0, pause))
    assert registered[-1] is profile and len(registered) == len(pauses)  # each sweep's fit is registered
    return profile.timing, pauses


def test_a_sweep_slowed_by_a_neighbour_is_swept_again_and_each_steps_quickest_reading_fitted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    third = len(_sweep()) // 3
    slowed_middle = _sweep(slowed=range(third, 2 * third))
    assert relative_error(fit_timing(slowed_middle), slowed_middle) > RESWEEP_ERROR  # what the first sweep reads
    assert relative_error(fit_timing(slowed_middle), _sweep()) > 0.1  # and how far off a profile of it is
    timing, pauses = _calibrated(monkeypatch, [slowed_middle, _sweep()])
    assert pauses == [0.0, RESWEEP_AFTER_S]
    assert relative_error(timing, _sweep()) < 0.01
    # A neighbour that slows other steps in each sweep: neither sweep fits alone, their quickest readings do.
    slowed_end = _sweep(slowed=range(2 * third, len(_sweep())))
    timing, pauses = _calibrated(monkeypatch, [slowed_middle, slowed_end])
    assert len(pauses) == 2
    assert relative_error(timing, _sweep()) < 0.01


def test_a_quiet_sweep_runs_once_and_a_noisy_machine_at_most_max_sweeps_times(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _calibrated(monkeypatch, [_sweep()])[1] == [0.0]
    third = len(_sweep()) // 3
    slowed = _sweep(slowed=range(third, 2 * third))  # the same steps in every sweep
    assert _calibrated(monkeypatch, [slowed] * (MAX_SWEEPS + 1))[1] == [0.0, RESWEEP_AFTER_S, 2 * RESWEEP_AFTER_S]


@pytest.mark.parametrize("traffic", ["refined the profile", "in flight"])
def test_no_sweep_again_beside_real_traffic(monkeypatch: pytest.MonkeyPatch, traffic: str) -> None:
    third = len(_sweep()) // 3
    sweeps = []

    async def sweep_once(*args: object) -> list[StepSample]:
        sweeps.append(1)
        return _sweep(slowed=range(third, 2 * third))

    profiler = VllmProfiler(2048, 16, 1024, changed=lambda: None)

    quiet = [True]

    async def traffic_meanwhile(seconds: float) -> None:
        assert profiler.profile is not None
        if traffic == "refined the profile":
            profiler.profile = dataclasses.replace(profiler.profile, source=ProfileSource.ONLINE)
        else:
            quiet[0] = False

    monkeypatch.setattr(profiler_module, "calibrate", sweep_once)
    asyncio.run(profiler.calibrate(None, Sweep(), 1000, lambda: quiet[0], lambda: 0.0, traffic_meanwhile))
    assert len(sweeps) == 1
