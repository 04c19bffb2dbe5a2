"""What an uninterrupted generation produces: the pure sim engine core run alone, in-process."""

from __future__ import annotations

from services.node_agent.engines.sim.core import SimEngineCore
from services.node_agent.engines.sim.models import get_model
from services.node_agent.engines.sim.timing import load_coefficients
from services.node_agent.engines.types import EngineRequest, FinishReason, SamplingParams


def reference_completion(
    prompt_token_ids: list[int],
    max_tokens: int,
    temperature: float = 0.0,
    seed: int | None = None,
    ignore_eos: bool = False,
    model: str = "sim-llama-3-8b",
) -> tuple[list[int], FinishReason]:
    """The completion tokens and finish reason of the request, run alone on a fresh engine."""
    spec = get_model(model)
    core = SimEngineCore(spec, load_coefficients("h100", spec.perf_model), num_kv_blocks=8192)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=ignore_eos)
    core.add_request(EngineRequest("reference", tuple(prompt_token_ids), sampling))
    tokens: list[int] = []
    while True:
        for output in core.step().outputs:
            tokens.extend(output.new_token_ids)
            if output.finish_reason is not None:
                return tokens, output.finish_reason
