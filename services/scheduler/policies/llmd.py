"""llm-d's inference scheduler (Gateway API Inference Extension) scoring, both prefix scorers. Pure.

Weighted scorers, each in [0, 1], summed; the highest total wins (ANCHORS.md). Queue:
(maxQ − q)/(maxQ − minQ) over the candidates; KV utilisation: 1 − kv_usage. Two variants:

- `llm_d` (the EPP's default profile): queue 2, KV 2, prefix 3 · matched/prompt blocks from an
  approximate index of chained 16-token block hashes per pod, updated with the chosen pod after
  each decision (LRU capacity per pod, as llm-d's default).
- `llm_d_precise` (llm-d's precise-prefix-cache-aware guide): queue 1, KV 1, prefix 2 from the
  index built from the engines' own KV events (here: the kvindex's overlap). Each pod's
  longest cached prefix is min-max normalised over the pods that hold any of it (all equal: 1),
  pods holding none score 0 — as the scheduler's `indexedScoresToNormalizedScoredPods` does.
"""

from __future__ import annotations

import hashlib

from services.scheduler.fleet import NodeStatus
from services.scheduler.policies.base import Decision, PlacementRequest, Policy, decision
from services.scheduler.policies.routed_prefix import RoutedPrefixIndex

QUEUE_WEIGHT = 2.0
KV_WEIGHT = 2.0
PREFIX_WEIGHT = 3.0
# llm-d's approximate prefix cache: 31,250 blocks per server by default.
CAPACITY_PER_NODE = 31_250
PRECISE_WEIGHTS = (1.0, 1.0, 2.0)  # queue, KV, prefix


class LlmdPolicy(Policy):
    name = "llm_d"

    def __init__(self) -> None:
        self._prefixes = RoutedPrefixIndex(capacity_per_node=CAPACITY_PER_NODE)
        self._weights = (QUEUE_WEIGHT, KV_WEIGHT, PREFIX_WEIGHT)

    def prefix_scores(self, request: PlacementRequest, candidates: list[NodeStatus],
                      matched_blocks: dict[str, int]) -> dict[str, float]:
        """The approximate scorer: the share of the prompt's blocks routed to each pod before."""
        if not request.num_prompt_blocks:
            return {s.spec.node_id: 0.0 for s in candidates}
        return {s.spec.node_id: self._prefixes.matched(s.spec.node_id, request.block_hashes)
                / request.num_prompt_blocks for s in candidates}

    def scores(self, request: PlacementRequest, candidates: list[NodeStatus],
               matched_blocks: dict[str, int] | None = None) -> dict[str, float]:
        queue_weight, kv_weight, prefix_weight = self._weights
        prefixes = self.prefix_scores(request, candidates, matched_blocks or {})
        queues = {s.spec.node_id: s.load.num_waiting + s.placed_requests for s in candidates}
        low, high = min(queues.values()), max(queues.values())
        totals = {}
        for status in candidates:
            node_id = status.spec.node_id
            queue = 1.0 if high == low else (high - queues[node_id]) / (high - low)
            load = status.load
            kv_free = 1.0 - (load.kv_blocks_used / load.kv_blocks_total if load.kv_blocks_total else 0.0)
            totals[node_id] = queue_weight * queue + kv_weight * kv_free + prefix_weight * prefixes[node_id]
        return totals

    def choose(
        self, request: PlacementRequest, candidates: list[NodeStatus], matched_blocks: dict[str, int], now: float
    ) -> Decision:
        scores = self.scores(request, candidates, matched_blocks)
        # Highest score; ties broken at random, as llm-d's max-score picker does (it shuffles the
        # pods first): here by a hash of request and node, so that a run can be replayed.
        chosen = max(candidates, key=lambda s: (scores[s.spec.node_id],
                                                _shuffle_key(request.request_id, s.spec.node_id)))
        self._prefixes.record(chosen.spec.node_id, request.block_hashes)
        return decision(chosen, matched_blocks, scores[chosen.spec.node_id])


class LlmdPrecisePolicy(LlmdPolicy):
    name = "llm_d_precise"

    def __init__(self) -> None:
        super().__init__()
        self._weights = PRECISE_WEIGHTS

    def prefix_scores(self, request: PlacementRequest, candidates: list[NodeStatus],
                      matched_blocks: dict[str, int]) -> dict[str, float]:
        held = {s.spec.node_id: matched_blocks[s.spec.node_id] for s in candidates
                if matched_blocks.get(s.spec.node_id, 0) > 0}
        low, high = min(held.values(), default=0), max(held.values(), default=0)
        return {s.spec.node_id: 0.0 if s.spec.node_id not in held
                else 1.0 if high == low else (held[s.spec.node_id] - low) / (high - low) for s in candidates}


def _shuffle_key(request_id: str, node_id: str) -> bytes:
    return hashlib.blake2b(f"{request_id}/{node_id}".encode(), digest_size=8).digest()
