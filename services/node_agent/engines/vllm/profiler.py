"""The vllm engine's registered profile: calibrated once at start-up, then refined online."""

from __future__ import annotations

import asyncio
import logging
import math
import random
from dataclasses import dataclass
from collections.abc import Awaitable, Callable
from typing import Any

from services.common.engine_profile import EngineProfile, ProfileSource, TimingModel
from services.common.profile_fit import ProfileRefiner, StepSample, fit_timing, relative_error
from services.node_agent.engines.vllm.calibration import StepObserver, Sweep, calibrate

log = logging.getLogger(__name__)

# A sweep whose fitted coefficients miss its own steps by more than this on average was likely slowed in
# part by another process on the machine (on the two-core CI host, a neighbour engine starting beside it:
# 64 % against a quiet sweep's 12 %, and the node registered as the slower of two; one such pair of
# measurements, so a rough line). Such a sweep counts as no fit (its profile is registered only while no other is).
RESWEEP_ERROR = 0.3
# A sweep slowed evenly throughout fits well: two identical vLLM nodes calibrating side by side on two cores
# registered decode steps of 3.5 and 10.9 ms, the slower sweep missing its own steps by 28 %, and the slower node
# then got no request, so online refinement never corrected it (helper-172). So the node sweeps until a fitting
# sweep agrees with an earlier fitting one within SWEEPS_AGREE, on the time of the prefill steps and of the decode
# steps either read, each (on their sum, decodes outweighed a sweep slowed only while it prefilled: helper-174); it
# registers the quicker of the two, since another process only slows a sweep, and until two agree the quickest
# fitting one. Whole sweeps are compared, not single readings: a decode reading is the gap between two outputs, which
# delivery jitter can shorten as well as lengthen, so the quickest readings would make the node look faster than it
# is. A sweep quick by chance is not confirmed, and gives way to the quicker of two that agree.
SWEEPS_AGREE = 0.15
# The pause before sweep n + 1 is n times RESWEEP_AFTER_S (a neighbour's start takes tens of seconds), plus a random
# share of three times the last sweep's length (at least half RESWEEP_AFTER_S), so that nodes started together are
# less likely to sweep side by side again; MAX_SWEEPS in all, each on other random prompts.
RESWEEP_AFTER_S = 10.0
MAX_SWEEPS = 4


@dataclass(frozen=True)
class _Fit:
    """One sweep's fit, its readings and how far it misses them."""

    timing: TimingModel
    samples: list[StepSample]
    error: float


def _phases_ms(timing: TimingModel, samples: list[StepSample]) -> tuple[float, float]:
    """The time timing gives samples' prefill steps, and their decode steps."""
    prefill = decode = 0.0
    for s in samples:
        ms = timing.step_ms(s.num_decode_seqs, s.num_context_tokens, s.prefill_chunks)
        if s.prefill_chunks:
            prefill += ms
        else:
            decode += ms
    return prefill, decode


def _quickest(fits: list[_Fit]) -> _Fit:
    """Of sweeps' fits, the one predicting every step any of them read quickest in all."""
    steps = [s for fit in fits for s in fit.samples]
    return min(fits, key=lambda fit: sum(_phases_ms(fit.timing, steps)))


def _agree(first: _Fit, second: _Fit) -> bool:
    """Whether two fits predict the prefill steps, and the decode steps, either read within SWEEPS_AGREE of each
    other."""
    steps = first.samples + second.samples
    return all(abs(a - b) <= SWEEPS_AGREE * min(a, b)
               for a, b in zip(_phases_ms(first.timing, steps), _phases_ms(second.timing, steps), strict=True))


def _complete(samples: list[StepSample], sweep: Sweep) -> bool:
    """Whether samples hold a reading of every prefill size and every decode batch of sweep."""
    prefills = {chunk for s in samples for chunk in s.prefill_chunks}
    batches = {s.num_decode_seqs for s in samples if s.num_decode_seqs}
    return set(sweep.prefill_sizes) <= prefills and set(sweep.decode_batches) <= batches


