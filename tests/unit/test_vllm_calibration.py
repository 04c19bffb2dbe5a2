"""The vllm engine's readings of clean steps, its calibration sweep's limits, and a sweep slowed by a neighbour."""

from __future__ import annotations

import asyncio
import dataclasses
import types
from collections.abc import Callable

import pytest

from services.common.engine_profile import EngineProfile
from services.common.profile_fit import StepSample, fit_timing, relative_error
from services.common.step_timing import TimingModel
from services.node_agent.engines.vllm import profiler as profiler_module
from services.node_agent.engines.vllm.calibration import StepObserver, Sweep, calibrate
from services.node_agent.engines.vllm.profiler import (MAX_SWEEPS, RESWEEP_AFTER_S, RESWEEP_ERROR, SWEEPS_AGREE,
                                                       VllmProfiler)

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


THIRD = len(_sweep()) // 3
SLOWED_IN_PART = _sweep(slowed=range(THIRD, 2 * THIRD))


class _Sweeps:
    """What a VllmProfiler's sweeps read, in turn; what they were called with, and the pauses before them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, readings: list[list[StepSample]]) -> None:
        self.readings, self.seeds, self.yielding, self.pauses = readings, [], [], []
        self.during: Callable[[], None] = lambda: None
        monkeypatch.setattr(profiler_module, "calibrate", self.sweep)

    async def sweep(self, *args: object, seed: int, yield_to_traffic: bool) -> list[StepSample]:
        self.seeds.append(seed)
        self.yielding.append(yield_to_traffic)
        self.during()
        return self.readings[len(self.seeds) - 1]

    async def pause(self, seconds: float) -> None:
        self.pauses.append(seconds)


def _profiler() -> tuple[VllmProfiler, list[EngineProfile]]:
    registered: list[EngineProfile] = []
    profiler = VllmProfiler(2048, 16, 1024, changed=lambda: registered.append(profiler.profile))
    return profiler, registered


def _calibrate(profiler: VllmProfiler, sweeps: _Sweeps, quiet: Callable[[], bool] = lambda: True,
               stretch: float = 0.0) -> None:
    asyncio.run(profiler.calibrate(None, Sweep(), 1000, quiet, lambda: 0.0, sweeps.pause, lambda: stretch))


def _slowed_evenly(factor: float) -> list[StepSample]:
    """A sweep's readings with another process beside it all along: every step factor times too slow."""
    return [dataclasses.replace(s, ms=s.ms * factor) for s in _sweep()]


def test_a_sweep_slowed_in_part_by_a_neighbour_is_swept_again_and_the_better_fit_registered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert relative_error(fit_timing(SLOWED_IN_PART), SLOWED_IN_PART) > RESWEEP_ERROR  # what the first reads
    assert relative_error(fit_timing(SLOWED_IN_PART), _sweep()) > 0.1  # and how far off a profile of it is
    sweeps = _Sweeps(monkeypatch, [SLOWED_IN_PART, _sweep(), _sweep()])
    profiler, registered = _profiler()
    _calibrate(profiler, sweeps)
    # Until two sweeps that fit agree; other prompts each time: no cache hits.
    assert sweeps.pauses == [RESWEEP_AFTER_S, 2 * RESWEEP_AFTER_S] and sweeps.seeds == [0, 1, 2]
    assert sweeps.yielding == [False, True, True]
    assert len(registered) == 2 and relative_error(registered[-1].timing, _sweep()) < 0.01


