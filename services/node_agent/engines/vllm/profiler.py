"""The vllm engine's registered profile: calibrated once at start-up, then refined online."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from services.common.engine_profile import EngineProfile, ProfileSource
from services.common.profile_fit import ProfileRefiner, StepSample, fit_timing, relative_error
from services.node_agent.engines.vllm.calibration import StepObserver, Sweep, calibrate

log = logging.getLogger(__name__)


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
                        clock: Callable[[], float]) -> EngineProfile:
        """Run the sweep on llm and register what it measured."""
        started = clock()
        samples = await calibrate(llm, sweep, vocab_size, is_quiet, clock)
        max_num_batched_tokens, kv_block_size, num_kv_blocks, max_num_seqs = self._limits
        timing = fit_timing(samples)
        self.profile = EngineProfile(timing, max_num_batched_tokens, kv_block_size, num_kv_blocks,
                                     ProfileSource.CALIBRATED, num_samples=len(samples), max_num_seqs=max_num_seqs)
        self._refiner = ProfileRefiner(self.profile)
        log.info("calibrated in %.1f s on %d steps (mean error %.0f%%): %s", clock() - started, len(samples),
                 100 * relative_error(timing, samples), self.profile.describe())
        self._changed()
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
