"""What every placement policy sees and returns. Pure, no I/O; time is passed in."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from services.scheduler.fleet import NodeStatus


@dataclass(frozen=True)
class PlacementRequest:
    request_id: str
    model: str
    num_prompt_tokens: int
    num_prompt_blocks: int
    max_tokens: int
    # Chained keys of the prompt's full blocks (for policies that keep their own prefix index).
    block_hashes: tuple[int, ...] = field(default=(), repr=False)
    # The request's own SLO (0: the cluster's default): time to first token and per output token,
    # and end-to-end, in ms from arrival.
    ttft_budget_ms: int = 0
    deadline_ms: int = 0
    tpot_budget_ms: int = 0
    tenant: str = ""
    priority: int = 0
    # Workflow context: this is step `step` of `total_steps` of workflow `workflow_id`.
    workflow_id: str = ""
    step: int = 0
    total_steps: int = 0


@dataclass(frozen=True)
class Decision:
    node_id: str
    address: str
    matched_blocks: int
    # The policy's own figure of merit for the chosen node (cost or score), for explanations.
    cost: float
    # Which fallback placed it, or how candidates were treated that the policy could not predict
    # (no registered engine profile); empty when it predicted for every candidate.
    fallback: str = ""


@dataclass(frozen=True)
class Option:
    """One model a request accepts, with the nodes that could run it and their cached prompt blocks."""

    request: PlacementRequest
    candidates: list[NodeStatus]
    matched_blocks: dict[str, int]


@dataclass(frozen=True)
class Terms:
    """Why a node scored what it did, for a policy that predicts (GetRecentDecisions, the Place span)."""

    node_id: str
    gpu: str
    cached_tokens: int
    ttft_ms: float
    tpot_ms: float
    cost: float
    success: float
    workflow_spent: float
    has_kv_room: bool
    score: float
    warm: bool = True
    load_ms: float = 0.0
    kv_free_blocks: int = 0
    at_risk: float = 0.0
    model: str = ""
    #: The node's measured decode step with this request joining it, where it decodes now (0: none measured), and
    #: for how many steps it is expected to last (the prompts to prefill there, queued or coming, a chunk a step).
    measured_tpot_ms: float = 0.0
    measured_steps: float = 0.0


class Policy:
    """A placement policy: everything the scheduler and the simulator call. Subclasses implement `choose`
    and override what they weigh; the defaults are a policy that predicts nothing and keeps no state."""

    #: The name `--policy` and the simulator know it by.
    name: str = ""
    #: Whether it predicts load time, and so may be offered nodes where the model is cold.
    weighs_cold_nodes: bool = False

    def choose(
        self, request: PlacementRequest, candidates: list[NodeStatus], matched_blocks: dict[str, int], now: float
    ) -> Decision:
        """Pick one of candidates (non-empty) for request; matched_blocks is the kvindex's overlap."""
        raise NotImplementedError

    def choose_among(self, options: list[Option], now: float) -> tuple[int, Decision]:
        """The option (index) and node for a request that accepts several models, preferred first: by
        default the first model with a candidate."""
        index = next(i for i, option in enumerate(options) if option.candidates)
        option = options[index]
        return index, self.choose(option.request, option.candidates, option.matched_blocks, now)

    def last_terms(self) -> Sequence[Terms]:
        """The per-candidate terms of the last decision (none for a policy that predicts nothing)."""
        return ()

    def observe_finished(self, model: str, num_output_tokens: int) -> None:
        """A request of model ended having generated num_output_tokens (what a live scheduler learns)."""

    def workflow_state(self) -> dict[str, float]:
        """What a successor leader needs of the policy's per-workflow memory, least recent first."""
        return {}

    def restore_workflow_state(self, state: dict[str, float]) -> None:
        """Take over a predecessor's workflow_state()."""


def decision(status: NodeStatus, matched_blocks: dict[str, int], cost: float) -> Decision:
    return Decision(node_id=status.spec.node_id, address=status.spec.address,
                    matched_blocks=matched_blocks.get(status.spec.node_id, 0), cost=cost)


def warm_first(request: PlacementRequest, candidates: list[NodeStatus]) -> list[NodeStatus]:
    """The candidates with request's model warm; all of them when none is (then one must load it).

    Policies that do not weigh load time choose among these: they never pick a cold node over a
    warm one.
    """
    return [s for s in candidates if request.model in s.spec.warm_models] or candidates


def num_in_flight(status: NodeStatus) -> int:
    """Requests on the node: running and waiting at its last report, plus those placed since."""
    return status.load.num_running + status.load.num_waiting + status.placed_requests
