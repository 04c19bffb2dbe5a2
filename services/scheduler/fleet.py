"""The scheduler's view of the fleet: registered nodes, their last load, placements not yet there. Pure."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from services.common.block_hash import DEFAULT_BLOCK_SIZE
from services.common.engine_profile import EngineProfile
from services.common.gone_from_listing import GoneFromListing
from services.common.load import Load
from services.scheduler.admission import pool_saturation

# Seconds after which a placement its node never reported receiving stops counting as its load (the
# router failed before sending it on), counted from when the node last changed its models.
PLACEMENT_TRANSIT_S = 5.0


@dataclass(frozen=True)
class NodeSpec:
    """A node as it registered in etcd."""

    node_id: str
    address: str
    gpu: str
    price_per_hour: float
    warm_models: frozenset[str]
    kv_block_size: int = 16
    # Tokens one engine step computes at most (the chunked-prefill budget).
    max_num_batched_tokens: int = 2048
    # Models on the node's local disk that are not warm, and those of them being loaded.
    cold_models: frozenset[str] = frozenset()
    loading_models: frozenset[str] = frozenset()
    # Seconds to load each local model onto the GPU (the node's own estimate).
    load_time_s: dict[str, float] = field(default_factory=dict, compare=False)
    region: str = ""
    # Each local model's KV cache there when warm, in blocks (0: not registered).
    kv_blocks: dict[str, int] = field(default_factory=dict, compare=False)
    # The engine ("sim", "vllm") and the performance profile it registered for each model: what the
    # policies predict from. A model without one (an engine still calibrating) is placed by a fallback.
    engine: str = ""
    profiles: dict[str, EngineProfile] = field(default_factory=dict, compare=False)
    # Each model's context window here, in tokens (absent or 0: not registered; taken to fit).
    context_tokens: dict[str, int] = field(default_factory=dict, compare=False)

    def has(self, model: str) -> bool:
        """model is warm here or on the node's disk (loading, or cold)."""
        return model in self.warm_models or model in self.cold_models

    @property
    def is_empty(self) -> bool:
        """Nothing warm and nothing loading: the GPU is free for any of its models."""
        return not self.warm_models and not self.loading_models


@dataclass
class NodeStatus:
    spec: NodeSpec
    load: Load = field(default_factory=Load)
    # When the last load report arrived (scheduler clock, seconds); None before the first.
    reported_at: float | None = None
    # Placed here but not yet received by the node as of that report: load it has not told us about.
    placed_prefill_blocks: int = 0
    placed_requests: int = 0
    # Those placements, (when, prompt blocks), oldest first; and the node's count of requests received
    # as of its last report (Load.num_received; None before the first report).
    unreceived: deque[tuple[float, int]] = field(default_factory=deque)
    num_received: int | None = None
    # When its models last changed (warm set or loading set), when it was last given a request, and when a load
    # report last showed it running or queueing one (a standby hears the reports, not the placements: taking over,
    # it counted a node served a second ago as idle since it first saw it, and swapped out a model's only warm copy).
    models_since: float = 0.0
    last_placed_at: float | None = None
    last_busy_at: float | None = None
    # Its registration is gone from etcd but held for a grace period (PrefixView.lapsed).
    is_lapsed: bool = False

    def profile(self, model: str) -> EngineProfile | None:
        """The profile the node registered for model; None when it has none."""
        return self.spec.profiles.get(model)

    def kv_capacity(self, model: str) -> int | None:
        """Blocks of KV cache model has (or would have) here; None when unknown."""
        registered = self.spec.kv_blocks.get(model, 0)
        if registered:
            return registered
        if model in self.spec.warm_models and self.load.kv_blocks_total:
            return self.load.kv_blocks_total
        return None

    def can_hold(self, model: str, needed_blocks: int, needed_block_size: int = DEFAULT_BLOCK_SIZE) -> bool:
        """Whether model's whole KV cache here (not what is free now) is large enough for needed_blocks of
        needed_block_size tokens (this node's blocks may be larger: vLLM's are 32 tokens on CPU); True if unknown."""
        capacity = self.kv_capacity(model)
        return capacity is None or capacity * self.spec.kv_block_size >= needed_blocks * needed_block_size

    def fits(self, model: str, tokens: int) -> bool:
        """Whether tokens (prompt + max_tokens) fit model's context window here; True if unknown. In a fleet whose
        nodes run a model with different windows, the router and Place check against the largest (helper-183)."""
        context = self.spec.context_tokens.get(model, 0)
        return context <= 0 or tokens <= context

    def idle_s(self, now: float) -> float:
        """How long the node has had nothing in flight and nothing placed (0 while it has)."""
        if self.load.num_running or self.load.num_waiting or self.placed_requests:
            return 0.0
        return now - max(self.models_since, self.last_placed_at or self.models_since,
                         self.last_busy_at or self.models_since)


def saturation(nodes: Iterable[NodeStatus]) -> float:
    """llm-d's saturation of nodes as the scheduler sees them: placements not yet reported count as waiting.

    The one measure the admission gate, the model planner and the simulator all use."""
    return pool_saturation([(s.load.num_waiting + s.placed_requests, s.load.kv_blocks_used, s.load.kv_blocks_total)
                            for s in nodes])


