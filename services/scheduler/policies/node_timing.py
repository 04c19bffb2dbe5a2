"""A node's step-time model, as the scheduler's policies read it. Pure.

Today it is looked up from the GPU generation in the sim engine's fitted table (the engine every
node runs); when nodes register their engine's measured profile, this is the one place to read it.
"""

from __future__ import annotations

import functools

from services.node_agent.engines.sim.models import SIM_MODELS
from services.node_agent.engines.sim.timing import TimingModel, load_coefficients

__all__ = ["TimingModel", "decode_tokens_per_s", "node_timing"]

# The decode batch a node's throughput is quoted at: 64 sequences of 1,024 tokens of context.
REFERENCE_BATCH = 64
REFERENCE_CONTEXT = 1024


@functools.cache
def node_timing(gpu: str, model: str) -> TimingModel | None:
    """The step-time model of model on gpu; None when there is none."""
    spec = SIM_MODELS.get(model)
    if spec is None:
        return None
    try:
        return load_coefficients(gpu, spec.perf_model)
    except KeyError:
        return None


def decode_tokens_per_s(timing: TimingModel) -> float:
    """Tokens a second the node decodes at the reference batch: its speed relative to other GPUs."""
    step_ms = timing.decode_step_ms(REFERENCE_BATCH, REFERENCE_BATCH * REFERENCE_CONTEXT)
    return REFERENCE_BATCH * 1000.0 / step_ms
