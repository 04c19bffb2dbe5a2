"""SGLang model gateway's cache-aware policy (sgl-router `src/policies/cache_aware.rs`). Pure.

Load is the requests in flight per worker. When the fleet is imbalanced
(max − min > 64 and max > 1.5 · min) the least-loaded worker wins. Otherwise the worker whose
approximate tree matches the longest prefix wins if it matches more than 30 % of the prompt, else
the worker with the smallest tree (the most free cache, as the router believes). Either way the
prompt is then inserted into the chosen worker's tree. The trees are bounded by size, not age: every
120 s an eviction pass drops each tree's least recently used entries down to `max_tree_size`.

SGLang's trees hold characters (2^26 per tree by default); this one holds 16-token blocks, so the
bound is converted at ~4 characters per token: 2^26 / 64 = 2^20 blocks.
"""

from __future__ import annotations

from services.scheduler.fleet import NodeStatus
from services.scheduler.policies.base import Decision, PlacementRequest, Policy, decision, num_in_flight
from services.scheduler.policies.routed_prefix import RoutedPrefixIndex

CACHE_THRESHOLD = 0.3
BALANCE_ABS = 64
BALANCE_REL = 1.5
EVICTION_INTERVAL_S = 120.0
MAX_TREE_BLOCKS = 2**26 // 64


class SglangPolicy(Policy):
    name = "sglang"

    def __init__(self, max_tree_blocks: int = MAX_TREE_BLOCKS) -> None:
        self._tree = RoutedPrefixIndex()
        self._max_tree_blocks = max_tree_blocks
        self._evicted_at: float | None = None

    def choose(
        self, request: PlacementRequest, candidates: list[NodeStatus], matched_blocks: dict[str, int], now: float
    ) -> Decision:
        self._evict_if_due(now)
        loads = {s.spec.node_id: num_in_flight(s) for s in candidates}
        high, low = max(loads.values()), min(loads.values())
        if high - low > BALANCE_ABS and high > BALANCE_REL * low:
            chosen = min(candidates, key=lambda s: (loads[s.spec.node_id], s.spec.node_id))
        else:
            matches = {s.spec.node_id: self._tree.matched(s.spec.node_id, request.block_hashes) for s in candidates}
            best = max(candidates, key=lambda s: (matches[s.spec.node_id], -loads[s.spec.node_id]))
            rate = matches[best.spec.node_id] / request.num_prompt_blocks if request.num_prompt_blocks else 0.0
            if rate > CACHE_THRESHOLD:
                chosen = best
            else:
                chosen = min(candidates, key=lambda s: (self._tree.size(s.spec.node_id), s.spec.node_id))
        self._tree.record(chosen.spec.node_id, request.block_hashes)
        return decision(chosen, matched_blocks, float(loads[chosen.spec.node_id]))

    def _evict_if_due(self, now: float) -> None:
        """SGLang's background eviction thread, run on the policy's own clock."""
        if self._evicted_at is None:
            self._evicted_at = now
        elif now - self._evicted_at >= EVICTION_INTERVAL_S:
            self._tree.evict_to(self._max_tree_blocks)
            self._evicted_at = now
