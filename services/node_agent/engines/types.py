"""Engine-facing domain types, shared by every engine and the node agent. No I/O."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

# KV events are part of what engines produce; re-exported for engine code.
from services.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent  # noqa: F401


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen; temperature 0 is greedy."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[tuple[int, ...], ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams


@dataclass
class RequestOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    # Prompt tokens found in the prefix cache when the request was first scheduled.
    num_cached_tokens: int = 0
    num_completion_tokens: int = 0




@dataclass
class StepResult:
    """One engine step: how long it takes on the modelled GPU, and what it produced."""

    duration_s: float
    outputs: list[RequestOutput] = field(default_factory=list)
    kv_events: list[KVEvent] = field(default_factory=list)
