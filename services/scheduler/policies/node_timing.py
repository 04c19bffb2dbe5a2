"""A node's step-time model, as the scheduler's policies read it: its registered profile. Pure.

Nodes register an engine profile per model (services/common/engine_profile.py): the sim engine its
configured coefficients, the vllm engine what it calibrated and refined. Nothing here knows any
engine's tables. A candidate without a profile cannot be predicted: the policies say which fallback
placed it (`Decision.fallback`), never silently.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from services.common.step_timing import TimingModel
from services.scheduler.fleet import NodeStatus
from services.scheduler.policies.base import Decision

__all__ = ["TimingModel", "decode_tokens_per_s", "node_timing", "noting_unprofiled"]

# The decode batch a node's throughput is quoted at: 64 sequences of 1,024 tokens of context.
REFERENCE_BATCH = 64
REFERENCE_CONTEXT = 1024


def node_timing(status: NodeStatus, model: str) -> TimingModel | None:
    """The step-time model of model on the node, from its registered profile; None without one."""
    profile = status.profile(model)
    return profile.timing if profile is not None else None


def decode_tokens_per_s(timing: TimingModel) -> float:
    """Tokens a second the node decodes at the reference batch: its speed relative to other GPUs."""
    step_ms = timing.decode_step_ms(REFERENCE_BATCH, REFERENCE_BATCH * REFERENCE_CONTEXT)
    return REFERENCE_BATCH * 1000.0 / max(step_ms, 1e-6)  # a measured profile may round a step to 0


def unprofiled(candidates: Iterable[tuple[str, NodeStatus]]) -> list[str]:
    """The (model, node) candidates without a registered profile, as 'node' or 'node/model'."""
    pairs = [(model, s.spec.node_id) for model, s in candidates if s.profile(model) is None]
    several = len({model for model, _ in pairs}) > 1
    return [f"{node}/{model}" if several else node for model, node in pairs]


def noting_unprofiled(decision: Decision, candidates: Iterable[tuple[str, NodeStatus]], fallback: str,
                      none_scored: bool) -> Decision:
    """decision with the fallback stated: fallback placed it (none_scored), or the candidates without a
    profile were treated as fallback says; unchanged when every candidate had a profile."""
    missing = unprofiled(candidates)
    if not missing:
        return decision
    if none_scored:
        note = f"no engine profile registered by any candidate ({', '.join(missing)}): placed by {fallback}"
    else:
        note = f"no engine profile registered by {', '.join(missing)}: {fallback}"
    # After what the policy already said of it (a trial of a node: it was replaced, helper-183).
    return dataclasses.replace(decision, fallback="; ".join(n for n in (decision.fallback, note) if n))
