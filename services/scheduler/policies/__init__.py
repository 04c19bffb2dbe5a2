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


def make_policy(name: str, prefill_load_scale: float = 1.0) -> Policy:
    """A fresh policy called name; ValueError naming the known ones otherwise."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    if name == "dynamo":
        return KvLoadPolicy(prefill_load_scale)
    return POLICIES[name]()