class ClusterView:
    """Registered nodes and what the scheduler knows of their load. Time is passed in."""

    def __init__(self, load_timeout_s: float, lapsed_silence_s: float = 0.0) -> None:
        self._load_timeout_s = load_timeout_s
        # A node whose registration lapsed stays live only while it reports load this often.
        self._lapsed_silence_s = lapsed_silence_s
        self._nodes: dict[str, NodeStatus] = {}
        # The models that left every node's registration lately (a request for one is told to retry).
        self._gone_models: GoneFromListing[bool] = GoneFromListing()

    def set_nodes(self, specs: list[NodeSpec], now: float = 0.0, lapsed: frozenset[str] = frozenset()) -> None:
        """Replace membership with specs (from etcd), keeping what is known of staying nodes.

        Nodes in lapsed are gone from etcd, held for a grace period: they stay candidates only
        while their load reports say they are alive (is_live)."""
        nodes = {}
        for spec in specs:
            status = self._nodes.get(spec.node_id)
            if status is None:
                status = NodeStatus(spec=spec, models_since=now)
            else:
                if (status.spec.warm_models, status.spec.loading_models) != (spec.warm_models, spec.loading_models):
                    status.models_since = now
                status.spec = spec
            status.is_lapsed = spec.node_id in lapsed
            nodes[spec.node_id] = status
        self._nodes = nodes
        self._gone_models.update({m: True for spec in specs for m in spec.warm_models | spec.cold_models}, now)

    def report_load(self, node_id: str, load: Load, now: float) -> None:
        """A fresh report supersedes the placements it shows arrived (Load.num_received), oldest first.

        Those still on their way stay counted, so a report sent while a router is still connecting to
        the node does not make room that is not there. A placement stops counting once the node has
        been warm (loading nothing) for PLACEMENT_TRANSIT_S without receiving it. On the node's first
        report, after its engine restarted (its count went back), or from an agent that does not
        count, every placement is taken as arrived.
        """
        status = self._nodes.get(node_id)
        if status is None:
            return
        previous = status.num_received
        if load.num_received is None or previous is None or load.num_received < previous:
            arrived = len(status.unreceived)
        else:
            arrived = load.num_received - previous
        for _ in range(min(arrived, len(status.unreceived))):
            status.unreceived.popleft()
        # A placement on a node loading a model is sent on once the load ends: its clock starts then.
        while (status.unreceived and not status.spec.loading_models
               and max(status.unreceived[0][0], status.models_since) < now - PLACEMENT_TRANSIT_S):
            status.unreceived.popleft()
        status.num_received = load.num_received
        if load.num_running or load.num_waiting:
            status.last_busy_at = now
        status.load = load
        status.reported_at = now
        status.placed_requests = len(status.unreceived)
        status.placed_prefill_blocks = sum(blocks for _, blocks in status.unreceived)

    def record_placement(self, node_id: str, num_prompt_blocks: int, now: float | None = None) -> None:
        status = self._nodes.get(node_id)
        if status is not None:
            placed_at = now if now is not None else status.reported_at or 0.0
            status.unreceived.append((placed_at, num_prompt_blocks))
            status.placed_prefill_blocks += num_prompt_blocks
            status.placed_requests += 1
            if now is not None:
                status.last_placed_at = now

    def is_live(self, status: NodeStatus, now: float) -> bool:
        """Registered, and not silent for longer than the load timeout once it has reported.

        A node whose registration lapsed must have reported within lapsed_silence_s: a live
        node reports every heartbeat, while one that lost its lease by dying or hanging had
        been silent for most of a TTL before etcd noticed."""
        if status.is_lapsed:
            return status.reported_at is not None and now - status.reported_at <= self._lapsed_silence_s
        return status.reported_at is None or now - status.reported_at <= self._load_timeout_s

    def is_listed(self, status: NodeStatus, now: float) -> bool:
        """Registered in etcd, or lapsed but still live: a member of the fleet as users see it."""
        return not status.is_lapsed or self.is_live(status, now)

    def candidates(self, model: str, now: float, exclude: frozenset[str] = frozenset(),
                   needed_blocks: int = 0, needed_tokens: int = 0) -> list[NodeStatus]:
        """Live nodes with model warm whose KV cache could hold needed_blocks and whose context window
        needed_tokens, in node-id order."""
        return [
            status
            for node_id, status in sorted(self._nodes.items())
            if model in status.spec.warm_models and node_id not in exclude and self.is_live(status, now)
            and status.can_hold(model, needed_blocks) and status.fits(model, needed_tokens)
        ]

    def cold_candidates(self, model: str, now: float, exclude: frozenset[str] = frozenset(),
                        needed_blocks: int = 0, needed_tokens: int = 0) -> list[NodeStatus]:
        """Live nodes that could serve model once it is loaded: it is on their disk and their GPU is
        free (or already loading it), and its KV cache there could hold needed_blocks and its context
        window needed_tokens. They serve nothing until warm."""
        return [
            status
            for node_id, status in sorted(self._nodes.items())
            if node_id not in exclude and self.is_live(status, now) and status.can_hold(model, needed_blocks)
            and status.fits(model, needed_tokens) and (
                model in status.spec.loading_models or (model in status.spec.cold_models and status.spec.is_empty))
        ]

    def nodes(self) -> list[NodeStatus]:
        return [self._nodes[node_id] for node_id in sorted(self._nodes)]

    def get(self, node_id: str) -> NodeStatus | None:
        return self._nodes.get(node_id)

    def has_model(self, model: str, now: float | None = None) -> bool:
        """Some node has model, warm or on its disk (given now: a listed one, see is_listed)."""
        return any(s.spec.has(model) for s in self._nodes.values()
                   if now is None or self.is_listed(s, now))

    def served_lately(self, model: str, now: float) -> bool:
        """Whether some node had model lately and no listed one has it now: its nodes lapsed (held for their grace
        period, silent), or it left the last registration with it within GONE_MODEL_MEMORY_S of now."""
        return not self.has_model(model, now) and (self.has_model(model) or bool(self._gone_models.get(model, now)))

    def models(self) -> list[str]:
        return sorted({m for s in self._nodes.values() for m in s.spec.warm_models | s.spec.cold_models})
