"""llm-d's inference scheduler (Gateway API Inference Extension) default scoring. Pure.

Weighted scorers, each in [0, 1], summed; the highest total wins (ANCHORS.md):
queue 2 · (maxQ − q)/(maxQ − minQ) over the candidates, KV utilisation 2 · (1 − kv_usage),
prefix 3 · matched/prompt blocks from an approximate index of chained 16-token block hashes per
pod, updated with the chosen pod after each decision (LRU capacity per pod, as llm-d's default).
"""

from __future__ import annotations

from services.scheduler.cluster import NodeStatus
from services.scheduler.policies.base import Decision, PlacementRequest, decision
from services.scheduler.policies.routed_prefix import RoutedPrefixIndex

QUEUE_WEIGHT = 2.0
KV_WEIGHT = 2.0
PREFIX_WEIGHT = 3.0
# llm-d's approximate prefix cache: 31,250 blocks per server by default.
CAPACITY_PER_NODE = 31_250


class LlmdPolicy:
    name = "llm_d"

    def __init__(self) -> None:
        self._prefixes = RoutedPrefixIndex(capacity_per_node=CAPACITY_PER_NODE)

    def scores(self, request: PlacementRequest, candidates: list[NodeStatus], now: float) -> dict[str, float]:
        queues = {s.spec.node_id: s.load.num_waiting + s.placed_requests for s in candidates}
        low, high = min(queues.values()), max(queues.values())
        totals = {}
        for status in candidates:
            node_id = status.spec.node_id
            queue = 1.0 if high == low else (high - queues[node_id]) / (high - low)
            load = status.load
            kv_free = 1.0 - (load.kv_blocks_used / load.kv_blocks_total if load.kv_blocks_total else 0.0)
            prefix = (self._prefixes.matched(node_id, request.block_hashes, now) / request.num_prompt_blocks
                      if request.num_prompt_blocks else 0.0)
            totals[node_id] = QUEUE_WEIGHT * queue + KV_WEIGHT * kv_free + PREFIX_WEIGHT * prefix
        return totals

    def choose(
        self, request: PlacementRequest, candidates: list[NodeStatus], matched_blocks: dict[str, int], now: float
    ) -> Decision:
        scores = self.scores(request, candidates, now)
        # Highest score; ties go to the earlier candidate (node-id order).
        chosen = max(candidates, key=lambda s: scores[s.spec.node_id])
        self._prefixes.record(chosen.spec.node_id, request.block_hashes, now)
        return decision(chosen, matched_blocks, scores[chosen.spec.node_id])
