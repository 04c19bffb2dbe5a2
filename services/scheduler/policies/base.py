"""What every placement policy sees and returns. Pure, no I/O; time is passed in."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from services.scheduler.cluster import NodeStatus


@dataclass(frozen=True)
class PlacementRequest:
    request_id: str
    model: str
    num_prompt_tokens: int
    num_prompt_blocks: int
    max_tokens: int
    # Chained keys of the prompt's full blocks (for policies that keep their own prefix index).
    block_hashes: tuple[int, ...] = field(default=(), repr=False)
    # Latency budget (0: none): time to first token and end-to-end, in ms from arrival.
    ttft_budget_ms: int = 0
    deadline_ms: int = 0
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


class Policy(Protocol):
    #: The name `--policy` and the simulator know it by.
    name: str

    def choose(
        self, request: PlacementRequest, candidates: list[NodeStatus], matched_blocks: dict[str, int], now: float
    ) -> Decision:
        """Pick one of candidates (non-empty) for request; matched_blocks is the kvindex's overlap."""


@dataclass(frozen=True)
class Option:
    """One model a request accepts, with the nodes that could run it and their cached prompt blocks."""

    request: PlacementRequest
    candidates: list[NodeStatus]
    matched_blocks: dict[str, int]


def choose_among(policy: Policy, options: list[Option], now: float) -> tuple[int, Decision]:
    """The option (index) and node for a request that accepts several models, preferred first.

    A policy that weighs models against each other (`choose_among`) decides; any other takes the
    first model with a candidate.
    """
    weigh = getattr(policy, "choose_among", None)
    if weigh is not None:
        return weigh(options, now)
    index = next(i for i, option in enumerate(options) if option.candidates)
    option = options[index]
    return index, policy.choose(option.request, option.candidates, option.matched_blocks, now)


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
