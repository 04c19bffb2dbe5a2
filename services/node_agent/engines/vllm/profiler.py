"""The vllm engine's registered profile: calibrated once at start-up, then refined online."""

from __future__ import annotations

import asyncio
import logging
import math
import random
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
# sweep agrees with an earlier fitting one, on the time of every step either read, within SWEEPS_AGREE; of the
# fitting ones it registers the quickest, since another process only slows a sweep. Whole sweeps are compared, not
# single readings: a decode reading is the gap between two outputs, which delivery jitter can shorten as well as
# lengthen, so the quickest readings would make the node look faster than it is.
SWEEPS_AGREE = 0.15
# The pause before sweep n + 1 is n times RESWEEP_AFTER_S (a neighbour's start takes tens of seconds), stretched by
# up to half again at random, so that nodes started together do not sweep again side by side; MAX_SWEEPS in all, each
# on other random prompts.
RESWEEP_AFTER_S = 10.0
MAX_SWEEPS = 4


def _total_ms(timing: TimingModel, samples: list[StepSample]) -> float:
    return sum(timing.step_ms(s.num_decode_seqs, s.num_context_tokens, s.prefill_chunks) for s in samples)


def _quickest(fitting: list[tuple[TimingModel, list[StepSample]]]) -> TimingModel:
    """Of sweeps' fits, the one predicting every step any of them read quickest in all."""
    steps = [s for _, samples in fitting for s in samples]
    return min((timing for timing, _ in fitting), key=lambda timing: _total_ms(timing, steps))


def _agree(first: tuple[TimingModel, list[StepSample]], second: tuple[TimingModel, list[StepSample]]) -> bool:
    """Whether two sweeps' fits predict the steps either read within SWEEPS_AGREE of each other in all."""
    steps = first[1] + second[1]
    a, b = _total_ms(first[0], steps), _total_ms(second[0], steps)
    return abs(a - b) <= SWEEPS_AGREE * min(a, b)


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
        steps within RESWEEP_ERROR agree within SWEEPS_AGREE, registering the quickest fitting one (see both).
        Once a profile is registered, only while the engine has been sent no real request since, and giving way
        to the first that comes. stretch: a draw in [0, 1) that lengthens each pause by up to half."""
        registered_error, fitting = math.inf, []
        for number in range(1, MAX_SWEEPS + 1):
            if number > 1:
                await pause(RESWEEP_AFTER_S * (number - 1) * (1 + stretch() / 2))
                if not self._may_sweep(is_quiet):
                    break
            registered, admitted = self.profile is not None, self._num_admitted
            self._sweeping = True  # real steps read meanwhile would miss the sweep's requests beside them
            try:
                started = clock()
                samples = await calibrate(llm, sweep, vocab_size, is_quiet, clock, seed=number - 1,
                                          yield_to_traffic=registered)
            finally:
                self._sweeping = False
            if registered and not (self._may_sweep(is_quiet) and self._num_admitted == admitted):
                break  # a real request came meanwhile: the sweep's steps may have run beside it
            samples = [s for s in samples if s.ms > 0 and math.isfinite(s.ms)]
            if not samples:
                log.warning("calibration sweep %d read no step (real requests beside every one)", number)
                continue
            timing = fit_timing(samples)
            # A sweep missing a kind of step fits the rest well and says nothing of it: it counts as no fit.
            error = relative_error(timing, samples) if _complete(samples, sweep) else math.inf
            log.info("calibration sweep %d in %.1f s on %d steps: mean error %.0f%%", number, clock() - started,
                     len(samples), 100 * error)
            if error <= RESWEEP_ERROR:
                fitting.append((timing, samples))
                quickest = _quickest(fitting)
                better = quickest is timing and (registered_error > RESWEEP_ERROR or len(fitting) > 1)
            else:
                better = not fitting and error < registered_error
            if better or not registered:
                registered_error = error
                self._register(timing, len(samples))
            if any(_agree(earlier, fitting[-1]) for earlier in fitting[:-1]):
                break
            if number < MAX_SWEEPS:
                log.info("calibration: %d of %d sweeps fit their steps within %.0f%%, and no two of them agree: "
                         "sweeping again if the engine stays idle", len(fitting), number, 100 * RESWEEP_ERROR)
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
