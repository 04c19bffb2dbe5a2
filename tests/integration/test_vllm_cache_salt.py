"""vLLM's own prefix cache keeps tenants apart: the node agent passes a request's cache salt to vLLM
as `cache_salt`, so an identical prompt under another salt finds nothing cached; and the blocks vLLM
stored under a salt are indexed under the salted keys a router computes for that tenant."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

import pytest

from services.common.block_hash import block_hashes, salted_root
from services.node_agent.engines.types import EngineRequest, SamplingParams

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

# Three full 32-token vLLM blocks and a partial one.
PROMPT_IDS = tuple((5 * i + 11) % 600 + 2 for i in range(100))


async def cached_tokens_by_salt(model_dir: Path, salts: list[str]) -> tuple[list[int], set[int]]:
    """Run the prompt once per salt, in order, on one VllmEngine: what each found cached, and the Baton
    keys the engine indexes once the blocks of every salt's chain have been reported."""
    from services.node_agent.engines.vllm.engine import VllmEngine, VllmSettings

    engine = VllmEngine("tiny-llama", VllmSettings(model_dir=str(model_dir), kv_cache_bytes=64 << 20,
                                                   max_model_len=512, block_size=32))
    runner = asyncio.get_running_loop().create_task(engine.run())
    try:
        cached = []
        for i, salt in enumerate(salts):
            request = EngineRequest(f"r{i}", PROMPT_IDS, SamplingParams(max_tokens=2, ignore_eos=True),
                                    cache_salt=salt)
            outputs = [o async for o in engine.generate(request, heartbeat_s=5.0) if o is not None]
            cached.append(outputs[-1].num_cached_tokens)
        expected = {key for salt in salts for key in block_hashes(PROMPT_IDS, parent_hash=salted_root(salt))}
        deadline = asyncio.get_running_loop().time() + 10.0
        while not expected <= set(engine.cached_block_hashes()) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)  # KV events arrive from vLLM's publisher; wait for them, bounded
        return cached, set(engine.cached_block_hashes())
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        del engine
        gc.collect()


def test_vllm_caches_and_indexes_each_salt_apart(tiny_model_dir: Path) -> None:
    salts = ["tenant-cache:a", "tenant-cache:a", "tenant-cache:b", ""]
    cached, indexed = asyncio.run(cached_tokens_by_salt(tiny_model_dir, salts))
    assert cached[0] == 0
    assert cached[1] == 96  # its own salt: the three full blocks
    assert cached[2] == 0 and cached[3] == 0  # another salt, and the shared namespace
    for salt in ("tenant-cache:a", "tenant-cache:b", ""):  # what a router asks the kvindex, per tenant
        assert set(block_hashes(PROMPT_IDS, parent_hash=salted_root(salt))) <= indexed, salt