class VllmProfiler:
    """Holds the engine's profile (None until calibrated) and calls changed() when it is new."""

    def __init__(self, max_num_batched_tokens: int, kv_block_size: int, num_kv_blocks: int,
                 changed: Callable[[], None], max_num_seqs: int = 0) -> None:
        self._limits = (max_num_batched_tokens, kv_block_size, num_kv_blocks, max_num_seqs)
        self._changed = changed
        self._observer = StepObserver()
        self._refiner: ProfileRefiner | None = None
        self._sweeping = False
        self._num_admitted = 0
        self.profile: EngineProfile | None = None

    async def calibrate(self, llm: Any, sweep: Sweep, vocab_size: int, is_quiet: Callable[[], bool],
                        clock: Callable[[], float],
                        pause: Callable[[float], Awaitable[None]] = asyncio.sleep,
                        stretch: Callable[[], float] = random.random) -> EngineProfile | None:
        """Run the sweep on llm and register what it measured; sweep again later until two sweeps that fit their own
        steps within RESWEEP_ERROR agree within SWEEPS_AGREE, and register the quicker of them (see both). Once a
        profile is registered, only while the engine has been sent no real request since, and giving way to the
        first that comes. stretch: a draw in [0, 1), the random share of each pause (see RESWEEP_AFTER_S)."""
        fitting: list[_Fit] = []
        registered: _Fit | None = None  # this calibration's registered fit
        sweep_s = 0.0
        for number in range(1, MAX_SWEEPS + 1):
            if number > 1:
                await pause(RESWEEP_AFTER_S * (number - 1) + stretch() * max(RESWEEP_AFTER_S / 2, 3 * sweep_s))
                if not self._may_sweep(is_quiet):
                    break
            had_profile, admitted = self.profile is not None, self._num_admitted
            self._sweeping = True  # real steps read meanwhile would miss the sweep's requests beside them
            try:
                started = clock()
                samples = await calibrate(llm, sweep, vocab_size, is_quiet, clock, seed=number - 1,
                                          yield_to_traffic=had_profile)
            finally:
                self._sweeping = False
            sweep_s = clock() - started
            if had_profile and not (self._may_sweep(is_quiet) and self._num_admitted == admitted):
                break  # a real request came meanwhile: the sweep's steps may have run beside it
            samples = [s for s in samples if s.ms > 0 and math.isfinite(s.ms)]
            if not samples:
                log.warning("calibration sweep %d read no step (real requests beside every one)", number)
                continue
            timing = fit_timing(samples)
            # A sweep missing a kind of step fits the rest well and says nothing of it: it counts as no fit.
            swept = _Fit(timing, samples, relative_error(timing, samples) if _complete(samples, sweep) else math.inf)
            log.info("calibration sweep %d in %.1f s on %d steps: mean error %.0f%%", number, sweep_s, len(samples),
                     100 * swept.error)
            agreeing: list[_Fit] = []
            if swept.error <= RESWEEP_ERROR:
                fitting.append(swept)
                agreeing = [fit for fit in fitting[:-1] if _agree(fit, swept)]
                chosen = _quickest([agreeing[0], swept] if agreeing else fitting)
            elif registered is None or (not fitting and swept.error < registered.error):
                chosen = swept  # no fit yet: the one that misses its steps least
            else:
                chosen = registered
            if chosen is not registered:
                registered = chosen
                self._register(chosen.timing, len(chosen.samples))
            if agreeing:
                break
            if number < MAX_SWEEPS:
                log.info("calibration: %d of %d sweeps fit their steps within %.0f%%, and no two of them agree: "
                         "sweeping again if the engine stays idle", len(fitting), number, 100 * RESWEEP_ERROR)
        else:
            log.info("calibration: no two of %d sweeps agreed; keeping the profile registered (online refinement "
                     "corrects it once real requests come)", MAX_SWEEPS)
        return self.profile

    def _register(self, timing: TimingModel, num_samples: int) -> None:
        max_num_batched_tokens, kv_block_size, num_kv_blocks, max_num_seqs = self._limits
        self.profile = EngineProfile(timing, max_num_batched_tokens, kv_block_size, num_kv_blocks,
                                     ProfileSource.CALIBRATED, num_samples=num_samples, max_num_seqs=max_num_seqs)
        self._refiner = ProfileRefiner(self.profile)
        log.info("calibrated: %s", self.profile.describe())
        self._changed()

    def _may_sweep(self, is_quiet: Callable[[], bool]) -> bool:
        """No profile yet; or no real request in flight, and no step of one read since the calibration."""
        if self._refiner is None:
            return True
        return is_quiet() and self._refiner.num_observed == 0

    def admitted(self, request_id: str, num_in_flight: int, now: float) -> None:
        self._num_admitted += 1
        self._observer.admitted(request_id, num_in_flight, now)

    def first_token(self, request_id: str, num_new_tokens: int, num_computed: int, now: float) -> None:
        sample = self._observer.first_token(request_id, num_new_tokens, num_computed, now)
        if num_computed <= self._limits[0]:  # a longer prompt is prefilled in several steps: not one step's time
            self._observe(sample, now)

    def decoded(self, interval_s: float, num_new_tokens: int, num_decoding: int, num_context_tokens: int,
                num_prefilling: int, now: float) -> None:
        self._observe(StepObserver.decode(interval_s, num_new_tokens, num_decoding, num_context_tokens,
                                          num_prefilling), now)

    def _observe(self, sample: StepSample | None, now: float) -> None:
        if sample is None or self._refiner is None or self._sweeping:
            return
        self._refiner.observe(sample)
        refined = self._refiner.refit(now)
        if refined is not None:
            self.profile = refined
            log.info("profile refined online: %s", refined.describe())
            self._changed()
