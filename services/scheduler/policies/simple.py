"""Cache-blind baselines: round-robin, least-loaded, and least-loaded weighted by GPU speed. Pure."""

from __future__ import annotations

from services.scheduler.fleet import NodeStatus
from services.scheduler.policies.base import Decision, PlacementRequest, Policy, decision, num_in_flight
from services.scheduler.policies.node_timing import decode_tokens_per_s, node_timing, noting_unprofiled


class RoundRobinPolicy(Policy):
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


class LeastLoadedPolicy(Policy):
    """The candidate with the fewest requests in flight (ties: lower node id)."""

    name = "least_loaded"

    def choose(
        self, request: PlacementRequest, candidates: list[NodeStatus], matched_blocks: dict[str, int], now: float
    ) -> Decision:
        chosen = min(candidates, key=lambda s: (num_in_flight(s), s.spec.node_id))
        return decision(chosen, matched_blocks, float(num_in_flight(chosen)))


class WeightedLeastLoadedPolicy(Policy):
    """Least loaded counting each GPU's speed: the candidate where (in flight + 1) / decode throughput
    is smallest, so an H100 takes about twice an A100's share. GPU-aware but cache-blind and
    price-blind: the baseline a heterogeneous fleet's operator would set up first. A node without a
    registered profile counts as the slowest profiled one (as 1 token/s if none has one), and the
    decision says so."""

    name = "weighted_least_loaded"

    def choose(
        self, request: PlacementRequest, candidates: list[NodeStatus], matched_blocks: dict[str, int], now: float
    ) -> Decision:
        speeds = {}
        for status in candidates:
            timing = node_timing(status, request.model)
            speeds[status.spec.node_id] = decode_tokens_per_s(timing) if timing else None
        slowest = min((s for s in speeds.values() if s), default=1.0)

        def load(status: NodeStatus) -> float:
            return (num_in_flight(status) + 1) / (speeds[status.spec.node_id] or slowest)

        chosen = min(candidates, key=lambda s: (load(s), s.spec.node_id))
        any_profiled = any(speeds.values())
        return noting_unprofiled(decision(chosen, matched_blocks, load(chosen)),
                                 [(request.model, s) for s in candidates],
                                 "counted as the slowest profiled node" if any_profiled else "fewest in flight",
                                 none_scored=not any_profiled)
