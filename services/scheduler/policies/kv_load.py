"""Dynamo's KV-router cost: uncached prompt blocks plus load, in blocks. Pure."""

from __future__ import annotations

import math

from services.common.block_hash import DEFAULT_BLOCK_SIZE
from services.scheduler.fleet import NodeStatus
from services.scheduler.policies.base import Decision, PlacementRequest, Policy, decision, num_in_flight


class KvLoadPolicy(Policy):
    """Dynamo's KV router cost, in blocks: lowest wins.

    prefill = max(pending prefill blocks + prompt blocks - cached prompt blocks, 0)
    cost    = prefill_load_scale * prefill + active decode blocks + prompt blocks
    Ties go to the node with fewer running requests, then to the lower node id.
    """

    name = "dynamo"

    def __init__(self, prefill_load_scale: float = 1.0) -> None:
        self._prefill_load_scale = prefill_load_scale

    def cost(self, request: PlacementRequest, status: NodeStatus, matched: int) -> float:
        # In the router's key blocks (DEFAULT_BLOCK_SIZE tokens), as the prompt and its matches are counted;
        # the node reports its decoding context in its engine's blocks (vLLM's are 32 tokens on CPU).
        pending_blocks = math.ceil(status.load.pending_prefill_tokens / DEFAULT_BLOCK_SIZE)
        pending_blocks += status.placed_prefill_blocks
        prefill = max(pending_blocks + request.num_prompt_blocks - matched, 0)
        decode_blocks = math.ceil(status.load.active_decode_blocks * status.spec.kv_block_size / DEFAULT_BLOCK_SIZE)
        return self._prefill_load_scale * prefill + decode_blocks + request.num_prompt_blocks

    def choose(
        self, request: PlacementRequest, candidates: list[NodeStatus], matched_blocks: dict[str, int], now: float
    ) -> Decision:
        def key(status: NodeStatus) -> tuple[float, int, str]:
            matched = matched_blocks.get(status.spec.node_id, 0)
            return (self.cost(request, status, matched), num_in_flight(status), status.spec.node_id)

        best = min(candidates, key=key)
        return decision(best, matched_blocks, self.cost(request, best, matched_blocks.get(best.spec.node_id, 0)))
