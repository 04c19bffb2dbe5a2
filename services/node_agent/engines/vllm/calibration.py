"""The vllm engine's profile: a short calibration sweep at start-up, refined online from its streams.

vLLM's API reports no step times, so they are timed from outside, where they can be read cleanly:

- a prefill step: a request's time to first token while it is alone in the engine (one step when
  its uncached prompt fits the step's token budget);
- a decode step: the time between two outputs of a decoding request while no prompt is being
  prefilled beside it (B = the requests decoding, C = their context tokens; the sweep decodes each
  batch on short and on long prompts, so that C does not move only with B).

Both include vLLM's own per-step overhead (scheduling, the hop between its processes): part of the
step as the scheduler sees it. The sweep times prefills of a few sizes and decodes of a few batch
sizes on prompts of random tokens (no prefix-cache hits), then clears the prefix cache it filled;
a measurement during which a real request was in flight is dropped. The same readings taken on
real traffic refine the profile online (ProfileRefiner).
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.common.profile_fit import StepSample

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sweep:
    """What the calibration times: each prefill size `repeats` times, each decode batch for `decode_steps`
    on prompts of each decode_prompt_tokens (two context lengths, or C would move only with B)."""

    prefill_sizes: tuple[int, ...] = (32, 128, 256, 512)
    repeats: int = 2
    decode_batches: tuple[int, ...] = (1, 4, 8)
    decode_steps: int = 8
    decode_prompt_tokens: tuple[int, ...] = (32, 384)

    def fitted_to(self, max_model_len: int, max_num_batched_tokens: int, max_num_seqs: int) -> Sweep:
        """This sweep within an engine's limits: one step's budget, its context and its batch."""
        longest = min(max_num_batched_tokens, max_model_len - 1)
        sizes = tuple(dict.fromkeys(min(n, longest) for n in self.prefill_sizes))
        batches = tuple(b for b in self.decode_batches if b <= max_num_seqs) or (1,)
        prompts = tuple(dict.fromkeys(max(1, min(n, max_model_len - self.decode_steps - 2))
                                      for n in self.decode_prompt_tokens))
        return Sweep(sizes, self.repeats, batches, self.decode_steps, prompts)


async def _run(llm: Any, prompt: list[int], max_tokens: int, clock: Callable[[], float]) -> list[tuple[float, int]]:
    """(time, tokens) of each output of one greedy request, ignoring EOS."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.DELTA)
    times = []
    async for output in llm.generate({"prompt_token_ids": prompt}, params, f"calibration-{uuid.uuid4().hex}"):
        times.append((clock(), len(output.outputs[0].token_ids)))
    return times


async def calibrate(llm: Any, sweep: Sweep, vocab_size: int, is_quiet: Callable[[], bool],
                    clock: Callable[[], float], seed: int = 0, yield_to_traffic: bool = False) -> list[StepSample]:
    """Time sweep's prefills and decodes on llm; is_quiet() says no real request is in flight. With
    yield_to_traffic, it stops at the first real request it finds and returns nothing."""
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(2, vocab_size) for _ in range(n)]

    def giving_way() -> bool:
        return yield_to_traffic and not is_quiet()

    samples: list[StepSample] = []
    if giving_way():
        return []
    await _run(llm, prompt(sweep.prefill_sizes[0]), 2, clock)  # the first forward pass warms up: not timed
    for n in sweep.prefill_sizes:
        for _ in range(sweep.repeats):
            if giving_way():
                return []
            quiet, started = is_quiet(), clock()
            times = await _run(llm, prompt(n), 1, clock)
            if quiet and is_quiet() and times:
                samples.append(StepSample(0, 0, (n,), (times[0][0] - started) * 1000.0))
    for batch in sweep.decode_batches:
        for prompt_tokens in sweep.decode_prompt_tokens:
            if giving_way():
                return []
            quiet = is_quiet()
            runs = await asyncio.gather(*(_run(llm, prompt(prompt_tokens), sweep.decode_steps + 1, clock)
                                          for _ in range(batch)))
            if quiet and is_quiet():
                samples += _decode_steps(runs, batch, prompt_tokens)
    await llm.reset_prefix_cache()  # the sweep's random prompts are nobody's prefix
    return samples


def _decode_steps(runs: list[list[tuple[float, int]]], batch: int, prompt_tokens: int) -> list[StepSample]:
    """The steps after every request's first token: each output of each request, one step apart."""
    if not all(runs):
        return []
    decoding_from = max(run[0][0] for run in runs)
    samples = []
    for run in runs:
        generated = run[0][1]
        for (before, _), (after, num_tokens) in zip(run, run[1:], strict=False):
            if before >= decoding_from and num_tokens:
                context = batch * (prompt_tokens + generated)
                samples.append(StepSample(batch, context, (), (after - before) * 1000.0 / num_tokens))
            generated += num_tokens
    return samples


class StepObserver:
    """Readings of clean steps on real traffic (see the module docstring). Pure; time is passed in."""

    def __init__(self) -> None:
        self._alone_since: dict[str, float] = {}  # requests admitted into an empty engine, by id

    def admitted(self, request_id: str, num_in_flight: int, now: float) -> None:
        """A request entered the engine, which then held num_in_flight requests (itself included)."""
        self._alone_since.clear()  # whoever was alone is no longer
        if num_in_flight == 1:
            self._alone_since[request_id] = now

    def first_token(self, request_id: str, num_new_tokens: int, num_computed: int, now: float) -> StepSample | None:
        """A request's first output: its prefill step, if it was alone all along (num_computed: the
        prompt tokens vLLM computed, its cached ones excluded)."""
        started = self._alone_since.pop(request_id, None)
        if started is None or num_computed <= 0 or num_new_tokens != 1:
            return None
        return StepSample(0, 0, (num_computed,), (now - started) * 1000.0)

    @staticmethod
    def decode(interval_s: float, num_new_tokens: int, num_decoding: int, num_context_tokens: int,
               num_prefilling: int) -> StepSample | None:
        """A decoding request's output num_new_tokens steps after its previous one: a decode step, if
        no prompt was being prefilled beside it."""
        if num_prefilling or num_new_tokens <= 0 or interval_s <= 0:
            return None
        return StepSample(num_decoding, num_context_tokens, (), interval_s * 1000.0 / num_new_tokens)
