"""The vllm engine's registered profile: calibrated once at start-up, then refined online."""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from services.common.engine_profile import EngineProfile, ProfileSource
from services.common.profile_fit import ProfileRefiner, StepSample, fit_timing, relative_error
from services.node_agent.engines.vllm.calibration import StepObserver, Sweep, calibrate

log = logging.getLogger(__name__)

# A sweep whose fitted coefficients miss its own steps by more than this on average was likely slowed in
# part by another process on the machine (on the two-core CI host, a neighbour engine starting beside it:
# 64 % against a quiet sweep's 12 %, and the node registered as the slower of two). It is run again
# RESWEEP_AFTER_S later (a neighbour's start takes tens of seconds), then twice that, MAX_SWEEPS in all,
# and each step's quickest readings over the sweeps are fitted: another process only ever adds time to a
# step. A sweep slowed evenly throughout fits well and is not detected; online refinement corrects it.
RESWEEP_ERROR = 0.3
RESWEEP_AFTER_S = 10.0
MAX_SWEEPS = 3


def quickest(earlier: Sequence[StepSample], later: Sequence[StepSample]) -> list[StepSample]:
    """The readings of two sweeps of the same steps merged: of each step (its batch, context and chunks),
    as many readings as the sweep that read it most often holds, the quickest of both sweeps."""
    by_step: dict[tuple, list[list[StepSample]]] = defaultdict(lambda: [[], []])
    for side, samples in enumerate((earlier, later)):
        for sample in samples:
            by_step[(sample.num_decode_seqs, sample.num_context_tokens, sample.prefill_chunks)][side].append(sample)
    merged = []
    for first, second in by_step.values():
        merged += sorted(first + second, key=lambda s: s.ms)[:max(len(first), len(second))]
    return merged


class VllmProfiler:
    """Holds the engine's profile (None until calibrated) and calls changed() when it is new."""

    def __init__(self, max_num_batched_tokens: int, kv_block_size: int, num_kv_blocks: int,
                 changed: Callable[[], None], max_num_seqs: int = 0) -> None:
        self._limits = (max_num_batched_tokens, kv_block_size, num_kv_blocks, max_num_seqs)
        self._changed = changed
        self._observer = StepObserver()
        self._refiner: ProfileRefiner | None = None
        self.profile: EngineProfile | None = None

    async def calibrate(self, llm: Any, sweep: Sweep, vocab_size: int, is_quiet: Callable[[], bool],
                        clock: Callable[[], float],
                        pause: Callable[[float], Awaitable[None]] = asyncio.sleep) -> EngineProfile:
        """Run the sweep on llm and register what it measured. While the fit misses its own steps by more
        than RESWEEP_ERROR, sweep again RESWEEP_AFTER_S later (then twice that), MAX_SWEEPS in all, and
        register the fit of each step's quickest readings; not beside real requests, nor once real traffic has
        refined the profile (online refinement reads real steps instead)."""
        samples: list[StepSample] = []
        for number in range(1, MAX_SWEEPS + 1):
            if number > 1:
                await pause(RESWEEP_AFTER_S * (number - 1))
                if not is_quiet() or (self.profile is not None and self.profile.source is ProfileSource.ONLINE):
                    break
            started = clock()
            samples = quickest(samples, await calibrate(llm, sweep, vocab_size, is_quiet, clock))
            timing = fit_timing(samples)
            error = relative_error(timing, samples)
            max_num_batched_tokens, kv_block_size, num_kv_blocks, max_num_seqs = self._limits
            self.profile = EngineProfile(timing, max_num_batched_tokens, kv_block_size, num_kv_blocks,
                                         ProfileSource.CALIBRATED, num_samples=len(samples),
                                         max_num_seqs=max_num_seqs)
            self._refiner = ProfileRefiner(self.profile)
            log.info("calibrated (sweep %d) in %.1f s on %d steps (mean error %.0f%%): %s", number,
                     clock() - started, len(samples), 100 * error, self.profile.describe())
            self._changed()
            if error <= RESWEEP_ERROR:
                break
            if number < MAX_SWEEPS:
                log.info("the fit misses its steps by %.0f%% on average (another process beside the sweep?): "
                         "sweeping again in %.0f s", 100 * error, RESWEEP_AFTER_S * number)
        return self.profile

    def admitted(self, request_id: str, num_in_flight: int, now: float) -> None:
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
        if sample is None or self._refiner is None:
            return
        self._refiner.observe(sample)
        refined = self._refiner.refit(now)
        if refined is not None:
            self.profile = refined
            log.info("profile refined online: %s", refined.describe())
            self._changed()
