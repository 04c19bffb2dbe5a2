"""The profile a sim engine registers: its configured coefficients, from the fitted table. Pure."""

from __future__ import annotations

from services.common.engine_profile import EngineProfile, ProfileSource
from services.node_agent.engines.sim.models import SimModelSpec
from services.node_agent.engines.sim.timing import load_coefficients


def configured_profile(gpu: str, model: SimModelSpec, num_kv_blocks: int, max_num_batched_tokens: int = 2048,
                       kv_block_size: int = 16, max_num_seqs: int = 256) -> EngineProfile:
    """model's coefficients on gpu as fitted to ../shared/perf; KeyError if that pair was not fitted."""
    return EngineProfile(load_coefficients(gpu, model.perf_model), max_num_batched_tokens=max_num_batched_tokens,
                         kv_block_size=kv_block_size, num_kv_blocks=num_kv_blocks, source=ProfileSource.CONFIGURED,
                         max_num_seqs=max_num_seqs)
