"""Placement policies, one per module; `make_policy` builds one by name."""

from __future__ import annotations

from services.scheduler.policies.base import Decision, Option, PlacementRequest, Policy
from services.scheduler.policies.baton import BatonPolicy
from services.scheduler.policies.kv_load import KvLoadPolicy
from services.scheduler.policies.llmd import LlmdPolicy, LlmdPrecisePolicy
from services.scheduler.policies.sglang import SglangPolicy
from services.scheduler.policies.simple import LeastLoadedPolicy, RoundRobinPolicy, WeightedLeastLoadedPolicy

POLICIES = {
    "round_robin": RoundRobinPolicy,
    "least_loaded": LeastLoadedPolicy,
    "weighted_least_loaded": WeightedLeastLoadedPolicy,
    "dynamo": KvLoadPolicy,
    "llm_d": LlmdPolicy,
    "llm_d_precise": LlmdPrecisePolicy,
    "sglang": SglangPolicy,
    "baton": BatonPolicy,
}

__all__ = ["POLICIES", "Decision", "Option", "PlacementRequest", "Policy", "make_policy"]


def make_policy(name: str, prefill_load_scale: float = 1.0, default_ttft_budget_ms: float = 0,
                default_tpot_budget_ms: float = 0) -> Policy:
    """A fresh policy called name; ValueError naming the known ones otherwise. Baton's aims at the
    cluster's default budgets for requests that set none (0: its own defaults)."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    if name == "dynamo":
        return KvLoadPolicy(prefill_load_scale)
    if name == "baton":
        return BatonPolicy(**{k: v for k, v in (("default_ttft_budget_ms", default_ttft_budget_ms),
                                                ("default_tpot_budget_ms", default_tpot_budget_ms)) if v})
    return POLICIES[name]()
