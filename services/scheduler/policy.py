"""Placement policies: score candidate nodes for one request. Pure, no I/O."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from services.scheduler.cluster import NodeStatus


@dataclass(frozen=True)
class PlacementRequest:
    request_id: str
    model: str
    num_prompt_tokens: int
    num_prompt_blocks: int
    max_tokens: int


@dataclass(frozen=True)
class Decision:
    node_id: str
    address: str
    matched_blocks: int
    cost: float


class Policy(Protocol):
    def choose(
        self, request: PlacementRequest, candidates: list[NodeStatus], matched_blocks: dict[str, int]
    ) -> Decision:
        """Pick one of candidates (non-empty) for request."""


class KvLoadPolicy:
    """Dynamo's KV router cost, in blocks: lowest wins.

    prefill = max(pending prefill blocks + prompt blocks - cached prompt blocks, 0)
    cost    = prefill_load_scale * prefill + active decode blocks + prompt blocks
    Ties go to the node with fewer running requests, then to the lower node id.
    """

    def __init__(self, prefill_load_scale: float = 1.0) -> None:
        self._prefill_load_scale = prefill_load_scale

    def cost(self, request: PlacementRequest, status: NodeStatus, matched: int) -> float:
        block_size = status.spec.kv_block_size
        pending_blocks = math.ceil(status.load.pending_prefill_tokens / block_size)
        pending_blocks += status.placed_prefill_blocks
        prefill = max(pending_blocks + request.num_prompt_blocks - matched, 0)
        return self._prefill_load_scale * prefill + status.load.active_decode_blocks + request.num_prompt_blocks

    def choose(
        self, request: PlacementRequest, candidates: list[NodeStatus], matched_blocks: dict[str, int]
    ) -> Decision:
        def key(status: NodeStatus) -> tuple[float, int, str]:
            matched = matched_blocks.get(status.spec.node_id, 0)
            running = status.load.num_running + status.load.num_waiting + status.placed_requests
            return (self.cost(request, status, matched), running, status.spec.node_id)

        best = min(candidates, key=key)
        matched = matched_blocks.get(best.spec.node_id, 0)
        return Decision(
            node_id=best.spec.node_id,
            address=best.spec.address,
            matched_blocks=matched,
            cost=self.cost(request, best, matched),
        )
