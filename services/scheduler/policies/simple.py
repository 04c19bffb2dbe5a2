"""Cache-blind baselines: round-robin and least-loaded. Pure."""

from __future__ import annotations

from services.scheduler.cluster import NodeStatus
from services.scheduler.policies.base import Decision, PlacementRequest, decision, num_in_flight


class RoundRobinPolicy:
    """Each request to the next candidate in node-id order."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(
        self, request: PlacementRequest, candidates: list[NodeStatus], matched_blocks: dict[str, int], now: float
    ) -> Decision:
        chosen = candidates[self._next % len(candidates)]
        self._next += 1
        return decision(chosen, matched_blocks, 0.0)


class LeastLoadedPolicy:
    """The candidate with the fewest requests in flight (ties: lower node id)."""

    name = "least_loaded"

    def choose(
        self, request: PlacementRequest, candidates: list[NodeStatus], matched_blocks: dict[str, int], now: float
    ) -> Decision:
        chosen = min(candidates, key=lambda s: (num_in_flight(s), s.spec.node_id))
        return decision(chosen, matched_blocks, float(num_in_flight(chosen)))
