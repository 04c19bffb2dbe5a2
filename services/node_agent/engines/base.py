"""The one interface every engine (sim, vllm) offers the node agent."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Protocol

from services.common.change_signal import ChangeSignal
from services.common.engine_profile import EngineProfile
from services.common.load import Load
from services.node_agent.engines.types import (
    EngineRequest,
    KVEvent,
    RequestOutput,
    RequestProgress,
    SamplingParams,
)


class EngineInputError(ValueError):
    """A request the engine cannot take (bad length, duplicate id); names the field."""

    def __init__(self, field: str, value: object, reason: str) -> None:
        super().__init__(reason)
        self.field = field
        self.value = value
        self.reason = reason


class OutputStream:
    """One request's outputs. Closing it ends that request only: a stream closed late, after its request was
    aborted and another of the same id admitted (a stream resumed on this node), leaves the new one running.
    Closing a stream never read ends its request too (an async generator's own cleanup would not run)."""

    def __init__(self, outputs: AsyncGenerator[RequestOutput | None, None], release: Callable[[], None]) -> None:
        self._outputs = outputs
        self._release = release  # ends this request if it is still the one its id names; idempotent

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> RequestOutput | None:
        return await anext(self._outputs)

    async def aclose(self) -> None:
        try:
            await self._outputs.aclose()
        finally:
            self._release()


class Engine(Protocol):
    """An inference engine for one model, driven in real time."""

    model: str
    max_context_tokens: int
    vocab_size: int
    tokenizer: str
    kv_block_size: int
    #: Set when a request arrives, finishes or is aborted, so load is reported at once.
    load_changed: ChangeSignal
    #: Set when profile() is new (calibrated, refined), so the registration is rewritten.
    profile_changed: ChangeSignal

    async def run(self) -> None:
        """The engine loop; runs until cancelled."""

    def generate(self, request: EngineRequest, heartbeat_s: float) -> OutputStream:
        """Admit request at once (EngineInputError if it cannot be served); return its outputs.

        Outputs come as they are produced, several steps merged when the reader is slow; None
        when nothing came for heartbeat_s (the engine is alive, e.g. still prefilling).
        Closing the stream early aborts the request (this one, not a later one of its id) and frees
        its KV blocks; every stream must be closed.
        """

    def resumes_exactly(self, sampling: SamplingParams) -> bool:
        """Whether re-running prompt + generated tokens with this sampling continues identically."""

    def refused_before_admission(self) -> None:
        """Count a request the node refused by its own checks, before generate(): Load.num_received counts every
        request the node was sent, refused ones included (the leader stops counting its placements by it)."""

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks; a no-op once it has finished."""

    def progress(self, request_id: str) -> RequestProgress | None:
        """Where request_id stands now (queued, prefilling, decoding); None once it has ended."""

    def profile(self) -> EngineProfile | None:
        """The profile the engine measured of itself; None when it measures none (yet): the node then
        registers the model's configured profile, if it has one."""

    def expected_step_ms(self) -> float:
        """Wall-clock time of the next decode step."""

    def load(self) -> Load: ...

    async def next_kv_events(self) -> list[KVEvent]:
        """Wait for and take the KV events produced since the last call."""

    def cached_block_hashes(self) -> list[int]:
        """Every block the engine's prefix cache holds now."""
