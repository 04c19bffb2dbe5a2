"""The scheduler's view of the fleet: registered nodes, their last load, placements since. Pure."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.load import Load


@dataclass(frozen=True)
class NodeSpec:
    """A node as it registered in etcd."""

    node_id: str
    address: str
    gpu: str
    price_per_hour: float
    warm_models: frozenset[str]
    kv_block_size: int = 16


@dataclass
class NodeStatus:
    spec: NodeSpec
    load: Load = field(default_factory=Load)
    # When the last load report arrived (scheduler clock, seconds); None before the first.
    reported_at: float | None = None
    # Prompt blocks placed here since that report: load the node has not told us about yet.
    placed_prefill_blocks: int = 0
    placed_requests: int = 0


class ClusterView:
    """Registered nodes and what the scheduler knows of their load. Time is passed in."""

    def __init__(self, load_timeout_s: float) -> None:
        self._load_timeout_s = load_timeout_s
        self._nodes: dict[str, NodeStatus] = {}

    def set_nodes(self, specs: list[NodeSpec]) -> None:
        """Replace membership with specs (from etcd), keeping what is known of staying nodes."""
        nodes = {}
        for spec in specs:
            status = self._nodes.get(spec.node_id)
            if status is None:
                status = NodeStatus(spec=spec)
            else:
                status.spec = spec
            nodes[spec.node_id] = status
        self._nodes = nodes

    def report_load(self, node_id: str, load: Load, now: float) -> None:
        """A fresh report supersedes the placements made before it."""
        status = self._nodes.get(node_id)
        if status is None:
            return
        status.load = load
        status.reported_at = now
        status.placed_prefill_blocks = 0
        status.placed_requests = 0

    def record_placement(self, node_id: str, num_prompt_blocks: int) -> None:
        status = self._nodes.get(node_id)
        if status is not None:
            status.placed_prefill_blocks += num_prompt_blocks
            status.placed_requests += 1

    def is_live(self, status: NodeStatus, now: float) -> bool:
        """Registered, and not silent for longer than the load timeout once it has reported."""
        return status.reported_at is None or now - status.reported_at <= self._load_timeout_s

    def candidates(self, model: str, now: float, exclude: frozenset[str] = frozenset()) -> list[NodeStatus]:
        """Live nodes with model warm, in node-id order."""
        return [
            status
            for node_id, status in sorted(self._nodes.items())
            if model in status.spec.warm_models and node_id not in exclude and self.is_live(status, now)
        ]

    def nodes(self) -> list[NodeStatus]:
        return [self._nodes[node_id] for node_id in sorted(self._nodes)]

    def has_model(self, model: str) -> bool:
        return any(model in status.spec.warm_models for status in self._nodes.values())
