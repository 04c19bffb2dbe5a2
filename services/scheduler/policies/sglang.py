"""SGLang model gateway's cache-aware policy (sgl-router `cache_aware.rs`). Pure.

Load is the requests in flight per worker. When the fleet is imbalanced
(max − min > 64 and max > 1.5 · min) the least-loaded worker wins. Otherwise the worker whose
approximate tree matches the longest prefix wins if it matches more than 30 % of the prompt, else
the least-loaded one. The tree is built from routed requests and forgets entries after 120 s.
SGLang matches characters; this matches 16-token blocks.
"""

from __future__ import annotations

from services.scheduler.cluster import NodeStatus
from services.scheduler.policies.base import Decision, PlacementRequest, decision, num_in_flight
from services.scheduler.policies.routed_prefix import RoutedPrefixIndex

CACHE_THRESHOLD = 0.3
BALANCE_ABS = 64
BALANCE_REL = 1.5
EVICTION_S = 120.0


class SglangPolicy:
    name = "sglang"

    def __init__(self) -> None:
        self._tree = RoutedPrefixIndex(ttl_s=EVICTION_S)

    def choose(
        self, request: PlacementRequest, candidates: list[NodeStatus], matched_blocks: dict[str, int], now: float
    ) -> Decision:
        loads = {s.spec.node_id: num_in_flight(s) for s in candidates}
        least = min(candidates, key=lambda s: (loads[s.spec.node_id], s.spec.node_id))
        high, low = max(loads.values()), min(loads.values())
        chosen = least
        if not (high - low > BALANCE_ABS and high > BALANCE_REL * low) and request.num_prompt_blocks:
            matches = {s.spec.node_id: self._tree.matched(s.spec.node_id, request.block_hashes, now)
                       for s in candidates}
            best = max(candidates, key=lambda s: (matches[s.spec.node_id], -loads[s.spec.node_id]))
            if matches[best.spec.node_id] / request.num_prompt_blocks > CACHE_THRESHOLD:
                chosen = best
        self._tree.record(chosen.spec.node_id, request.block_hashes, now)
        return decision(chosen, matched_blocks, float(loads[chosen.spec.node_id]))