def test_a_worse_sweep_does_not_replace_the_registered_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    worse = _sweep(slowed=range(THIRD // 2, 2 * THIRD))
    assert relative_error(fit_timing(worse), worse) > relative_error(fit_timing(SLOWED_IN_PART), SLOWED_IN_PART)
    sweeps = _Sweeps(monkeypatch, [SLOWED_IN_PART, worse, worse, worse])
    profiler, registered = _profiler()
    _calibrate(profiler, sweeps)
    assert len(sweeps.seeds) == MAX_SWEEPS == 4
    assert sweeps.pauses == [RESWEEP_AFTER_S, 2 * RESWEEP_AFTER_S, 3 * RESWEEP_AFTER_S]
    assert len(registered) == 1 and registered[0].timing == fit_timing(SLOWED_IN_PART)


def test_two_quiet_sweeps_that_agree_end_the_calibration(monkeypatch: pytest.MonkeyPatch) -> None:
    sweeps = _Sweeps(monkeypatch, [_sweep(), _slowed_evenly(1 + SWEEPS_AGREE / 2)])
    profiler, registered = _profiler()
    _calibrate(profiler, sweeps)
    assert sweeps.seeds == [0, 1] and len(registered) == 1 and registered[0].timing == fit_timing(_sweep())


def test_a_sweep_slowed_evenly_throughout_is_replaced_by_a_quicker_one_that_a_later_one_confirms(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two identical vLLM nodes calibrating side by side registered decode steps of 3.5 and 10.9 ms: the slower
    sweep fitted its own steps within 28 %, so it was kept, and its node then got no request to correct it by
    (helper-172)."""
    slowed = _slowed_evenly(3.0)
    assert relative_error(fit_timing(slowed), slowed) < RESWEEP_ERROR  # it fits well: no miss to catch it by
    sweeps = _Sweeps(monkeypatch, [slowed, _sweep(), _slowed_evenly(2.0), _sweep()])
    profiler, registered = _profiler()
    _calibrate(profiler, sweeps, stretch=0.5)
    assert sweeps.seeds == [0, 1, 2, 3]  # the quicker two disagree with the slowed ones; the fourth agrees
    # Stretched by a random share of half RESWEEP_AFTER_S (these sweeps take no time on the test's clock).
    assert sweeps.pauses == [RESWEEP_AFTER_S * (n + 0.25) for n in (1, 2, 3)]
    assert len(registered) == 2 and relative_error(registered[-1].timing, _sweep()) < 0.01


def test_of_two_sweeps_that_agree_the_quicker_is_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    sweeps = _Sweeps(monkeypatch, [_slowed_evenly(1 + SWEEPS_AGREE / 2), _sweep()])
    profiler, registered = _profiler()
    _calibrate(profiler, sweeps)
    assert sweeps.seeds == [0, 1] and len(registered) == 2 and registered[-1].timing == fit_timing(_sweep())


def test_a_sweep_quick_by_chance_gives_way_to_two_that_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """It stayed registered, though none confirmed it (helper-174): jitter can shorten readings too."""
    sweeps = _Sweeps(monkeypatch, [_slowed_evenly(0.7), _sweep(), _sweep()])
    profiler, registered = _profiler()
    _calibrate(profiler, sweeps)
    assert sweeps.seeds == [0, 1, 2] and len(registered) == 2 and registered[-1].timing == fit_timing(_sweep())


def test_sweeps_agree_on_their_prefills_and_their_decodes_each_not_on_their_sum(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sweep slowed only while it prefilled agreed with one slowed only while it decoded, on the sum of their
    steps, and the first was registered, its prefills 50 % too slow (helper-174)."""
    slow_prefills = [dataclasses.replace(s, ms=s.ms * 1.3) if s.prefill_chunks else s for s in _sweep()]
    slow_decodes = [s if s.prefill_chunks else dataclasses.replace(s, ms=s.ms * 1.25) for s in _sweep()]
    sums = [sum(s.ms for s in sweep) for sweep in (slow_prefills, slow_decodes)]
    assert abs(sums[0] - sums[1]) <= 0.01 * min(sums)  # alike on their sums
    sweeps = _Sweeps(monkeypatch, [slow_prefills, slow_decodes, _sweep(), _sweep()])
    profiler, registered = _profiler()
    _calibrate(profiler, sweeps)
    assert sweeps.seeds == [0, 1, 2, 3] and relative_error(registered[-1].timing, _sweep()) < 0.01


@pytest.mark.parametrize("traffic", ["a real step observed", "a real request in flight"])
def test_no_sweep_again_once_real_traffic_came(monkeypatch: pytest.MonkeyPatch, traffic: str) -> None:
    sweeps = _Sweeps(monkeypatch, [SLOWED_IN_PART, _sweep()])
    profiler, registered = _profiler()
    in_flight = [False]

    async def traffic_meanwhile(seconds: float) -> None:
        if traffic == "a real step observed":
            profiler.decoded(0.01, 1, num_decoding=1, num_context_tokens=100, num_prefilling=0, now=1.0)
        else:
            in_flight[0] = True

    sweeps.pause = traffic_meanwhile
    _calibrate(profiler, sweeps, lambda: not in_flight[0])
    assert sweeps.seeds == [0] and len(registered) == 1


def test_traffic_during_a_second_sweep_keeps_the_first_profile_and_is_not_read_beside_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sweeps = _Sweeps(monkeypatch, [SLOWED_IN_PART, _sweep()])
    profiler, registered = _profiler()
    in_flight = [False]

    def a_request_arrives() -> None:
        if len(sweeps.seeds) == 2:
            in_flight[0] = True
            # A step of it read now would miss the sweep's requests beside it: not observed.
            profiler.decoded(0.01, 1, num_decoding=1, num_context_tokens=100, num_prefilling=0, now=1.0)

    sweeps.during = a_request_arrives
    _calibrate(profiler, sweeps, lambda: not in_flight[0])
    assert len(sweeps.seeds) == 2 and len(registered) == 1 and registered[0].timing == fit_timing(SLOWED_IN_PART)
    profiler.decoded(0.01, 1, num_decoding=1, num_context_tokens=100, num_prefilling=0, now=2.0)
    assert profiler._refiner is not None and profiler._refiner.num_observed == 1  # read once the sweep ended


def test_a_second_sweep_gives_way_to_a_real_request_before_it_starts() -> None:
    assert asyncio.run(calibrate(None, Sweep(), 1000, lambda: False, lambda: 0.0, yield_to_traffic=True)) == []


def test_a_first_sweep_that_read_no_step_is_swept_again_rather_than_stopping_the_node(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sweeps = _Sweeps(monkeypatch, [[], _sweep()])
    profiler, registered = _profiler()
    _calibrate(profiler, sweeps, lambda: False)  # real requests beside it all along
    assert sweeps.yielding == [False, False]  # a node without a profile keeps sweeping beside traffic
    assert len(registered) == 1 and relative_error(registered[0].timing, _sweep()) < 0.01


def test_a_sweep_missing_a_kind_of_step_is_registered_until_a_complete_one_replaces_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prefills_only = [s for s in _sweep() if s.prefill_chunks]  # every decode reading dropped: fits perfectly
    assert relative_error(fit_timing(prefills_only), prefills_only) < 1e-6
    sweeps = _Sweeps(monkeypatch, [prefills_only, SLOWED_IN_PART, SLOWED_IN_PART, SLOWED_IN_PART])
    profiler, registered = _profiler()
    _calibrate(profiler, sweeps)
    assert len(registered) == 2 and registered[1].timing == fit_timing(SLOWED_IN_PART)


def test_a_request_that_came_and_went_during_a_second_sweep_discards_it(monkeypatch: pytest.MonkeyPatch) -> None:
    sweeps = _Sweeps(monkeypatch, [SLOWED_IN_PART, _sweep()])
    profiler, registered = _profiler()
    sweeps.during = lambda: profiler.admitted("real", num_in_flight=1, now=1.0) if len(sweeps.seeds) == 2 else None
    _calibrate(profiler, sweeps)  # quiet at every check: it ended between them
    assert len(sweeps.seeds) == 2 and len(registered) == 1


class _Engine:
    """Stands in for vLLM's AsyncLLM: each request outputs a token at a time, on a clock it advances."""

    def __init__(self) -> None:
        self.now = 0.0
        self.requests = 0

    async def generate(self, prompt: dict, params: object, request_id: str):  # noqa: ANN201 - an async generator
        self.requests += 1
        for _ in range(params.max_tokens):
            self.now += 0.01
            yield types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[1])])

    async def reset_prefix_cache(self) -> bool:
        return True


def test_a_second_sweep_gives_way_to_a_real_request_between_its_measurements() -> None:
    engine = _Engine()
    checks = iter([True] * 6)  # real traffic arrives after the sweep's first checks
    swept = asyncio.run(calibrate(engine, Sweep(), 1000, lambda: next(checks, False), lambda: engine.now,
                                  yield_to_traffic=True))
    assert swept == [] and engine.requests < 4
    # The first sweep (nothing registered yet) reads on beside it, keeping only what ran alone.
    engine, checks = _Engine(), iter([True] * 6)
    swept = asyncio.run(calibrate(engine, Sweep(), 1000, lambda: next(checks, False), lambda: engine.now))
    assert swept and engine.requests > 20
